"""Crash consistency under SIGKILL (CI mode of ``tests/support/crash_harness.py``).

Every kill point of every scenario is hit once (plus crashes during recovery
and "go back" recoveries), the points before any change and after the target
is verified (``crash_trials.EDGE_POINTS``) once per start store; each trial
kills a refit child, then a fresh refit
must leave the store READY at a verified version with byte-exact tensors, an
installed identity that names exactly those files, and no unverified byte
ever handed to the engine. A few trials crash ``python -m flows.refit`` itself.
Every pair, plus random trials: ``python -m tests.support.crash_harness --trials 200``.
"""

from __future__ import annotations

import json

import pytest

import tests.support.crash_support as cs
import tests.support.crash_trials as ct
from storage.runtime.killpoints import POINTS


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    return ct.build_world(tmp_path_factory.mktemp("crash-world"))


def test_every_kill_point_of_every_scenario_recovers(world, tmp_path):
    trials = ct.run_trials(world, ct.plan_trials(world, 20, seed=11, edges_once_per_start=True), tmp_path)
    assert len(trials) >= 20
    assert {(t.scenario.name, t.kill.split(":")[1]) for t in trials} >= {  # every pair but repeated edges
        (s.name, p) for s in ct.SCENARIOS for p in world.points[s.name] if p not in ct.EDGE_POINTS}
    assert {(t.scenario.start, t.kill.split(":")[1]) for t in trials} >= {  # the edges from every start store
        (s.start, p) for s in ct.SCENARIOS for p in world.points[s.name]}
    summary = ct.summarize(trials)
    assert summary["failures"] == [], json.dumps(summary["failures"], indent=1)
    assert summary["recovered"] == summary["trials"]
    assert summary["killed"] == summary["trials"]  # named kill points: every run really died
    assert summary["kill_points_not_reached"] == []
    assert set(summary["kill_points"]) == set(POINTS)


def test_random_moment_kills_recover(world, tmp_path):
    trials = [t for t in ct.plan_trials(world, 200, seed=5) if t.kill.startswith("random:")][:4]
    ct.run_trials(world, trials, tmp_path, prefix="r")
    summary = ct.summarize(trials)
    assert summary["failures"] == [], json.dumps(summary["failures"], indent=1)
    assert summary["killed"] >= 1


def test_going_back_after_a_takeover_crash_records_the_rebuilt_files(world, tmp_path):
    """r1 is installed; a refit to r3 takes materialized/r1 over and dies; going back to r1 rebuilds it.

    The engine still runs r1, so the install is skipped, but active.json must
    name the rebuilt files, not the ones that were taken over.
    """
    trial = ct.Trial(ct.SCENARIOS[1], "point:apply.materialized:1", "r1")
    ct.run_trial(world, trial, tmp_path / "back")
    assert trial.crashed and trial.reached == "apply.materialized"
    assert trial.violations == []
    store = tmp_path / "back" / world.lab.model.replace("/", "--")
    active = json.loads((store / "active.json").read_text())
    verified = json.loads((store / "verified" / "r1.json").read_text())
    assert (active["version"], active["path"], active["files"]) == ("r1", verified["path"], verified["files"])
    engine = cs.RecordingEngine(tmp_path / "back" / "engine.json")
    assert [load["version"] for load in engine.loads()] == ["r1"]  # golden run's load only: skipped


@pytest.mark.parametrize("point", ["apply.block", "install.after"])
def test_real_flow_killed_and_recovered_by_the_flow(world, tmp_path, point):
    trial = ct.run_real_flow_trial(world, tmp_path / point, point, seed=3)
    assert trial.crashed and trial.reached == point
    assert trial.violations == []
