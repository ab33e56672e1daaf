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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from storage.catalog import SCHEMA, Catalog, Revision
from storage.checkpoint import INDEX_FILE, CheckpointIndex, TensorLocation, require_same_layout
from storage.codec import encode_delta, sparse_size
from storage.digests import canonical_json, checksum_bytes, snapshot_digest
from storage.durable import atomic_write_json, copy_tree_files, file_identity, read_json_file, remove_tree
from storage.errors import LineageError, ObjectNotFound
from storage.manifests import DELTA_INDEX_FILE
from storage.mapped import MappedFiles
from storage.objects import ObjectStore
from storage.urls import join_url
from storage.safetensors import encode_header, write_safetensors

log = logging.getLogger("canonical_refit.publisher")
OVERWRITE_MAX_TENSOR = 2**32


@dataclass(frozen=True)
class Snapshot:
    """A local checkpoint with its digests: what a revision record describes."""

    index: CheckpointIndex
    checksum_format: str
    checksums: Mapping[str, str]
    format_digest: str
    target_digest: str


def snapshot_of(path: Path, checksum_format: str, *, workers: int, checksums: Mapping[str, str] | None = None
                ) -> Snapshot:
    """Index and digests of a local checkpoint (hashing it unless ``checksums`` are known)."""
    index = CheckpointIndex.open(path)
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

    @property
    def compression_ratio(self) -> float:
        return self.decoded_bytes / self.encoded_bytes if self.encoded_bytes else 0.0


class _Tensors:
    """Read-only views of a checkpoint's tensors (its shards mapped once)."""

    def __init__(self, index: CheckpointIndex):
        self._files = MappedFiles(index.folder)

    def tensor(self, location: TensorLocation) -> np.ndarray:
        return self._files.array(location.file)[location.offset: location.offset + location.nbytes]

    def close(self) -> None:
        self._files.close()


def choose_encoding(base: Snapshot, target: CheckpointIndex, requested: str, *, workers: int) -> str:
    """``requested``, or for ``auto`` a sparse encoding when it is clearly smaller than dense XOR.

    Dense bf16 deltas compress about 4x; a sparse record is chosen only when
    its raw size is under an eighth of the changed tensors' bytes.
    """
    if requested != "auto":
        return requested
    bmaps, tmaps = _Tensors(base.index), _Tensors(target)

    def count(name: str) -> tuple[int, int]:
        b, t = bmaps.tensor(base.index.tensors[name]), tmaps.tensor(target.tensors[name])
        changed = int(np.count_nonzero(b != t))
        return changed, (b.size if changed else 0)

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            counts = list(pool.map(count, sorted(target.tensors)))
    finally:
        bmaps.close(), tmaps.close()
    changed = sum(c for c, _ in counts)
    dense = sum(n for _, n in counts)
    if not changed:
        return "xor"
    small = all(t.nbytes <= OVERWRITE_MAX_TENSOR for t in target.tensors.values())
    sparse = "overwrite" if small else "xor_sparse"
    return sparse if sparse_size(changed, sparse) * 8 < dense else "xor"


def stage_delta(
    base: Snapshot,
    target: CheckpointIndex,
    folder: Path,
    *,
    version: str,
    base_version: str,
    encoding: str,
    level: int,
    bucket_max_bytes: int,
    workers: int,
    progress: Callable[[int], None] | None = None,
) -> Payload:
    """Encode every changed tensor of ``target`` against ``base`` into buckets under ``folder``.

    Tensors are visited in name order and packed into buckets of at most
    ``bucket_max_bytes`` decoded bytes (a larger tensor gets its own);
    unchanged tensors are omitted. Memory holds one window of frames at a time.
    """
    require_same_layout(base.index.layout(), target.layout(), revision=version, file=str(target.folder))
    encoding = choose_encoding(base, target, encoding, workers=workers)
    remove_tree(folder)
    folder.mkdir(parents=True)
    payload = Payload(folder, DELTA_INDEX_FILE, encoding=encoding, checksums=dict(base.checksums))
    bmaps, tmaps = _Tensors(base.index), _Tensors(target)
    weight_map: dict[str, str] = {}
    bucket: list[tuple[str, bytes, str]] = []
    bucket_decoded = 0

    def encode(name: str) -> tuple[str, bytes | None, str | None]:
        b, t = bmaps.tensor(base.index.tensors[name]), tmaps.tensor(target.tensors[name])
        if np.array_equal(b, t):
            return name, None, None
        return name, encode_delta(b, t, encoding, level=level), checksum_bytes(base.checksum_format, t)

    def flush() -> None:
        nonlocal bucket, bucket_decoded
        if not bucket:
            return
        name = f"bucket-{len(payload.files):05d}.safetensors"
        with open(folder / name, "wb") as fh:
            write_safetensors(fh, [(t, "U8", [len(frame)], frame) for t, frame, _ in bucket],
                              {t: checksum for t, _, checksum in bucket})
        payload.files.append(name)
        for tensor, _, _ in bucket:
            weight_map[tensor] = name
        bucket, bucket_decoded = [], 0

    names = sorted(target.tensors)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="encode") as pool:
        for window in _windows(names, target, bucket_max_bytes):
            for name, frame, checksum in pool.map(encode, window):
                nbytes = target.tensors[name].nbytes
                if progress:
                    progress(nbytes)
                if frame is None:
                    continue
                if bucket and bucket_decoded + nbytes > bucket_max_bytes:
                    flush()
                bucket.append((name, frame, checksum))
                bucket_decoded += nbytes
                payload.changed.append(name)
                payload.checksums[name] = checksum
                payload.decoded_bytes += nbytes
                payload.encoded_bytes += len(frame)
    bmaps.close(), tmaps.close()
    flush()
    index = {"metadata": {"version": version, "base_version": base_version, "delta_encoding": encoding,
                          "compression_format": "zstd", "checksum_format": base.checksum_format},
             "weight_map": weight_map}
    (folder / DELTA_INDEX_FILE).write_bytes(canonical_json(index))
    return payload


def _windows(names: list[str], index: CheckpointIndex, limit: int):
    window, size = [], 0
    for name in names:
        nbytes = index.tensors[name].nbytes
        if window and size + nbytes > limit:
            yield window
            window, size = [], 0
        window.append(name)
        size += nbytes
    if window:
        yield window


def stage_full(snapshot: Snapshot, folder: Path, *, progress: Callable[[int], None] | None = None) -> Payload:
    """Copy a checkpoint's shards with per-tensor checksums in their metadata, plus a declaring index."""
    remove_tree(folder)
    folder.mkdir(parents=True)
    index = snapshot.index
    payload = Payload(folder, INDEX_FILE, checksums=dict(snapshot.checksums))
    for name, header in sorted(index.headers.items()):
        tensors = sorted(header.tensors.values(), key=lambda t: t.start)
        metadata = dict(header.metadata) | {t.name: snapshot.checksums[t.name] for t in tensors}
        raw, _ = encode_header(((t.name, t.dtype, t.shape, t.nbytes) for t in tensors), metadata)
        with open(index.folder / name, "rb") as src, open(folder / name, "wb") as dst:
            dst.write(raw)
            for t in tensors:
                src.seek(header.data_offset + t.start)
                left = t.nbytes
                while left:
                    chunk = src.read(min(left, 16 * 2**20))
                    dst.write(chunk)
                    left -= len(chunk)
                if progress:
                    progress(t.nbytes)
        payload.files.append(name)
        payload.decoded_bytes += sum(t.nbytes for t in tensors)
    payload.encoded_bytes = payload.decoded_bytes
    payload.changed = sorted(index.tensors)
    weight_map = {t.name: t.file for t in index.tensors.values()}
    manifest = {"metadata": {"checksum_format": snapshot.checksum_format, "total_size": index.nbytes},
                "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_bytes(json.dumps(manifest, indent=2).encode())
    return payload


def upload_payload(objects: ObjectStore, payload: Payload, url: str, *, workers: int) -> int:
    """Put every staged file create-only (shards and buckets first, the index last); returns bytes."""
    files = sorted(payload.files, key=lambda n: -(payload.folder / n).stat().st_size)

    def put(name: str) -> int:
        objects.put_immutable_file(join_url(url, name), payload.folder / name)
        return (payload.folder / name).stat().st_size

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="upload") as pool:
        written = sum(pool.map(put, files))
    if payload.index_name:
        written += put(payload.index_name)
    return written


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
    """The sequence a new revision gets (one above the latest) and the latest record."""
    versions = catalog.versions()
    if not versions:
        return 0, None
    latest = catalog.latest()
    return latest.sequence + 1, latest


def same_publication(existing: Revision, record: Revision) -> bool:
    """True if ``existing`` is the same publication as ``record`` (all but the creation time)."""
    a, b = existing.to_json(), record.to_json()
    a.pop("created_at_unix_ms"), b.pop("created_at_unix_ms")
    return a == b


class PublisherCopy:
    """The publisher's own copy of the last published checkpoint (the next delta's base)."""

    def __init__(self, state_dir: Path, model: str):
        self.root = Path(state_dir).expanduser() / model.replace("/", "--")
        self.checkpoint = self.root / "checkpoint"
        self.record_path = self.root / "last.json"

    def last(self) -> dict | None:
        raw = read_json_file(self.record_path)
        return raw if isinstance(raw, dict) else None

    def base_for(self, base: Revision, *, workers: int) -> Snapshot:
        """The kept copy as a snapshot of ``base``, refusing anything but the exact base."""
        last = self.last()
        if last is None or not self.checkpoint.is_dir():
            raise LineageError("no base checkpoint: pass --base-checkpoint (the publisher keeps no copy yet)",
                               revision=base.version)
        files = {p.name: file_identity(p) for p in sorted(self.checkpoint.iterdir()) if p.is_file()}
        known = last.get("checksums") if last.get("files") == files and last.get("version") == base.version else None
        snap = snapshot_of(self.checkpoint, base.checksum_format, workers=workers,
                           checksums=known if last.get("checksum_format") == base.checksum_format else None)
        if snap.target_digest != base.target_digest:
            raise LineageError(f"the publisher's kept copy ({last.get('version')}) is not the exact base "
                               f"{base.version}; pass --base-checkpoint", revision=base.version,
                               file=str(self.checkpoint))
        return snap

    def keep(self, source: Path, version: str, checksum_format: str, checksums: Mapping[str, str]) -> None:
        """Replace the kept copy with ``source`` as published under ``version``."""
        staging = self.root / "checkpoint.new"
        remove_tree(staging)
        self.root.mkdir(parents=True, exist_ok=True)
        copy_tree_files(source, staging)
        remove_tree(self.checkpoint)
        self.record_path.unlink(missing_ok=True)
        staging.rename(self.checkpoint)
        files = {p.name: file_identity(p) for p in sorted(self.checkpoint.iterdir()) if p.is_file()}
        atomic_write_json(self.record_path, {"version": version, "checksum_format": checksum_format,
                                             "checksums": dict(checksums), "files": files})


def existing_record(catalog: Catalog, version: str) -> Revision | None:
    """The record of ``version`` if it is already in the catalog, else None."""
    try:
        return catalog.read(version)
    except ObjectNotFound:
        return None
