"""Stage 2, seed checkpoint: recover the store, and seed it from the launch snapshot if needed."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from storage.store import launch_files
from storage.catalog.records import Revision
from storage.format.checkpoint import CheckpointIndex
from storage.durable import (
    CopyReport, boot_id, copied_size, copy_tree_files, folder_identity, fsync_dir, remove_tree, source_files,
)
from storage.errors import ChecksumMismatch, CheckpointMismatch, StoreError
from storage.runtime.killpoints import killpoint
from storage.store.local_store import Chain, VerifiedCheckpoint, now_ms
from storage.store.quota import ensure_capacity
from tasks.receiver import Receiver
from tasks.resolve_catalog import ReplayPlan
from tasks.stage import Stage

log = logging.getLogger("canonical_refit.seed")


@dataclass(frozen=True)
class Baseline:
    """The verified local checkpoint reconstruction starts from (None: a full revision to fetch)."""

    checkpoint: VerifiedCheckpoint | None
    seeded: bool = False
    recovery: tuple[str, ...] = field(default_factory=tuple)
    bytes: int = 0
    placed: str = ""  # how the seed's bytes were placed (hard links, reflinks, copies), in words

    @property
    def summary(self) -> str:
        parts = list(self.recovery)
        if self.checkpoint is None:
            parts.append("start from a full revision")
        else:
            parts.append(("seeded " if self.seeded else "reuse ") + f"{self.checkpoint.version} "
                         f"({self.checkpoint.path})" + (f": {self.placed}" if self.placed else ""))
        return "; ".join(parts)


def seed_checkpoint(rx: Receiver, plan: ReplayPlan) -> Baseline:
    """Make sure the store holds a verified checkpoint to start from (call under the exclusive lock).

    Reports what the recovery at the start of the preparation did (an
    interrupted update discarded, tampered files forgotten); seeds the launch
    snapshot into ``full/{v}`` on first use, verified against revision 0's
    format and target digest before the store trusts it.
    """
    recovery = rx.recovery  # done (and noted) when the preparation lock was taken
    root = plan.root
    keep_launch_files(rx, root)
    inventory = rx.store.inventory()
    if root.version in inventory:
        return Baseline(inventory[root.version], recovery=recovery)
    if plan.root_is_local:
        raise StoreError(f"checkpoint {root.version} disappeared from the store while it was locked",
                         revision=root.version, file=str(rx.store.root))
    if root.payload_format == "full_hf_checkpoint":
        return Baseline(None, recovery=recovery)
    report = CopyReport()
    checkpoint, copied = seed_launch_snapshot(rx, root, report=report)
    return Baseline(checkpoint, seeded=True, recovery=recovery, bytes=copied, placed=report.summary())


def bytes_to_copy(seed_path: Path, into: Path, *, links: bool) -> int:
    """The bytes the seed will write into the folder ``into`` (on the store's filesystem): every file it
    copies, at its link target's size; none for a weight file it will hard-link (``links``, and the file's
    bytes on the same filesystem as ``into``). A link the filesystem refuses even so (``fs.protected_hardlinks``,
    too many links) is copied beyond this count: the copy's own ENOSPC handling covers it."""
    device = os.stat(into).st_dev
    total = 0
    for entry in source_files(seed_path):
        info = entry.stat(follow_symlinks=True)
        if not (links and launch_files.is_weight_file(entry.name) and info.st_dev == device):
            total += info.st_size
    return total


def seed_launch_snapshot(rx: Receiver, initial: Revision, *,
                         report: CopyReport | None = None) -> tuple[VerifiedCheckpoint, int]:
    """Place the launch snapshot into ``full/{initial}`` and verify it; returns the record and bytes placed.

    Its weight files are hard-linked where the store's filesystem allows
    (the store never writes a ``full/`` file, and the first delta copies
    the folder before patching, so neither name is ever patched in place);
    everything else, and every file a link is refused for, is copied
    (reflink, else ``copy_file_range``). Every file is fsynced either way.
    ``report`` tallies which was used.
    """
    seed_path = _launch_snapshot_folder(rx, initial)
    folder = rx.store.full_dir(initial.version)
    size = copied_size(seed_path)  # what the seed places: link targets (a hub snapshot's blobs), not links
    links = rx.params.seed_links
    writes = bytes_to_copy(seed_path, rx.store.tmp_dir, links=links)  # hard-linked weights write nothing
    ensure_capacity(rx.store, writes, {rx.store.tmp_dir}, what=f"seeding {initial.version}")
    state = rx.store.state()
    rx.store.begin_update(initial.version, folder, state.version if state else None)
    remove_tree(folder)
    staging = rx.store.staging(f"seed-{initial.version}")
    progress = rx.progress(f"seed {initial.version}", size)
    report = report if report is not None else CopyReport()
    try:
        copied = copy_tree_files(seed_path, staging, workers=rx.params.apply_workers, progress=progress,
                                 stop=rx.stop, link=launch_files.is_weight_file if links else None,
                                 report=report)
        staging.rename(folder)
        fsync_dir(folder.parent)
    except OSError as exc:  # e.g. ENOSPC: drop the partial copy, point the state back at what is verified
        remove_tree(staging)
        rx.store.recover()
        raise StoreError(f"could not copy the launch snapshot into the store ({exc})", revision=initial.version,
                         file=str(folder)) from exc
    except BaseException:
        remove_tree(staging)
        rx.store.recover()
        raise
    log.info("seeded %s from %s: %s", initial.version, seed_path, report.summary(),
             extra={"copy": report.as_dict() | {"what": "seed", "version": initial.version}})
    killpoint("seed.copied")
    index = CheckpointIndex.open(folder, revision=initial.version)
    try:
        checksums = index.checksums(initial.checksum_format, workers=rx.params.apply_workers,
                                    progress=rx.progress(f"verify {initial.version}", index.nbytes), stop=rx.stop)
    except BaseException:
        rx.store.recover()
        raise
    digest = index.snapshot_digest(initial.checksum_format, checksums)
    if digest != initial.target_digest:
        rx.store.recover()
        raise ChecksumMismatch(
            f"launch snapshot hashes to {digest}, revision {initial.version} says {initial.target_digest}",
            revision=initial.version, file=str(seed_path), field="target_digest",
        )
    rx.artifacts.record_seed(initial.version, seed_path)
    kept = launch_files.capture(rx.store.root, folder, initial.version)
    record = VerifiedCheckpoint(
        version=initial.version, path=rx.store.relative(folder), sequence=initial.sequence,
        checksum_format=initial.checksum_format, format_digest=initial.format_digest,
        target_digest=digest, checksums=checksums, files=folder_identity(folder), verified_at_unix_ms=now_ms(),
        boot_id=boot_id(), flushed=True,  # copy_tree_files fsynced every file, linked ones too
        launch_files=kept.digest,
    )
    rx.store.commit_ready(record, Chain(initial.version, initial.version, ()))
    rx.ledger.note(f"seeded {initial.version} from {seed_path}: {report.summary()}; digest verified")
    return record, copied


def _launch_snapshot_folder(rx: Receiver, initial: Revision) -> Path:
    """The configured launch snapshot's folder, checked before the store changes: given, a folder, and this
    model's (its format digest is ``initial``'s); otherwise raises a typed error naming the revision."""
    seed = rx.params.seed_checkpoint
    if not seed:
        raise StoreError(
            f"the store has no checkpoint to start from; pass seed_checkpoint= with the launch snapshot "
            f"of {initial.version}",
            revision=initial.version,
        )
    seed_path = launch_files.snapshot_folder(seed, revision=initial.version)  # only regular files, no loops
    if not seed_path.is_dir():
        raise StoreError(f"seed_checkpoint=\"{seed_path}\" is not a folder; pass the launch snapshot of "
                         f"{initial.version} (a folder of *.safetensors files)", revision=initial.version,
                         local_file=str(seed_path))
    source = CheckpointIndex.open(seed_path, revision=initial.version)
    if source.format_digest() != initial.format_digest:
        raise CheckpointMismatch(
            f"launch snapshot has format digest {source.format_digest()}, revision {initial.version} says "
            f"{initial.format_digest}: it is not this model's launch snapshot",
            revision=initial.version, file=str(seed_path),
        )
    return seed_path


def keep_launch_files(rx: Receiver, root: Revision) -> None:
    """A store that keeps no launch files yet (seeded by an older release, or started from a full revision)
    takes them from the configured launch snapshot, so every checkpoint prepared from now on carries them."""
    seed = rx.params.seed_checkpoint
    if launch_files.kept(rx.store.root) is None and seed and Path(seed).expanduser().is_dir():
        folder = launch_files.snapshot_folder(seed, revision=root.version)  # only regular files, no loops
        kept = launch_files.capture(rx.store.root, folder, root.version)
        rx.ledger.note(f"kept the launch snapshot's non-weight files ({', '.join(sorted(kept.files)) or 'none'})")


SEED_CHECKPOINT = Stage("seed checkpoint", seed_checkpoint)
