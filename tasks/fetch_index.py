"""Stage 3, fetch index: download and validate every manifest of the replay chain first."""

from __future__ import annotations

from dataclasses import dataclass

from storage.checkpoint import CheckpointIndex
from storage.errors import RefitError
from storage.manifests import MAX_INDEX_BYTES, Manifest, parse_manifest, require_known_tensors
from tasks.receiver import Receiver
from tasks.resolve_catalog import ReplayPlan
from tasks.seed_checkpoint import Baseline
from tasks.stage import stage_task


@dataclass(frozen=True)
class Indexes:
    """Validated manifests to fetch, oldest first (a full root first, if there is one)."""

    manifests: tuple[Manifest, ...]
    bytes: int = 0

    @property
    def full(self) -> Manifest | None:
        return self.manifests[0] if self.manifests and not self.manifests[0].is_delta else None

    @property
    def deltas(self) -> tuple[Manifest, ...]:
        return tuple(m for m in self.manifests if m.is_delta)

    @property
    def summary(self) -> str:
        files = sum(len(m.files) for m in self.manifests)
        return f"{len(self.manifests)} manifest(s), {files} file(s) to fetch"


def fetch_index(rx: Receiver, plan: ReplayPlan, baseline: Baseline) -> Indexes:
    """Read and validate the manifest of every revision to replay, before anything is mutated.

    Delta manifests are checked against the catalog record and against the
    tensors of the checkpoint they apply to, so a bad manifest anywhere in the
    chain fails the run with the store untouched.
    """
    revisions = plan.lineage if baseline.checkpoint is None else plan.deltas
    layout = None
    if baseline.checkpoint is not None:
        layout = CheckpointIndex.open(rx.store.absolute(baseline.checkpoint.path)).layout()
    manifests, total = [], 0
    for revision in revisions:
        try:
            raw = rx.objects.read_bytes(revision.uri, max_size=MAX_INDEX_BYTES)
        except RefitError as exc:  # e.g. an oversized index: name the revision too
            raise exc.with_context(revision=revision.version)
        total += len(raw)
        manifest = parse_manifest(raw, revision)
        if manifest.is_delta and layout is not None:
            require_known_tensors(manifest, layout)
        manifests.append(manifest)
    return Indexes(tuple(manifests), bytes=total)


fetch_index_task = stage_task("fetch index", fetch_index, read_only=True)
