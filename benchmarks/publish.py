"""Publishing from memory: one trainer process against a plain XOR, then one revision from 1, 2 and 4 ranks.

    python -m benchmarks.publish                       # 256 MiB model, 2 % RL steps, ranks 1,2,4
    python -m benchmarks.publish --size-mb 1024 --ranks 1,2 --steps 3
    python -m benchmarks.publish --shape deepseek-v3 --tensors-scale 0.087,1   # per tensor, real layouts

Part one, in this process: a bf16 transformer-shaped model (``benchmarks._model``)
and RL steps of ``--share`` changed elements (``flows.synthetic.RLTrainer``)
published from memory with ``flows.api.publish`` (the kept base in memory,
``--threads`` encoding threads) to a ``file://`` catalog, each step timed
whole (plan, encode, upload, record, the kept copy); beside it the reference,
a plain in-memory XOR of the same base and new bytes with the same threads.
Goal: publishing at >= 0.5 x the XOR's rate of model bytes.

Part two, the runnable example of sharded publishing: for each count N of
``--ranks``, N processes (``python -m benchmarks.publish --child``) each hold
every N-th tensor of the model, train on them, and publish every step together
(``flows.api.publish(..., rank=, world_size=, publication=)``) from memory,
``--rank-threads`` threads each; the timed window of a step opens when every
rank is ready and closes when the last rank returns. Prints all ranks' rate of
model bytes and each rank's own, against one rank's.

Part three, the upload overlapped with training: a loop of ``--train-s``
training steps (a sleep: the GPU's work) that publishes every step to an S3
server (moto) behind a proxy capping each connection at ``--upload-cap-mb-s``,
once waiting for each publication and once with ``wait=False`` (the next step
trains while the upload goes); prints the median step time and how long the
trainer was blocked. Writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks._bench import ROOT, bench_main
from flows.synthetic import SHAPES, SMALL_SCALES
from testbed.processes import machine

SCHEMA = "canonical-refit.benchmark.publish.v1"
MODEL = "bench/publish"
GOAL_OVER_XOR = 0.5


def log(message: str) -> None:
    print(f"[publish {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.publish", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256, help="model size in MiB (bf16)")
    p.add_argument("--share", type=float, default=0.02, help="share of bf16 elements each step changes")
    p.add_argument("--steps", type=int, default=3, help="timed delta publications (the best is the figure)")
    p.add_argument("--threads", type=int, default=2, help="encoding threads of the one-process publisher and "
                                                          "of the XOR reference")
    p.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts of the sharded part ('' skips it)")
    p.add_argument("--encoding", default="xor", help="publisher encoding of the one-process part (xor, the "
                                                     "publisher's default; auto, xor_sparse, overwrite, xor_gaps)")
    p.add_argument("--train-s", type=float, default=1.0, help="seconds of a training step in the overlap part "
                                                                "(0 skips it)")
    p.add_argument("--upload-cap-mb-s", type=float, default=10.0,
                   help="per-connection bandwidth of the S3 server in the overlap part, MB/s")
    p.add_argument("--rank-threads", type=int, default=1, help="encoding threads of each rank")
    p.add_argument("--json", type=Path, help="where to write the result (default benchmarks/results/publish-*.json)")
    p.add_argument("--keep", action="store_true", help="keep the working folder")
    p.add_argument("--shape", choices=SHAPES,
                   help="instead of the three parts: a checkpoint with a real model's layout (tensor names, dtypes "
                        "and count; tiny tensors) published step by step; prints microseconds per tensor per "
                        "stage and the goal (benchmarks/_shapes.py)")
    p.add_argument("--tensors-scale", default="1", metavar="S[,S...]",
                   help="with --shape: shares of the shape's full tensor count, each measured")
    p.add_argument("--small", action="store_true",
                   help="with --shape: the suite's small mode (flows.synthetic.SMALL_SCALES: a few hundred tensors)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one rank of part two
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_tensors(size_bytes: int, rank: int = 0, world_size: int = 1) -> dict[str, np.ndarray]:
    """The benchmark model's tensors held by ``rank`` of ``world_size`` (every ``world_size``-th by name)."""
    from benchmarks._model import shape_for
    from flows.synthetic import random_model

    tensors = random_model(shape_for(size_bytes), seed=1)
    return {n: tensors[n] for n in sorted(tensors)[rank::world_size]}


def xor_rate(base: dict[str, np.ndarray], new: dict[str, np.ndarray], threads: int, repeat: int = 3) -> dict:
    """A plain XOR of every tensor's bytes, ``threads`` threads each with its own output buffer: best of
    ``repeat``, in model bytes per second."""
    names = sorted(base, key=lambda n: -base[n].nbytes)
    largest = max(base[n].nbytes for n in names)
    scratch = [np.empty(largest, dtype=np.uint8) for _ in range(threads)]
    for s in scratch:
        s.fill(0)  # pages touched before timing, as a publisher's reused buffers are
    nbytes = sum(base[n].nbytes for n in names)

    def run(worker: int) -> None:
        for name in names[worker::threads]:
            b, t = base[name].reshape(-1).view(np.uint8), new[name].reshape(-1).view(np.uint8)
            np.bitwise_xor(b, t, out=scratch[worker][: b.size])

    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, range(threads)))
        best = min(best, time.perf_counter() - t0)
    return {"seconds": round(best, 4), "bytes": nbytes, "gb_s": round(nbytes / best / 1e9, 3), "threads": threads}


def one_process(root: Path, *, size_bytes: int, share: float, steps: int, threads: int,
                encoding: str = "xor") -> dict:
    """Part one (also run by ``benchmarks.refit``): ``steps`` RL steps of ``share`` published from memory by one
    process with ``threads`` encoding threads, each against a plain XOR of the same bytes with as many threads."""
    from flows import api
    from flows.synthetic import RLTrainer, changed_share

    base = model_tensors(size_bytes)
    trainer = RLTrainer(base, seed=2)
    common = dict(catalog=f"file://{root}/one/catalog", model=MODEL, state_dir=root / "one" / "state",
                  emit_event=False, keep_base="memory", workers=threads, encoding=encoding)
    api.publish(base, kind="initial", **common)
    rows = []
    for _ in range(steps):
        new = trainer.step(share)
        reference = xor_rate(base, new, threads)
        result = api.publish(new, kind="delta", **common)
        stages = {s["name"]: s["seconds"] for s in result.stages}
        rows.append({"version": result.version, "seconds": result.seconds, "model_bytes": result.model_bytes,
                      "gb_s": round(result.model_bytes / result.seconds / 1e9, 3), "encoding": result.encoding,
                      "encoded_bytes": result.encoded_bytes, "stages": stages,
                      "changed_element_share": round(changed_share(base, new), 5), "xor": reference,
                      "over_xor": round(result.model_bytes / result.seconds / 1e9 / reference["gb_s"], 3)})
        log(f"{result.version}: {rows[-1]['gb_s']} GB/s of model, XOR {reference['gb_s']} GB/s "
            f"({rows[-1]['over_xor']} x)")
        base = new
    best = max(rows, key=lambda s: s["over_xor"])
    return {"steps": rows, "best": best, "goal": {"target": "publish from memory >= 0.5 x in-memory XOR",
                                                    "measured": best["over_xor"], "bound": GOAL_OVER_XOR,
                                                    "met": best["over_xor"] >= GOAL_OVER_XOR}}


def child(args: argparse.Namespace) -> int:
    """One rank of part two: its tensors, its RL steps, each published with the other ranks."""
    from flows import api
    from flows.synthetic import RLTrainer

    world, rank, root = args.world_size, args.rank, args.root
    tensors = model_tensors(args.size_mb * 2**20, rank, world)
    trainer = RLTrainer(tensors, seed=10 + rank)
    common = dict(catalog=f"file://{root}/catalog", model=MODEL, state_dir=root / "state", emit_event=False,
                  keep_base="memory", workers=args.rank_threads, rank=rank, world_size=world, part_timeout_s=300)
    api.publish(tensors, kind="initial", publication=f"{root.name}-s0", **common)
    steps = []
    for step in range(1, args.steps + 1):
        new = trainer.step(args.share)
        _barrier(root / f"ready-{step}", rank, world)
        started = time.time()
        result = api.publish(new, kind="delta", publication=f"{root.name}-s{step}", **common)
        steps.append({"version": result.version, "started": started, "ended": time.time(),
                       "seconds": result.seconds, "rank_bytes": result.model_bytes,
                       "encoded_bytes": result.encoded_bytes})
    (root / f"rank-{rank}.json").write_text(json.dumps(steps))
    return 0


def _barrier(folder: Path, rank: int, world: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(rank)).touch()
    while len(list(folder.iterdir())) < world:
        time.sleep(0.001)


def sharded(args: argparse.Namespace, root: Path, world: int) -> dict:
    """Part two for ``world`` ranks: every step's window over all ranks, and each rank's own rate."""
    folder = root / f"ranks{world}"
    folder.mkdir(parents=True)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.publish", "--child", "--rank", str(r),
                               "--world-size", str(world), "--root", str(folder), "--size-mb", str(args.size_mb),
                               "--share", str(args.share), "--steps", str(args.steps),
                               "--rank-threads", str(args.rank_threads)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    failed = [(r, p.returncode, outs[r][-2000:]) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"ranks failed: {failed}")
    ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(world)]
    steps = []
    for i in range(args.steps):
        rows = [ranks[r][i] for r in range(world)]
        window = max(row["ended"] for row in rows) - min(row["started"] for row in rows)
        nbytes = sum(row["rank_bytes"] for row in rows)
        steps.append({"version": rows[0]["version"], "seconds": round(window, 4), "model_bytes": nbytes,
                      "gb_s": round(nbytes / window / 1e9, 3),
                      "per_rank_gb_s": [round(row["rank_bytes"] / row["seconds"] / 1e9, 3) for row in rows]})
    best = min(steps, key=lambda s: s["seconds"])
    from storage.catalog.records import Catalog
    from storage.objects.store import ObjectStore

    versions = Catalog(ObjectStore(), f"file://{folder}/catalog", MODEL).versions()
    log(f"{world} rank(s): {best['gb_s']} GB/s of model, per rank {best['per_rank_gb_s']}")
    return {"ranks": world, "threads_per_rank": args.rank_threads, "steps": steps, "best": best,
            "versions": versions}


def overlap(root: Path, *, size_bytes: int, share: float, steps: int, threads: int, train_s: float,
            upload_cap_mb_s: float) -> dict:
    """Part three: a training loop that publishes every step to an S3 server whose connections are capped at
    ``upload_cap_mb_s``, once waiting for each publication and once not (``wait=False``); a training step is
    ``train_s`` of sleep (the GPU's work, which leaves the CPU to the upload)."""
    from flows import api
    from flows.synthetic import RLTrainer
    from storage.settings import ObjectStoreSettings
    from testbed.s3 import MotoServer

    credentials = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in credentials}
    os.environ.update(credentials)
    server = MotoServer(root / "moto.log", "bench").start()
    proxy = subprocess.Popen([sys.executable, "-m", "testbed.s3proxy", server.url, "--bandwidth-mb-s",
                              str(upload_cap_mb_s)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        storage = ObjectStoreSettings(endpoint_url=proxy.stdout.readline().strip(), region="us-east-1",
                                      addressing_style="path")
        out = {"train_s": train_s, "upload_cap_mb_s": upload_cap_mb_s, "steps": steps}
        for label, wait in (("waiting", True), ("not waiting", False)):
            base = model_tensors(size_bytes)
            trainer = RLTrainer(base, seed=2)
            weights = {n: a.copy() for n, a in base.items()}
            common = dict(catalog=f"s3://bench/{label.replace(' ', '-')}/catalog", model=MODEL, storage=storage,
                          state_dir=root / f"overlap-{label.replace(' ', '-')}", emit_event=False,
                          keep_base="memory", workers=threads)
            api.publish(weights, kind="initial", **common)
            rows, pending = [], None
            for _ in range(steps):
                new = trainer.step(share)  # the next weights (computed outside the timed window)
                t_train = time.perf_counter()
                time.sleep(train_s)
                for name, value in new.items():
                    np.copyto(weights[name], value)  # the optimizer's in-place update
                blocked = time.perf_counter()
                if pending is not None:
                    rows[-1]["publication_s"] = pending.result(timeout=600).seconds
                if wait:
                    result = api.publish(weights, **common)
                else:
                    pending = api.publish(weights, wait=False, **common)
                end = time.perf_counter()
                rows.append({"step_s": round(end - t_train, 3), "blocked_s": round(end - blocked, 3),
                             "publication_s": result.seconds if wait else None})
            if pending is not None:
                last = pending.result(timeout=600)
                rows[-1]["publication_s"] = last.seconds
            out[label] = {"rows": rows, "step_s": round(float(np.median([r["step_s"] for r in rows])), 3),
                          "blocked_s": round(float(np.median([r["blocked_s"] for r in rows])), 3)}
            log(f"{label}: a step takes {out[label]['step_s']} s, the trainer blocked {out[label]['blocked_s']} s "
                f"(median of {steps})")
        out["step_ratio"] = round(out["not waiting"]["step_s"] / out["waiting"]["step_s"], 3)
        return out
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run(args: argparse.Namespace, root: Path) -> dict:
    result = {"schema": SCHEMA, "machine": machine(), "config": {k: str(v) for k, v in vars(args).items()}}
    log(f"one process, {args.size_mb} MiB, {args.share * 100:g} % changed, {args.threads} threads")
    result["one_process"] = one_process(root, size_bytes=args.size_mb * 2**20, share=args.share, steps=args.steps,
                                        threads=args.threads, encoding=args.encoding)
    if args.train_s > 0:
        log(f"a training loop against S3 capped at {args.upload_cap_mb_s} MB/s per connection, {args.train_s} s "
            "per training step, waiting for each publication or not")
        result["overlap"] = overlap(root, size_bytes=args.size_mb * 2**20, share=args.share, steps=args.steps + 1,
                                    threads=args.threads, train_s=args.train_s,
                                    upload_cap_mb_s=args.upload_cap_mb_s)
    result["sharded"] = [sharded(args, root, int(n)) for n in args.ranks.split(",") if n.strip()]
    if result["sharded"]:
        one = result["sharded"][0]["best"]["gb_s"]
        for row in result["sharded"]:
            row["over_first"] = round(row["best"]["gb_s"] / one, 3) if one else None
    return result


def table(result: dict) -> str:
    one = result["one_process"]
    best = one["best"]
    goal = one["goal"]
    lines = [f"publish from memory, {best['changed_element_share'] * 100:.2f} % of elements changed, "
             f"{best['model_bytes'] / 1e6:.0f} MB of model, {best['xor']['threads']} threads "
             f"(encoding {best['encoding']})",
             f"  plain in-memory XOR of the same bytes: {best['xor']['gb_s']} GB/s",
             f"  publish (plan, encode, upload, record, kept copy): {best['gb_s']} GB/s, {best['seconds']} s "
             f"({', '.join(f'{k} {v}' for k, v in best['stages'].items())})",
             f"  {goal['target']}: {goal['measured']} x (bound {goal['bound']}) "
             f"{'met' if goal['met'] else 'not met'}"]
    lap = result.get("overlap")
    if lap:
        lines += ["", f"a training loop ({lap['train_s']} s per training step), S3 capped at {lap['upload_cap_mb_s']} "
                      "MB/s per connection (medians):",
                  f"  waiting for each publication: a step takes {lap['waiting']['step_s']} s, the trainer blocked "
                  f"{lap['waiting']['blocked_s']} s",
                  f"  publish(wait=False):          a step takes {lap['not waiting']['step_s']} s, the trainer blocked "
                  f"{lap['not waiting']['blocked_s']} s ({lap['step_ratio']} x the step time)"]
    if result["sharded"]:
        lines += ["", "sharded publishing (processes, each every N-th tensor; best step):",
                  "  ranks | threads/rank | all ranks, GB/s of model | vs first | each rank's own GB/s | versions"]
        for row in result["sharded"]:
            lines.append(f"  {row['ranks']:5d} | {row['threads_per_rank']:12d} | {row['best']['gb_s']:24.3f} | "
                         f"{row['over_first']:8.2f} | {', '.join(map(str, row['best']['per_rank_gb_s']))} | "
                         f"{','.join(row['versions'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child" in argv:
        return child(parse_args(argv))
    args = parse_args(argv)
    if args.shape:
        from benchmarks import _shapes

        try:
            scales = [SMALL_SCALES[args.shape]] if args.small else _shapes.parse_scales(args.tensors_scale)
        except ValueError as exc:
            raise SystemExit(f"python -m benchmarks.publish: {exc}")
        return _shapes.main(name="publish", shape=args.shape, scales=scales, workers=args.threads, parts=(),
                            json_path=args.json, keep=args.keep)
    return bench_main("publish", argv, parse_args, run, table, log)


if __name__ == "__main__":
    sys.exit(main())
