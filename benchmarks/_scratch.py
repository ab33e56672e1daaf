"""Scratch copies for the benchmark: checkpoints, receiver-store snapshots, disk accounting.

Restores are made durable (fsync) before anything is measured, so that no
page a measured run writes is still dirty from the copy: ``write_bytes``
(see ``_meter``) is only charged when a clean page becomes dirty.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LINK_MIN_BYTES = 1 * 2**20  # immutable big files are hard-linked; small state files are copied


def _copy_durable(src: Path, dst: Path) -> int:
    shutil.copy2(src, dst)  # keeps mtime_ns: the store recognises its files by (size, mtime_ns)
    with open(dst, "rb+") as fh:
        os.fsync(fh.fileno())
    return dst.stat().st_size


def copy_checkpoint(src: Path, dst: Path) -> int:
    """Copy a checkpoint folder (one level) durably; returns bytes copied."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    return sum(_copy_durable(p, dst / p.name) for p in sorted(Path(src).iterdir()) if p.is_file())


def clone_store(src: Path, dst: Path) -> int:
    """Copy a receiver cache folder: mutable checkpoints and small files copied, immutable artifacts linked.

    Only ``materialized/`` is ever patched in place, so everything else large
    (``full/`` shards, downloaded buckets) is shared by hard link. Returns the
    bytes actually copied.
    """
    if dst.exists():
        shutil.rmtree(dst)
    copied = 0
    for folder, dirs, files in os.walk(src):
        rel = Path(folder).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        mutable = "materialized" in rel.parts
        for name in files:
            s, d = Path(folder) / name, dst / rel / name
            if not mutable and s.stat().st_size >= LINK_MIN_BYTES:
                os.link(s, d)
            else:
                copied += _copy_durable(s, d)
    return copied


def tree_bytes(*paths: Path) -> int:
    """Disk bytes under ``paths`` (a hard-linked file counted once)."""
    seen, total = set(), 0
    for path in paths:
        for folder, _dirs, files in os.walk(path):
            for name in files:
                try:
                    st = os.lstat(os.path.join(folder, name))
                except FileNotFoundError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


class DiskMeter:
    """Largest disk use seen under the benchmark's folders (sampled when asked)."""

    def __init__(self, *roots: Path):
        self.roots = roots
        self.peak = 0

    def sample(self) -> int:
        now = tree_bytes(*(r for r in self.roots if r.exists()))
        self.peak = max(self.peak, now)
        return now
