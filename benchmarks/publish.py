"""Publishing from memory: one trainer process against a plain XOR, then one revision from 1, 2 and 4 ranks.

    python -m benchmarks.publish                       # 256 MiB model, 2 % RL steps, ranks 1,2,4
    python -m benchmarks.publish --size-mb 1024 --ranks 1,2 --steps 3

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
model bytes and each rank's own, against one rank's. Writes JSON under
benchmarks/results/.
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
    p.add_argument("--rank-threads", type=int, default=1, help="encoding threads of each rank")
    p.add_argument("--json", type=Path, help="where to write the result (default benchmarks/results/publish-*.json)")
    p.add_argument("--keep", action="store_true", help="keep the working folder")
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


def run(args: argparse.Namespace, root: Path) -> dict:
    result = {"schema": SCHEMA, "machine": machine(), "config": {k: str(v) for k, v in vars(args).items()}}
    log(f"one process, {args.size_mb} MiB, {args.share * 100:g} % changed, {args.threads} threads")
    result["one_process"] = one_process(root, size_bytes=args.size_mb * 2**20, share=args.share, steps=args.steps,
                                        threads=args.threads, encoding=args.encoding)
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
    return bench_main("publish", argv, parse_args, run, table, log)


if __name__ == "__main__":
    sys.exit(main())
