"""Concurrent receivers on one cache: tensor-parallel ranks, the installation fence, dead lock holders.

Every receiver is a separate process (forked from a forkserver that imported
the pipeline once) running the refit stages in flow order; the engine is the
recording stand-in of ``crash_support``, which hashes what it loads.
Downloads are counted by a ``countfile://`` filesystem in every process.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import tests.support.crash_support as cs
import tests.support.crash_trials as ct

RANKS = 4


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    root = tmp_path_factory.mktemp("concurrency")
    return ct.World(root, ct.publish_world(root / "lab", counting=True))


def wait_for(predicate, timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until true; fail after ``timeout_s`` (bounded, never a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def log_says(job: dict, text: str) -> bool:
    path = Path(job["log"])
    return path.exists() and text in path.read_text()


def artifact_files(world, versions) -> set[str]:
    """Bucket and shard files the catalog publishes for ``versions`` (index files are read, not downloaded)."""
    root = world.lab.catalog_dir.parent / "revisions"
    return {str(p) for v in versions for p in (root / v).iterdir() if p.suffix == ".safetensors"}


def test_ranks_refitting_one_target_download_each_artifact_once(world, tmp_path):
    cache = tmp_path / "cache"
    counter = tmp_path / "downloads.log"
    jobs = [world.job(cache, "r3", log=str(tmp_path / f"rank{i}.log"), result=str(tmp_path / f"rank{i}.json"),
                      env={"COUNTFS_LOG": str(counter)}, lock_timeout_s=60) for i in range(RANKS)]
    procs = [world.children.start(job) for job in jobs]
    for proc in procs:
        proc.join(120)
    assert [p.exitcode for p in procs] == [0] * RANKS, "a rank hung or died"
    results = [world.children.outcome(job, 0) for job in jobs]
    assert [r["status"] for r in results] == ["READY"] * RANKS, results
    assert {r["version"] for r in results} == {"r3"}
    fetched = [d["path"] for d in cs.downloads(counter)]
    assert sorted(fetched) == sorted(artifact_files(world, ["r1", "r2", "r3"]))  # each exactly once
    assert cs.check_recovered(world, cache, "r3") == []
    loads = cs.RecordingEngine(cache / "engine.json").loads()
    assert [load["version"] for load in loads] == ["r3"]  # one load; the other ranks found it current
    locks = [e["pid"] for e in cs.events(cache) if e["what"] == "lock.exclusive"]
    assert sorted(locks) == sorted(p.pid for p in procs)  # every rank took its turn


def test_installation_fence_blocks_preparation_until_activation(world, tmp_path):
    cache = tmp_path / "cache"
    gate = tmp_path / "gate"
    first = world.job(cache, "r1", gate=str(gate), log=str(tmp_path / "a.log"), result=str(tmp_path / "a.json"))
    second = world.job(cache, "r3", log=str(tmp_path / "b.log"), result=str(tmp_path / "b.json"),
                       lock_timeout_s=60)
    a = world.children.start(first)
    try:
        wait_for(lambda: any(e["what"] == "install.start" for e in cs.events(cache)), 60, "the install to start")
        b = world.children.start(second)
        wait_for(lambda: log_says(second, "waiting for another receiver's exclusive lock"), 60,
                 "the preparation to wait for the fence")
        assert [e["what"] for e in cs.events(cache) if e["pid"] == b.pid] == []
        gate.touch()  # the engine finishes loading r1
        a.join(60)
        b.join(60)
    finally:
        gate.touch()
    assert (a.exitcode, b.exitcode) == (0, 0)
    order = [(e["pid"], e["what"], e["version"]) for e in cs.events(cache)]
    assert order.index((a.pid, "activate.written", "r1")) < order.index((b.pid, "lock.exclusive", "r3"))
    loads = cs.RecordingEngine(cache / "engine.json").loads()
    assert [(x["version"], x["bytes"] == world.expected_digest(x["version"])) for x in loads] == [
        ("r1", True), ("r3", True)]  # r1's bytes were intact while the engine read them
    assert cs.check_recovered(world, cache, "r3") == []


@pytest.mark.parametrize("held", ["exclusive", "shared"])
def test_a_killed_lock_holder_does_not_wedge_the_others(world, tmp_path, held):
    """fcntl locks die with their holder: the waiting receiver proceeds and recovers the store."""
    cache = tmp_path / "cache"
    if held == "exclusive":  # parked at its first kill point, after seeding, holding the exclusive lock
        env = {"CANONICAL_REFIT_KILLPOINT_PAUSE": "60", "CANONICAL_REFIT_KILLPOINT_LOG": str(tmp_path / "kp.log")}
        holder = world.job(cache, "r3", env=env, log=str(tmp_path / "a.log"), result=str(tmp_path / "a.json"))
        parked = lambda: (tmp_path / "kp.log").exists()  # noqa: E731
    else:  # inside the installation fence, its engine load never finishing
        holder = world.job(cache, "r1", gate=str(tmp_path / "never"), log=str(tmp_path / "a.log"),
                           result=str(tmp_path / "a.json"))
        parked = lambda: any(e["what"] == "install.start" for e in cs.events(cache))  # noqa: E731
    waiter = world.job(cache, "r3", log=str(tmp_path / "b.log"), result=str(tmp_path / "b.json"), lock_timeout_s=60)
    a = world.children.start(holder)
    wait_for(parked, 60, f"the holder to hold the {held} lock")
    b = world.children.start(waiter)
    try:
        wait_for(lambda: log_says(waiter, "waiting for another receiver's exclusive lock"), 60, "the waiter to wait")
        os.kill(a.pid, signal.SIGKILL)
        a.join(10)
        b.join(90)
    finally:
        for proc in (a, b):
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
    assert a.exitcode == -signal.SIGKILL
    assert b.exitcode == 0
    assert world.children.outcome(waiter, 0)["status"] == "READY"
    assert cs.check_recovered(world, cache, "r3") == []
