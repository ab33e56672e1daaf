"""Full crash harness: SIGKILL refits at kill points and at random moments, recover, check.

    python -m tests.support.crash_harness --trials 200 [--seed 7] [--json out.json] [--real-flow 3]
    python -m tests.support.crash_harness --publisher --trials 100


Publishes a tiny catalog through the real publish flow (an isolated Prefect
API), builds start stores, then runs ``--trials`` trials: each starts a refit
in a child process (the plain stage functions in flow order), kills it with
SIGKILL at a named kill point or after a random delay (sometimes twice), runs
a fresh refit and checks that the store ends READY at the target, byte-exact
(compared with the safetensors library against what was published), with a
consistent installed identity, and that no unverified byte was ever installed.
``--real-flow N`` adds N trials that crash ``python -m flows.refit`` itself
and recover through the Prefect flow. Prints trials, kill points covered and
recoveries; exits 1 unless every trial recovered. ``--publisher`` runs the
publisher's trials instead (``tests/support/crash_publish.py``): a trainer killed at
every publisher kill point and at random moments, then the next publication
(the same command, or the next step's) must go past it by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _isolate_prefect() -> None:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="canonical-refit-crash-prefect-")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    for key in [k for k in os.environ if k.startswith("CANONICAL_REFIT_") or k.startswith("AWS_")]:
        del os.environ[key]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.crash_harness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200, help="crash trials (default 200)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the trial plan")
    parser.add_argument("--real-flow", type=int, default=3, help="extra trials through `python -m flows.refit`")
    parser.add_argument("--workdir", help="keep everything here (default: a temporary folder)")
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--publisher", action="store_true", help="crash the publisher instead of the receiver")
    args = parser.parse_args(argv)
    _isolate_prefect()
    if args.publisher:
        return _publisher(args, argv)

    from prefect.testing.utilities import prefect_test_harness

    import tests.support.crash_trials as ct

    work = Path(args.workdir or tempfile.mkdtemp(prefix="canonical-refit-crash-"))
    started = time.monotonic()
    with prefect_test_harness(server_startup_timeout=120):
        world = ct.build_world(work)
        print(f"world: {len(world.lab.revisions)} revisions, scenarios "
              + ", ".join(f"{s.name} ({sum(world.points[s.name].values())} kill-point hits)" for s in ct.SCENARIOS),
              flush=True)
        trials = ct.plan_trials(world, args.trials, seed=args.seed)
        for i, trial in enumerate(trials):
            ct.run_trial(world, trial, work / "trials" / f"t{i:04d}")
            if not trial.ok:
                print(f"trial {i} FAILED: {trial.scenario.name} {trial.kill} -> {trial.violations}", flush=True)
            elif (i + 1) % 25 == 0:
                print(f"{i + 1}/{len(trials)} trials, all recovered so far", flush=True)
        real = [ct.run_real_flow_trial(world, work / "real" / f"f{i}", point, args.seed + i)
                for i, point in zip(range(args.real_flow), ("apply.block", "state.updating", "install.after",
                                                            "fetch.file", "verify.before_ready"))]
    shutil.rmtree(os.environ["PREFECT_HOME"], ignore_errors=True)  # the harness's own Prefect database
    summary = ct.summarize(trials + real)
    summary["real_flow_trials"] = len(real)
    return _finish(summary, args, argv, work, started)


def _finish(summary: dict, args, argv, work: Path, started: float) -> int:
    """Print (and with --json write) the summary; keep the work folder of a failed run. The exit status."""
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["command"] = "python -m tests.support.crash_harness " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    ok = summary["recovered"] == summary["trials"]
    if ok and not args.workdir:  # keep the stores of a failed run for inspection
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept under {work}")
    return 0 if ok else 1


def _publisher(args, argv) -> int:
    import tests.support.crash_publish as cp

    work = Path(args.workdir or tempfile.mkdtemp(prefix="canonical-refit-publish-crash-"))
    started = time.monotonic()
    world = cp.build_world(work)
    trials = cp.plan_trials(world, args.trials, seed=args.seed)
    for i, trial in enumerate(trials):
        cp.run_trial(world, trial, work / "trials" / f"p{i:04d}")
        if not trial.ok:
            print(f"trial {i} FAILED: {trial.kill} {trial.mode} -> {trial.violations}", flush=True)
        elif (i + 1) % 25 == 0:
            print(f"{i + 1}/{len(trials)} trials, all gone past so far", flush=True)
    return _finish(cp.summarize(trials), args, argv, work, started)


if __name__ == "__main__":
    raise SystemExit(main())
