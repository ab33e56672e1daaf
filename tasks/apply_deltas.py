"""Stage 5, apply deltas: mark UPDATING, materialize the target and patch it in place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from storage.store.artifacts import DELTA, FULL
from storage.format.checkpoint import CheckpointIndex
from storage.store.local_store import Chain, VerifiedCheckpoint
from storage.catalog.manifests import require_known_tensors
from storage.patch.pipeline import Arrivals, ArrivingPlans
from storage.patch.reconstruct import materialize, verify_full_artifact
from tasks.fetch_index import Indexes
from tasks.receiver import Receiver
from tasks.resolve_catalog import ReplayPlan
from tasks.seed_checkpoint import Baseline
from tasks.stage import Stage


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
                 arrivals: Arrivals) -> Prepared:
    """Reconstruct the target while its buckets arrive: verify a full root, then patch the deltas in.

    Nothing changes before the fetch stage has made room (``arrivals``). Each
    tensor is patched as soon as the buckets it needs are in and validated. A
    failure once the store is ``UPDATING`` carries ``mutation_started`` and
    what is needed to put the base back; the run does that once the fetch
    beside it has stopped (``flows/refit.py``).
    """
    state = rx.store.state()
    previous = state.version if state else None
    base = baseline.checkpoint
    arrivals.wait_admitted()
    folders = {m.version: rx.artifacts.folder(DELTA if m.is_delta else FULL, m.version) for m in indexes.manifests}
    if indexes.full is not None:
        for name in indexes.full.files:
            arrivals.wait(indexes.full.version, name)
        base = verify_full_artifact(rx.store, indexes.full, folders[indexes.full.version],
                                    reference=_reference_layout(rx), workers=rx.params.apply_workers, stop=rx.stop)
        rx.ledger.note(f"verified full revision {base.version}")
    if not indexes.deltas:
        return Prepared(base.version, rx.store.absolute(base.path), base, {}, Chain(base.version, base.version),
                        mutated=False, previous=previous)
    layout = CheckpointIndex.open(rx.store.absolute(base.path), revision=base.version).tensors
    for manifest in indexes.deltas:  # already checked against a local base; a full root is known only now
        require_known_tensors(manifest, layout)
    done = materialize(
        rx.store, base, plan.target, indexes.deltas, folders, workers=rx.params.apply_workers,
        source=ArrivingPlans(indexes.deltas, folders, layout, arrivals, workers=rx.params.apply_workers),
        progress=lambda total: rx.progress("apply", total), on_updating=lambda: rx.ledger.note(
            f"store UPDATING: materializing {plan.target.version} from {base.version}"),
        stop=rx.stop,
    )
    return Prepared(done.version, done.path, base, done.patched, done.chain, mutated=True, previous=previous,
                    bytes=done.patched_bytes, copied_bytes=done.copied_bytes)


def _reference_layout(rx: Receiver):
    """Layout of any verified local checkpoint, so a full revision's mismatch names the tensor."""
    for record in rx.store.inventory().values():
        return CheckpointIndex.open(rx.store.absolute(record.path)).layout()
    return None


APPLY_DELTAS = Stage("apply deltas", apply_deltas)
