"""Stage 6, verify digest: coverage, layout and snapshot digest, then mark READY."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from storage.errors import RefitError, StoreError
from storage.local_store import VerifiedCheckpoint
from storage.reconstruct import restore_previous, verify_target
from tasks.apply_deltas import Prepared
from tasks.receiver import Receiver
from tasks.resolve_catalog import ReplayPlan
from tasks.stage import stage_task


@dataclass(frozen=True)
class VerifiedTarget:
    """The verified checkpoint of the target revision, READY to install."""

    checkpoint: VerifiedCheckpoint
    path: Path
    reread_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.reread_bytes

    @property
    def summary(self) -> str:
        return f"{self.checkpoint.version} {self.checkpoint.target_digest[:19]}... at {self.checkpoint.path}"


def verify_digest(rx: Receiver, plan: ReplayPlan, prepared: Prepared) -> VerifiedTarget:
    """Verify the prepared checkpoint against the catalog's digests and record it READY.

    Only tensors that changed were hashed (during apply); clean tensors keep
    their verified checksums unless ``--verify full`` asks to reread them all.
    """
    full = rx.params.verify == "full"
    if not prepared.mutated and not full:
        record = rx.store.verified(prepared.version)
        if record is None:
            raise StoreError("the prepared checkpoint changed before it could be verified",
                             revision=prepared.version, file=str(prepared.path))
        rx.store.mark_ready(record)
        return VerifiedTarget(record, prepared.path)
    progress = rx.progress("verify", 0)
    try:
        record = verify_target(
            rx.store, plan.target, prepared.path, base=prepared.base, patched=prepared.patched,
            chain=prepared.chain, full=full, workers=rx.params.apply_workers, mutated=prepared.mutated,
            progress=progress,
        )
    except RefitError:
        if prepared.mutated:
            outcome = restore_previous(rx.store, prepared.previous, workers=rx.params.apply_workers)
            rx.ledger.note(f"verification failed; {outcome}")
        raise
    return VerifiedTarget(record, prepared.path, reread_bytes=progress.done)


verify_digest_task = stage_task("verify digest", verify_digest, read_only=False)
