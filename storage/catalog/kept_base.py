"""The publisher's kept base: its own copy of the last published checkpoint, the exact base of its next delta.

On disk (``state_dir/{model}/checkpoints/{version}.{n}`` and ``last.json``:
version, folder, checksums and the files' identity, so an unchanged copy is
not hashed again) or in this
process (``keep_base="memory"``: a copy of the tensors as published, gone with
the process). Either is used only if it hashes to the base's ``target_digest``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Mapping

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as strict_dataclass

from storage.catalog.publisher import Snapshot, snapshot_of
from storage.catalog.records import Revision
from storage.durable import atomic_write_json, copy_tree_files, file_identity, fsync_dir, fsync_files, remove_tree
from storage.errors import LineageError, StoreError
from storage.jsonio.bounded_json import STORE_RECORD, read_record
from storage.format.checkpoint import CheckpointIndex
from storage.format.tensor_source import MemoryCheckpoint
from storage.runtime.killpoints import killpoint


KEEP_BASES = ("disk", "memory")


@dataclass(frozen=True)
class _KeptInMemory:
    version: str
    checksum_format: str
    checksums: Mapping[str, str]
    checkpoint: MemoryCheckpoint


@strict_dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class KeptRecord:
    """Contents of ``last.json``: the kept copy's version, folder, checksums and the files' identity. Strict,
    no unknown key (the publisher's own state: only its own writes it). A record without ``folder`` (a copy
    kept before copies were versioned) names ``checkpoint/``; one without files or checksums is hashed."""

    version: str
    checksum_format: str | None = None
    checksums: dict[str, str] | None = None
    files: dict[str, Annotated[list[int], Field(min_length=2, max_length=2)]] | None = None  # [size, mtime_ns]
    folder: str | None = None  # under the model's state folder: checkpoints/{version}.{n}


_IN_MEMORY: dict[Path, _KeptInMemory] = {}  # this process's kept bases, by publisher state folder
_SPARE: dict[Path, _KeptInMemory] = {}  # copies given up while a staged one waited: their buffers are reused
_IN_MEMORY_LOCK = threading.Lock()


class PublisherCopy:
    """The publisher's own copy of the last published checkpoint (the next delta's base).

    It lives on disk (``state_dir``: ``checkpoints/{version}.{n}/`` and
    ``last.json``, which names the folder) or, with ``keep_base="memory"``,
    in this process (a copy of the tensors as published; gone when the
    process ends, when the disk copy, if it is the exact base, serves
    instead). Replacing it is crash-safe: the new copy is complete in its own
    folder before ``last.json`` is switched to it, so a publisher killed at
    any instant leaves ``last.json`` naming a complete copy, the old or the
    new one.
    """

    def __init__(self, state_dir: Path, model: str, *, keep_base: str = "disk"):
        if keep_base not in KEEP_BASES:
            raise ValueError(f"keep_base must be one of {', '.join(KEEP_BASES)}, not {keep_base!r}")
        self.root = Path(state_dir).expanduser() / model.replace("/", "--")
        self.record_path = self.root / "last.json"
        self.in_memory = keep_base == "memory"

    def last(self) -> KeptRecord | None:
        """``last.json``, or None if there is none; ``StoreError`` naming it if it is not such a record."""
        return read_record(self.record_path, KeptRecord, STORE_RECORD, error=StoreError, missing_ok=True,
                           hint='; move it away, then pass the base\'s checkpoint as base_checkpoint= or publish '
                                'with kind="full"')

    @property
    def checkpoint(self) -> Path:
        """The folder of the kept copy on disk (``checkpoint/`` for copies kept before it was versioned)."""
        last = self.last()
        folder = last.folder if last is not None else None
        return self.root / folder if folder is not None and "/" in folder and ".." not in folder \
            else self.root / "checkpoint"

    def kept_version(self) -> str | None:
        """The version the kept copy was published as (this process's copy in memory first), or None."""
        kept = _IN_MEMORY.get(self.root.resolve()) if self.in_memory else None
        if kept is not None:
            return kept.version
        last = self.last()
        return last.version if last is not None and self.checkpoint.is_dir() else None

    def base_for(self, base: Revision, *, workers: int, publishing: str | None = None) -> Snapshot:
        """The kept copy as a snapshot of ``base``, refusing anything but the exact base; errors name the
        revision being ``publishing`` and the base apart."""
        snap = self._in_memory(base.version, base.checksum_format, workers)
        if snap is not None and snap.target_digest == base.target_digest:
            return snap
        last = self.last()
        if last is None or not self.checkpoint.is_dir():
            where = ("this process keeps no copy of it in memory (a copy kept in memory is gone with the process "
                     "that published it)" if self.in_memory else f"{self.root} holds no kept copy")
            raise LineageError(f"no copy of the base revision {base.version} to encode the delta against: {where}; "
                               f"pass the checkpoint of {base.version} as base_checkpoint=, or publish this "
                               'revision with kind="full"', revision=publishing, field="base_checkpoint")
        snap = self._on_disk(last, base.version, base.checksum_format, workers)
        if snap.target_digest != base.target_digest:
            raise LineageError(f"the publisher's kept copy ({last.version}) is not the exact base revision "
                               f"{base.version}; pass the checkpoint of {base.version} as base_checkpoint=",
                               revision=publishing, file=str(self.checkpoint), field="base_checkpoint")
        return snap

    def kept_snapshot(self, version: str, checksum_format: str, *, workers: int) -> Snapshot | None:
        """The kept copy as a snapshot, if it is ``version``'s (this process's copy in memory first): a trainer
        rank's part of a revision, which no catalog digest can check alone (the part records its checksums
        and the merge checks them all together)."""
        snap = self._in_memory(version, checksum_format, workers)
        if snap is not None:
            return snap
        last = self.last()
        if last is None or last.version != version or not self.checkpoint.is_dir():
            return None
        return self._on_disk(last, version, checksum_format, workers)

    def _in_memory(self, version: str, checksum_format: str, workers: int) -> Snapshot | None:
        """This process's copy in memory, if it was kept as ``version`` in ``checksum_format``."""
        kept = _IN_MEMORY.get(self.root.resolve()) if self.in_memory else None
        if kept is None or kept.version != version or kept.checksum_format != checksum_format:
            return None
        return snapshot_of(kept.checkpoint, checksum_format, workers=workers, checksums=kept.checksums)

    def _on_disk(self, last: KeptRecord, version: str, checksum_format: str, workers: int) -> Snapshot:
        """The copy on disk; its recorded checksums are reused only if its files, version and format are the
        recorded ones (otherwise it is hashed)."""
        checkpoint = self.checkpoint
        files = {p.name: file_identity(p) for p in sorted(checkpoint.iterdir()) if p.is_file()}
        same = (last.files == files and last.version == version and last.checksum_format == checksum_format)
        return snapshot_of(checkpoint, checksum_format, workers=workers, checksums=last.checksums if same else None)

    def keep(self, source: Path | CheckpointIndex | MemoryCheckpoint, version: str, checksum_format: str,
             checksums: Mapping[str, str], *, workers: int = 4) -> None:
        """Replace the kept copy with ``source`` (a folder, or tensors in memory) as published under ``version``.

        In memory, the tensors are copied (the trainer's own ones change with
        its next step) by ``workers`` threads into the buffers of the copy they
        replace (given up first: a copy that fails midway is no copy); on disk, tensors in memory are written as their one
        shard (``storage.format.tensor_source``), into a folder of their own;
        ``last.json`` is switched to it only once it is complete and durable,
        then the older copies are removed.
        """
        if self.in_memory and isinstance(source, MemoryCheckpoint):
            with _IN_MEMORY_LOCK:
                old = _IN_MEMORY.pop(self.root.resolve(), None)
                spare = _SPARE.pop(self.root.resolve(), None)  # one copy is enough when nothing waits
            old = old or spare
            tensors = source.copy(reuse=old.checkpoint if old else None, workers=workers)
            kept = _KeptInMemory(version, checksum_format, dict(checksums), tensors)
            with _IN_MEMORY_LOCK:
                _IN_MEMORY[self.root.resolve()] = kept
            return
        self.stage(source, version, checksum_format, checksums, workers=workers).commit()

    def stage(self, source: Path | CheckpointIndex | MemoryCheckpoint, version: str, checksum_format: str,
              checksums: Mapping[str, str], *, workers: int = 4) -> "StagedCopy":
        """A complete new copy of ``source`` that is not the kept copy yet: ``commit`` makes it the kept one
        (once ``version``'s record is written), ``discard`` drops it. Until then the kept copy is unchanged.

        In memory the tensors are copied into the buffers of a copy given up
        earlier, when there is one (so a publisher that stages while its kept
        copy is still the base holds two copies); on disk they are written to
        a folder of their own under ``checkpoints/``, which ``last.json`` does
        not name until ``commit``.
        """
        root = self.root.resolve()
        if self.in_memory and isinstance(source, MemoryCheckpoint):
            with _IN_MEMORY_LOCK:
                spare = _SPARE.pop(root, None)
            tensors = source.copy(reuse=spare.checkpoint if spare else None, workers=workers)
            return StagedCopy(self, _KeptInMemory(version, checksum_format, dict(checksums), tensors))
        folders = self.root / "checkpoints"
        folders.mkdir(parents=True, exist_ok=True)
        name = f"{version}.{time.time_ns()}"
        staging = folders / f".{name}.partial"
        if isinstance(source, MemoryCheckpoint):
            staging.mkdir()
            source.write(staging)
            fsync_files(staging, [p.name for p in staging.iterdir()])
            fsync_dir(staging)
        else:
            copy_tree_files(source.folder if isinstance(source, CheckpointIndex) else source, staging)
        staging.rename(folders / name)
        fsync_dir(folders)
        return StagedCopy(self, _KeptOnDisk(version, checksum_format, dict(checksums), name))

    def _switch_on_disk(self, kept: "_KeptOnDisk") -> None:
        folders, name = self.root / "checkpoints", kept.folder
        killpoint("publish.kept_staged", kept.version)
        files = {p.name: file_identity(p) for p in sorted((folders / name).iterdir()) if p.is_file()}
        atomic_write_json(self.record_path, {"version": kept.version, "checksum_format": kept.checksum_format,
                                             "checksums": dict(kept.checksums), "files": files,
                                             "folder": f"checkpoints/{name}"})
        for old in [*folders.iterdir(), self.root / "checkpoint"]:  # older copies, and a crashed keep's leftovers
            if old.name != name:
                remove_tree(old)
        with _IN_MEMORY_LOCK:  # the disk copy is now the newer one
            _IN_MEMORY.pop(self.root.resolve(), None)
            _SPARE.pop(self.root.resolve(), None)


@dataclass(frozen=True)
class _KeptOnDisk:
    version: str
    checksum_format: str
    checksums: Mapping[str, str]
    folder: str  # under checkpoints/


@dataclass
class StagedCopy:
    """A new copy made by ``PublisherCopy.stage``, waiting for its revision's record."""

    owner: PublisherCopy
    kept: _KeptInMemory | _KeptOnDisk | None

    def commit(self) -> None:
        """Make it the kept copy (the one it replaces is kept as a spare in memory, removed on disk)."""
        kept, self.kept = self.kept, None
        if isinstance(kept, _KeptOnDisk):
            self.owner._switch_on_disk(kept)
        elif kept is not None:
            root = self.owner.root.resolve()
            with _IN_MEMORY_LOCK:
                old = _IN_MEMORY.get(root)
                _IN_MEMORY[root] = kept
                if old is not None:
                    _SPARE[root] = old

    def discard(self) -> None:
        """Drop it: the kept copy stays what it was (in memory its buffers are kept as the spare)."""
        kept, self.kept = self.kept, None
        if isinstance(kept, _KeptOnDisk):
            remove_tree(self.owner.root / "checkpoints" / kept.folder)
        elif kept is not None:
            with _IN_MEMORY_LOCK:
                _SPARE[self.owner.root.resolve()] = kept
