"""Single-thread ceilings and the apply sweep: memcpy, XOR, checksums, zstd decode, apply per thread count.

Every rate is bytes of tensor data per second (decoded bytes for zstd and
apply), measured on the benchmark's own checkpoint and frames, best of
``repeat`` runs.
"""

from __future__ import annotations

import resource
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import zstandard

from benchmarks._meter import measured
from benchmarks._scratch import copy_checkpoint
from storage.format.changes import PAGE
from storage.format.checkpoint import CheckpointIndex
from storage.format.digests import CHECKSUM_FORMATS, new_checksum
from storage.catalog.manifests import DELTA_INDEX_FILE, parse_delta_manifest
from storage.format.mapped import MADV_POPULATE_WRITE, MappedFiles
from storage.patch.patcher import BLOCK_SIZE, apply_patches, plan_patches
from storage.catalog.publisher import snapshot_of, stage_delta
from storage.format.safetensors import read_header

HASH_BLOCK = 8 * 2**20


@dataclass(frozen=True)
class Frame:
    """One tensor's zstd frame as published (inside a bucket file read into memory)."""

    tensor: str
    data: memoryview
    decoded_bytes: int


def frames_of(folder: Path, sizes: dict[str, int] | None = None) -> list[Frame]:
    """Every frame of a delta's buckets (largest tensor first), each bucket read whole.

    ``decoded_bytes`` is the tensor's size when ``sizes`` gives it (a sparse
    record decodes to fewer bytes than its tensor has), else the frame's
    declared content size.
    """
    frames = []
    for path in sorted(folder.glob("*.safetensors")):
        header = read_header(path)
        data = memoryview(path.read_bytes())
        for name, info in header.tensors.items():
            frame = data[header.data_offset + info.start: header.data_offset + info.end]
            size = sizes[name] if sizes else zstandard.get_frame_parameters(frame).content_size
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


def decode_rates(folders: dict[str, Path], reference: str, repeat: int, sizes: dict[str, int] | None = None) -> dict:
    """Single-thread decode of every delta's frames; rates of ``reference``'s frames, best of ``repeat``.

    Rates are in tensor bytes per second when ``sizes`` gives the tensors' sizes.
    """
    per_revision = {}
    for version, folder in folders.items():
        frames = frames_of(folder, sizes)
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


def kernel_rates(checkpoint: Path, other: Path, max_bytes: int, repeat: int) -> dict:
    """memcpy, in-place XOR and checksum rates over the same tensor bytes (largest tensors first).

    The XOR operand is the difference between the two checkpoints, so it is
    the delta a revision between them carries.
    """
    index, second = CheckpointIndex.open(checkpoint), CheckpointIndex.open(other)
    chosen, total = [], 0
    for t in sorted(index.tensors.values(), key=lambda t: -t.nbytes):
        if not chosen or total + t.nbytes <= max_bytes:
            chosen.append(t)
            total += t.nbytes
    base = np.empty(total, dtype=np.uint8)
    delta = np.empty(total, dtype=np.uint8)
    offset = 0
    with MappedFiles(checkpoint) as a, MappedFiles(other) as b:
        for t in chosen:
            u = second.tensors[t.name]
            base[offset: offset + t.nbytes] = a.array(t.file)[t.offset: t.offset + t.nbytes]
            np.bitwise_xor(base[offset: offset + t.nbytes], b.array(u.file)[u.offset: u.offset + u.nbytes],
                           out=delta[offset: offset + t.nbytes])
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
    out["definition"] = ("one thread, on the checkpoint's largest tensors held in anonymous memory (no page faults); "
                         "bytes of tensor data per second, best of repeats; checksums through "
                         "storage.format.digests.new_checksum (what the receiver uses), zlib_adler32 is the standard "
                         "library's for reference")
    return out


def apply_once(base_checkpoint: Path, work: Path, manifests: list, folders: dict[str, Path], *,
               workers: int, checksum_format: str) -> dict:
    """Copy ``base_checkpoint`` to ``work`` and patch it with ``storage.patch.patcher`` using ``workers`` threads."""
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


def apply_sweep(base: Path, manifests: list, folders: dict[str, Path], threads: list[int], *, workdir: Path,
                decode_gb_s: float | None, repeat: int, checksum_format: str, log: Callable[[str], None],
                label: str) -> list[dict]:
    """Apply throughput of a delta per thread count, with its ratio to threads x single-thread decode."""
    rows = []
    for t in threads:
        runs = [apply_once(base, workdir / f"sweep-{t}", manifests, folders, workers=t,
                           checksum_format=checksum_format) for _ in range(max(1, repeat))]
        best = min(runs, key=lambda r: r["seconds"])
        ideal = t * decode_gb_s if decode_gb_s else None
        best.update(ideal_gb_s=round(ideal, 3) if ideal else None,
                    ratio=round(best["gb_s"] / ideal, 3) if ideal else None, runs_s=[r["seconds"] for r in runs])
        rows.append(best)
        log(f"apply {label} with {t} thread(s): {best['gb_s']:.3f} GB/s (ratio to {t} x single-thread "
            f"decode: {best['ratio']})")
    return rows


def decode_threads(folder: Path, threads: int, sizes: dict[str, int], repeat: int) -> dict:
    """Decode the frames of ``folder`` on ``threads`` threads at once (frames dealt round-robin), best of
    ``repeat``: what the cores give for zstd alone, the machine's own ceiling for an apply that decodes."""
    import threading

    frames = frames_of(folder, sizes)
    total = sum(f.decoded_bytes for f in frames)

    def run() -> None:
        workers = [threading.Thread(target=decode_stream, args=(frames[k::threads],)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    seconds = _best(run, repeat)
    return {"threads": threads, "seconds": round(seconds, 4), "gb_s": round(total / seconds / 1e9, 3)}


# --- the RL sweep: bytes on the wire, publishing rate, apply against a plain in-place XOR ------------------------


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def publish_rates(base: Path, target: Path, settings: dict[str, str], out: Path, *, level: int, workers: int,
                  bucket_bytes: int, repeat: int) -> dict:
    """Stage the delta ``base -> target`` once per publisher setting (``{label: encoding}``), best of ``repeat``.

    Timed: ``stage_delta`` (choosing the encoding, XOR, positions, checksums,
    zstd, bucket files) with ``workers`` threads, the base's checksums known
    (as with the publisher's kept copy). ``fraction_of_full`` is what goes on
    the wire (bucket files and index) over the full checkpoint's files. The
    payload of the last run of each setting stays in ``out/{label}`` for the
    apply measurements.
    """
    snapshot = snapshot_of(base, "adler32", workers=workers)
    index = CheckpointIndex.open(target)
    full = sum(p.stat().st_size for p in target.glob("*.safetensors"))
    rows = {}
    for label, encoding in settings.items():
        runs = []
        for _ in range(max(1, repeat)):
            cpu, t0 = _cpu_s(), time.perf_counter()
            payload = stage_delta(snapshot, index, out / label, version="s1", base_version="s0", encoding=encoding,
                                  level=level, bucket_max_bytes=bucket_bytes, workers=workers,
                                  allow_extended=label.endswith("+extended"))
            runs.append((time.perf_counter() - t0, _cpu_s() - cpu))
        seconds, cpu = min(runs)
        wire = sum(f.stat().st_size for f in (out / label).iterdir() if f.is_file())
        row = {"requested": encoding, "encoding": payload.encoding, "level": payload.level,
               "encoded_bytes": payload.encoded_bytes, "changed_tensors": len(payload.changed),
               "fraction_of_model": round(payload.encoded_bytes / index.nbytes, 5),
               "wire_bytes": wire, "fraction_of_full": round(wire / full, 5),
               "seconds": round(seconds, 4), "cpu_s": round(cpu, 3), "gb_s": round(index.nbytes / seconds / 1e9, 3),
               "runs_s": [round(r[0], 3) for r in runs], "folder": str(out / label)}
        if payload.auto is not None:
            row["auto_sample_ratios"] = payload.auto.ratios()
        rows[label] = row
    return rows


def sweep_manifest(folder: Path, checksum_format: str = "adler32"):
    """A staged sweep payload as a validated delta manifest (its record is made up: it is not in a catalog)."""
    from storage.catalog.records import Revision

    digest = "sha256:" + "0" * 64
    record = Revision.model_validate({
        "schema": "canonical-refit.revision.v1", "model": "bench/sweep", "version": "s1", "sequence": 1,
        "payload_format": "xor_delta", "base_version": "s0", "base_digest": digest, "target_digest": digest,
        "format_digest": digest, "checksum_format": checksum_format,
        "uri": f"file://{folder}/{DELTA_INDEX_FILE}", "created_at_unix_ms": 0})
    return parse_delta_manifest((folder / DELTA_INDEX_FILE).read_bytes(), record)


def apply_in_place(base: Path, payload: Path, work: Path, *, workers: int, repeat: int) -> dict:
    """Patch a fresh copy of ``base`` (on ``work``'s file system, fsynced: clean pages in the page cache, as the
    previous checkpoint of a steady-state refit) with the staged delta; best of ``repeat``.

    ``validate_s`` is the buckets' validation (``plan_patches``), done before
    the store changes in a refit; ``seconds`` is ``apply_patches`` alone.
    """
    manifest = sweep_manifest(payload)
    runs = []
    for _ in range(max(1, repeat)):
        copy_checkpoint(base, work)
        try:
            index = CheckpointIndex.open(work)
            t0 = time.perf_counter()
            plans = plan_patches([manifest], {"s1": payload}, index.tensors, workers=workers)
            validate_s = time.perf_counter() - t0
            stats: dict = {}
            with measured() as m:
                apply_patches(index, plans, target_checksum_format="adler32", workers=workers, stats=stats)
            pages = sum(-(-(p.location.offset % PAGE + p.location.nbytes) // PAGE) for p in plans)
            runs.append({"seconds": m["wall_s"], "validate_s": round(validate_s, 4), "cpu_s": round(
                m["cpu_user_s"] + m["cpu_sys_s"], 3), "pages_written": stats.get("pages_written"),
                "pages_of_changed_tensors": pages, "write_bytes": m.get("write_bytes"),
                "dirtied_pages": (m.get("write_bytes") or 0) // PAGE, "minor_faults": m["minor_faults"],
                "blocks_unchanged": stats.get("blocks_unchanged"),
                "applied_bytes": sum(p.location.nbytes for p in plans)})
        finally:
            shutil.rmtree(work, ignore_errors=True)
    best = min(runs, key=lambda r: r["seconds"])
    best["runs_s"] = [round(r["seconds"], 4) for r in runs]
    best["gb_s"] = round(best["applied_bytes"] / best["seconds"] / 1e9, 3)
    return best


def xor_reference(base: Path, target: Path, names: list[str], work: Path, *, threads: list[int], repeat: int
                  ) -> dict:
    """A plain in-place XOR over the same bytes: the decoded delta (held in memory) XORed into a writable shared
    mapping of a fresh copy of ``base``, tensor by tensor, pages faulted as the writes reach them; per thread
    count, best of ``repeat``. Also timed with every page mapped writable first (``MADV_POPULATE_WRITE``)."""
    index, other = CheckpointIndex.open(base), CheckpointIndex.open(target)
    locations = sorted((index.tensors[n] for n in names), key=lambda t: -t.nbytes)
    deltas = {}
    with MappedFiles(base) as a, MappedFiles(target) as b:
        for t in locations:
            u = other.tensors[t.name]
            deltas[t.name] = a.array(t.file)[t.offset:t.offset + t.nbytes] ^ b.array(u.file)[u.offset:u.offset + u.nbytes]
    total = sum(t.nbytes for t in locations)
    out = {"bytes": total, "tensors": len(locations)}
    for populate in (False, True):
        for n in threads:
            runs = []
            for _ in range(max(1, repeat)):
                copy_checkpoint(base, work)
                try:
                    with MappedFiles(work, writable=True) as maps, measured() as m:
                        def one(t, maps=maps):
                            view = maps.array(t.file)[t.offset:t.offset + t.nbytes]
                            if populate:
                                maps.advise(t.file, t.offset, t.nbytes, MADV_POPULATE_WRITE)
                            np.bitwise_xor(view, deltas[t.name], out=view)
                        with ThreadPoolExecutor(max_workers=n) as pool:
                            list(pool.map(one, locations))
                    runs.append(m["wall_s"])
                finally:
                    shutil.rmtree(work, ignore_errors=True)
            key = f"{'populated' if populate else 'plain'}_{n}t"
            out[key] = {"seconds": round(min(runs), 4), "gb_s": round(total / min(runs) / 1e9, 3),
                        "runs_s": [round(r, 4) for r in runs]}
    plain = [out[f"plain_{n}t"]["seconds"] for n in threads]
    out["reference_s"] = min(plain)
    out["definition"] = ("plain_Nt: numpy XOR of the decoded delta into a writable shared mapping of a fresh, fsynced "
                         "copy of the base on the work disk (what touching the changed bytes in place costs, faults "
                         "included), N threads over the tensors; populated_Nt: the same after MADV_POPULATE_WRITE of "
                         "each tensor; reference_s: the fastest plain one")
    return out
