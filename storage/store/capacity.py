"""Free disk space and the rollback reserve of a model's local store.

Before an update changes a checkpoint in place, ``reserve_rollback`` checks the disk and holds the bytes a
rollback will need, so that a disk filling up mid-update cannot take them; ``release_reserve`` frees them
right before the rollback (or the commit) writes. The reserve is a temporary file under ``tmp/``, not state:
a killed process's reserve is swept by the next ``recover``.
"""

from __future__ import annotations

import os
from pathlib import Path

from storage.durable import temp_name
from storage.errors import CapacityError
from storage.store.layout import StoreLayout
from storage.store.records import VerifiedCheckpoint

RESERVE_FLOOR_BYTES = 1 << 20  # the smallest rollback reserve: a few state files, each at least one block


class StoreCapacity(StoreLayout):
    """Free bytes on the store's filesystem and this process's rollback reserve."""

    _reserve: Path | None = None  # this process's rollback reserve (``reserve_rollback``), while it is held

    # -- free disk space and the rollback reserve ---------------------------------------------------

    def free_bytes(self) -> int:
        """Bytes this process may still allocate on the filesystem holding the store (root may use the blocks
        ext4 reserves for it, so ENOSPC comes at ``f_bfree`` for root, at ``f_bavail`` for anyone else)."""
        st = os.statvfs(self.root)
        return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize

    def records_bytes(self, base: VerifiedCheckpoint | None) -> int:
        """At most what one checkpoint's records take while being replaced: its verified record, chain,
        ``state.json`` and ``active.json``, each twice (the temporary file beside the old one), rounded up to
        whole blocks; at least ``RESERVE_FLOOR_BYTES``."""
        sizes = [self._verified_path(base.version), self._chain_path(base.version)] if base is not None else []
        total = 0
        for path in sizes + [self.state_path, self.active_path]:
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                size = 0
            total += 2 * (size + 2 * 4096)
        return max(RESERVE_FLOOR_BYTES, total)

    def reserve_rollback(self, *, writes: int, rollback: int, revision: str, what: str) -> None:
        """Before the first in-place change: check the disk, then hold ``rollback`` bytes for the rollback.

        Raises ``CapacityError`` (nothing changed) unless ``writes + rollback`` bytes are free on the
        store's filesystem. The rollback bytes are allocated to a reserve file under ``tmp/``
        (``posix_fallocate``), so a disk that fills up during the update cannot take them;
        ``release_reserve`` deletes it right before the rollback (or the committed update) writes.
        A killed process's reserve is a temporary file of another process: the next ``recover`` sweeps it.
        """
        self.release_reserve()
        free = self.free_bytes()
        needed = writes + rollback
        if free < needed:
            raise self._capacity(what, revision, needed, free, writes, rollback)
        path = self.tmp_dir / temp_name("rollback-reserve")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, max(1, rollback))
            finally:
                os.close(fd)
        except OSError as exc:  # ENOSPC between the check and the allocation: still nothing changed
            path.unlink(missing_ok=True)
            raise self._capacity(what, revision, needed, self.free_bytes(), writes, rollback) from exc
        self._reserve = path

    def release_reserve(self) -> int:
        """Delete this process's rollback reserve (its blocks become free); returns the bytes it held."""
        path, self._reserve = self._reserve, None
        if path is None:
            return 0
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return size

    def _capacity(self, what: str, revision: str, needed: int, free: int, writes: int,
                  rollback: int) -> CapacityError:
        error = CapacityError(
            f"not enough free disk space for {what}: it needs {needed:,} bytes free ({writes:,} to write, "
            f"{rollback:,} reserved so that a rollback never needs new blocks) and the filesystem has {free:,}; "
            "free disk space on that filesystem (nothing was changed)", revision=revision, file=str(self.root))
        error.needed_bytes, error.free_bytes = needed, free
        return error
