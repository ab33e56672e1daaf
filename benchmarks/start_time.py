"""Start time of the commands that run no flow, against ``python -c 'import numpy'`` in the same run.

    python -m benchmarks.start_time              # 9 rounds (about a minute on 2 cores)
    python -m benchmarks.start_time --rounds 5 --tree /path/to/another/checkout

Each round runs every command once as a fresh process, as a user runs it,
interleaved with the reference ``python -c 'import numpy'`` (the order
rotates each round), so a machine busy with other work slows both alike:
``--help`` of the entry points, ``status`` and ``recover`` on an empty store,
``flows.fleet status`` on an empty ``file://`` catalog and ``import
flows.api``. It reports each command's median wall time from ``fork`` to
exit, its fastest run (the least disturbed by other work) and its CPU time
(user + system, from ``wait4``; NumPy's counts its BLAS threads' too), their
ratios to the reference's, the goal (wall time at most 2 x the reference's) met or not,
the load average before and after, and how many Prefect modules each command
imported (one untimed ``-X importtime`` run each). ``python -c pass`` and
``import pydantic_settings`` are timed beside them for context (not judged). ``--tree`` times another
checkout's commands (a version before a change, say). Writes JSON under
``benchmarks/results/``.

Every command runs with the bytecode cache a user's installation has: the
untimed warm-up run writes it into a fresh folder of its own
(``PYTHONPYCACHEPREFIX``), even where ``PYTHONDONTWRITEBYTECODE`` is set (a
CI or sandbox setting; with it, each run compiled the checkout's own modules
again while NumPy's came compiled). Compare a change with ``--tree``, under
the same conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "canonical-refit.benchmark.start-time.v1"
GOAL_RATIO = 2.0
REFERENCE = "import numpy"
FLOORS = ("python -c pass", "import pydantic_settings")  # shown for context, not judged: the interpreter alone, and
# the settings library the commands' settings were built on until they read their environment themselves


def commands(work: Path) -> list[tuple[str, list[str], int]]:
    """(name, arguments after ``python``, the exit code it must end with)."""
    store = ["--model", "org/none", "--cache-dir", str(work / "cache")]
    return [
        (REFERENCE, ["-c", "import numpy"], 0),
        (FLOORS[0], ["-c", "pass"], 0),
        (FLOORS[1], ["-c", "import pydantic_settings"], 0),
        ("flows.refit --help", ["-m", "flows.refit", "--help"], 0),
        ("flows.refit status --help", ["-m", "flows.refit", "status", "--help"], 0),
        ("flows.publish --help", ["-m", "flows.publish", "--help"], 0),
        ("flows.fleet --help", ["-m", "flows.fleet", "--help"], 0),
        ("deployments.serve --help", ["-m", "deployments.serve", "--help"], 0),
        ("flows.refit status (empty store)", ["-m", "flows.refit", "status", *store], 1),
        ("flows.refit recover (empty store)", ["-m", "flows.refit", "recover", *store], 1),
        ("flows.fleet status (empty catalog)", ["-m", "flows.fleet", "status", "--catalog",
                                                f"file://{work}/catalog", "--model", "org/none"], 0),
        ("import flows.api", ["-c", "import flows.api"], 0),
    ]


def timed(argv: list[str], tree: Path, env: dict, expected: int) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``python ARGV`` in ``tree``; it must exit with ``expected``."""
    with tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *argv], cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != expected:
            err.seek(0)
            raise SystemExit(f"python {' '.join(argv)} exited {proc.returncode}, not {expected}:\n"
                             f"{err.read().decode(errors='replace')[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def prefect_modules(argv: list[str], tree: Path, env: dict) -> int:
    """How many ``prefect`` modules ``python ARGV`` imports (``-X importtime`` names each on stderr)."""
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=tree, env=env, capture_output=True,
                          text=True)
    names = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return sum(1 for name in names if name.split(".")[0] == "prefect")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.start_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9, help="runs of each command (default 9)")
    p.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose commands are timed (default: this one)")
    p.add_argument("--json", type=Path, help="where to write the result (default benchmarks/results/start-time-*.json)")
    args = p.parse_args(argv)
    tree = args.tree.resolve()
    work = Path(tempfile.mkdtemp(prefix="canonical-refit-start-"))
    (work / "catalog").mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CANONICAL_REFIT_", "PREFECT_")) and k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PREFECT_HOME=str(work / "prefect-home"), PYTHONPATH=str(tree), DO_NOT_TRACK="1",
               PYTHONPYCACHEPREFIX=str(work / "bytecode"))  # written by the warm-up run, read by the timed ones
    listed = commands(work)
    for _, command, expected in listed:  # warm the page cache and the bytecode; not timed
        timed(command, tree, env, expected)
    load_before = os.getloadavg()
    wall: dict[str, list[float]] = {name: [] for name, _, _ in listed}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in listed}
    for round_ in range(args.rounds):
        shift = round_ % len(listed)
        for name, command, expected in listed[shift:] + listed[:shift]:
            seconds, cpu_s = timed(command, tree, env, expected)
            wall[name].append(seconds)
            cpu[name].append(cpu_s)
    load_after = os.getloadavg()
    prefect = {name: prefect_modules(command, tree, env) for name, command, _ in listed}
    subprocess.run(["rm", "-rf", str(work)])

    median_wall = {name: statistics.median(v) for name, v in wall.items()}
    median_cpu = {name: statistics.median(v) for name, v in cpu.items()}
    ref_wall, ref_cpu, ref_best = median_wall[REFERENCE], median_cpu[REFERENCE], min(wall[REFERENCE])
    rows = {name: {"wall_s": round(median_wall[name], 4), "cpu_s": round(median_cpu[name], 4),
                   "wall_ratio": round(median_wall[name] / ref_wall, 2),
                   "cpu_ratio": round(median_cpu[name] / ref_cpu, 2) if ref_cpu else None,
                   "best_wall_s": round(min(wall[name]), 4), "best_ratio": round(min(wall[name]) / ref_best, 2),
                   "prefect_modules": prefect[name]} for name in wall}
    judged = [name for name in rows if name != REFERENCE and name not in FLOORS]
    met = all(rows[name]["wall_ratio"] <= GOAL_RATIO for name in judged)
    print(f"{'command':<38}{'wall':>8}{'x numpy':>9}{'best':>8}{'x numpy':>9}{'cpu':>8}{'x numpy':>9}{'prefect':>9}")
    for name, row in rows.items():
        print(f"{name:<38}{row['wall_s']:>7.3f}s{row['wall_ratio']:>8.2f}x{row['best_wall_s']:>7.3f}s"
              f"{row['best_ratio']:>8.2f}x{row['cpu_s']:>7.3f}s{row['cpu_ratio'] or 0:>8.2f}x{row['prefect_modules']:>9}")
    print(f"wall and cpu: medians of {args.rounds} interleaved rounds; best: the fastest run; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after (1 min), {os.cpu_count()} CPUs")
    worst = max((rows[name]["wall_ratio"], name) for name in judged)
    print(f"goal: each command's start <= {GOAL_RATIO:.0f}x `python -c 'import numpy'`: "
          f"{'met' if met else 'not met'} (slowest {worst[1]}: {worst[0]:.2f}x)")
    out = args.json or ROOT / "benchmarks" / "results" / f"start-time-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "schema": SCHEMA, "tree": str(tree), "rounds": args.rounds, "goal_ratio": GOAL_RATIO, "met": met,
        "reference": REFERENCE, "commands": rows, "runs_wall_s": wall, "runs_cpu_s": cpu,
        "load_average": {"before": load_before, "after": load_after},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
