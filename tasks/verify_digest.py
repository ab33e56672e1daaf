"""Stage 6, verify digest: coverage, layout and snapshot digest, then mark READY."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from storage.errors import StoreError
from storage.store.local_store import VerifiedCheckpoint
from storage.patch.reconstruct import verify_target
from tasks.apply_deltas import Prepared
from tasks.receiver import Receiver
from tasks.resolve_catalog import ReplayPlan
from tasks.stage import Stage


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
    A failure after mutation is rolled back by the run, like an apply failure.
    """
    full = rx.params.verify == "full"
    if not prepared.mutated and not full:
        record = rx.store.verified(prepared.version)
        if record is None:
            raise StoreError("the prepared checkpoint changed before it could be verified",
                             revision=prepared.version, file=str(prepared.path))
        rx.store.point_at(record)
        return VerifiedTarget(record, prepared.path)
    progress = rx.progress("verify", 0)
    record = verify_target(
        rx.store, plan.target, prepared.path, base=prepared.base, patched=prepared.patched,
        chain=prepared.chain, full=full, workers=rx.params.apply_workers, mutated=prepared.mutated,
        progress=progress, stop=rx.stop,
    )
    return VerifiedTarget(record, prepared.path, reread_bytes=progress.done)


VERIFY_DIGEST = Stage("verify digest", verify_digest)
