"""Stage 4, fetch buckets: download buckets and full shards concurrently into the artifact cache."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from storage.store.artifacts import DELTA, FULL, bucket_bound, shard_bound
from storage.durable import tree_size
from storage.errors import Cancelled, FormatError, ManifestError, RefitError, SafetensorsError
from storage.runtime.killpoints import killpoint
from storage.catalog.manifests import Manifest
from storage.patch.pipeline import Arrivals
from storage.store.quota import ensure_capacity
from storage.format.safetensors import header_length, parse_header, read_header
from tasks.receiver import Receiver
from tasks.fetch_index import Indexes, _local_layout
from tasks.resolve_catalog import ReplayPlan
from tasks.seed_checkpoint import Baseline
from tasks.stage import Stage


@dataclass(frozen=True)
class Artifacts:
    """Where each revision's artifact folder is, and what fetching it cost."""

    folders: dict[str, Path]
    downloaded_files: int = 0
    reused_files: int = 0
    reused_bytes: int = 0
    bytes: int = 0
    evicted: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        text = (f"downloaded {self.downloaded_files} file(s), reused {self.reused_files} "
                f"({self.reused_bytes:,} bytes) from the cache")
        return text + (f"; evicted {', '.join(self.evicted)}" if self.evicted else "")


@dataclass(frozen=True)
class _Job:
    manifest: Manifest
    kind: str
    name: str
    folder: Path
    bound: int | None = None  # most bytes the file may have (None: no local layout to bound it by)
    tensors: tuple[str, ...] = ()  # the tensors the index maps to the file

    @property
    def url(self) -> str:
        return self.manifest.file_url(self.name)


def fetch_buckets(rx: Receiver, plan: ReplayPlan, baseline: Baseline, indexes: Indexes,
                  arrivals: Arrivals | None = None) -> Artifacts:
    """Fetch every file of ``indexes`` not already complete in the cache, size- and header-checked.

    The quota is checked (and room made) before the first byte is downloaded,
    and only then may the apply stage change the store (``arrivals.admit``).
    Each file is announced on ``arrivals`` as soon as it is in the cache, so
    the apply stage can patch it while later files are still downloading.
    Every file that can be fetched is, so a retry after one bad object reuses
    all the others. ``arrivals.cancel()`` (or the run's stop) stops it within
    one chunk of each download in flight; what completed stays cached.
    """
    arrivals = arrivals or Arrivals(rx.stop.child())
    objects = rx.objects  # worker threads count into this stage
    try:
        return _fetch(rx, objects, plan, baseline, indexes, arrivals)
    except BaseException as exc:
        arrivals.abort(exc)
        raise
    finally:
        arrivals.close()
        killpoint("fetch.stopped")


def _inventory(rx: Receiver, indexes: Indexes):
    """Each revision's artifact folder, the files already complete in the cache (their bytes, by revision)
    and the files to fetch with the tensors the index maps to each."""
    folders, reused, reused_files = {}, 0, []
    version_bytes: dict[str, int] = {}
    missing: list[tuple[Manifest, str, str, Path, tuple[str, ...]]] = []
    for manifest in indexes.manifests:
        kind = DELTA if manifest.is_delta else FULL
        folder = rx.artifacts.folder(kind, manifest.version)
        folders[manifest.version] = folder
        complete = (rx.artifacts.complete_files(kind, manifest.version)
                    if rx.artifacts.matches(kind, manifest.version, manifest.uri, manifest.raw) else set())
        groups: dict[str, list[str]] = {}
        for tensor, file in manifest.weight_map.items():  # once per manifest, not once per file
            groups.setdefault(file, []).append(tensor)
        for name in manifest.files:
            if name in complete:
                size = (folder / name).stat().st_size
                reused += size
                reused_files.append((manifest.version, name))
                version_bytes[manifest.version] = version_bytes.get(manifest.version, 0) + size
            else:
                missing.append((manifest, kind, name, folder, tuple(groups.get(name, ()))))
    return folders, reused, reused_files, version_bytes, missing


def _fetch(rx: Receiver, objects, plan: ReplayPlan, baseline: Baseline, indexes: Indexes,
           arrivals: Arrivals) -> Artifacts:
    folders, reused, reused_files, version_bytes, missing = _inventory(rx, indexes)
    sizes = _tensor_sizes(rx, baseline, indexes) if missing else None  # bounds only for what is fetched
    jobs = [_Job(manifest, kind, name, folder, _bound(manifest, tensors, sizes), tensors)
            for manifest, kind, name, folder, tensors in missing]
    workers = rx.params.storage.concurrency
    stop = arrivals.stop or rx.stop
    cancel = threading.Event()  # downloads in flight watch this
    stop.add_listener(cancel.set)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fetch") as pool:
            sized = list(pool.map(lambda job: _attempt(job, _size, objects, job), jobs))
        stop.check()
        errors = [e for _, e in sized if e is not None]
        known = [(job, size) for job, (size, e) in zip(jobs, sized) if e is None]
        for job, size in known:
            version_bytes[job.manifest.version] = version_bytes.get(job.manifest.version, 0) + size
        evicted = ensure_capacity(
            rx.store, sum(s for _, s in known) + _materialize_bytes(rx, baseline, indexes, version_bytes),
            _working_set(rx, baseline, folders), what=f"refit to {plan.target.version}",
        )
        for manifest in indexes.manifests:  # only now, with room made, does the cache change
            rx.artifacts.open(DELTA if manifest.is_delta else FULL, manifest.version, manifest.uri, manifest.raw)
        arrivals.admit()
        for version, name in reused_files:
            arrivals.arrived(version, name)
        progress = rx.progress("fetch", sum(s for _, s in known))

        def fetch(job: _Job, size: int) -> int:
            path = job.folder / job.name
            got = objects.download(job.url, path, expected_size=size, max_size=job.bound, cancel=cancel,
                                   progress=progress)
            try:
                _check_file(job, path)
            except RefitError:
                rx.artifacts.discard(job.kind, job.manifest.version, job.name)
                raise
            rx.artifacts.record(job.kind, job.manifest.version, job.name)
            killpoint("fetch.file")
            arrivals.arrived(job.manifest.version, job.name)
            return got

        def one(job_size: tuple[_Job, int]):
            job, size = job_size
            if stop.stopped:  # the apply stage already failed, or the run was stopped: start nothing new
                try:
                    stop.check(revision=job.manifest.version, file=job.url)
                except RefitError as exc:
                    return None, exc
            got, error = _attempt(job, fetch, job, size)
            if error is not None:
                arrivals.failed(job.manifest.version, job.name, error)
            return got, error

        for job, (_, error) in zip(jobs, sized):
            if error is not None:
                arrivals.failed(job.manifest.version, job.name, error)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fetch") as pool:
            fetched = list(pool.map(one, known))
    finally:
        stop.remove_listener(cancel.set)
    errors += [e for _, e in fetched if e is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
    downloaded = sum(n or 0 for n, _ in fetched)
    return Artifacts(folders, len(jobs), len(reused_files), reused, downloaded, tuple(evicted))


def discard_rejected_artifact(rx: Receiver, indexes: Indexes, error: BaseException) -> None:
    """If ``error`` rejects a cached bucket or shard, drop the local copy so the next run fetches it again.

    The error then names both the remote object and the discarded local file.
    """
    if not isinstance(error, FormatError) or not error.file:
        return
    for manifest in indexes.manifests:
        for name in manifest.files:
            if manifest.file_url(name) == error.file:
                kind = DELTA if manifest.is_delta else FULL
                path = rx.artifacts.discard(kind, manifest.version, name)
                error.discarded = True
                error.reason += "; the local copy was discarded, so the next run downloads it again"
                error.with_context(local_file=str(path))
                rx.ledger.note(f"discarded {path}: {error.reason}")
                return


def _tensor_sizes(rx: Receiver, baseline: Baseline, indexes: Indexes) -> dict[str, int] | None:
    """Byte size of every tensor: the local layout the index stage checked the manifests against; on a node
    with no checkpoint yet, the headers of the full revision's shards (ranged reads); else None."""
    layout = _local_layout(rx, baseline)
    if layout is not None:
        return {name: nbytes for name, (_dtype, _shape, nbytes) in layout.items()}
    return _shard_sizes(rx, indexes.full) if indexes.full is not None else None


_HEADER_GUESS = 64 * 2**10  # header bytes read with a shard's length prefix, in one request


def _shard_sizes(rx: Receiver, manifest: Manifest) -> dict[str, int]:
    """The tensors' byte sizes in the shards' own headers, read with one ranged read a shard (two for a header
    over 64 KiB): each header is checked against its object's size (nothing after the last tensor), so a
    shard's bound is its exact size."""
    objects = rx.objects

    def one(name: str) -> dict[str, int]:
        url = manifest.file_url(name)
        try:
            size = objects.size(url)
            first = objects.read_range(url, 0, min(size, 8 + _HEADER_GUESS)) if size else b""
            n = header_length(first[:8], size, file=url, revision=manifest.version)
            raw = first[8:8 + n] if 8 + n <= len(first) else first[8:] + objects.read_range(url, len(first), 8 + n)
            header = parse_header(raw, n, size, file=url, revision=manifest.version)
        except RefitError as exc:
            raise exc.with_context(revision=manifest.version)
        return {tensor: info.nbytes for tensor, info in header.tensors.items()}

    sizes: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=rx.params.storage.concurrency, thread_name_prefix="fetch") as pool:
        for found in pool.map(one, manifest.files):
            sizes.update(found)
    return sizes


def _bound(manifest: Manifest, tensors, sizes: dict[str, int] | None) -> int | None:
    """Most bytes a file of ``manifest`` holding ``tensors`` may have: a bucket's header and worst-case frames,
    a shard's header and tensors (docs/format.md, "Download bounds")."""
    if sizes is None:
        return None
    tensors = {t: sizes.get(t, 0) for t in tensors}
    return bucket_bound(manifest.delta_encoding, tensors) if manifest.is_delta else shard_bound(tensors)


def _size(objects, job: _Job) -> int:
    """The object's size (one HEAD), refused before any byte is fetched when it is over the file's bound."""
    size = objects.size(job.url)
    if job.bound is not None and size > job.bound:
        what = "bucket" if job.kind == DELTA else "shard"
        raise SafetensorsError(
            f"the {what} is {size:,} bytes, more than the {job.bound:,} bytes the tensors the index maps to it "
            "can take (docs/format.md, download bounds); not downloaded",
            revision=job.manifest.version, file=job.url)
    return size


def _attempt(job: _Job, fn, *args):
    """(result, None) or (None, error naming the revision) for one file."""
    try:
        return fn(*args), None
    except RefitError as exc:
        return None, exc.with_context(revision=job.manifest.version)


def _check_file(job: _Job, path: Path) -> None:
    """Strict header check right after download; a full shard must hold exactly its mapped tensors."""
    # a bucket's parsed header is remembered: the apply stage validates the bucket from it (one parse, not two)
    header = read_header(path, revision=job.manifest.version, file=job.url, remember=job.kind != FULL)
    if job.kind == FULL:
        expected = set(job.tensors)
        for name in sorted(expected ^ set(header.tensors)):
            where = "is missing from the shard" if name in expected else "is in the shard but not in the index"
            raise ManifestError(f"tensor {where}", revision=job.manifest.version, file=job.url, tensor=name)


def _materialize_bytes(rx: Receiver, baseline: Baseline, indexes, version_bytes: dict[str, int]) -> int:
    """Bytes the apply stage will copy: a full checkpoint copied once before the first delta."""
    if not indexes.deltas:
        return 0
    if baseline.checkpoint is not None:
        if baseline.checkpoint.path.startswith("materialized/"):
            return 0
        return tree_size(rx.store.absolute(baseline.checkpoint.path))
    return version_bytes.get(indexes.full.version, 0) if indexes.full else 0


def _working_set(rx: Receiver, baseline: Baseline, folders: dict[str, Path]) -> set[Path]:
    protect = set(folders.values()) | {rx.store.tmp_dir}
    if baseline.checkpoint is not None:
        protect.add(rx.store.absolute(baseline.checkpoint.path))
    current = rx.store.current()
    if current is not None:
        protect.add(rx.store.absolute(current.path))
    active = rx.store.active()
    if active is not None:
        protect.add(rx.store.absolute(active.path))
    for version in rx.ledger.lineage:  # full checkpoints of the chain may be needed for the copy
        protect.add(rx.store.full_dir(version))
    return protect


# it writes the store (evicts, caches artifacts): no stage retries; each request retries underneath
FETCH_BUCKETS = Stage("fetch buckets", fetch_buckets)
