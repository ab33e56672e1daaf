"""The trainer side: turn a local safetensors checkpoint into canonical revision artifacts.

``stage_delta`` and ``stage_full`` write a revision's payload into a local
staging folder (deterministic bytes, so a republish after a crash uploads the
same objects); ``upload_payload`` puts them create-only; the catalog record
is written last by the caller, so no reader ever sees a record whose payload
is incomplete.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

from storage.runtime.gc_pause import gc_paused_call
from storage.catalog.records import SCHEMA, Catalog, Revision
from storage.format.checkpoint import INDEX_FILE, CheckpointIndex, TensorLocation, require_same_layout
from storage.format import autoselect
from storage.format.autoselect import Choice
from storage.format.encoding import CANONICAL, EXTENDED, Encoded, Encoder, FileSlice, Setting
from storage.jsonio.canonical import canonical_json
from storage.format.digests import snapshot_digest
from storage.durable import copy_bytes, remove_tree
from storage.errors import ObjectNotFound
from storage.catalog.manifests import DELTA_INDEX_FILE
from storage.objects.store import ObjectStore
from storage.urls import join_url
from storage.format.safetensors import encode_header, write_safetensors
from storage.format.tensor_source import MemoryCheckpoint
from storage.runtime.killpoints import killpoint

log = logging.getLogger("canonical_refit.publisher")
MAX_BUCKET_TENSORS = 65_536  # tensors a delta bucket holds at most: its header stays far below a receiver's
# element bound (storage.jsonio.bounded_json.HEADER, about 380k tensors) at any tensor count (a 500k-tensor step of tiny tensors)


@dataclass(frozen=True)
class Snapshot:
    """A local checkpoint with its digests: what a revision record describes."""

    index: CheckpointIndex | MemoryCheckpoint
    checksum_format: str
    checksums: Mapping[str, str]
    format_digest: str
    target_digest: str


@gc_paused_call  # a checksum a tensor, and the layout digest
def snapshot_of(checkpoint: Path | CheckpointIndex | MemoryCheckpoint, checksum_format: str, *, workers: int,
                checksums: Mapping[str, str] | None = None) -> Snapshot:
    """Index and digests of a local checkpoint, a folder or in memory (hashing it unless ``checksums`` are known)."""
    index = checkpoint if isinstance(checkpoint, (CheckpointIndex, MemoryCheckpoint)) else CheckpointIndex.open(
        checkpoint)
    if checksums is None:
        checksums = index.checksums(checksum_format, workers=workers)
    layout = index.format_digest()
    return Snapshot(index, checksum_format, dict(checksums), layout,
                    snapshot_digest(checksum_format, layout, checksums))


@dataclass
class Payload:
    """A staged revision payload: files to upload and the numbers worth reporting."""

    folder: Path
    index_name: str | None
    files: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    decoded_bytes: int = 0
    encoded_bytes: int = 0
    encoding: str | None = None
    checksums: dict = field(default_factory=dict)
    level: int | None = None  # zstd level of a delta's frames
    auto: Choice | None = None  # what --encoding auto measured, when it chose
    changed_bytes: int | None = None  # bytes that differ from the base (counted by the sparse encodings)

    @property
    def compression_ratio(self) -> float:
        return self.decoded_bytes / self.encoded_bytes if self.encoded_bytes else 0.0


class _Tensors:
    """A checkpoint's tensors as ``FileSlice``s of its shards (each shard opened once, read with pread)."""

    def __init__(self, index: CheckpointIndex):
        self._folder = index.folder
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def tensor(self, location: TensorLocation) -> FileSlice:
        fd = self._fds.get(location.file)  # a shard's descriptor is set once: read without the lock
        if fd is None:
            with self._lock:
                fd = self._fds.get(location.file)
                if fd is None:
                    fd = self._fds[location.file] = os.open(self._folder / location.file, os.O_RDONLY)
        return FileSlice(fd, location.offset, location.nbytes)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def _reader(index: CheckpointIndex | MemoryCheckpoint) -> _Tensors | MemoryCheckpoint:
    """What reads a checkpoint's tensors: its shards' files, or the arrays themselves."""
    return index if isinstance(index, MemoryCheckpoint) else _Tensors(index)


def source_label(index: CheckpointIndex | MemoryCheckpoint) -> str | None:
    """The folder errors name (None for tensors in memory: the revision and tensor say it all)."""
    return str(index.folder) if index.folder is not None else None


def choose_setting(base: Snapshot, target: CheckpointIndex | MemoryCheckpoint, requested: str, *, level: int,
                   workers: int, allow_extended: bool = False) -> tuple[Setting, Choice | None]:
    """The encoding and zstd level to publish with; for ``auto``, measured on a sample (``storage.format.autoselect``).

    ``auto`` considers the canonical encodings only, unless ``allow_extended``
    (then ``xor_gaps`` too: receivers must know it). A named encoding is used
    as named, at ``level``.
    """
    if requested != "auto":
        if requested not in CANONICAL + EXTENDED:
            raise ValueError(f"unknown delta encoding {requested!r} (known: auto, {', '.join(CANONICAL + EXTENDED)})")
        return Setting(requested, level), None
    bmaps, tmaps = _reader(base.index), _reader(target)
    try:
        names = sorted(target.tensors)
        choice = autoselect.choose(
            lambda n: (bmaps.tensor(base.index.tensors[n]), tmaps.tensor(target.tensors[n])),
            [(n, target.tensors[n].nbytes) for n in names], level, extended=allow_extended, workers=workers)
    finally:
        bmaps.close(), tmaps.close()
    log.info("auto encoding: %s (sampled %.1f MB; frame bytes per sampled byte: %s)", choice.setting,
             choice.sampled_bytes / 1e6, ", ".join(f"{k} {v:.2%}" for k, v in choice.ratios().items()))
    return choice.setting, choice


def choose_encoding(base: Snapshot, target: CheckpointIndex | MemoryCheckpoint, requested: str, *, workers: int,
                    level: int = 3, allow_extended: bool = False) -> str:
    """``requested``, or for ``auto`` the encoding whose frames are smallest on a sample of this revision."""
    return choose_setting(base, target, requested, level=level, workers=workers,
                          allow_extended=allow_extended)[0].encoding


@gc_paused_call  # a frame, a checksum and their bookkeeping a tensor: no cycles
def stage_delta(
    base: Snapshot,
    target: CheckpointIndex | MemoryCheckpoint,
    folder: Path,
    *,
    version: str,
    base_version: str,
    encoding: str,
    level: int,
    bucket_max_bytes: int,
    workers: int,
    progress: Callable[[int], None] | None = None,
    allow_extended: bool = False,
    bucket_prefix: str = "bucket",
) -> Payload:
    """Encode every changed tensor of ``target`` against ``base`` into buckets under ``folder``.

    Buckets are named ``{bucket_prefix}-{n:05d}.safetensors`` (a trainer rank's part names its own).

    Tensors are visited in name order and packed into buckets of at most
    ``bucket_max_bytes`` decoded bytes (a larger tensor gets its own) and at
    most ``MAX_BUCKET_TENSORS`` tensors (a receiver's header bound);
    unchanged tensors are omitted. ``workers`` threads encode tensors ahead
    (results taken in name order), each in one pass over base and target
    (``storage.format.encoding``). Memory holds the frames of the tensors in flight.
    """
    require_same_layout(base.index.layout(), target.layout(), revision=version, file=source_label(target))
    setting, choice = choose_setting(base, target, encoding, level=level, workers=workers,
                                     allow_extended=allow_extended)
    remove_tree(folder)
    folder.mkdir(parents=True)
    payload = Payload(folder, DELTA_INDEX_FILE, encoding=setting.encoding, checksums=dict(base.checksums),
                      level=setting.level, auto=choice)
    bmaps, tmaps = _reader(base.index), _reader(target)
    weight_map: dict[str, str] = {}
    bucket: list[tuple[str, bytes, str]] = []
    bucket_decoded = 0
    local = threading.local()

    def encode(name: str) -> Encoded:
        encoder = getattr(local, "encoder", None) or Encoder()
        local.encoder = encoder
        return encoder.encode(bmaps.tensor(base.index.tensors[name]), tmaps.tensor(target.tensors[name]), setting,
                              checksum_format=base.checksum_format)

    def flush() -> None:
        nonlocal bucket, bucket_decoded
        if not bucket:
            return
        name = f"{bucket_prefix}-{len(payload.files):05d}.safetensors"
        with open(folder / name, "wb") as fh:
            write_safetensors(fh, [(t, "U8", [len(frame)], frame) for t, frame, _ in bucket],
                              {t: checksum for t, _, checksum in bucket})
        payload.files.append(name)
        for tensor, _, _ in bucket:
            weight_map[tensor] = name
        bucket, bucket_decoded = [], 0

    try:
        with _pool(workers) as pool:
            for name, encoded in _in_order(pool, encode, sorted(target.tensors), target, bucket_max_bytes, workers):
                nbytes = target.tensors[name].nbytes
                if progress:
                    progress(nbytes)
                if encoded.frame is None:
                    continue
                if bucket and (bucket_decoded + nbytes > bucket_max_bytes or len(bucket) >= MAX_BUCKET_TENSORS):
                    flush()
                bucket.append((name, encoded.frame, encoded.checksum))
                bucket_decoded += nbytes
                _count_changed(payload, name, encoded, nbytes)
    finally:
        bmaps.close(), tmaps.close()
    flush()
    (folder / DELTA_INDEX_FILE).write_bytes(delta_index(version, base_version, setting.encoding,
                                                        base.checksum_format, weight_map))
    return payload


def _count_changed(payload: Payload, name: str, encoded: Encoded, nbytes: int) -> None:
    """Account one changed tensor's frame in ``payload`` (its checksum, decoded and encoded bytes)."""
    payload.changed.append(name)
    payload.checksums[name] = encoded.checksum
    payload.decoded_bytes += nbytes
    payload.encoded_bytes += len(encoded.frame)
    if encoded.changed_bytes is not None:
        payload.changed_bytes = (payload.changed_bytes or 0) + encoded.changed_bytes


def delta_index(version: str, base_version: str, encoding: str, checksum_format: str,
                weight_map: dict[str, str]) -> bytes:
    """A delta revision's index (``delta.safetensors.index.json``), canonical JSON (docs/format.md 5.3)."""
    return canonical_json({"metadata": {"version": version, "base_version": base_version, "delta_encoding": encoding,
                                        "compression_format": "zstd", "checksum_format": checksum_format},
                           "weight_map": weight_map})


def full_index(checksum_format: str, total_size: int, weight_map: dict[str, str]) -> bytes:
    """A full revision's index (``model.safetensors.index.json``), tensors in name order."""
    return json.dumps({"metadata": {"checksum_format": checksum_format, "total_size": total_size},
                       "weight_map": dict(sorted(weight_map.items()))}, indent=2).encode()


class _Inline:
    """A pool of one that runs each task when it is submitted: a single worker needs no thread."""

    def __enter__(self) -> "_Inline":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # delivered in order by result(), as from a thread
            future.set_exception(exc)
        return future


def _pool(workers: int):
    return _Inline() if workers <= 1 else ThreadPoolExecutor(max_workers=workers, thread_name_prefix="encode")


def _in_order(pool, fn, names: list[str], index: CheckpointIndex | MemoryCheckpoint, limit: int, workers: int):
    """``(name, fn(name))`` in ``names`` order, computed ahead by ``pool``.

    Up to ``limit`` decoded bytes (and at least ``workers + 1`` tensors) are in
    flight, so a large tensor does not leave the other threads idle while
    memory stays bounded by the frames in flight.
    """
    pending: deque = deque()
    inflight = 0
    it = iter(_groups(names, index))  # small tensors go to a thread together: a hand-off costs tens of us
    nxt = next(it, None)
    while nxt is not None or pending:
        while nxt is not None and (len(pending) <= workers or inflight + nxt[1] <= limit):
            pending.append((nxt, pool.submit(_each, fn, nxt[0])))
            inflight += nxt[1]
            nxt = next(it, None)
        (group, nbytes), future = pending.popleft()
        inflight -= nbytes
        for name, (value, error) in zip(group, future.result()):
            if error is not None:
                raise error  # as the tensor's own future would have, after the ones before it
            yield name, value


GROUP_BYTES, GROUP_TENSORS = 2**20, 256


def _groups(names: list[str], index) -> Iterator[tuple[list[str], int]]:
    """Consecutive names in groups of under ``GROUP_BYTES`` (a larger tensor alone), with their bytes."""
    group, size = [], 0
    for name in names:
        nbytes = index.tensors[name].nbytes
        if group and (size + nbytes > GROUP_BYTES or len(group) >= GROUP_TENSORS):
            yield group, size
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield group, size


def _each(fn, group: list[str]) -> list[tuple[object, BaseException | None]]:
    """``fn`` of each name, stopping at the first error (returned in its place)."""
    out: list[tuple[object, BaseException | None]] = []
    for name in group:
        try:
            out.append((fn(name), None))
        except Exception as exc:
            out.append((None, exc))
            break
    return out


def stage_full(snapshot: Snapshot, folder: Path, *, progress: Callable[[int], None] | None = None,
               shard_prefix: str = "") -> Payload:
    """Copy a checkpoint's shards with per-tensor checksums in their metadata, plus a declaring index.

    A checkpoint in memory is its one shard (``storage.format.tensor_source``), written from the arrays.
    Shards keep their names, after ``shard_prefix`` (a trainer rank's part names its own).
    """
    remove_tree(folder)
    folder.mkdir(parents=True)
    index = snapshot.index
    payload = Payload(folder, INDEX_FILE, checksums=dict(snapshot.checksums))
    for name, header in sorted(index.headers.items()):
        tensors = sorted(header.tensors.values(), key=lambda t: t.start)
        metadata = dict(header.metadata) | {t.name: snapshot.checksums[t.name] for t in tensors}
        raw, _ = encode_header(((t.name, t.dtype, t.shape, t.nbytes) for t in tensors), metadata)
        memory = isinstance(index, MemoryCheckpoint)
        with open(folder / (shard_prefix + name), "wb") as dst, \
                open(os.devnull if memory else index.folder / name, "rb") as src:
            dst.write(raw)
            for t in tensors:
                if memory:
                    dst.write(memoryview(index.array(t.name)))
                else:
                    copy_bytes(src, dst, t.nbytes, src_offset=header.data_offset + t.start)
                if progress:
                    progress(t.nbytes)
        payload.files.append(shard_prefix + name)
        payload.decoded_bytes += sum(t.nbytes for t in tensors)
    payload.encoded_bytes = payload.decoded_bytes
    payload.changed = sorted(index.tensors)
    weight_map = {t.name: shard_prefix + t.file for t in index.tensors.values()}
    (folder / INDEX_FILE).write_bytes(full_index(snapshot.checksum_format, index.nbytes, weight_map))
    return payload


def upload_payload(objects: ObjectStore, payload: Payload, url: str, *, workers: int) -> int:
    """Put every staged file create-only (shards and buckets first, the index last); returns bytes."""
    files = sorted(payload.files, key=lambda n: -(payload.folder / n).stat().st_size)

    def put(name: str) -> int:
        objects.put_immutable_file(join_url(url, name), payload.folder / name)
        killpoint("publish.file", name)
        return (payload.folder / name).stat().st_size

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="upload") as pool:
        written = sum(pool.map(put, files))
    if payload.index_name:
        written += put(payload.index_name)
    return written


PAYLOAD_FORMATS = {"initial": "metadata_only", "full": "full_hf_checkpoint", "delta": "xor_delta"}  # by kind


def make_record(model: str, version: str, sequence: int, payload_format: str, snapshot_format: str,
                layout: str, target_digest: str, *, base: Revision | None, uri: str | None) -> Revision:
    return Revision.model_validate({
        "schema": SCHEMA, "model": model, "version": version, "sequence": sequence,
        "payload_format": payload_format,
        "base_version": base.version if base else None, "base_digest": base.target_digest if base else None,
        "target_digest": target_digest, "format_digest": layout, "checksum_format": snapshot_format,
        "uri": uri, "created_at_unix_ms": int(time.time() * 1000),
    })


def next_sequence(catalog: Catalog) -> tuple[int, Revision | None]:
    """The sequence a new revision gets (one above the newest claim or record) and the latest record.

    Costs the same at any catalog length (``Catalog.head``: the head hint, a
    probe of the claims above it and one record); a head hint found wrong is
    rewritten here, by the publisher.
    """
    latest = catalog.head(repair_hint=True)
    top = catalog.top_claim
    if latest is None and top is None:
        return 0, None
    return max(latest.sequence if latest is not None else -1, top if top is not None else -1) + 1, latest


def same_publication(existing: Revision, record: Revision) -> bool:
    """True if ``existing`` is the same publication as ``record`` (all but the creation time)."""
    a, b = existing.to_json(), record.to_json()
    a.pop("created_at_unix_ms"), b.pop("created_at_unix_ms")
    return a == b


def existing_record(catalog: Catalog, version: str) -> Revision | None:
    """The record of ``version`` if it is already in the catalog, else None."""
    try:
        return catalog.read(version)
    except ObjectNotFound:
        return None
