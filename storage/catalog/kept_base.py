"""The publisher's kept base: its own copy of the last published checkpoint, the exact base of its next delta.

On disk (``state_dir/{model}/checkpoint`` and ``last.json``: version, checksums
and the files' identity, so an unchanged copy is not hashed again) or in this
process (``keep_base="memory"``: a copy of the tensors as published, gone with
the process). Either is used only if it hashes to the base's ``target_digest``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from storage.catalog.publisher import Snapshot, snapshot_of
from storage.catalog.records import Revision
from storage.durable import atomic_write_json, copy_tree_files, file_identity, read_json_file, remove_tree
from storage.errors import LineageError
from storage.format.checkpoint import CheckpointIndex
from storage.format.tensor_source import MemoryCheckpoint


KEEP_BASES = ("disk", "memory")


@dataclass(frozen=True)
class _KeptInMemory:
    version: str
    checksum_format: str
    checksums: Mapping[str, str]
    checkpoint: MemoryCheckpoint


_IN_MEMORY: dict[Path, _KeptInMemory] = {}  # this process's kept bases, by publisher state folder
_IN_MEMORY_LOCK = threading.Lock()


class PublisherCopy:
    """The publisher's own copy of the last published checkpoint (the next delta's base).

    It lives on disk (``state_dir``, a checkpoint folder and ``last.json``)
    or, with ``keep_base="memory"``, in this process (a copy of the tensors
    as published; gone when the process ends, when the disk copy, if it is
    the exact base, serves instead).
    """

    def __init__(self, state_dir: Path, model: str, *, keep_base: str = "disk"):
        if keep_base not in KEEP_BASES:
            raise ValueError(f"keep_base must be one of {', '.join(KEEP_BASES)}, not {keep_base!r}")
        self.root = Path(state_dir).expanduser() / model.replace("/", "--")
        self.checkpoint = self.root / "checkpoint"
        self.record_path = self.root / "last.json"
        self.in_memory = keep_base == "memory"

    def last(self) -> dict | None:
        raw = read_json_file(self.record_path)
        return raw if isinstance(raw, dict) else None

    def base_for(self, base: Revision, *, workers: int) -> Snapshot:
        """The kept copy as a snapshot of ``base``, refusing anything but the exact base."""
        kept = _IN_MEMORY.get(self.root.resolve()) if self.in_memory else None
        if kept is not None and kept.version == base.version and kept.checksum_format == base.checksum_format:
            snap = snapshot_of(kept.checkpoint, base.checksum_format, workers=workers, checksums=kept.checksums)
            if snap.target_digest == base.target_digest:
                return snap
        last = self.last()
        if last is None or not self.checkpoint.is_dir():
            raise LineageError("no base checkpoint: pass --base-checkpoint (the publisher keeps no copy yet)",
                               revision=base.version)
        files = {p.name: file_identity(p) for p in sorted(self.checkpoint.iterdir()) if p.is_file()}
        known = last.get("checksums") if last.get("files") == files and last.get("version") == base.version else None
        snap = snapshot_of(self.checkpoint, base.checksum_format, workers=workers,
                           checksums=known if last.get("checksum_format") == base.checksum_format else None)
        if snap.target_digest != base.target_digest:
            raise LineageError(f"the publisher's kept copy ({last.get('version')}) is not the exact base "
                               f"{base.version}; pass --base-checkpoint", revision=base.version,
                               file=str(self.checkpoint))
        return snap

    def keep(self, source: Path | CheckpointIndex | MemoryCheckpoint, version: str, checksum_format: str,
             checksums: Mapping[str, str]) -> None:
        """Replace the kept copy with ``source`` (a folder, or tensors in memory) as published under ``version``.

        In memory, the tensors are copied (the trainer's own ones change with
        its next step); on disk, tensors in memory are written as their one
        shard (``storage.format.tensor_source``).
        """
        if self.in_memory and isinstance(source, MemoryCheckpoint):
            kept = _KeptInMemory(version, checksum_format, dict(checksums), source.copy())
            with _IN_MEMORY_LOCK:
                _IN_MEMORY[self.root.resolve()] = kept
            return
        staging = self.root / "checkpoint.new"
        remove_tree(staging)
        self.root.mkdir(parents=True, exist_ok=True)
        if isinstance(source, MemoryCheckpoint):
            staging.mkdir()
            source.write(staging)
        else:
            copy_tree_files(source.folder if isinstance(source, CheckpointIndex) else source, staging)
        remove_tree(self.checkpoint)
        self.record_path.unlink(missing_ok=True)
        staging.rename(self.checkpoint)
        files = {p.name: file_identity(p) for p in sorted(self.checkpoint.iterdir()) if p.is_file()}
        atomic_write_json(self.record_path, {"version": version, "checksum_format": checksum_format,
                                             "checksums": dict(checksums), "files": files})
        with _IN_MEMORY_LOCK:  # the disk copy is now the newer one
            _IN_MEMORY.pop(self.root.resolve(), None)
