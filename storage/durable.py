"""Durable local file operations: atomic replace, fsync, fast copies, identities."""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from storage.digests import canonical_json

COPY_CHUNK = 64 * 2**20


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
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
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


def read_json_file(path: Path):
    """Parsed JSON of a local file, or None if it does not exist."""
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read())
    except FileNotFoundError:
        return None


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


def copy_file(src: Path, dst: Path, progress: Callable[[int], None] | None = None) -> int:
    """Copy with the fastest safe primitive (reflink or copy_file_range, else buffered); fsync."""
    size = os.path.getsize(src)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        if not _reflink(fin.fileno(), fout.fileno()):
            _copy_range(fin, fout, size, progress)
        else:
            progress and progress(size)
        fout.flush()
        os.fsync(fout.fileno())
    return size


def _reflink(src_fd: int, dst_fd: int) -> bool:
    try:
        import fcntl

        FICLONE = 0x40049409
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return True
    except OSError:
        return False


def _copy_range(fin, fout, size: int, progress) -> None:
    offset = 0
    use_cfr = hasattr(os, "copy_file_range")
    while offset < size:
        n = min(COPY_CHUNK, size - offset)
        copied = 0
        if use_cfr:
            try:
                copied = os.copy_file_range(fin.fileno(), fout.fileno(), n, offset, offset)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_cfr = False
        if not copied:
            chunk = os.pread(fin.fileno(), n, offset)
            if not chunk:
                raise OSError(errno.EIO, f"unexpected end of {fin.name} at {offset} of {size}")
            os.pwrite(fout.fileno(), chunk, offset)
            copied = len(chunk)
        offset += copied
        if progress:
            progress(copied)


def copy_tree_files(
    src: Path, dst: Path, *, workers: int = 4, progress: Callable[[int], None] | None = None
) -> int:
    """Copy the regular files of ``src`` (one level) into a new folder ``dst`` in parallel."""
    dst.mkdir(parents=True, exist_ok=False)
    files = [e for e in sorted(os.scandir(src), key=lambda e: -e.stat().st_size)
             if e.is_file() and not e.name.startswith(".")]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        sizes = list(pool.map(lambda e: copy_file(Path(e.path), dst / e.name, progress), files))
    fsync_dir(dst)
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
