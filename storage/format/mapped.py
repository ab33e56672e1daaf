"""Memory-mapped files: the one wrapper every reader and writer of tensor bytes goes through.

``MappedFiles`` maps the files of a folder on first use (read-only, or
writable for the checkpoint being patched), hands out NumPy ``uint8`` views,
advises the kernel per byte range (``madvise`` through ctypes, so applier
threads do not hold the GIL while the kernel populates or drops pages),
flushes, and unmaps everything on ``close`` — explicitly, because a live
mapping pins its file system (a test's tmpfs cannot be unmounted otherwise).
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+: fault a range in with one call
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)

try:  # libc's madvise through ctypes: unlike mmap.madvise it runs without the GIL
    import ctypes

    _libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
    _libc_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc_madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc: faults happen on first touch
    _libc_madvise = None

_EMPTY = np.empty(0, dtype=np.uint8)


def advise(view: np.ndarray, start: int, length: int, advice: int) -> None:
    """``madvise`` bytes ``[start, start+length)`` of the mapping behind ``view`` (widened to pages).

    POPULATE: one call instead of a page fault per 4 KiB. DONTNEED on a shared
    file mapping only unmaps: dirty pages stay in the page cache and reach the
    disk on flush, so the process does not hold the whole checkpoint resident.
    A kernel without the advice simply ignores it.
    """
    if length <= 0 or _libc_madvise is None or view.size == 0:
        return
    aligned = start - start % PAGE
    _libc_madvise(view.ctypes.data + aligned, min(view.size - aligned, length + start - aligned), advice)


class MappedFiles:
    """Lazily mapped files of one folder (thread-safe); ``writable`` maps them shared read-write."""

    def __init__(self, folder: Path, *, writable: bool = False):
        self.folder = Path(folder)
        self.writable = writable
        self._lock = threading.Lock()
        self._maps: dict[str, mmap.mmap] = {}
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, name: str) -> np.ndarray:
        """The whole file ``name`` as a ``uint8`` array (empty files give an empty array)."""
        with self._lock:
            array = self._arrays.get(name)
            if array is None:
                array = self._arrays[name] = self._map(self.folder / name, name)
            return array

    def _map(self, path: Path, name: str) -> np.ndarray:
        mode = "r+b" if self.writable else "rb"
        with open(path, mode) as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                return _EMPTY
            access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
            m = mmap.mmap(fh.fileno(), 0, access=access)
        self._maps[name] = m
        return np.frombuffer(m, dtype=np.uint8)

    def range(self, name: str, start: int, end: int) -> np.ndarray:
        return self.array(name)[start:end]

    def advise(self, name: str, start: int, length: int, advice: int) -> None:
        advise(self.array(name), start, length, advice)

    def flush(self) -> None:
        """Write dirty pages of every writable mapping back (``msync``)."""
        with self._lock:
            maps = list(self._maps.values())
        for m in maps:
            m.flush()

    def close(self) -> None:
        """Unmap now; a view still referenced elsewhere keeps its mapping until it is collected."""
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
            self._arrays.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere: the GC closes it
                pass

    def __enter__(self) -> "MappedFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
