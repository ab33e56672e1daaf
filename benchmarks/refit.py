"""Refit benchmark: where the receiver stands against the machine's own ceilings, on RL-sized revisions.

    python -m benchmarks.refit                      # ~1 GB model, the RL sweep and every refit
    python -m benchmarks.refit --quick              # 64 MB, a smaller sweep, no Prefect (about a minute)
    python -m benchmarks.refit --shape deepseek-v3 --tensors-scale 0.087,0.35,1   # 8k/32k/92k tensors

Builds, in a temporary folder, a transformer-shaped bf16 model whose revisions
are optimizer steps on fp32 master weights exported to bf16
(``flows.synthetic.RLTrainer``), calibrated so a share of the bf16 elements
changes by one ulp per step (2 % by default, what RL runs publish), published
to a local ``file://`` catalog. Then measures in the same run:

- the sweep (0.5, 1, 2, 5 % and a dense step): per revision the changed
  share, the encoded bytes against the full checkpoint for ``--encoding auto``,
  ``xor`` and the opt-in ``xor_gaps``, the publishing rate, the in-place apply
  against a plain in-place XOR over the same bytes, and the pages dirtied;
- memcpy/XOR/checksum and zstd decode rates, and the dense step's apply
  throughput per thread count against threads x single-thread decode;
- a cold and a steady-state refit by stage (each in a child process, for its
  peak RSS), READY separately from the background write-back, a catch-up of K
  deltas folded vs K one-delta refits (pages dirtied, faults), the
  straightforward baseline, a rate-limited store (fetch/apply overlap) and
  Prefect's overhead (ephemeral API and a local server).

Prints every goal as met or not with its ratio, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import _render, _report, _shapes
from benchmarks._baseline import fetch_revision
from benchmarks._jobs import Jobs
from benchmarks._meter import load_average
from benchmarks.publish import one_process as publish_from_memory
from benchmarks._model import build, parse_share, share_label, sweep_steps
from benchmarks._rates import (apply_in_place, apply_sweep, decode_rates, decode_threads, kernel_rates,
                               publish_rates, sweep_manifest, xor_reference)
from benchmarks._scratch import DiskMeter, clone_store
from flows.synthetic import SHAPES, SMALL_SCALES
from storage.format.checkpoint import CheckpointIndex
from testbed import throttle
from testbed.prefect_server import PrefectServer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = "canonical-refit.benchmark.refit.v1"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _default_threads() -> str:
    cores = os.cpu_count() or 1
    steps = sorted({1 << i for i in range(cores.bit_length()) if 1 << i <= cores} | {cores})
    return ",".join(map(str, steps))


QUICK = {"size_mb": 64, "catch_up": 2, "prefect": "none", "kernel_mb": 16, "repeat": 1, "kernel_repeat": 2,
         "sweep": "0.02,dense", "bandwidth_mb_s": 400}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.refit", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--quick", action="store_true",
        help="a small run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
             + " (flags given explicitly still win)")
    add("--size-mb", type=float, default=1000, help="model size in decimal MB of bf16 tensors")
    add("--share", default="0.02",
        help="share of bf16 elements each published step changes (one ulp each; 'dense' for a dense step): "
             "the lineage the refits replay")
    add("--sweep", default="0.005,0.01,0.02,0.05,dense",
        help="comma-separated shares of the sweep (bytes, publishing rate, apply vs in-place XOR); 'none' skips it")
    add("--lr", type=float, default=3e-3,
        help="relative step of the dense case; 3e-3 changes about 40 %% of the elements")
    add("--encoding", default="auto", help="publisher encoding of the lineage (auto, xor, xor_sparse, overwrite, "
                                           "or the opt-in xor_gaps)")
    add("--catch-up", type=int, default=5, metavar="K", help="deltas folded in the catch-up refit")
    add("--bucket-mib", type=int, default=256, help="decoded MiB per delta bucket (publisher)")
    add("--zstd-level", type=int, default=3, help="zstd level of the published frames")
    add("--threads", default=_default_threads(), help="comma-separated thread counts for the apply sweep")
    add("--apply-workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
        help="apply threads of the refits, the catch-up and the baseline")
    add("--publish-workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
        help="encoding threads of the publisher")
    add("--fetch-workers", type=int, default=8, help="concurrent downloads (ObjectStoreSettings.concurrency)")
    add("--bandwidth-mb-s", type=float, default=200,
        help="read bandwidth of the rate-limited throttled:// store in MB/s; 0 skips that part")
    add("--prefect", choices=("both", "ephemeral", "server", "none"), default="both",
        help="which Prefect overhead measurements to run")
    add("--no-baseline", action="store_true", help="skip the straightforward baseline receiver")
    add("--kernel-mb", type=float, default=256, help="MB of tensor bytes for memcpy/XOR/checksum rates")
    add("--repeat", type=int, default=2, help="runs per apply/publish measurement (best is kept)")
    add("--kernel-repeat", type=int, default=3, help="runs per memcpy/XOR/checksum/decode rate (best is kept)")
    add("--workdir", type=Path, default=Path(tempfile.gettempdir()),
        help="where the temporary model, catalog and caches go (peak use about 9x the model size)")
    add("--memdir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
        help="memory-backed folder for the dense apply sweep's checkpoint copy (isolates compute from writeback); "
             "default /dev/shm, else --workdir")
    add("--json", type=Path, help="result file (default benchmarks/results/refit-<UTC time>.json)")
    add("--plot", type=Path, help="PNG of apply throughput vs threads (default: next to the JSON)")
    add("--no-plot", action="store_true", help="do not draw the PNG")
    add("--child-timeout", type=float, default=1800, help="seconds before a measured child process is killed")
    add("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    add("--shape", choices=SHAPES, help="instead of the 1 GB sweep: a checkpoint with a real model's layout (tensor "
        "names, dtypes and count; tiny tensors), published and refitted; prints microseconds per tensor per stage, "
        "the refit's RssAnon per tensor of index and the goals (benchmarks/_shapes.py)")
    add("--tensors-scale", default="1", metavar="S[,S...]",
        help="with --shape: shares of the shape's full tensor count, each measured (e.g. 0.087,0.35,1 for "
             "deepseek-v3's 8k, 32k and 92k tensors)")
    add("--small", action="store_true",
        help="with --shape: the suite's small mode (flows.synthetic.SMALL_SCALES: a few hundred tensors)")
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    if args.shape:
        try:
            args.scales = ([SMALL_SCALES[args.shape]] if args.small
                           else _shapes.parse_scales(args.tensors_scale))
        except ValueError as exc:
            p.error(str(exc))
    args.thread_list = sorted({int(t) for t in args.threads.split(",") if t.strip()})
    if not args.thread_list or min(args.thread_list) < 1:
        p.error("--threads needs positive integers")
    if args.catch_up < 1 or args.size_mb <= 0:
        p.error("--catch-up must be >= 1 and --size-mb > 0")
    try:
        args.share_value = parse_share(str(args.share))
        args.sweep_shares = [] if args.sweep.strip().lower() == "none" else [
            parse_share(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError as exc:
        p.error(str(exc))
    return args


def machine_info() -> dict:
    def first(path: str, prefix: str) -> str | None:
        try:
            with open(path) as fh:
                return next((line.split(":", 1)[1].strip() for line in fh if line.startswith(prefix)), None)
        except OSError:
            return None

    cpu = first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    mem = int((first("/proc/meminfo", "MemTotal") or "0 kB").split()[0]) * 1024
    import numpy
    import zstandard

    def git(*cmd: str) -> str:  # read-only: --no-optional-locks keeps `status` from refreshing the index
        try:
            return subprocess.run(["git", "--no-optional-locks", *cmd], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gb": round(mem / 1e9, 1), "kernel": platform.release(),
            "python": platform.python_version(), "numpy": numpy.__version__, "zstandard": zstandard.__version__,
            "git_commit": git("rev-parse", "HEAD"), "git_dirty_files": len(git("status", "--porcelain").splitlines())}


class Bench:
    """One benchmark run: the workspace, its jobs and the result being assembled.

    A step that fails (for example a refit that does not install its target)
    is recorded under ``errors`` and the steps that do not depend on it still
    run, so a broken stage still leaves every other number.
    """

    def __init__(self, args: argparse.Namespace, root: Path):
        self.args, self.root = args, root
        self.ws = self.jobs = None
        self.disk = DiskMeter(root)
        self.result: dict = {"schema": SCHEMA, "errors": [], "load": {"start": load_average(), "sections": {}}}

    @contextmanager
    def step(self, name: str):
        self.result["load"]["sections"][name] = load_average()
        self.disk.sample()
        log(f"{name} (load {self.result['load']['sections'][name]}, disk {self.disk.peak / 1e9:.2f} GB peak)")
        try:
            yield
        except Exception as exc:  # recorded, and the independent steps still run
            log(f"{name} FAILED: {type(exc).__name__}: {exc}")
            self.result["errors"].append({"step": name, "error": f"{type(exc).__name__}: {exc}"[-4000:]})

    def run(self) -> dict:
        a, r = self.args, self.result
        r["machine"] = machine_info()
        if a.memdir and shutil.disk_usage(a.memdir).free < 1.5 * a.size_mb * 1e6:
            log(f"{a.memdir} has too little free space for a model copy: the apply sweep uses {a.workdir}")
            a.memdir = None
        memdir = Path(tempfile.mkdtemp(prefix="canonical-refit-bench-", dir=a.memdir)) if a.memdir else self.root
        r["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
        r["config"]["memdir_kind"] = "memory (tmpfs)" if a.memdir else "the work disk"
        try:
            self._measure(memdir)
        finally:
            if memdir != self.root:
                shutil.rmtree(memdir, ignore_errors=True)
        r["load"]["end"] = load_average()
        r["disk"] = {"peak_bytes": self.disk.peak}
        r["targets"] = _report.targets(r)
        return r

    def _measure(self, memdir: Path) -> None:
        a, r = self.args, self.result
        deltas = a.catch_up + 1
        later = [f"r{k}" for k in range(2, deltas + 1)]
        log(f"building model and catalog (each step changes {share_label(a.share_value)} of the elements, "
            f"encoding {a.encoding})")
        t0 = time.perf_counter()
        self.ws = ws = build(self.root, size_bytes=int(a.size_mb * 1e6), deltas=deltas, share=a.share_value,
                             dense_lr=a.lr, encoding=a.encoding, bucket_mib=a.bucket_mib, zstd_level=a.zstd_level,
                             workers=a.publish_workers, log=log)
        self.jobs = jobs = Jobs(ws, apply_workers=a.apply_workers, fetch_workers=a.fetch_workers,
                                timeout_s=a.child_timeout, after=self.disk.sample)
        r["model"], r["revisions"] = ws.model_json(), [x.to_json() for x in ws.revisions]
        r["build_s"] = round(time.perf_counter() - t0, 2)
        refits = r["refits"] = {}
        r["prefect"] = {"ephemeral": None, "server": None}
        sizes = {t.name: t.nbytes for t in CheckpointIndex.open(ws.launch).tensors.values()}

        with self.step("single-thread rates"):
            r["kernels"] = kernel_rates(ws.launch, ws.checkpoint_of("r1"), int(a.kernel_mb * 1e6), a.kernel_repeat)
            r["decode"] = decode_rates({v: ws.delta_folder(v) for v in later}, "r2", a.kernel_repeat, sizes)
        with self.step("RL sweep"):
            r["sweep"] = self._sweep(memdir, sizes)
        with self.step("publish from memory"):  # the trainer's way: its tensors, the kept base in memory
            r["publish_memory"] = publish_from_memory(self.root / "publish-memory", size_bytes=int(a.size_mb * 1e6),
                                                      share=0.02, steps=2, threads=a.publish_workers)
            shutil.rmtree(self.root / "publish-memory", ignore_errors=True)
        with self.step("cold refit r0 -> r1"):
            refits["cold"] = jobs.plain("cold", ["r1"], restore=False)
            clone_store(ws.cache, ws.pristine)
        if "cold" not in refits:
            return  # every later refit starts from the receiver state the cold refit leaves
        with self.step("refit r1 -> r2"):
            refits["single"] = jobs.plain("single", ["r2"], restore=True)
            r["memory"] = _report.memory(refits["single"], ws.info("r2").largest_bucket_bytes)
            r["fetch"] = _report.fetched(refits["single"], None, ws.checkpoint_file_bytes)
        with self.step(f"catch-up r1 -> r{deltas} vs {len(later)} one-delta refits"):
            refits["catchup"] = jobs.plain("catchup", [f"r{deltas}"], restore=True)
            refits["sequential"] = jobs.plain("sequential", later, restore=True)
            r["catch_up"] = _report.catch_up(refits, r.get("decode"), later, a.apply_workers)
            r["fetch"] = _report.fetched(refits.get("single"), refits["catchup"], ws.checkpoint_file_bytes)
        if not a.no_baseline:
            with self.step("baseline receiver"):
                r["baseline"] = jobs.baseline("baseline", "r2", ws.catalog)
        throttled_url, rate = None, a.bandwidth_mb_s * 1e6
        if rate > 0:
            with self.step(f"rate-limited store at {a.bandwidth_mb_s:g} MB/s"):
                throttled_url = throttle.mirror_catalog(ws.catalog_dir, ws.root / "catalog-throttled")
                r["fetch_only"] = self._fetch_only(throttled_url, rate)
                refits["throttled"] = jobs.plain("throttled", ["r2"], restore=True, catalog=throttled_url,
                                                 throttle=rate)
                if not a.no_baseline:
                    r["baseline_throttled"] = jobs.baseline("baseline-throttled", "r2", throttled_url, rate)
        self._prefect(throttled_url, rate)
        r["overlap"] = _report.overlap(r, a.bandwidth_mb_s) if throttled_url else None

    def _sweep(self, memdir: Path, sizes: dict[str, int]) -> list[dict]:
        """One training step per share: bytes and publishing rate per publisher setting, apply in place against a
        plain in-place XOR, pages dirtied; the dense step also gives the apply-vs-decode sweep over threads."""
        a, r, ws = self.args, self.result, self.ws
        rows = []
        settings = {"auto": "auto", "xor": "xor", "xor_gaps": "xor_gaps"}
        for step in sweep_steps(ws, a.sweep_shares, dense_lr=a.lr, log=log):
            out = ws.scratch / "sweep-payloads"
            row = {"share": step.label, "changed_element_share": step.changed_element_share,
                   "changed_byte_share": step.changed_byte_share}
            row["publish"] = publish_rates(step.base, step.target, settings, out, level=a.zstd_level,
                                           workers=a.publish_workers, bucket_bytes=a.bucket_mib * 2**20,
                                           repeat=a.repeat)
            changed = sweep_manifest(Path(row["publish"]["xor"]["folder"])).weight_map
            row["xor_reference"] = xor_reference(step.base, step.target, sorted(changed), ws.scratch / "reference",
                                                 threads=sorted({1, a.apply_workers}), repeat=a.repeat)
            row["apply"] = {}
            for label, pub in row["publish"].items():
                if label == "auto" and pub["encoding"] in settings and pub["level"] == a.zstd_level:
                    row["apply"][label] = {"same_as": pub["encoding"]}
                    continue
                row["apply"][label] = apply_in_place(step.base, Path(pub["folder"]), ws.scratch / "apply",
                                                     workers=a.apply_workers, repeat=a.repeat)
            for label in row["apply"]:
                if "same_as" in row["apply"][label]:
                    row["apply"][label] = dict(row["apply"][row["apply"][label]["same_as"]])
                row["apply"][label]["over_reference"] = round(
                    row["apply"][label]["seconds"] / row["xor_reference"]["reference_s"], 3)
            log(f"sweep {step.label}: " + "; ".join(
                f"{k} {v['encoding']} {v['fraction_of_model']:.2%} at {v['gb_s']} GB/s, apply "
                f"{row['apply'][k]['seconds']:.3f}s ({row['apply'][k]['over_reference']}x the in-place XOR)"
                for k, v in row["publish"].items()))
            if step.share is None:  # the dense step: apply throughput per thread count against decode
                dense = Path(row["publish"]["xor"]["folder"])
                r["decode_dense"] = decode_rates({"dense": dense}, "dense", a.kernel_repeat, sizes)
                rate = r["decode_dense"]["single_thread_gb_s"]
                r["decode_dense"]["threads"] = decode_threads(dense, a.apply_workers, sizes, a.kernel_repeat)
                r["apply_threads"] = apply_sweep(step.base, [sweep_manifest(dense)], {"s1": dense}, a.thread_list,
                                                 workdir=memdir, decode_gb_s=rate, repeat=a.repeat,
                                                 checksum_format="adler32", log=log, label="the dense step")
                r["apply_disk"] = dict(row["apply"]["xor"], threads=a.apply_workers)
            shutil.rmtree(out, ignore_errors=True)
            rows.append(row)
        return rows

    def _fetch_only(self, url: str, rate: float) -> dict:
        """The revision's files downloaded alone through the rate-limited store (same concurrency)."""
        dest = self.ws.scratch / "fetch-only"
        throttle.configure(rate)
        try:
            return fetch_revision(url, self.ws.model, "r2", dest, concurrency=self.args.fetch_workers)[1]
        finally:
            throttle.configure(0)
            shutil.rmtree(dest, ignore_errors=True)

    def _prefect(self, throttled_url: str | None, rate: float) -> None:
        """Two flow refits per mode (fresh process, then warm); the last mode also runs one rate-limited."""
        a, ws, r = self.args, self.ws, self.result
        modes = [m for m in ("ephemeral", "server") if a.prefect in ("both", m)]
        for mode in modes:
            runs = [{"target": "r2", "restore": True, "label": "first flow in the process"},
                    {"target": "r2", "restore": True, "label": "next flow"}]
            if throttled_url and mode == modes[-1]:
                runs.append({"target": "r2", "restore": True, "catalog": throttled_url, "label": "rate-limited"})
            with self.step(f"Prefect flow, {mode}"):
                if mode == "ephemeral":
                    data = self.jobs.flow("prefect-ephemeral", ws.root / "prefect-ephemeral", runs=runs,
                                          throttle=rate)
                else:
                    with PrefectServer(ws.root / "prefect-server") as server:
                        data = self.jobs.flow("prefect-server", ws.root / "prefect-client", api_url=server.url,
                                              runs=runs, throttle=rate)
                    data["server_startup_s"] = round(server.startup_s, 2)
                r["prefect"][mode] = data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.shape:
        return _shapes.main(name="refit", shape=args.shape, scales=args.scales, workers=args.apply_workers,
                            parts=("refit",), json_path=args.json, keep=args.keep, timeout=args.child_timeout,
                            bucket_mib=args.bucket_mib)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.json or RESULTS / f"refit-{stamp}.json"
    root = Path(tempfile.mkdtemp(prefix="canonical-refit-bench-", dir=args.workdir))
    log(f"working in {root}")
    started = time.perf_counter()
    bench = Bench(args, root)
    try:
        result = bench.run()
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result["command"] = "python -m benchmarks.refit " + shlex.join(sys.argv[1:] if argv is None else argv)
    result["started_at"] = stamp
    result["seconds"] = round(time.perf_counter() - started, 1)
    if not args.no_plot:
        drawn = _render.plot(result, args.plot or out.with_suffix(".png"))
        result["plot"] = str(drawn) if drawn else None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(_render.table(result))
    print(f"\nJSON: {out}" + (f"\nplot: {result['plot']}" if result.get("plot") else ""))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
