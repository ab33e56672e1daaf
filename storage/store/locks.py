"""Inter-process reader/writer locks on one lock file (fcntl).

Preparation takes the lock exclusively; installation holds it shared from
validation to activation (the installation fence of docs/format.md, section 7), so
tensor-parallel ranks can load at once while no preparation can change the
checkpoint under them. Open-file-description locks are used where the OS has
them: they belong to the open file, not the process (a second open in the
same process does not silently release the first), they die with their
holder, and converting exclusive to shared is atomic. Elsewhere ``flock``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
from pathlib import Path

from storage.errors import StoreBusy

log = logging.getLogger("canonical_refit.locks")
_OFD = hasattr(fcntl, "F_OFD_SETLK") and hasattr(fcntl, "F_OFD_SETLKW")


def _try_lock(fd: int, exclusive: bool) -> bool:
    if _OFD:
        kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
        # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
        arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0)
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)
            return True
        except OSError as exc:
            if exc.errno in (11, 13):  # EAGAIN / EACCES: held by someone else
                return False
            raise
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _same_file(fd: int, path: Path) -> bool:
    """True if ``path`` still names the file open as ``fd`` (a lock on an unlinked file guards nothing)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


class StoreLock:
    """One acquisition of the store lock; use as a context manager."""

    def __init__(self, path: Path, *, exclusive: bool, timeout_s: float, what: str, stop=None):
        self.path = Path(path)
        self.stop = stop  # a StopToken: an interrupted run stops waiting
        self.exclusive = exclusive
        self.timeout_s = timeout_s
        self.what = what
        self.waited_s = 0.0
        self._fd: int | None = None

    def acquire(self) -> "StoreLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if os.path.islink(self.path):  # a link planted in the cache is removed, never opened (nor created through)
            os.unlink(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        start = time.monotonic()
        delay, announced = 0.01, False
        try:
            while not _try_lock(fd, self.exclusive):
                waited = time.monotonic() - start
                if waited >= self.timeout_s:
                    raise StoreBusy(
                        f"another receiver held the store lock for {waited:.0f}s, longer than the "
                        f"{self.timeout_s:.0f}s allowed for {self.what}",
                        file=str(self.path),
                    )
                if self.stop is not None:
                    self.stop.check(file=str(self.path))
                if not announced and waited > 1.0:
                    log.info("waiting for another receiver's %s lock on %s (%s)",
                             "exclusive" if self.exclusive else "shared", self.path, self.what)
                    announced = True
                time.sleep(delay)
                delay = min(0.25, delay * 1.5)
        except BaseException:
            os.close(fd)
            raise
        if not _same_file(fd, self.path):  # the folder was removed and made again while we waited
            os.close(fd)
            return self.acquire()
        self.waited_s = time.monotonic() - start
        self._fd = fd
        return self

    def downgrade(self) -> None:
        """Turn an exclusive hold into a shared one (atomic with OFD locks)."""
        if self._fd is None or not self.exclusive:
            return
        if _OFD:
            arg = struct.pack("hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, arg)
        else:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        self.exclusive = False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the open file description releases its lock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "StoreLock":
        return self if self.held else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
