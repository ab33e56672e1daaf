"""The store's byte quota: make room by evicting what no one needs, or refuse up front."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from storage.durable import tree_size
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


def _units(store: LocalStore) -> list[Evictable]:
    units = []
    for kind in _KIND_ORDER:
        base = store.root / kind
        for folder in base.iterdir():
            if folder.is_dir() and not folder.is_symlink():  # a link is the recovery's to remove, not a unit
                units.append(Evictable(kind, folder.name, folder, tree_size(folder), os.stat(folder).st_mtime_ns))
    return units


def ensure_capacity(store: LocalStore, required: int, protect: set[Path], *, what: str) -> list[str]:
    """Make ``required`` more bytes fit under the quota, or raise ``CapacityError`` changing nothing.

    Eviction order: delta artifacts, then materialized checkpoints, then full
    checkpoints, least recently used first; nothing in ``protect`` (the active
    version, the current checkpoint, this operation's working set) is touched.
    """
    usage = tree_size(store.root)
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
            "working set are kept); raise --cache-max-gb or free disk",
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
