"""The straightforward receiver, for comparison: fetch everything, then decode whole tensors, then hash.

1. download every bucket of the revision to disk (the same ``ObjectStore``
   downloads and concurrency as the fetch stage);
2. read the buckets into memory and, tensor by tensor in a thread pool,
   decode each frame whole with zstd and apply it to the mmap-backed
   checkpoint with numpy (XOR a dense frame; index a sparse record); flush
   and fsync (the straightforward receiver makes its bytes durable first);
3. hash every patched tensor and compare with the bucket's checksum.

No step starts before the previous one ends, so its wall time is the sum.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zstandard

from storage.catalog.records import Catalog
from storage.format.checkpoint import CheckpointIndex
from storage.format.digests import new_checksum
from storage.errors import ChecksumMismatch, CodecError
from storage.catalog.manifests import MAX_INDEX_BYTES, Manifest, parse_delta_manifest
from storage.objects.store import ObjectStore
from storage.format.safetensors import read_header
from storage.settings import ObjectStoreSettings


def fetch_revision(catalog_url: str, model: str, version: str, dest: Path, *,
                   concurrency: int) -> tuple[Manifest, dict]:
    """Download the index and every bucket of ``version`` into ``dest``; returns the manifest and timings."""
    objects = ObjectStore(ObjectStoreSettings(concurrency=concurrency))
    t0 = time.perf_counter()
    record = Catalog(objects, catalog_url, model).read(version)
    manifest = parse_delta_manifest(objects.read_bytes(record.uri, max_size=MAX_INDEX_BYTES), record)
    dest.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="fetch") as pool:
        sizes = list(pool.map(lambda name: objects.download(manifest.file_url(name), dest / name), manifest.files))
    seconds = time.perf_counter() - t0
    return manifest, {"seconds": round(seconds, 4), "bytes": sum(sizes), "files": len(sizes),
                      "mb_s": round(sum(sizes) / seconds / 1e6, 1) if seconds else None}


def _apply_record(encoding: str, record: np.ndarray, dest: np.ndarray, version: str, tensor: str) -> None:
    """A whole decoded sparse record applied with fancy indexing (trusted: the baseline does not validate)."""
    if encoding == "xor_gaps":
        count = int(record[:8].view("<u8")[0])
        body = record[8:]
        ends = np.flatnonzero(body < 0x80)[:count]
        gaps = _gap_values(body, ends)
        positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
        dest[positions] ^= body[int(ends[-1]) + 1:][:count] if count else body[:0]
        return
    width = 8 if encoding == "xor_sparse" else 4
    count = int(record[:width].view(f"<u{width}")[0])
    positions = record[width:width + width * count].view(f"<u{width}").astype(np.int64)
    values = record[width + width * count:]
    if values.size != count:
        raise CodecError(f"{encoding} record does not hold its {count} values", revision=version, tensor=tensor)
    if encoding == "xor_sparse":
        dest[positions] ^= values
    else:
        dest[positions] = values


def _gap_values(body: np.ndarray, ends: np.ndarray) -> np.ndarray:
    from storage.format.gaps import _decode

    return _decode(body, ends, {}) if ends.size else np.empty(0, dtype=np.uint64)


def run_baseline(catalog_url: str, model: str, version: str, checkpoint: Path, dest: Path, *,
                 workers: int, concurrency: int) -> dict:
    """Patch ``checkpoint`` (a copy of the base) to ``version`` the straightforward way; returns timings."""
    started = time.perf_counter()
    manifest, fetch = fetch_revision(catalog_url, model, version, dest, concurrency=concurrency)
    t_apply = time.perf_counter()
    index = CheckpointIndex.open(checkpoint, revision=version)
    buckets = {name: (read_header(dest / name), (dest / name).read_bytes()) for name in manifest.files}
    shards = {}
    for name in {index.tensors[t].file for t in manifest.weight_map}:
        with open(checkpoint / name, "r+b") as fh:
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_WRITE)
        shards[name] = (m, np.frombuffer(m, dtype=np.uint8))

    def target(tensor: str) -> np.ndarray:
        loc = index.tensors[tensor]
        return shards[loc.file][1][loc.offset: loc.offset + loc.nbytes]

    def apply(tensor: str) -> int:
        header, data = buckets[manifest.weight_map[tensor]]
        info = header.tensors[tensor]
        frame = memoryview(data)[header.data_offset + info.start: header.data_offset + info.end]
        decoded = np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), dtype=np.uint8)
        dest_view = target(tensor)
        if manifest.delta_encoding != "xor":
            _apply_record(manifest.delta_encoding, decoded, dest_view, version, tensor)
            return dest_view.size
        if decoded.size != dest_view.size:
            raise CodecError(f"frame decodes to {decoded.size} bytes, the tensor has {dest_view.size}",
                             revision=version, tensor=tensor)
        np.bitwise_xor(dest_view, decoded, out=dest_view)
        return dest_view.size

    names = sorted(manifest.weight_map, key=lambda t: -index.tensors[t].nbytes)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="baseline") as pool:
        applied = sum(pool.map(apply, names))
    for m, _ in shards.values():
        m.flush()
    for name in shards:
        with open(checkpoint / name, "rb+") as fh:
            os.fsync(fh.fileno())
    t_hash = time.perf_counter()

    def check(tensor: str) -> None:
        header, _ = buckets[manifest.weight_map[tensor]]
        h = new_checksum(manifest.checksum_format)
        h.update(memoryview(target(tensor)))
        if h.hexdigest() != header.metadata[tensor]:
            raise ChecksumMismatch(f"tensor hashes to {h.hexdigest()}, the bucket says {header.metadata[tensor]}",
                                   revision=version, tensor=tensor)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="baseline-hash") as pool:
        list(pool.map(check, names))
    done = time.perf_counter()
    shards.clear()
    buckets.clear()
    apply_s, hash_s = t_hash - t_apply, done - t_hash
    return {"fetch_s": fetch["seconds"], "fetch_bytes": fetch["bytes"], "apply_s": round(apply_s, 4),
            "hash_s": round(hash_s, 4), "wall_s": round(done - started, 4), "applied_bytes": applied,
            "apply_gb_s": round(applied / apply_s / 1e9, 3), "tensors": len(names), "workers": workers}
