"""Apply scaling on a many-core GPU host, and the prepared checkpoint's upload into GPU memory.

Needs only the storage layer (no Prefect, no SGLang): numpy, zstandard, xxhash, blake3, pydantic,
pydantic-settings, safetensors, and torch with CUDA for the upload part.

    python -m benchmarks.gpu_check --size-mb 2048 --out gpu_check.json

It builds a synthetic bf16 model and one optimizer-step-like revision, publishes the delta with
the real publisher code, then in the same run measures: single-thread zstd decode rate of the
actual frames, the receiver's apply throughput (materialize + patch in place, checksums on the same
pass) for 1, 2, 4, ... threads up to the core count, the digest of the result against the
publisher's, the rate at which the verified checkpoint's tensors reach GPU memory (mmap ->
pinned -> device), checked byte for byte on the way back, and the install pause into CUDA parameters
(``benchmarks.install --device cuda``, with torch's threads and with one copy thread; ``--install-mb``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard


def build(root: Path, size_mb: int, seed: int = 0):
    from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint

    hidden = 2048
    layers = max(1, int((size_mb * 2**20 / 2 - 2 * 32000 * hidden) / (hidden * hidden * 4 + 3 * hidden * 5632)))
    shape = ModelShape(vocab=32000, hidden=hidden, intermediate=5632, layers=layers, shards=4)
    base = random_model(shape, seed=seed)
    target = train_step(base, seed=seed + 1)
    write_checkpoint(root / "r0", base, shards=4)
    write_checkpoint(root / "r1", target, shards=4)
    return shape


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2048, help="model size in MiB (default 2048)")
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON results")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--install-mb", type=int, default=1000,
                        help="model size of the install-pause measurement into CUDA parameters (0 skips it)")
    args = parser.parse_args()

    from storage.format.checkpoint import CheckpointIndex
    from storage.format.digests import snapshot_digest
    from storage.durable import copy_tree_files
    from storage.catalog.manifests import Manifest
    from storage.patch.patcher import apply_patches, plan_patches
    from storage.catalog.publisher import snapshot_of, stage_delta

    cores = os.cpu_count() or 1
    root = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    out: dict = {"cores": cores, "size_mb": args.size_mb}
    t0 = time.perf_counter()
    shape = build(root, args.size_mb)
    out["model_bytes"] = shape.nbytes
    out["build_s"] = round(time.perf_counter() - t0, 2)
    base = snapshot_of(root / "r0", "adler32", workers=cores)
    t0 = time.perf_counter()
    payload = stage_delta(base, CheckpointIndex.open(root / "r1"), root / "delta", version="r1", base_version="r0",
                          encoding="xor", level=3, bucket_max_bytes=256 * 2**20, workers=cores)
    out["encode_s"] = round(time.perf_counter() - t0, 2)
    out["delta_bytes"], out["compression_ratio"] = payload.encoded_bytes, round(payload.compression_ratio, 3)
    expected = snapshot_of(root / "r1", "adler32", workers=cores).target_digest

    class _Revision:  # the two fields plan_patches reads through the manifest
        version, checksum_format = "r1", "adler32"

    raw = (root / "delta" / "delta.safetensors.index.json").read_bytes()
    weight_map = json.loads(raw)["weight_map"]
    manifest = Manifest(_Revision(), f"file://{root}/delta/delta.safetensors.index.json", weight_map, "adler32",
                        "xor", raw)
    base_index = CheckpointIndex.open(root / "r0")
    plans = plan_patches([manifest], {"r1": root / "delta"}, base_index.tensors)

    # single-thread decode rate of the actual frames (no XOR, no checksum)
    decoded, t0 = 0, time.perf_counter()
    scratch = np.empty(4 * 2**20, dtype=np.uint8)
    for plan in plans:
        step = plan.steps[0]
        with open(step.bucket, "rb") as fh:
            fh.seek(step.start)
            frame = fh.read(step.end - step.start)
        reader = zstandard.ZstdDecompressor().stream_reader(frame)
        while n := reader.readinto(scratch):
            decoded += n
    decode_s = time.perf_counter() - t0
    out["decode_1t_GBps"] = round(decoded / decode_s / 1e9, 3)

    threads = sorted({1, 2, 4, 8, 16, 32, cores} & set(range(1, cores + 1)))
    out["decode_only"] = []  # the CPU's own scaling: every frame decoded, nothing written
    frames = []
    for plan in plans:
        step = plan.steps[0]
        with open(step.bucket, "rb") as fh:
            fh.seek(step.start)
            frames.append(fh.read(step.end - step.start))

    def decode(frame: bytes) -> int:
        buf, total = np.empty(2**20, dtype=np.uint8), 0
        reader = zstandard.ZstdDecompressor().stream_reader(frame)
        while n := reader.readinto(buf):
            total += n
        return total

    from concurrent.futures import ThreadPoolExecutor

    for n in threads:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=n) as pool:
            got = sum(pool.map(decode, sorted(frames, key=len, reverse=True)))
        seconds = time.perf_counter() - t0
        out["decode_only"].append({"threads": n, "GBps": round(got / seconds / 1e9, 3)})
        print(json.dumps(out["decode_only"][-1]), flush=True)
    out["adler32_threads"] = []  # does the checksum scale across threads (GIL released)?
    from storage.format.digests import new_checksum

    blob = np.frombuffer(frames[0] * 8, dtype=np.uint8)

    def hash_all(_: int) -> int:
        h = new_checksum("adler32")
        for i in range(0, blob.size, 2**20):
            h.update(blob[i:i + 2**20])
        return blob.size

    for n in threads:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=n) as pool:
            got = sum(pool.map(hash_all, range(n)))
        out["adler32_threads"].append({"threads": n, "GBps": round(got / (time.perf_counter() - t0) / 1e9, 2)})
        print(json.dumps(out["adler32_threads"][-1]), flush=True)
    out["apply"] = []
    for n in threads:
        work = root / f"work-{n}"
        shutil.rmtree(work, ignore_errors=True)
        copy_tree_files(root / "r0", work, workers=cores)
        index = CheckpointIndex(work, base_index.tensors, base_index.headers)
        t0 = time.perf_counter()
        patched = apply_patches(index, plans, target_checksum_format="adler32", workers=n)
        seconds = time.perf_counter() - t0
        sums = dict(base.checksums) | patched
        digest = snapshot_digest("adler32", base_index.format_digest(), sums)
        ceiling = n * decoded / decode_s
        out["apply"].append({"threads": n, "seconds": round(seconds, 3), "GBps": round(decoded / seconds / 1e9, 3),
                             "ratio_to_threads_x_decode": round(decoded / seconds / ceiling, 3),
                             "digest_ok": digest == expected})
        print(json.dumps(out["apply"][-1]), flush=True)
        if n != threads[-1]:
            shutil.rmtree(work)
    out["gpu"] = gpu_upload(CheckpointIndex(root / f"work-{threads[-1]}", base_index.tensors, base_index.headers))
    shutil.rmtree(root / f"work-{threads[-1]}", ignore_errors=True)
    out["install"] = install_pause(root / "install", args.install_mb)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    shutil.rmtree(root, ignore_errors=True)
    return 0 if all(a["digest_ok"] for a in out["apply"]) and out["gpu"].get("exact", True) else 1


def install_pause(root: Path, size_mb: int, device: str = "cuda") -> dict:
    """The install pause on ``device`` (``python -m benchmarks.install --device cuda``): the in-engine loader
    taking a prepared checkpoint into a torch module's parameters there, against a plain parallel copy of
    the same bytes, each checked bit for bit; with one copy thread as well, as an engine copies."""
    if size_mb <= 0:
        return {"skipped": "--install-mb 0"}
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    if device.startswith("cuda") and not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from benchmarks import install

    out = {}
    for label, extra in (("threads", []), ("one_copy_thread", ["--torch-threads", "1"])):
        folder = root / label
        folder.mkdir(parents=True, exist_ok=True)
        result = install.run(install.parse_args(["--size-mb", str(size_mb), "--device", device, *extra]), folder)
        out[label] = {"reference": result["reference"], "loader": result["loader"], "goal": result["goal"]}
        print(install.table(result), flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    return out


def gpu_upload(index) -> dict:
    """Time mmap -> device copies of every tensor, and check them byte for byte on the way back."""
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    import mmap

    device = torch.device("cuda")
    maps = {}
    for name in {t.file for t in index.tensors.values()}:
        with open(index.folder / name, "rb") as fh:
            maps[name] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    total, exact = 0, True
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gpu = {}
    for t in sorted(index.tensors.values(), key=lambda t: -t.nbytes):
        host = torch.frombuffer(maps[t.file], dtype=torch.uint8, count=t.nbytes, offset=t.offset)
        gpu[t.name] = host.to(device, non_blocking=False).view(torch.bfloat16).view(t.shape)
        total += t.nbytes
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    for t in index.tensors.values():
        back = gpu[t.name].view(torch.uint8).flatten().cpu().numpy().tobytes()
        exact &= back == maps[t.file][t.offset:t.offset + t.nbytes]
    return {"device": torch.cuda.get_device_name(0), "bytes": total, "seconds": round(seconds, 3),
            "GBps": round(total / seconds / 1e9, 2), "exact": bool(exact)}


if __name__ == "__main__":
    raise SystemExit(main())
