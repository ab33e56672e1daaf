"""Real checkpoint shapes: what a tensor costs each stage of publishing and refitting, at real tensor counts.

``python -m benchmarks.refit --shape deepseek-v3`` and ``python -m benchmarks.publish --shape ...`` run
``main`` here. For each ``--tensors-scale`` (a share of the shape's full tensor count), in fresh processes:

1. build: the shape's checkpoint (``flows.synthetic.shape_layout``: real names, dtypes and counts, tiny
   tensors) and two RL-like steps (one byte of every tensor changes, and 2 % of all bytes), published to a
   ``file://`` catalog with the publish flow's own body (``flows.publish.run_publish``): ``r0`` (initial),
   ``r1`` and ``r2`` (deltas, every tensor in them); each delta's stages are timed;
2. refit: a fresh node refits to ``r1`` (seed from the launch folder, then the delta) and then to ``r2``
   (the steady state: one delta in place) with the refit flow's body (``flows.refit.run_refit``), each
   stage timed, ``RssAnon`` sampled, and the installed checkpoint compared byte for byte with ``r2``.

Prints microseconds per tensor for each stage, the per-extra-tensor slope between the smallest and the largest
count, and the goals: a refit's stages <= 20 us a tensor, publishing a step <= 40 us a tensor, and a tensor's
cost at the largest count within 1.5 x its cost at the smallest. The same goals are also judged on the
process's CPU time (all its threads), which other work on a shared machine does not inflate as it does the
wall clock. Memory: the refitting process's peak ``RssAnon`` over its baseline, per tensor of index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench/shape"
GOAL_REFIT_US = 20.0
GOAL_PUBLISH_US = 40.0
GOAL_FLAT = 1.5
PUBLISH_STAGES = ("plan revision", "encode payload", "upload payload", "write record")


def log(message: str) -> None:
    print(f"[shapes {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _publish_params(root: Path, **values):
    from storage.settings import PublishParams
    from storage.urls import normalize_url

    return PublishParams(catalog=normalize_url(str(root / "catalog")), model=MODEL, state_dir=root / "publisher",
                         keep_copy=False, emit_event=False, workers=values.pop("workers"), **values)


def build(root: Path, shape: str, scale: float, workers: int, bucket_mib: int = 256) -> dict:
    """Child ``build``: write the checkpoints, publish r0..r2; returns each delta's stage seconds."""
    from flows.publish import run_publish
    from flows.synthetic import ShapedCheckpoint, shape_layout

    t0 = time.perf_counter()
    specs = shape_layout(shape, scale)
    r0 = ShapedCheckpoint.random(specs, seed=1)
    r0.write(root / "launch")
    run_publish(_publish_params(root, checkpoint=root / "launch", kind="initial", version="r0", workers=workers,
                                bucket_max_mib=bucket_mib))
    out = {"tensors": len(specs), "bytes": int(r0.starts[-1]), "dtypes": sorted({s.dtype for s in specs}),
           "largest_tensor_bytes": max(s.nbytes for s in specs), "publish": []}
    base, current = root / "launch", r0
    build_s = time.perf_counter() - t0
    for k in (1, 2):
        current = current.step(seed=100 + k)
        folder = current.write(root / f"r{k}")
        started, cpu = time.perf_counter(), time.process_time()
        result = run_publish(_publish_params(root, checkpoint=folder, kind="delta", version=f"r{k}",
                                             base_version=f"r{k - 1}", base_checkpoint=base, workers=workers,
                                             bucket_max_mib=bucket_mib))
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        if result.changed_tensors != len(specs):
            raise SystemExit(f"r{k} changed {result.changed_tensors} tensors, not all {len(specs)}")
        out["publish"].append({"version": f"r{k}", "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                               "stages": {s["name"]: s["seconds"] for s in result.stages}})
        base = folder
    out["build_s"] = round(build_s, 2)
    return out


def refit(root: Path, workers: int) -> dict:
    """Child ``refit``: a fresh node to r1 (seeded), then r1 -> r2; per stage wall and CPU seconds, collector
    runs, RssAnon, the files mapped meanwhile, the index's bytes, and the byte-exact check."""
    import flows.refit  # noqa: F401  (imported before anything is timed)
    from flows.refit import run_refit
    from storage.format.checkpoint import CheckpointIndex
    from storage.settings import RefitParams
    from storage.store.flush import wait_for_flushes

    from benchmarks._meter import RefitWatch
    from storage.urls import normalize_url

    params = dict(catalog=normalize_url(str(root / "catalog")), model=MODEL, seed_checkpoint=str(root / "launch"),
                  cache_dir=str(root / "cache"), apply_workers=workers, lock_timeout_s=120,
                  installer={"kind": "none"})
    runs = []
    baseline = _anon()
    for target in ("r1", "r2"):
        wait_for_flushes(600)  # the previous refit's background write-back is not this one's cost
        with RefitWatch(root) as watch:
            started, cpu = time.perf_counter(), time.process_time()
            result = run_refit(RefitParams(**params, target=target))
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        if result.status != "READY" or result.version != target:
            raise SystemExit(f"refit to {target} ended {result.status}: {result.error}")
        runs.append({"target": target, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "anon_baseline_bytes": baseline,
                     "stages": {s["name"]: s["seconds"] for s in result.stages}} | watch.result())
    wait_for_flushes(600)
    # byte-exact: every tensor the node installed is the trainer's r2, tensor by tensor
    from storage.store.local_store import LocalStore

    store = LocalStore(Path(params["cache_dir"]), MODEL, create=False)
    installed = CheckpointIndex.open(store.root / store.active().path)
    expected = CheckpointIndex.open(root / "r2")
    mismatched = [n for n, loc in expected.tensors.items() if _read(installed, n) != _read(expected, n)]
    return {"runs": runs, "tensors_compared": len(expected.tensors), "mismatched": mismatched[:5],
            "byte_exact": not mismatched and set(installed.tensors) == set(expected.tensors),
            "index_bytes": _index_bytes(store.root / store.active().path, store.root / "deltas" / "r2")}


def _index_bytes(checkpoint: Path, delta: Path) -> dict:
    """The bytes of JSON a refit parses for its index: the checkpoint's index file and shard headers, the
    delta's manifest and bucket headers."""
    import struct

    def headers(folder: Path) -> int:
        total = 0
        for path in folder.glob("*.safetensors"):
            with open(path, "rb") as fh:
                total += struct.unpack("<Q", fh.read(8))[0]
        return total

    def size(path: Path) -> int:
        return path.stat().st_size if path.exists() else 0

    checkpoint_bytes = headers(checkpoint) + size(checkpoint / "model.safetensors.index.json")
    delta_bytes = headers(delta) + size(delta / "index.json")
    return {"checkpoint": checkpoint_bytes, "delta": delta_bytes, "total": checkpoint_bytes + delta_bytes}


def _read(index, name: str) -> bytes:
    loc = index.tensors[name]
    with open(index.folder / loc.file, "rb") as fh:
        fh.seek(loc.offset)
        return fh.read(loc.nbytes)


def _child(kind: str, root: Path, args: dict, timeout: float) -> dict:
    spec, out = root / f"{kind}.spec.json", root / f"{kind}.out.json"
    spec.write_text(json.dumps(args))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CANONICAL_REFIT_", "PREFECT_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks._shapes", kind, str(spec), str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def measure(root: Path, shape: str, scale: float, *, workers: int, parts: tuple[str, ...],
            timeout: float, bucket_mib: int = 256) -> dict:
    """One shape at one scale: build and publish, then (if ``refit`` in ``parts``) refit; per-tensor figures."""
    root.mkdir(parents=True, exist_ok=True)
    args = {"shape": shape, "scale": scale, "workers": workers, "root": str(root), "bucket_mib": bucket_mib}
    built = _child("build", root, args, timeout)
    n = built["tensors"]
    steady_pub = built["publish"][-1]
    point = {"shape": shape, "scale": scale, "tensors": n, "bytes": built["bytes"], "dtypes": built["dtypes"],
             "largest_tensor_bytes": built["largest_tensor_bytes"], "build_s": built["build_s"],
             "publish": built["publish"],
             "publish_us_per_tensor": {k: round(v / n * 1e6, 2) for k, v in steady_pub["stages"].items()}
             | {"wall": round(steady_pub["wall_s"] / n * 1e6, 2), "cpu": round(steady_pub["cpu_s"] / n * 1e6, 2)}}
    log(f"{shape} x{scale:g}: {n} tensors, {built['bytes'] / 1e6:.1f} MB; publish a step "
        f"{steady_pub['wall_s']:.2f} s = {point['publish_us_per_tensor']['wall']:.1f} us a tensor")
    if "refit" in parts:
        done = _child("refit", root, args, timeout)
        cold, steady = done["runs"]
        point["refit"] = done["runs"]
        point["byte_exact"] = done["byte_exact"]
        point["tensors_compared"] = done["tensors_compared"]
        point["refit_us_per_tensor"] = {k: round(v / n * 1e6, 2) for k, v in steady["stages"].items()} | {
            "stages_sum": round(sum(steady["stages"].values()) / n * 1e6, 2),
            "wall": round(steady["wall_s"] / n * 1e6, 2), "cpu": round(steady["cpu_s"] / n * 1e6, 2),
            "seed (fresh node)": round(cold["stages"].get("seed checkpoint", 0) / n * 1e6, 2)}
        point["refit_cpu_us_per_tensor"] = {k: round(v / n * 1e6, 2) for k, v in steady["stage_cpu_s"].items()} | {
            "refit": round(steady["cpu_s"] / n * 1e6, 2)}
        point["gc_collections"] = steady["gc_collections"]
        point["mappings"] = steady["mappings"]
        anon = steady["anon_peak_bytes"] - steady["anon_before_bytes"]
        held = max(cold["anon_peak_bytes"], steady["anon_peak_bytes"]) - cold["anon_baseline_bytes"]
        index = done["index_bytes"]["total"]
        point["memory"] = {"anon_peak_bytes": steady["anon_peak_bytes"], "anon_growth_bytes": anon,
                           "anon_bytes_per_tensor": round(anon / n, 1),
                           "anon_over_baseline_bytes": held,  # the process's peak over its RssAnon before refits
                           "anon_over_baseline_per_tensor": round(held / n, 1),
                           "index_bytes": done["index_bytes"], "index_bytes_per_tensor": round(index / n, 1),
                           "anon_beyond_index_bytes": held - index,
                           "anon_beyond_index_per_tensor": round((held - index) / n, 1)}
        log(f"{shape} x{scale:g}: refit r1 -> r2 {steady['wall_s']:.2f} s = "
            f"{point['refit_us_per_tensor']['stages_sum']:.1f} us a tensor over its stages, CPU "
            f"{point['refit_us_per_tensor']['cpu']:.1f}; RssAnon over baseline {held / 1e6:.1f} MB = "
            f"{held / n:.0f} B a tensor ({(held - index) / n:.0f} B beyond the index's {index / n:.0f} B of JSON); "
            f"byte-exact {done['byte_exact']}")
    return point


def goals(points: list[dict]) -> dict:
    """Per extra tensor (slope between the smallest and largest count, or the cost a tensor with one count) and
    the flatness of a tensor's cost; each with met or not."""
    points = sorted(points, key=lambda p: p["tensors"])
    lo, hi = points[0], points[-1]
    out = {}
    for part, key, goal, total in (("publish", "publish_us_per_tensor", GOAL_PUBLISH_US, "wall"),
                                   ("refit", "refit_us_per_tensor", GOAL_REFIT_US, "stages_sum"),
                                   ("publish (CPU)", "publish_us_per_tensor", GOAL_PUBLISH_US, "cpu"),
                                   ("refit (CPU)", "refit_us_per_tensor", GOAL_REFIT_US, "cpu")):
        if key not in hi:
            continue
        if total not in hi[key] or total not in lo[key]:
            continue
        per = hi[key][total]
        if hi["tensors"] > lo["tensors"]:
            slope = (per * hi["tensors"] - lo[key][total] * lo["tensors"]) / (hi["tensors"] - lo["tensors"])
        else:
            slope = per
        row = {"us_per_tensor": per, "us_per_extra_tensor": round(slope, 2), "goal_us": goal,
               "met": slope <= goal}
        if hi["tensors"] > lo["tensors"]:
            flat = per / lo[key][total]
            row |= {"flatness": round(flat, 3), "flatness_goal": GOAL_FLAT, "flat_met": flat <= GOAL_FLAT,
                    "from_tensors": lo["tensors"], "to_tensors": hi["tensors"]}
        out[part] = row
    if "memory" in hi and hi["tensors"] > lo["tensors"]:
        extra = hi["tensors"] - lo["tensors"]
        per = (hi["memory"]["anon_over_baseline_bytes"] - lo["memory"]["anon_over_baseline_bytes"]) / extra
        out["memory"] = {"anon_bytes_per_extra_tensor": round(per, 1), "from_tensors": lo["tensors"],
                         "to_tensors": hi["tensors"]}
        if "anon_beyond_index_bytes" in hi["memory"] and "anon_beyond_index_bytes" in lo["memory"]:
            out["memory"]["beyond_index_bytes_per_extra_tensor"] = round(
                (hi["memory"]["anon_beyond_index_bytes"] - lo["memory"]["anon_beyond_index_bytes"]) / extra, 1)
            out["memory"]["index_bytes_per_extra_tensor"] = round(
                (hi["memory"]["index_bytes"]["total"] - lo["memory"]["index_bytes"]["total"]) / extra, 1)
    return out


def table(result: dict) -> str:
    lines = []
    for p in result["points"]:
        lines.append(f"\n{p['shape']} x{p['scale']:g}: {p['tensors']} tensors, {p['bytes'] / 1e6:.1f} MB, "
                     f"dtypes {', '.join(p['dtypes'])}")
        lines.append("  publish a step, us a tensor: " + ", ".join(
            f"{k} {v:.1f}" for k, v in p["publish_us_per_tensor"].items()))
        if "refit_us_per_tensor" in p:
            lines.append("  refit r1 -> r2, us a tensor: " + ", ".join(
                f"{k} {v:.1f}" for k, v in p["refit_us_per_tensor"].items()))
            if "refit_cpu_us_per_tensor" in p:
                lines.append("  refit r1 -> r2, CPU us a tensor (the process's, each stage's window; fetch buckets "
                             "runs beside apply deltas): " + ", ".join(
                                 f"{k} {v:.1f}" for k, v in p["refit_cpu_us_per_tensor"].items()))
                lines.append(f"  cyclic GC runs during the refit (generations 0/1/2): "
                             f"{'/'.join(map(str, p['gc_collections']))}")
            m = p["memory"]
            lines.append(f"  RssAnon: peak {m['anon_peak_bytes'] / 1e6:.1f} MB; the refitting process's peak over its "
                         f"baseline {m['anon_over_baseline_bytes'] / 1e6:.1f} MB = "
                         f"{m['anon_over_baseline_per_tensor']:.0f} B a tensor of index (the steady refit's own "
                         f"growth {m['anon_bytes_per_tensor']:.0f} B); byte-exact {p['byte_exact']} "
                         f"({p['tensors_compared']} tensors compared)")
            if "index_bytes" in m:
                lines.append(f"  the index's JSON (checkpoint headers and index, delta manifest and bucket headers): "
                             f"{m['index_bytes']['total'] / 1e6:.1f} MB = {m['index_bytes_per_tensor']:.0f} B a "
                             f"tensor; RssAnon beyond it {m['anon_beyond_index_bytes'] / 1e6:.1f} MB = "
                             f"{m['anon_beyond_index_per_tensor']:.0f} B a tensor")
            if "mappings" in p:
                g = p["mappings"]
                lines.append(f"  files mapped by the refit at once: at most {g['mapped_bytes_peak'] / 1e6:.1f} MB "
                             f"(largest mapping {g['largest_mapping_bytes'] / 1e6:.2f} MB, largest file "
                             f"{g['largest_file_bytes'] / 1e6:.2f} MB), resident at most "
                             f"{g['resident_bytes_peak'] / 1e6:.1f} MB, anonymous in them at most "
                             f"{g['anonymous_bytes_peak'] / 1e6:.1f} MB, private writable mappings seen: "
                             f"{g['private_writable']}")
    lines.append("\ngoals:")
    for part, g in result["goals"].items():
        if part == "memory":
            line = (f"  memory: the refitting process's RssAnon grows {g['anon_bytes_per_extra_tensor']:.0f} B per "
                    f"extra tensor of index ({g['from_tensors']} -> {g['to_tensors']} tensors)")
            if "beyond_index_bytes_per_extra_tensor" in g:
                line += (f"; beyond the index's JSON ({g['index_bytes_per_extra_tensor']:.0f} B a tensor): "
                         f"{g['beyond_index_bytes_per_extra_tensor']:.0f} B")
            lines.append(line)
            continue
        line = (f"  {part}: {g['us_per_extra_tensor']:.1f} us per extra tensor (goal <= {g['goal_us']:g}): "
                f"{'met' if g['met'] else 'NOT met'}")
        if "flatness" in g:
            line += (f"; a tensor at {g['to_tensors']} costs {g['flatness']:.2f} x one at {g['from_tensors']} "
                     f"(goal <= {g['flatness_goal']}): {'met' if g['flat_met'] else 'NOT met'}")
        lines.append(line)
    return "\n".join(lines)


def main(*, name: str, shape: str, scales: list[float], workers: int, parts: tuple[str, ...],
         json_path: Path | None, keep: bool, timeout: float = 3600, bucket_mib: int = 256) -> int:
    """Measure ``shape`` at each scale, print the table and goals, write JSON under benchmarks/results/."""
    import shutil
    import tempfile
    from datetime import datetime, timezone

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = json_path or ROOT / "benchmarks" / "results" / f"{name}-{shape}-{stamp}.json"
    base = Path(tempfile.mkdtemp(prefix=f"canonical-refit-{shape}-"))
    log(f"working in {base}")
    points = []
    try:
        for scale in scales:
            points.append(measure(base / f"x{scale:g}", shape, scale, workers=workers, parts=parts,
                                  timeout=timeout, bucket_mib=bucket_mib))
            if not keep:
                shutil.rmtree(base / f"x{scale:g}", ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    result = {"schema": "canonical-refit.benchmark.shapes.v1", "benchmark": name, "shape": shape,
              "workers": workers, "bucket_mib": bucket_mib, "cores": os.cpu_count(), "started_at": stamp,
              "load": list(os.getloadavg()),
              "points": points, "goals": goals(points),
              "command": f"python -m benchmarks.{name} " + " ".join(sys.argv[1:])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"\nJSON: {out}")
    exact = all(p.get("byte_exact", True) for p in points)
    return 0 if exact else 1


def parse_scales(text: str) -> list[float]:
    scales = [float(x) for x in text.split(",") if x.strip()]
    if not scales or not all(0 < s <= 1 for s in scales):
        raise ValueError(f"--tensors-scale takes shares in (0, 1], comma-separated, not {text!r}")
    return scales


if __name__ == "__main__":  # a child: python -m benchmarks._shapes build|refit SPEC OUT
    kind, spec_path, out_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    if kind == "build":
        data = build(Path(spec["root"]), spec["shape"], spec["scale"], spec["workers"],
                     spec.get("bucket_mib", 256))
    else:
        data = refit(Path(spec["root"]), spec["workers"])
    Path(out_path).write_text(json.dumps(data))
