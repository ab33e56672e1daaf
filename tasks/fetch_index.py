"""Stage 3, fetch index: download and validate every manifest of the replay chain first."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from storage.format.checkpoint import CheckpointIndex, require_same_layout
from storage.errors import ManifestError, RefitError
from storage.catalog.manifests import MAX_INDEX_BYTES, Manifest, parse_manifest, require_known_tensors, require_same_tensors
from storage.format.safetensors import header_length, parse_header
from tasks.receiver import Receiver
from tasks.resolve_catalog import ReplayPlan
from tasks.seed_checkpoint import Baseline
from tasks.stage import Stage


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
    index = _local_index(rx, baseline)
    tensors = index.tensors if index is not None else None  # names are what a delta is checked against
    layout = None  # (dtype, shape, nbytes) a tensor: built only for a full revision
    manifests, total = [], 0
    for revision in revisions:
        try:
            raw = rx.objects.read_bytes(revision.uri, max_size=MAX_INDEX_BYTES)
        except RefitError as exc:  # e.g. an oversized index: name the revision too
            raise exc.with_context(revision=revision.version)
        total += len(raw)
        manifest = parse_manifest(raw, revision)
        if tensors is not None:
            if manifest.is_delta:
                require_known_tensors(manifest, tensors)
            else:  # a full revision must hold exactly the local tensors: refused before any shard is fetched
                require_same_tensors(manifest, tensors)
                layout = layout or index.layout()
                total += _check_shard_headers(rx, manifest, layout)
        manifests.append(manifest)
    return Indexes(tuple(manifests), bytes=total)


def _check_shard_headers(rx: Receiver, manifest: Manifest, layout) -> int:
    """Read each shard's header with ranged reads and check dtype, shape and size against ``layout``."""
    objects = rx.objects

    def check(name: str) -> int:
        url = manifest.file_url(name)
        size = objects.size(url)
        prefix = objects.read_range(url, 0, min(8, size)) if size else b""
        n = header_length(prefix, size, file=url, revision=manifest.version)
        header = parse_header(objects.read_range(url, 8, 8 + n), n, size, file=url, revision=manifest.version)
        for tensor in manifest.tensors_of(name):
            info = header.tensors.get(tensor)
            if info is None:
                raise ManifestError("tensor named by the index is missing from its shard", revision=manifest.version,
                                    file=url, tensor=tensor)
            require_same_layout({tensor: layout[tensor]}, {tensor: (info.dtype, tuple(info.shape), info.nbytes)},
                                revision=manifest.version, file=url)
        return 8 + n

    with ThreadPoolExecutor(max_workers=rx.params.storage.concurrency, thread_name_prefix="index") as pool:
        return sum(pool.map(check, manifest.files))


def _local_index(rx: Receiver, baseline: Baseline) -> CheckpointIndex | None:
    """The checkpoint deltas and full revisions must match: the baseline's, or any verified checkpoint's."""
    if baseline.checkpoint is not None:
        return CheckpointIndex.open(rx.store.absolute(baseline.checkpoint.path))
    for record in rx.store.inventory().values():
        return CheckpointIndex.open(rx.store.absolute(record.path))
    return None


def _local_layout(rx: Receiver, baseline: Baseline):
    """The layout (dtype, shape and size a tensor) deltas and full revisions must match, or None."""
    index = _local_index(rx, baseline)
    return index.layout() if index is not None else None


FETCH_INDEX = Stage("fetch index", fetch_index)
