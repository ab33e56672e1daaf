"""The store's byte quota: make room by evicting what no one needs, or refuse up front.

The quota counts the bytes the store alone holds (``held_size``): a file
hard-linked from outside the store (the seed's weight files, whose bytes the
launch snapshot holds too) takes no space of the store's and counts nothing,
neither in the store's usage nor as a unit's evictable bytes; once its other
name is gone it counts at its size. Copies count at their size.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from storage.errors import CapacityError
from storage.store.local_store import LocalStore

log = logging.getLogger("canonical_refit.quota")
_KIND_ORDER = {"deltas": 0, "materialized": 1, "full": 2}


@dataclass(frozen=True)
class Evictable:
    kind: str
    version: str
    folder: Path
    bytes: int
    last_used_ns: int


def held_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` that only it holds: a file with another name (a hard link
    from elsewhere) counts nothing (0 if ``path`` is missing)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                total += info.st_size
    return total


def _units(store: LocalStore) -> list[Evictable]:
    units = []
    for kind in _KIND_ORDER:
        base = store.root / kind
        for folder in base.iterdir():
            if folder.is_dir() and not folder.is_symlink():  # a link is the recovery's to remove, not a unit
                units.append(Evictable(kind, folder.name, folder, held_size(folder), os.stat(folder).st_mtime_ns))
    return units


def ensure_capacity(store: LocalStore, required: int, protect: set[Path], *, what: str) -> list[str]:
    """Make ``required`` more bytes fit under the quota, or raise ``CapacityError`` changing nothing.

    Eviction order: delta artifacts, then materialized checkpoints, then full
    checkpoints, least recently used first; nothing in ``protect`` (the active
    version, the current checkpoint, this operation's working set) is touched.
    """
    usage = held_size(store.root)
    if usage + required <= store.quota_bytes:
        return []
    protected = {Path(p).resolve() for p in protect if p is not None}
    candidates = sorted(
        (u for u in _units(store) if u.folder.resolve() not in protected),
        key=lambda u: (_KIND_ORDER[u.kind], u.last_used_ns),
    )
    freeable = sum(u.bytes for u in candidates)
    if usage - freeable + required > store.quota_bytes:
        raise CapacityError(
            f"{what} needs {required:,} more bytes; the store holds {usage:,} of its {store.quota_bytes:,}-byte "
            f"quota and only {freeable:,} bytes are evictable (the active version and this operation's "
            "working set are kept); raise cache_max_gb= or free disk",
            file=str(store.root),
        )
    evicted = []
    for unit in candidates:
        if usage + required <= store.quota_bytes:
            break
        store.evict(unit.version, unit.folder)
        usage -= unit.bytes
        evicted.append(f"{unit.kind}/{unit.version} ({unit.bytes:,} bytes)")
        log.info("evicted %s/%s (%d bytes) to make room for %s", unit.kind, unit.version, unit.bytes, what)
    return evicted
