"""Durable local file operations: atomic replace, fsync, fast copies, identities."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from storage.jsonio.bounded_json import STORE_RECORD, load_json, read_bounded
from storage.jsonio.canonical import canonical_json
from storage.errors import StoreRecordError

COPY_CHUNK = 64 * 2**20
TEMP_SUFFIXES = (".tmp",)


def _new_token() -> str:
    return f"{os.getpid():x}x{uuid.uuid4().hex[:6]}"


_TOKEN = _new_token()  # names this process's temporary files, so a recovery never sweeps a live one


def _renew_token() -> None:
    global _TOKEN
    _TOKEN = _new_token()


os.register_at_fork(after_in_child=_renew_token)


def boot_id() -> str:
    """Identity of the running boot of this machine (changes at every restart).

    ``CANONICAL_REFIT_BOOT_ID`` overrides it (tests simulate a reboot with it).
    """
    override = os.environ.get("CANONICAL_REFIT_BOOT_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:  # not Linux: no boot identity, so unflushed bytes are never trusted across processes
        return f"unknown-{_TOKEN}"


def fsync_files(folder: Path, names, stop=None) -> None:
    """Write the named files' dirty pages to disk (fsync each); ``stop`` is checked between files."""
    for name in names:
        if stop is not None and stop.stopped:
            return
        fd = os.open(Path(folder) / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temp_name(name: str) -> str:
    """A hidden temporary name for ``name`` that says which process made it."""
    return f".{name}.{_TOKEN}{uuid.uuid4().hex[:6]}.tmp"


def is_temp_of_other_process(name: str) -> bool:
    """True for a temporary file (``temp_name``) that this process did not make."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIXES) and f".{_TOKEN}" not in name


def fsync_dir(path: Path | str) -> None:
    """Make a rename or create inside ``path`` durable."""
    fd = os.open(str(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data``: temp file, fsync, rename, fsync the folder.

    ``durable=False`` keeps the atomic rename but skips the fsyncs (for caches).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(temp_name(path.name))
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)


def atomic_write_json(path: Path, value, *, durable: bool = True) -> None:
    """Replace ``path`` with the canonical JSON of ``value`` (durably unless told otherwise)."""
    atomic_write_bytes(path, canonical_json(value) + b"\n", durable=durable)


def create_only_write(path: Path, write: Callable) -> bool:
    """Create ``path`` exclusively, atomically and durably (temp file, fsync, link); False if it exists.

    ``write(fh)`` writes the content. Nobody ever sees a partial file, and an
    existing file is never replaced.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(temp_name(path.name))
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # fails with EEXIST instead of replacing
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def read_json_file(path: Path):
    """Parsed JSON of a local file, or None if it does not exist; ``StoreRecordError`` (a ``ValueError`` too)
    naming the file if it is not a regular file or not bounded strict JSON (storage.jsonio.bounded_json.STORE_RECORD)."""
    raw = read_bounded(path, STORE_RECORD, error=StoreRecordError, missing_ok=True, local_file=str(path))
    return None if raw is None else load_json(raw, STORE_RECORD, error=StoreRecordError, local_file=str(path))


def file_identity(path: Path) -> list[int]:
    """[size, mtime_ns]: how the store notices files changed behind its back."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def folder_identity(folder: Path) -> dict[str, list[int]]:
    """Identity of every regular file directly in ``folder`` (hidden temp files excluded)."""
    return {
        entry.name: file_identity(Path(entry.path))
        for entry in sorted(os.scandir(folder), key=lambda e: e.name)
        if entry.is_file(follow_symlinks=False) and not entry.name.startswith(".")
    }


@dataclass
class CopyReport:
    """How a tree's bytes were placed (thread-safe tallies): which primitive, how many bytes, how long.

    ``linked``: hard links (a new name for immutable bytes: nothing written);
    ``reflinked``: ``FICLONE`` (blocks shared until one side changes: nothing
    written now); ``kernel``: ``copy_file_range`` (no bytes through user
    space; the filesystem may share blocks, else it writes them);
    ``buffered``: ``pread``/``pwrite``. ``written`` is what the last two may write.
    """

    files: int = 0
    linked: int = 0
    reflinked: int = 0
    kernel: int = 0
    buffered: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, files: int = 1, **bytes_by_method: int) -> None:
        with self._lock:
            self.files += files
            for method, nbytes in bytes_by_method.items():
                setattr(self, method, getattr(self, method) + nbytes)

    @property
    def total(self) -> int:
        return self.linked + self.reflinked + self.kernel + self.buffered

    @property
    def written(self) -> int:
        """Bytes the placement may have written (copies; links and reflinks write none)."""
        return self.kernel + self.buffered

    def as_dict(self) -> dict:
        return {"files": self.files, "bytes": self.total, "linked": self.linked, "reflinked": self.reflinked,
                "copy_file_range": self.kernel, "buffered": self.buffered, "written": self.written,
                "seconds": round(self.seconds, 4)}

    def summary(self) -> str:
        """``"1,234 bytes in 3 file(s), 0.12 s: hard link 1,000, copy_file_range 234"`` (methods used only)."""
        parts = [f"{label} {n:,}" for label, n in (("hard link", self.linked), ("reflink", self.reflinked),
                                                    ("copy_file_range", self.kernel), ("buffered copy", self.buffered))
                 if n]
        return f"{self.total:,} bytes in {self.files} file(s), {self.seconds:.2f} s: {', '.join(parts) or 'empty'}"


def copy_file(src: Path, dst: Path, progress: Callable[[int], None] | None = None, stop=None, *,
              durable: bool = True, report: CopyReport | None = None) -> int:
    """Copy with the fastest safe primitive (reflink, else ``copy_file_range``, else buffered); fsync unless
    ``durable=False`` (for a copy whose record says its pages are not known to be on disk).

    ``stop`` (a ``StopToken``) is checked between chunks; ``report`` tallies the method used.
    """
    size = os.path.getsize(src)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        if _reflink(fin.fileno(), fout.fileno()):
            progress and progress(size)
            kernel, reflinked = 0, size
        else:
            kernel, reflinked = copy_bytes(fin, fout, size, progress=progress, stop=stop), 0
        fout.flush()
        if durable:
            os.fsync(fout.fileno())
        written = os.fstat(fout.fileno()).st_size
        if written != size:  # never leave a short copy behind a successful return
            raise OSError(errno.EIO, f"copied {written} of {size} bytes of {src} into {dst}")
    if report is not None:
        report.add(reflinked=reflinked, kernel=kernel, buffered=size - kernel - reflinked)
    return size


def link_file(src: Path, dst: Path, *, durable: bool = True, report: CopyReport | None = None) -> int | None:
    """Give the bytes of ``src`` (a link followed to its target) a second name ``dst`` (a hard link); its size,
    or None where the filesystem refuses (another filesystem, no permission, too many links: the caller
    copies). Only for bytes nobody patches in place: a link shares them. ``durable``: their pages are
    fsynced, as a copy's would be."""
    target = os.path.realpath(src)
    try:
        os.link(target, dst)
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP, errno.EROFS,
                         errno.ENOSYS, errno.EINVAL):
            return None
        raise
    size = os.path.getsize(dst)
    if durable:
        fsync_files(Path(dst).parent, [Path(dst).name])
    if report is not None:
        report.add(linked=size)
    return size


def reflink_file(src: Path, dst: Path, *, report: CopyReport | None = None) -> bool:
    """Make ``dst`` (new) a reflink of ``src`` (no bytes written); False, and no ``dst``, where the filesystem
    cannot. Not fsynced: for copies whose record says their pages are not known to be on disk."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        done = _reflink(fin.fileno(), fout.fileno())
    if not done:
        os.unlink(dst)
        return False
    if report is not None:
        report.add(reflinked=os.path.getsize(dst))
    return True


def _reflink(src_fd: int, dst_fd: int) -> bool:
    try:
        import fcntl

        FICLONE = 0x40049409
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return True
    except OSError:
        return False


def copy_bytes(fin, fout, nbytes: int, *, src_offset: int = 0, progress: Callable[[int], None] | None = None,
               stop=None) -> int:
    """The one chunked copy: ``nbytes`` of the open file ``fin`` from ``src_offset`` into ``fout`` at its position.

    ``copy_file_range`` where the kernel can (no bytes through user space),
    else ``pread``/``pwrite`` in ``COPY_CHUNK`` pieces; a write that takes
    nothing is ``ENOSPC``, an early end of ``fin`` is ``EIO``: never a short
    copy reported whole. ``fout``'s position ends after the copied bytes;
    ``stop`` (a ``StopToken``) is checked between chunks. Returns the bytes ``copy_file_range`` moved.
    """
    fout.flush()
    start = fout.tell()
    done = kernel = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < nbytes:
        if stop is not None:
            stop.check(file=fout.name)
        n = min(COPY_CHUNK, nbytes - done)
        copied = 0
        if use_cfr:
            try:
                copied = os.copy_file_range(fin.fileno(), fout.fileno(), n, src_offset + done, start + done)
                kernel += copied
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_cfr = False
        if not copied:
            chunk = os.pread(fin.fileno(), n, src_offset + done)
            if not chunk:
                raise OSError(errno.EIO, f"unexpected end of {fin.name} at {src_offset + done}")
            copied = os.pwrite(fout.fileno(), chunk, start + done)  # a full disk may take only part of it
            if not copied:
                raise OSError(errno.ENOSPC, f"no space left writing {fout.name} at {start + done}")
        done += copied
        if progress:
            progress(copied)
    fout.seek(start + nbytes)
    return kernel


def copy_tree_files(
    src: Path, dst: Path, *, workers: int = 4, progress: Callable[[int], None] | None = None, stop=None,
    durable: bool = True, link: Callable[[str], bool] | None = None, report: CopyReport | None = None,
) -> int:
    """Copy the regular files of ``src`` (one level, symlinks followed) into a new folder ``dst`` in parallel;
    returns the bytes placed.

    Each file is reflinked where the filesystem can, else copied with
    ``copy_file_range``, else through a buffer; files for which ``link(name)``
    is true (bytes nobody patches in place) are hard-linked instead where the
    filesystem allows, and copied where it does not. Every file is fsynced
    (linked ones too) unless ``durable=False``; the folder always is.
    ``report`` tallies the methods, bytes and seconds.
    """
    started = time.perf_counter()
    dst.mkdir(parents=True, exist_ok=False)
    files = [Path(e.path) for e in source_files(src)]
    files.sort(key=lambda p: -p.stat().st_size)

    def place(path: Path) -> int:
        if link is not None and link(path.name):
            if stop is not None:
                stop.check(file=str(path))
            size = link_file(path, dst / path.name, durable=durable, report=report)
            if size is not None:
                progress and progress(size)
                return size
        return copy_file(path, dst / path.name, progress, stop, durable=durable, report=report)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        sizes = list(pool.map(place, files))
    fsync_dir(dst)
    if report is not None:
        report.seconds += time.perf_counter() - started
    return sum(sizes)


def remove_tree(path: Path) -> None:
    """Remove a folder if present (idempotent) and make the removal durable."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path)
    if path.parent.exists():
        fsync_dir(path.parent)


def source_files(folder: Path) -> list[os.DirEntry]:
    """The files ``copy_tree_files`` copies: regular files (or links to them) directly in ``folder``."""
    return [e for e in sorted(os.scandir(folder), key=lambda e: e.name)
            if e.is_file(follow_symlinks=True) and not e.name.startswith(".")]


def copied_size(folder: Path) -> int:
    """Bytes ``copy_tree_files`` will write for ``folder`` (link targets' sizes, as copied)."""
    return sum(e.stat(follow_symlinks=True).st_size for e in source_files(folder))


def tree_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 if missing)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total
