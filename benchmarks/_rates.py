"""Single-thread ceilings and the apply sweep: memcpy, XOR, checksums, zstd decode, apply per thread count.

Every rate is bytes of tensor data per second (decoded bytes for zstd and
apply), measured on the benchmark's own checkpoint and frames, best of
``repeat`` runs.
"""

from __future__ import annotations

import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import zstandard

from benchmarks._meter import measured
from benchmarks._scratch import copy_checkpoint
from storage.checkpoint import CheckpointIndex
from storage.digests import CHECKSUM_FORMATS, new_checksum
from storage.manifests import DELTA_INDEX_FILE, parse_delta_manifest
from storage.patcher import BLOCK_SIZE, apply_patches, plan_patches
from storage.safetensors import read_header

HASH_BLOCK = 8 * 2**20


@dataclass(frozen=True)
class Frame:
    """One tensor's zstd frame as published (inside a bucket file read into memory)."""

    tensor: str
    data: memoryview
    decoded_bytes: int


def frames_of(folder: Path) -> list[Frame]:
    """Every frame of a delta's buckets (largest tensor first), each bucket read whole."""
    frames = []
    for path in sorted(folder.glob("*.safetensors")):
        header = read_header(path)
        data = memoryview(path.read_bytes())
        for name, info in header.tensors.items():
            frame = data[header.data_offset + info.start: header.data_offset + info.end]
            size = zstandard.get_frame_parameters(frame).content_size
            frames.append(Frame(name, frame, int(size)))
    frames.sort(key=lambda f: -f.decoded_bytes)
    return frames


def _best(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def decode_stream(frames: list[Frame], block_size: int = BLOCK_SIZE) -> float:
    """Seconds to stream-decode ``frames`` on this thread into one bounded block (as the patcher does)."""
    scratch = memoryview(bytearray(block_size))
    dctx = zstandard.ZstdDecompressor()
    t0 = time.perf_counter()
    for frame in frames:
        reader = dctx.stream_reader(frame.data, read_across_frames=False)
        while reader.readinto(scratch):
            pass
        reader.close()
    return time.perf_counter() - t0


def decode_whole(frames: list[Frame]) -> float:
    """Seconds to decode ``frames`` on this thread, each into one whole-tensor buffer."""
    dctx = zstandard.ZstdDecompressor()
    t0 = time.perf_counter()
    for frame in frames:
        dctx.decompress(frame.data)
    return time.perf_counter() - t0


def decode_rates(folders: dict[str, Path], reference: str, repeat: int) -> dict:
    """Single-thread decode of every delta's frames; rates of ``reference``'s frames, best of ``repeat``."""
    per_revision = {}
    for version, folder in folders.items():
        frames = frames_of(folder)
        decoded = sum(f.decoded_bytes for f in frames)
        encoded = sum(f.data.nbytes for f in frames)
        runs = repeat if version == reference else 1
        stream_s = min(decode_stream(frames) for _ in range(max(1, runs)))
        entry = {"frames": len(frames), "decoded_bytes": decoded, "encoded_bytes": encoded,
                 "stream_s": round(stream_s, 4), "stream_gb_s": round(decoded / stream_s / 1e9, 3)}
        if version == reference:
            whole_s = min(decode_whole(frames) for _ in range(max(1, runs)))
            entry.update(whole_s=round(whole_s, 4), whole_gb_s=round(decoded / whole_s / 1e9, 3))
        per_revision[version] = entry
    ref = per_revision[reference]
    rate = max(ref["stream_gb_s"], ref["whole_gb_s"])
    return {"revisions": per_revision, "reference_version": reference, "stream_gb_s": ref["stream_gb_s"],
            "whole_gb_s": ref["whole_gb_s"], "single_thread_gb_s": rate,
            "definition": "decoded bytes per second of one thread; single_thread_gb_s is the faster of "
                          "streaming into a 4 MiB block and decoding whole frames"}


def kernel_rates(checkpoint: Path, delta_folder: Path, max_bytes: int, repeat: int) -> dict:
    """memcpy, in-place XOR and checksum rates over the same tensor bytes (largest tensors first)."""
    index = CheckpointIndex.open(checkpoint)
    frames = {f.tensor: f for f in frames_of(delta_folder)}
    chosen, total = [], 0
    for t in sorted(index.tensors.values(), key=lambda t: -t.nbytes):
        if t.name in frames and (not chosen or total + t.nbytes <= max_bytes):
            chosen.append(t)
            total += t.nbytes
    base = np.empty(total, dtype=np.uint8)
    delta = np.empty(total, dtype=np.uint8)
    dctx = zstandard.ZstdDecompressor()
    offset = 0
    for t in chosen:
        with open(checkpoint / t.file, "rb") as fh:
            fh.seek(t.offset)
            fh.readinto(memoryview(base[offset: offset + t.nbytes]))
        delta[offset: offset + t.nbytes] = np.frombuffer(dctx.decompress(frames[t.name].data), dtype=np.uint8)
        offset += t.nbytes
    dst = base.copy()
    out = {"bytes": total, "tensors": len(chosen)}
    out["memcpy_gb_s"] = round(total / _best(lambda: np.copyto(dst, base), repeat) / 1e9, 3)
    out["xor_gb_s"] = round(total / _best(lambda: np.bitwise_xor(dst, delta, out=dst), repeat) / 1e9, 3)
    def stdlib_adler32() -> None:
        value = 1
        for start in range(0, total, HASH_BLOCK):
            value = zlib.adler32(memoryview(base[start: start + HASH_BLOCK]), value)

    out["zlib_adler32_gb_s"] = round(total / _best(stdlib_adler32, repeat) / 1e9, 3)
    for fmt in CHECKSUM_FORMATS:
        def run(fmt=fmt):
            h = new_checksum(fmt)
            for start in range(0, total, HASH_BLOCK):
                h.update(memoryview(base[start: start + HASH_BLOCK]))
            h.hexdigest()
        out[f"{fmt}_gb_s"] = round(total / _best(run, repeat) / 1e9, 3)
    out["definition"] = ("one thread, on the checkpoint's largest changed tensors held in memory; bytes of "
                         "tensor data per second, best of repeats; checksums through storage.digests.new_checksum "
                         "(what the receiver uses), zlib_adler32 is the standard library's for reference")
    return out


def apply_once(base_checkpoint: Path, work: Path, manifests: list, folders: dict[str, Path], *,
               workers: int, checksum_format: str) -> dict:
    """Copy ``base_checkpoint`` to ``work`` and patch it with ``storage.patcher`` using ``workers`` threads."""
    copy_checkpoint(base_checkpoint, work)
    try:
        index = CheckpointIndex.open(work)
        plans = plan_patches(manifests, folders, index.tensors)
        applied = sum(p.location.nbytes * len(p.steps) for p in plans)
        with measured() as m:
            apply_patches(index, plans, target_checksum_format=checksum_format, workers=workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = m["wall_s"]
    return {"threads": workers, "seconds": round(seconds, 4), "applied_bytes": applied,
            "gb_s": round(applied / seconds / 1e9, 3), "counters": m}


def load_manifests(ws, versions: list[str]) -> tuple[list, dict[str, Path]]:
    manifests, folders = [], {}
    for version in versions:
        folder = ws.delta_folder(version)
        manifests.append(parse_delta_manifest((folder / DELTA_INDEX_FILE).read_bytes(), ws.record(version)))
        folders[version] = folder
    return manifests, folders


def apply_sweep(ws, version: str, threads: list[int], *, workdir: Path, decode_gb_s: float | None, repeat: int,
                checksum_format: str, log: Callable[[str], None]) -> list[dict]:
    """Apply throughput of one delta per thread count, with its ratio to threads x single-thread decode."""
    base = ws.checkpoint_of(ws.info(version).base_version)
    manifests, folders = load_manifests(ws, [version])
    rows = []
    for t in threads:
        runs = [apply_once(base, workdir / f"sweep-{t}", manifests, folders, workers=t,
                           checksum_format=checksum_format) for _ in range(max(1, repeat))]
        best = min(runs, key=lambda r: r["seconds"])
        ideal = t * decode_gb_s if decode_gb_s else None
        best.update(ideal_gb_s=round(ideal, 3) if ideal else None,
                    ratio=round(best["gb_s"] / ideal, 3) if ideal else None)
        rows.append(best)
        log(f"apply {version} with {t} thread(s): {best['gb_s']:.3f} GB/s (ratio to {t} x single-thread "
            f"decode: {best['ratio']})")
    return rows
