"""Command latency of the first hour: the README's five-minute example, command by command, timed as a user runs it.

    python -m benchmarks.commands              # 3 rounds (about 3 minutes on 2 cores)
    python -m benchmarks.commands --rounds 1

Each round runs the example's five commands (publish the launch revision,
publish a delta, refit, roll back, status) as fresh processes, wall time
from ``fork`` to exit, in three set-ups, all in one fresh ``PREFECT_HOME``:

- ``local`` (the default, no ``PREFECT_API_URL``): the local Prefect server
  the first command started, reused (``flows.local_server``);
- ``server``: ``PREFECT_API_URL`` naming that same running server, as
  after ``prefect server start`` and ``export PREFECT_API_URL=...``;
- ``private`` (``CANONICAL_REFIT_API_MODE=private``): a private API server
  per command, started and stopped by it (the behaviour before the local
  server).

It also times the very first command, which starts the local server
(migrating a fresh database). The reference is the ``server`` set-up in
the same run: ``local`` should cost no more than it. Goal: each refit and
publish of the example at most 5 s on a quiet 2-core machine with no server
configured. Writes JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "canonical-refit.benchmark.commands.v1"
GOAL_S = 5.0
TIMED = ("publish initial", "publish delta", "refit", "rollback")


def commands(work: Path) -> list[tuple[str, list[str]]]:
    catalog = f"file://{work}/catalog"
    py = [sys.executable, "-m"]
    common = ["--catalog", catalog, "--model", "me/tiny"]
    node = [*common, "--seed-checkpoint", str(work / "step-0"), "--cache-dir", str(work / "cache")]
    return [
        ("publish initial", [*py, "flows.publish", *common, "--checkpoint", str(work / "step-0"), "--kind", "initial",
                             "--state-dir", str(work / "publisher")]),
        ("publish delta", [*py, "flows.publish", *common, "--checkpoint", str(work / "step-1"), "--kind", "delta",
                           "--state-dir", str(work / "publisher")]),
        ("refit", [*py, "flows.refit", *node]),
        ("rollback", [*py, "flows.refit", *node, "--target", "r0"]),
        ("status", [*py, "flows.refit", "status", "--model", "me/tiny", "--cache-dir", str(work / "cache")]),
    ]


def timed(argv: list[str], env: dict) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return seconds


def round_of(work: Path, env: dict) -> dict[str, float]:
    for name in ("catalog", "revisions", "cache", "publisher"):
        subprocess.run(["rm", "-rf", str(work / name)], check=True)
    return {name: timed(argv, env) for name, argv in commands(work)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.commands", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of the five commands per set-up")
    p.add_argument("--json", type=Path, help="where to write the result (default benchmarks/results/commands-*.json)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="canonical-refit-commands-"))
    home = work / "prefect-home"
    step0 = random_model(ModelShape(), seed=0)
    write_checkpoint(work / "step-0", step0)
    write_checkpoint(work / "step-1", train_step(step0, seed=1))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CANONICAL_REFIT_", "PREFECT_"))}
    base.update(PREFECT_HOME=str(home), PYTHONPATH=str(ROOT), DO_NOT_TRACK="1")
    stop = [sys.executable, "-m", "flows.local_server", "stop"]
    try:
        first = round_of(work, base)  # its first command starts the local server
        record = json.loads((home / "canonical-refit" / "local-server.json").read_text())
        setups = {"local": base, "server": {**base, "PREFECT_API_URL": record["url"]},
                  "private": {**base, "CANONICAL_REFIT_API_MODE": "private"}}
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
        for _ in range(args.rounds):
            for name, env in setups.items():
                rounds[name].append(round_of(work, env))
    finally:
        subprocess.run(stop, cwd=ROOT, env=base, capture_output=True)
    median = {name: {cmd: statistics.median(r[cmd] for r in rs) for cmd in rs[0]} for name, rs in rounds.items()}
    print(f"{'command':<17}{'local':>9}{'server':>9}{'private':>9}{'local/server':>14}")
    for cmd in median["local"]:
        local, server, private = (median[s][cmd] for s in ("local", "server", "private"))
        print(f"{cmd:<17}{local:>8.2f}s{server:>8.2f}s{private:>8.2f}s{local / server:>13.2f}x")
    print(f"first command of a fresh PREFECT_HOME (starts the local server): {first['publish initial']:.2f}s")
    worst = max(median["local"][cmd] for cmd in TIMED)
    print(f"goal: each refit and publish <= {GOAL_S:.0f}s with no server configured: "
          f"{'met' if worst <= GOAL_S else 'not met'} (slowest {worst:.2f}s)")
    out = args.json or ROOT / "benchmarks" / "results" / f"commands-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"schema": SCHEMA, "rounds": rounds, "median_s": median, "first_command_s": first,
                               "goal_s": GOAL_S, "met": worst <= GOAL_S, "load_average": os.getloadavg()},
                              indent=2))
    print(f"wrote {out}")
    subprocess.run(["rm", "-rf", str(work)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
