"""Crash trials: scenarios, start stores, kill plans, and what each trial checks.

A trial restores a start store, runs a refit child (``crash_support``) that
SIGKILL ends at a named kill point or at a random moment (sometimes killing
the first recovery too), then runs a fresh refit and checks the invariants of
``crash_support.check_recovered``. ``tests/support/crash_harness.py`` runs the
full mode; ``tests/crash/test_crash.py`` the CI mode.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.crash_support import Children, check_after_crash, check_recovered

# --- the world: a published catalog and golden start stores -------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """Refit from ``start`` (a golden store, or an empty one) to ``target``."""

    name: str
    start: str | None
    target: str


SCENARIOS = (
    Scenario("seed-and-delta", None, "r1"),            # seed the launch snapshot, copy, patch
    Scenario("sequential-takeover", "r1", "r3"),       # take over materialized/r1, sparse + overwrite
    Scenario("rollback", "r3", "r1"),                  # rebuild an older revision from full/r0
    Scenario("full-root", None, "r5"),                 # download full r4, verify it, patch r5
    Scenario("full-after-deltas", "r3", "r5"),          # a newer full revision replaces the chain
)


@dataclass
class World:
    """Published revisions (via the real publish flow) and stores to start trials from."""

    root: Path
    lab: object
    golden: dict[str, Path] = field(default_factory=dict)
    points: dict[str, dict[str, int]] = field(default_factory=dict)  # scenario -> killpoint -> hits
    seconds: dict[str, float] = field(default_factory=dict)
    children: Children = field(default_factory=Children)

    @property
    def catalog(self) -> str:
        return self.lab.catalog

    def expected_digest(self, version: str) -> str:
        from tests.support.lab import independent_digest

        return independent_digest(self.lab.expected(version))[1]

    def job(self, cache: Path, target: str, **extra) -> dict:
        cache = Path(cache)
        cache.mkdir(parents=True, exist_ok=True)
        job = {"catalog": self.catalog, "model": self.lab.model, "seed": str(self.lab.launch),
               "cache": str(cache), "target": target, "log": str(cache / "refit.log"),
               "result": str(cache / "result.json")}
        job.update(extra)
        return job

    def fresh_cache(self, scenario: Scenario, dest: Path) -> Path:
        """A copy of the scenario's start store (mtimes kept, so file identities still match)."""
        if dest.exists():
            shutil.rmtree(dest)
        if scenario.start is None:
            dest.mkdir(parents=True)
        else:
            shutil.copytree(self.golden[scenario.start], dest, symlinks=True)
            for leftover in ("events.log", "result.json", "refit.log", "killpoints.log"):
                (dest / leftover).unlink(missing_ok=True)
        return dest


def publish_world(root: Path, *, counting: bool = False):
    """r0 launch, r1 dense xor, r2 xor_sparse, r3 overwrite, r4 full, r5 dense xor (real publish flow).

    ``counting``: publish under ``countfile://`` so every download is logged.
    """
    from tests.support.lab import Lab, tiny_shape

    lab = Lab(Path(root), shape=tiny_shape())
    if counting:
        lab.catalog = "countfile://" + str(lab.catalog_dir.resolve())
    lab.publish("initial")
    lab.publish("delta")
    lab.publish("delta", lab.next_step(fraction=0.002), encoding="xor_sparse")
    lab.publish("delta", lab.next_step(fraction=0.002), encoding="overwrite")
    lab.publish("full")
    lab.publish("delta")
    return lab


def build_world(root: Path, lab=None) -> World:
    """Publish (unless ``lab`` is given), build golden stores at r1 and r3, calibrate every scenario."""
    root = Path(root)
    world = World(root, lab or publish_world(root / "lab"))
    for version, path in (("r1", ["r1"]), ("r3", ["r1", "r3"])):
        cache = root / "golden" / version
        for target in path:
            out = world.children.run(world.job(cache, target))
            if out.get("status") != "READY":
                raise RuntimeError(f"could not build the golden store at {target}: {out}")
        world.golden[version] = cache
    for scenario in SCENARIOS:
        cache = world.fresh_cache(scenario, root / "calibrate" / scenario.name)
        kplog = cache / "killpoints.log"
        started = time.monotonic()
        out = world.children.run(world.job(cache, scenario.target, env={
            "CANONICAL_REFIT_KILLPOINT_PAUSE": "0.0001", "CANONICAL_REFIT_KILLPOINT_LOG": str(kplog)}))
        world.seconds[scenario.name] = time.monotonic() - started
        if out.get("status") != "READY":
            raise RuntimeError(f"calibration of {scenario.name} failed: {out}")
        hits: dict[str, int] = {}
        for name in kplog.read_text().split():
            hits[name] = hits.get(name, 0) + 1
        world.points[scenario.name] = hits
    return world


# --- one trial ------------------------------------------------------------------------------------------------


@dataclass
class Trial:
    scenario: Scenario
    kill: str                  # "point:name:n" or "random:seconds"
    recovery_target: str
    second_kill: str | None = None  # kill the first recovery run too (same forms)
    reached: str | None = None  # the kill point it died at, or the last one it passed
    second_reached: str | None = None
    crashed: bool = False
    violations: list[str] = field(default_factory=list)
    recovery: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


# reached before the store changes (the lock) or once the target is verified (install, activation): what a crash
# there leaves depends on the start store only, not on how the scenario built its target
EDGE_POINTS = frozenset({"lock.exclusive", "install.before", "install.fenced", "install.after", "activate.written"})


def plan_trials(world: World, count: int, *, seed: int, cover_all: bool = True,
                edges_once_per_start: bool = False) -> list[Trial]:
    """``count`` trials: first every (scenario, kill point) pair once, then random ones.

    ``edges_once_per_start`` (the suite's small mode): an ``EDGE_POINTS`` point only in the first scenario of
    each start store (empty, r1, r3); every other pair as before, the same plan otherwise.
    """
    rng = random.Random(seed)
    trials: list[Trial] = []
    edges: set[tuple[str | None, str]] = set()
    if cover_all:
        for scenario in SCENARIOS:
            for point, hits in sorted(world.points[scenario.name].items()):
                kill = f"point:{point}:{rng.randint(1, hits)}"
                if edges_once_per_start and point in EDGE_POINTS:
                    if (scenario.start, point) in edges:
                        continue
                    edges.add((scenario.start, point))
                trials.append(Trial(scenario, kill, scenario.target))
            # a crash during the recovery of a crash
            trials.append(Trial(scenario, "point:apply.block:1", scenario.target, "point:recover.discarded:1"))
            if scenario.start is not None:  # give up after the base was taken over: back to the installed one
                trials.append(Trial(scenario, "point:apply.materialized:1", scenario.start))
    while len(trials) < count:
        scenario = rng.choice(SCENARIOS)
        hits = world.points[scenario.name]
        if rng.random() < 0.5:
            point = rng.choice(sorted(hits))
            kill = f"point:{point}:{rng.randint(1, hits[point])}"
        else:
            kill = f"random:{rng.uniform(0.0, world.seconds[scenario.name] * 0.9):.4f}"
        target = scenario.target
        if scenario.start is not None and rng.random() < 0.2:
            target = scenario.start  # give up on the new target, go back to the installed one
        second = None
        if rng.random() < 0.15:
            second = rng.choice(["point:recover.discarded:1",
                                 f"random:{rng.uniform(0.0, world.seconds[scenario.name]):.4f}"])
        trials.append(Trial(scenario, kill, target, second))
    return trials


def run_trials(world: World, trials: list[Trial], workdir: Path, *, prefix: str = "t", workers: int = 2) -> list[Trial]:
    """``run_trial`` for each, ``workers`` at a time (each trial has its own store and children; much of a trial is
    its children waiting on their disk writes), in ``workdir/<prefix><n>``."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda item: run_trial(world, item[1], Path(workdir) / f"{prefix}{item[0]:03d}"),
                      enumerate(trials)))
    return trials


def run_trial(world: World, trial: Trial, workdir: Path) -> Trial:
    """Crash a refit as ``trial`` says, check the crash invariants, recover, check the store."""
    cache = world.fresh_cache(trial.scenario, Path(workdir))
    out, reached = _crash(world, cache, trial.scenario.target, trial.kill, "killpoints.log")
    trial.crashed, trial.reached = out["status"] == "KILLED", reached
    if out["status"] not in ("KILLED", "READY"):
        trial.violations.append(f"crashed run ended {out}")
    trial.violations += check_after_crash(world, cache)
    if trial.second_kill:
        again, where = _crash(world, cache, trial.recovery_target, trial.second_kill, "killpoints-2.log")
        trial.second_reached = where if again["status"] == "KILLED" else None
        if again["status"] not in ("KILLED", "READY"):
            trial.violations.append(f"second (crashed) run ended {again}")
        trial.violations += check_after_crash(world, cache)
    trial.recovery = world.children.run(world.job(cache, trial.recovery_target))
    if trial.recovery.get("status") != "READY":
        trial.violations.append(f"recovery run ended {trial.recovery}")
    trial.violations += check_recovered(world, cache, trial.recovery_target)
    return trial


def _crash(world: World, cache: Path, target: str, kill: str, log_name: str) -> tuple[dict, str]:
    """Run a refit that ``kill`` ends; returns its outcome and the last kill point it reached."""
    kplog = cache / log_name
    env = {"CANONICAL_REFIT_KILLPOINT_LOG": str(kplog)}
    kind, _, rest = kill.partition(":")
    kill_after = None
    if kind == "point":
        env["CANONICAL_REFIT_KILLPOINT"] = rest
    else:  # pause briefly at every point so the log says where the kill landed
        env["CANONICAL_REFIT_KILLPOINT_PAUSE"] = "0.0005"
        kill_after = float(rest)
    out = world.children.run(world.job(cache, target, env=env), kill_after_s=kill_after)
    reached = kplog.read_text().split() if kplog.exists() else []
    return out, (reached[-1] if reached else "(before any kill point)")


def summarize(trials: list[Trial]) -> dict:
    """Trials, kill points covered, recoveries."""
    from storage.runtime.killpoints import POINTS

    covered: dict[str, int] = {}
    for t in trials:
        for crashed, where in ((t.crashed, t.reached), (t.second_reached is not None, t.second_reached)):
            if crashed:
                covered[where] = covered.get(where, 0) + 1
    return {
        "trials": len(trials),
        "killed": sum(t.crashed for t in trials),
        "completed_before_kill": sum(not t.crashed for t in trials),
        "double_crash": sum(t.second_reached is not None for t in trials),
        "recovered": sum(t.ok for t in trials),
        "recovery_rate": round(sum(t.ok for t in trials) / max(1, len(trials)), 4),
        "kill_points": dict(sorted(covered.items())),
        "kill_points_not_reached": sorted(set(POINTS) - set(covered)),
        "failures": [{"scenario": t.scenario.name, "kill": t.kill, "reached": t.reached,
                      "recovery_target": t.recovery_target, "violations": t.violations}
                     for t in trials if not t.ok],
    }


# --- trials through the real flow ------------------------------------------------------------------------------


def prefect_env() -> dict:
    """Environment for a child ``python -m flows.refit`` that talks to this process's Prefect API."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith("CANONICAL_REFIT_")}
    url = PREFECT_API_URL.value()
    if url:
        env["PREFECT_API_URL"] = url
    return env


def run_real_flow_trial(world: World, workdir: Path, point: str, seed: int) -> Trial:
    """Kill ``python -m flows.refit`` at ``point``, recover through the Prefect flow in this process."""
    import subprocess
    import sys

    scenario = SCENARIOS[0]
    trial = Trial(scenario, f"point:{point}:1", scenario.target)
    cache = world.fresh_cache(scenario, Path(workdir))
    kplog = cache / "killpoints.log"
    env = prefect_env() | {"CANONICAL_REFIT_KILLPOINT": point, "CANONICAL_REFIT_KILLPOINT_LOG": str(kplog)}
    cmd = [sys.executable, "-m", "flows.refit", "--catalog", world.catalog, "--model", world.lab.model,
           "--seed-checkpoint", str(world.lab.launch), "--cache-dir", str(cache), "--target", scenario.target,
           "--apply-workers", "2", "--lock-timeout", "120", "--json"]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    trial.crashed = proc.returncode == -9
    reached = kplog.read_text().split() if kplog.exists() else []
    trial.reached = reached[-1] if reached else "(before any kill point)"
    if not trial.crashed:
        trial.violations.append(f"flows.refit was not killed at {point}: rc {proc.returncode} {proc.stderr[-2000:]}")
    trial.violations += check_after_crash(world, cache)
    state, result = world.lab.refit(cache_dir=cache, target=scenario.target)
    trial.recovery = {"status": result.status, "error": result.error}
    if state.name != "Ready":
        trial.violations.append(f"recovery flow ended {state.name}: {result.error}")
    trial.violations += check_recovered(world, cache, scenario.target, engine=False)
    return trial
