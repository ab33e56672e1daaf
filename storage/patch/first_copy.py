"""The first delta's copy of a full checkpoint, with each page written once.

Copying a whole checkpoint and then patching it writes every patched page
twice whenever the kernel writes the copy back before the patch reaches it
(a model larger than the dirty-page limits, or a busy disk): an RL step
changes a few percent of the elements, spread over nearly every page. So
where the filesystem cannot reflink, the copy is made as the patch goes
(``CopyAsPatched``): the target's shards start as files of their final size
holding only their headers; tensors under ``LAZY_MIN`` are copied at once
(adjacent ones in one call); a larger tensor's bytes are copied from the base
when an apply worker takes it, just before it is patched (its pages are still
dirty when the patch touches them); whatever no delta touches is copied once
patching is done. A failure leaves a partial folder that the rollback
discards, as it did the half-patched copy. Tensor ranges are bookkept per
shard and the rest is their complement: O(tensors log tensors).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from storage.runtime.cancel import StopToken
from storage.durable import COPY_CHUNK, CopyReport, copy_file, fsync_dir, reflink_file, source_files
from storage.format.checkpoint import CheckpointIndex

LAZY_MIN = 1 << 20  # tensors under this are copied up front, adjacent ones in one call: no syscall per tiny tensor


class CopyAsPatched:
    """A ``PlanSource`` wrapper: a tensor handed to an apply worker is first copied from the base into the target.

    ``begin`` lays the target folder out (sized shards with their headers,
    other files copied whole); ``finish`` copies every byte no taken tensor
    covered. ``report`` tallies bytes and the seconds of copying (the union of
    the copy calls' spans across threads).
    """

    def __init__(self, inner, base: CheckpointIndex, base_dir: Path, target_dir: Path, *,
                 report: CopyReport, stop: StopToken | None = None):
        self.inner, self.base, self.base_dir, self.target_dir = inner, base, Path(base_dir), Path(target_dir)
        self.report, self.stop = report, stop
        self._lock = threading.Lock()
        self._copied: dict[str, list[tuple[int, int]]] = {f: [(0, h.data_offset)] for f, h in base.headers.items()}
        self._all_copied = False
        self._fds: dict[str, tuple[int, int]] = {}
        self._spans: list[tuple[float, float]] = []
        self._begin_s = 0.0

    # -- laying out and finishing --------------------------------------------------------------------------

    def begin(self, staging: Path) -> None:
        """Fill ``staging`` (a new folder): each shard at its final size with its header; other files copied."""
        started = time.perf_counter()
        staging.mkdir(parents=True, exist_ok=False)
        for entry in source_files(self.base_dir):
            if entry.name in self.base.headers:
                with open(staging / entry.name, "wb") as fout:
                    fout.truncate(os.path.getsize(entry.path))  # a hole until its bytes are copied
                self._copy_range(Path(entry.path), staging / entry.name, 0, self.base.headers[entry.name].data_offset)
            else:
                copy_file(Path(entry.path), staging / entry.name, durable=False, report=self.report)
        fsync_dir(staging)
        self._begin_s = time.perf_counter() - started

    def open(self) -> None:
        """Open every shard pair (base read-only, target for writing) once the target folder is in place; copy
        the tensors under ``LAZY_MIN`` bytes now (sorted by offset, adjacent ones merged into one range)."""
        for name in self.base.headers:
            src = os.open(self.base_dir / name, os.O_RDONLY | os.O_CLOEXEC)
            dst = os.open(self.target_dir / name, os.O_WRONLY | os.O_CLOEXEC)
            self._fds[name] = (src, dst)
        small = sorted((t.file, t.offset, t.offset + t.nbytes) for t in self.base.tensors.values()
                       if t.nbytes < LAZY_MIN)
        merged: list[list] = []
        for file, start, end in small:
            if merged and merged[-1][0] == file and merged[-1][2] == start:
                merged[-1][2] = end
            else:
                merged.append([file, start, end])
        for file, start, end in merged:
            self._copied[file].append((start, end))
            self._copy_span(file, start, end)

    def finish(self, workers: int) -> None:
        """Copy every byte of every shard that no taken tensor (nor a header) covered; then close."""
        chunks = [(name, start + off, min(COPY_CHUNK, end - start - off))
                  for name, start, end in self._claim_gaps() for off in range(0, end - start, COPY_CHUNK)]
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            list(pool.map(lambda c: self._copy_fds(*c), chunks))
        self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for src, dst in fds.values():
            os.close(src)
            os.close(dst)

    def _claim_gaps(self) -> list[tuple[str, int, int]]:
        """Byte ranges of each shard not copied nor claimed by a taken tensor (the complement of the claimed
        ones), claimed by the caller: no tensor taken from now on is copied (so nothing patched is ever
        copied over). [] when they were claimed already."""
        with self._lock:
            if self._all_copied:
                return []
            self._all_copied = True
            copied = {name: sorted(ranges) for name, ranges in self._copied.items()}
        out = []
        for name, ranges in sorted(copied.items()):
            size, at = os.fstat(self._fds[name][0]).st_size, 0
            for start, end in ranges:
                if start > at:
                    out.append((name, at, start))
                at = max(at, end)
            if at < size:
                out.append((name, at, size))
        return out

    # -- the wrapped plan source ------------------------------------------------------------------------

    def names(self) -> list[str]:
        return self.inner.names()

    def count(self) -> int:
        count = getattr(self.inner, "count", None)
        return count() if count is not None else len(self.inner.names())

    def take(self) -> str | None:
        name = self.inner.take()
        if name is not None:
            self._copy_tensors([name])
        return name

    def take_many(self, limit: int, small: int) -> list[str]:
        take_many = getattr(self.inner, "take_many", None)
        names = take_many(limit, small) if take_many is not None else [n for n in [self.inner.take()] if n]
        self._copy_tensors(names)
        return names

    def plan(self, name: str):
        return self.inner.plan(name)

    def cancel(self) -> None:
        self.inner.cancel()

    def prepare(self) -> None:
        self.inner.prepare()

    def total_bytes(self) -> int:
        return self.inner.total_bytes()

    def _copy_tensors(self, names: list[str]) -> None:
        tensors = self.base.tensors
        ranges = []
        for name in names:
            location = tensors.get(name)
            if location is None:  # not a whole tensor of the base: copy everything not copied yet, then patch
                self.finish_now()
                return
            if location.nbytes >= LAZY_MIN:  # smaller ones were copied by ``open``
                ranges.append((location.file, location.offset, location.offset + location.nbytes))
        if not ranges:
            return
        with self._lock:
            if self._all_copied:
                return
            for file, start, end in ranges:
                self._copied[file].append((start, end))
        for file, start, end in ranges:
            self._copy_span(file, start, end)

    def finish_now(self) -> None:
        """Copy every byte not copied yet (before anything else is patched)."""
        for name, start, end in self._claim_gaps():
            self._copy_span(name, start, end)

    # -- copying a byte range ------------------------------------------------------------------------------

    def _copy_span(self, name: str, start: int, end: int) -> None:
        """Copy bytes ``[start, end)`` of shard ``name`` in ``COPY_CHUNK`` pieces (a stop is seen between them)."""
        for off in range(start, end, COPY_CHUNK):
            self._copy_fds(name, off, min(COPY_CHUNK, end - off))

    def _copy_fds(self, name: str, offset: int, length: int) -> None:
        if self.stop is not None:
            self.stop.check(file=str(self.target_dir / name))
        src, dst = self._fds[name]
        started = time.perf_counter()
        kernel = _copy_range_fds(src, dst, offset, length)
        ended = time.perf_counter()
        self.report.add(files=0, kernel=kernel, buffered=length - kernel)
        with self._lock:
            self._spans.append((started, ended))

    def _copy_range(self, src: Path, dst: Path, offset: int, length: int) -> None:
        fin = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fout = os.open(dst, os.O_WRONLY | os.O_CLOEXEC)
            try:
                kernel = _copy_range_fds(fin, fout, offset, length)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        self.report.add(kernel=kernel, buffered=length - kernel)  # a shard: counted as one file

    def copy_seconds(self) -> float:
        """Seconds during which some copy ran (laying out, then the union of the copy calls' spans)."""
        with self._lock:
            spans = sorted(self._spans)
        total, end = self._begin_s, float("-inf")
        for start, stop in spans:
            if stop <= end:
                continue
            total += stop - max(start, end)
            end = stop
        return total


def _copy_range_fds(src: int, dst: int, offset: int, length: int) -> int:
    """Copy ``length`` bytes at ``offset`` of ``src`` to the same offset of ``dst``; the bytes
    ``copy_file_range`` moved (the rest went through ``pread``/``pwrite``). A short source is ``EIO``."""
    done = kernel = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < length:
        n = 0
        if use_cfr:
            try:
                n = os.copy_file_range(src, dst, length - done, offset + done, offset + done)
                kernel += n
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_cfr = False
        if not n:
            chunk = os.pread(src, min(COPY_CHUNK, length - done), offset + done)
            if not chunk:
                raise OSError(errno.EIO, f"unexpected end of the base at {offset + done}")
            n = os.pwrite(dst, chunk, offset + done)
            if not n:
                raise OSError(errno.ENOSPC, f"no space left writing at {offset + done}")
        done += n
    return kernel


def reflinks(base_dir: Path, staging: Path, report: CopyReport) -> bool:
    """Reflink every file of ``base_dir`` into the new folder ``staging`` (nothing written); False as soon as
    the filesystem refuses one (the caller removes ``staging``): then the copy is made as the patch goes."""
    started = time.perf_counter()
    staging.mkdir(parents=True, exist_ok=False)
    for entry in source_files(base_dir):
        if not reflink_file(Path(entry.path), staging / entry.name, report=report):
            return False
    fsync_dir(staging)
    report.seconds += time.perf_counter() - started
    return True
