"""Stage 5, apply deltas: mark UPDATING, materialize the target and patch it in place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from storage.checkpoint import CheckpointIndex
from storage.errors import RefitError
from storage.local_store import Chain, VerifiedCheckpoint
from storage.reconstruct import materialize, restore_previous, verify_full_artifact
from tasks.fetch_buckets import Artifacts
from tasks.fetch_index import Indexes
from tasks.receiver import Receiver
from tasks.resolve_catalog import ReplayPlan
from tasks.seed_checkpoint import Baseline
from tasks.stage import stage_task


@dataclass(frozen=True)
class Prepared:
    """The checkpoint folder holding the target's bytes, before its digest is verified."""

    version: str
    path: Path
    base: VerifiedCheckpoint | None
    patched: Mapping[str, str]
    chain: Chain
    mutated: bool
    previous: str | None
    bytes: int = 0
    copied_bytes: int = 0

    @property
    def summary(self) -> str:
        if not self.mutated:
            return f"{self.version} is already a verified checkpoint ({self.path.name})"
        how = f"copied {self.copied_bytes:,} bytes, " if self.copied_bytes else "took over the base folder, "
        return f"{how}patched {len(self.patched)} tensor(s), {self.bytes:,} bytes"


def apply_deltas(rx: Receiver, plan: ReplayPlan, baseline: Baseline, indexes: Indexes,
                 artifacts: Artifacts) -> Prepared:
    """Reconstruct the target: verify a fetched full root, then patch the deltas into a checkpoint.

    After a failure with bytes already changed, the last verified checkpoint
    is restored (rebuilt from the cache if it was taken over) before the
    error propagates, so the store is never left holding unverified bytes.
    """
    state = rx.store.state()
    previous = state.version if state else None
    base = baseline.checkpoint
    if indexes.full is not None:
        base = verify_full_artifact(
            rx.store, indexes.full, artifacts.folders[indexes.full.version], reference=_reference_layout(rx),
            workers=rx.params.apply_workers,
        )
        rx.ledger.note(f"verified full revision {base.version}")
    if not indexes.deltas:
        return Prepared(base.version, rx.store.absolute(base.path), base, {}, Chain(base.version, base.version),
                        mutated=False, previous=previous)
    try:
        done = materialize(
            rx.store, base, plan.target, indexes.deltas, artifacts.folders, workers=rx.params.apply_workers,
            progress=lambda total: rx.progress("apply", total), on_updating=lambda: rx.ledger.note(
                f"store UPDATING: materializing {plan.target.version} from {base.version}"),
        )
    except RefitError as exc:
        if exc.mutation_started:
            outcome = restore_previous(rx.store, previous, workers=rx.params.apply_workers)
            rx.ledger.note(f"apply failed after mutation; {outcome}")
        raise
    return Prepared(done.version, done.path, base, done.patched, done.chain, mutated=True, previous=previous,
                    bytes=done.patched_bytes, copied_bytes=done.copied_bytes)


def _reference_layout(rx: Receiver):
    """Layout of any verified local checkpoint, so a full revision's mismatch names the tensor."""
    for record in rx.store.inventory().values():
        return CheckpointIndex.open(rx.store.absolute(record.path)).layout()
    return None


apply_deltas_task = stage_task("apply deltas", apply_deltas, read_only=False)
