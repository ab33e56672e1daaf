"""One copy: how many bytes a fresh node writes to reach its first patched revision, and how fast it places them.

    python -m benchmarks.one_copy                  # a ~1 GB bf16 model, 2 repeats
    python -m benchmarks.one_copy --quick          # 128 MB, 1 repeat
    python -m benchmarks.one_copy --size-mb 4000 --repeat 3 --workdir /mnt/nvme/tmp

Builds a transformer-shaped bf16 model (``benchmarks._model``), publishes it
as ``r0`` (the launch snapshot) and one RL step ``r1`` (``--share`` of the
elements changed) with the publish runbook, and makes the launch files durable.
Then, per repeat, on the same disk in the same run:

- ``cp``: ``cp -r`` of the launch folder, timed; then ``sync`` of the copied
  files, timed apart (``cp`` alone leaves its bytes in the page cache);
- a fresh node's first refit to ``r1``: ``flows.refit.run_refit`` (the refit
  flow's own body) in a fresh interpreter on an empty cache with the launch
  folder as ``--seed-checkpoint``. Measured in that process: ``write_bytes``
  of ``/proc/self/io`` from just before the refit to its return (every page it
  dirtied: the seed, the downloads, the copy, the patch, the records), and how
  the product placed the model's bytes (its ``copy`` log records: hard link,
  reflink, ``copy_file_range`` or buffered copy, bytes and seconds, for the
  seed and for the copy the first delta patches).

Goals: bytes written <= 1.1 x the model's bytes (safetensors files of the
launch folder); placement throughput (model bytes / seconds the seed and the
copy took) >= 0.8 x ``cp``'s. ``--seed-links off`` shows the fallback a node
takes where the launch folder is on another filesystem (the seed copies too).
``--baseline-tree DIR`` also measures another source tree (e.g. an earlier
commit, ``git archive REV | tar -x -C DIR``) the same way. Writes JSON under
``benchmarks/results/`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "canonical-refit.benchmark.one_copy.v1"
GOAL_WRITTEN, GOAL_THROUGHPUT = 1.1, 0.8
QUICK = {"size_mb": 128, "repeat": 1}


def log(message: str) -> None:
    print(f"[one-copy {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.one_copy", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small run: --size-mb 128 --repeat 1")
    p.add_argument("--size-mb", type=float, default=1000, help="model size in decimal MB of bf16 tensors")
    p.add_argument("--share", type=float, default=0.02, help="share of bf16 elements the step r1 changes")
    p.add_argument("--repeat", type=int, default=2, help="fresh-node refits (each beside its own cp)")
    p.add_argument("--apply-workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    p.add_argument("--seed-links", choices=("on", "off", "both"), default="both",
                   help="on: the product's default; off: CANONICAL_REFIT_SEED_LINKS=0 (the seed copies, as where "
                        "the launch folder is on another filesystem); both: every repeat on, one run off")
    p.add_argument("--baseline-tree", type=Path, help="another source tree to measure once the same way")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the model, catalog, caches and cp's copy go (one disk: about 5 x the model)")
    p.add_argument("--json", type=Path, help="result file (default benchmarks/results/one_copy-<UTC time>.json)")
    p.add_argument("--keep", action="store_true", help="keep the working folder")
    p.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    return args


# -- the measured refit, in a fresh interpreter ---------------------------------------------------------


def _write_bytes() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split(":")[1]) for line in fh if line.startswith("write_bytes"))


def child(spec_path: str, out_path: str) -> int:
    """Body of the measured process: the refit runbook on ``spec["params"]``, its write_bytes and copy records."""
    import logging

    from flows.refit import run_refit  # every stage imported before anything is measured
    from storage.settings import RefitParams
    from storage.store.flush import wait_for_flushes

    spec = json.loads(Path(spec_path).read_text())
    copies: list[dict] = []

    class KeepCopies(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(getattr(record, "copy", None), dict):
                copies.append(record.copy)

    ours = logging.getLogger("canonical_refit")
    ours.addHandler(KeepCopies(logging.INFO))
    ours.setLevel(logging.INFO)
    params = RefitParams(**spec["params"])
    before, started = _write_bytes(), time.perf_counter()
    result = run_refit(params)
    wall, written = time.perf_counter() - started, _write_bytes() - before
    wait_for_flushes()
    out = {"status": result.status, "version": result.version, "target_digest": result.target_digest,
           "checkpoint_path": result.checkpoint_path, "error": result.error, "write_bytes": written,
           "wall_s": round(wall, 4), "flushed_s": round(time.perf_counter() - started, 4), "copies": copies,
           "stages": {s["name"]: {"seconds": s["seconds"], "bytes": s["bytes"]} for s in result.stages},
           "notes": result.notes}
    Path(out_path).write_text(json.dumps(out, indent=1))
    return 0


def first_refit(params: dict, scratch: Path, *, env: dict | None = None, tree: Path = ROOT,
                timeout_s: float = 1800) -> dict:
    """Run one refit (``params`` of ``RefitParams``) in a fresh interpreter of the code in ``tree``; its result:
    status, ``write_bytes`` of that process over the refit, wall seconds, the product's copy records, stages."""
    scratch.mkdir(parents=True, exist_ok=True)
    spec, out = scratch / "refit.spec.json", scratch / "refit.out.json"
    spec.write_text(json.dumps({"params": params}, default=str))
    out.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CANONICAL_REFIT_", "PREFECT_"))}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec), str(out)],
                          cwd=tree, env=base | {"PYTHONPATH": str(tree)} | (env or {}), capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the refit child exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


# -- the reference and the figures ---------------------------------------------------------------------


def cp_reference(src: Path, dst: Path) -> dict:
    """``cp -r src dst`` timed, then ``sync`` of the copied files timed apart; the copy is removed."""
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    cp_s = time.perf_counter() - t0
    files = [str(p) for p in sorted(dst.iterdir()) if p.is_file()]
    t1 = time.perf_counter()
    subprocess.run(["sync", *files], check=True)
    sync_s = time.perf_counter() - t1
    shutil.rmtree(dst)
    return {"cp_s": round(cp_s, 4), "sync_s": round(sync_s, 4), "cp_sync_s": round(cp_s + sync_s, 4)}


def copy_alone(src: Path, dst: Path, workers: int) -> dict:
    """The product's first-delta copy of ``src`` into ``dst`` with nothing to patch (``CopyAsPatched``: sized
    shards and headers, then every byte), timed in this process; the copy is removed."""
    from storage.durable import CopyReport, remove_tree
    from storage.format.checkpoint import CheckpointIndex
    from storage.patch.first_copy import CopyAsPatched
    from storage.patch.patcher import StaticPlans

    remove_tree(dst)
    report, staging = CopyReport(), dst.with_name(f".{dst.name}.staging")
    t0 = time.perf_counter()
    lazy = CopyAsPatched(StaticPlans([]), CheckpointIndex.open(src), src, dst, report=report)
    lazy.begin(staging)
    staging.rename(dst)
    lazy.open()
    lazy.finish(workers)
    seconds = time.perf_counter() - t0
    remove_tree(dst)
    return {"copy_alone_s": round(seconds, 4), "copy_alone_bytes": report.total}


def figures(run: dict, cp: dict, model_bytes: int) -> dict:
    """One refit against its cp: bytes written over the model, placement throughput over cp's."""
    placed_s = sum(c.get("seconds", 0.0) for c in run.get("copies", []))
    out = {"written_bytes": run["write_bytes"], "written_over_model": round(run["write_bytes"] / model_bytes, 4),
           "placement_s": round(placed_s, 4), "refit_wall_s": run["wall_s"], **cp,
           "copies": [{k: c.get(k) for k in ("what", "version", "bytes", "linked", "reflinked", "copy_file_range",
                                             "buffered", "seconds")} for c in run.get("copies", [])]}
    if placed_s > 0:
        out["placement_gb_s"] = round(model_bytes / placed_s / 1e9, 3)
        out["placement_over_cp"] = round(cp["cp_s"] / placed_s, 3)
        out["placement_over_cp_sync"] = round(cp["cp_sync_s"] / placed_s, 3)
    out["cp_gb_s"] = round(model_bytes / cp["cp_s"] / 1e9, 3)
    if cp.get("copy_alone_s"):
        out["copy_alone_over_cp"] = round(cp["cp_s"] / cp["copy_alone_s"], 3)
    out["refit_over_cp"] = round(cp["cp_s"] / run["wall_s"], 3)
    out["written_goal_met"] = out["written_over_model"] <= GOAL_WRITTEN
    out["throughput_goal_met"] = out.get("placement_over_cp", 0) >= GOAL_THROUGHPUT
    return out


def _check(run: dict, want_digest: str, label: str) -> None:
    if run["status"] != "READY" or run["version"] != "r1" or run["target_digest"] != want_digest:
        raise SystemExit(f"{label}: the refit ended {run['status']} at {run['version']} ({run['error']})")


def _same_bytes(a: Path, b: Path) -> bool:
    """The safetensors files of two checkpoint folders hold the same bytes."""
    import filecmp

    names = sorted(p.name for p in a.glob("*.safetensors"))
    return names == sorted(p.name for p in b.glob("*.safetensors")) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def run(args: argparse.Namespace, root: Path) -> dict:
    from benchmarks._model import build

    ws = build(root, size_bytes=int(args.size_mb * 1e6), deltas=1, share=args.share, dense_lr=3e-3,
               encoding="auto", bucket_mib=256, zstd_level=3, workers=args.apply_workers, log=log)
    model_bytes = sum(p.stat().st_size for p in ws.launch.glob("*.safetensors"))
    subprocess.run(["sync", *map(str, sorted(ws.launch.iterdir()))], check=True)  # a launch folder is on disk
    want = ws.record("r1").target_digest
    result = {"schema": SCHEMA, "model": ws.model_json() | {"file_bytes": model_bytes},
              "revision": ws.info("r1").to_json(), "workdir": str(args.workdir), "runs": []}
    plan = [("links", {}, ROOT)] * (args.repeat if args.seed_links != "off" else 0)
    if args.seed_links in ("off", "both"):
        plan += [("copy", {"CANONICAL_REFIT_SEED_LINKS": "0"}, ROOT)] * (1 if args.seed_links == "both"
                                                                         else args.repeat)
    if args.baseline_tree:
        plan.append(("baseline-tree", {}, args.baseline_tree.resolve()))
    for n, (label, env, tree) in enumerate(plan):
        cp = cp_reference(ws.launch, ws.scratch / "cp") | copy_alone(ws.launch, ws.scratch / "alone",
                                                                      args.apply_workers)
        cache = ws.scratch / f"cache-{n}"
        params = {"catalog": ws.catalog, "model": ws.model, "seed_checkpoint": str(ws.launch),
                  "cache_dir": str(cache), "target": "r1", "apply_workers": args.apply_workers,
                  "lock_timeout_s": 120, "installer": {"kind": "none"}}
        refit = first_refit(params, ws.scratch / f"job-{n}", env=env, tree=tree)
        _check(refit, want, label)
        row = {"label": label, **figures(refit, cp, model_bytes),
               "byte_exact": _same_bytes(Path(refit["checkpoint_path"]), ws.trainer / "r1"),
               "stages": refit["stages"]}
        result["runs"].append(row)
        log(f"{label}: wrote {row['written_over_model']:.3f} x the model; placement "
            f"{row.get('placement_over_cp')} x cp ({row['placement_s']} s against cp {cp['cp_s']} s, "
            f"cp+sync {cp['cp_sync_s']} s); refit {refit['wall_s']} s")
        shutil.rmtree(cache, ignore_errors=True)
    ours = [r for r in result["runs"] if r["label"] == "links"]
    result["goals"] = {
        "written_over_model": {"bound": GOAL_WRITTEN, "measured": [r["written_over_model"] for r in ours],
                               "met": bool(ours) and all(r["written_goal_met"] for r in ours)},
        "placement_over_cp": {"bound": GOAL_THROUGHPUT, "measured": [r.get("placement_over_cp") for r in ours],
                              "met": bool(ours) and all(r["throughput_goal_met"] for r in ours)},
        "byte_exact": all(r["byte_exact"] for r in result["runs"]),
    }
    return result


def table(r: dict) -> str:
    m = r["model"]
    lines = [f"model {m['file_bytes'] / 1e9:.3f} GB in {m['shape']['shards']} shards ({m['tensors']} tensors); "
             f"r1 changes {r['revision']['changed_element_fraction']:.2%} of the elements, delta "
             f"{r['revision']['encoded_bytes'] / 1e6:.1f} MB",
             "", f"{'run':<14}{'written/model':>14}{'placement s':>12}{'cp s':>8}{'cp+sync s':>10}"
                 f"{'placement/cp':>13}{'alone/cp':>9}{'refit s':>9}  how the model's bytes were placed"]
    for row in r["runs"]:
        how = "; ".join(f"{c['what']}: " + ", ".join(f"{k} {c[k] / 1e9:.3f} GB" for k in
                                                       ("linked", "reflinked", "copy_file_range", "buffered")
                                                       if c.get(k)) for c in row["copies"]) or "(not reported)"
        ratio = row.get("placement_over_cp")
        lines.append(f"{row['label']:<14}{row['written_over_model']:>14.3f}{row['placement_s']:>12.3f}"
                     f"{row['cp_s']:>8.3f}{row['cp_sync_s']:>10.3f}{(ratio if ratio is not None else float('nan')):>13.3f}"
                     f"{row.get('copy_alone_over_cp', float('nan')):>9.3f}{row['refit_wall_s']:>9.2f}  {how}")
    g = r["goals"]
    lines += ["", "placement: seconds the seed and the first copy spent placing the model's bytes in the refit (the "
                  "copy overlaps the patch); alone: the same first-copy code with nothing to patch, beside cp",
              f"goal: bytes written <= {GOAL_WRITTEN} x model: {g['written_over_model']['measured']} -> "
                  f"{'met' if g['written_over_model']['met'] else 'NOT met'}",
              f"goal: placement throughput >= {GOAL_THROUGHPUT} x cp: {g['placement_over_cp']['measured']} -> "
              f"{'met' if g['placement_over_cp']['met'] else 'NOT met'}",
              f"byte-exact r1 in every run: {g['byte_exact']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.child:
        return child(*args.child)
    from benchmarks._bench import bench_main

    tempfile.tempdir = str(args.workdir)  # bench_main's scratch folder goes there
    return bench_main("one_copy", argv, parse_args, run, table, log)


if __name__ == "__main__":
    raise SystemExit(main())
