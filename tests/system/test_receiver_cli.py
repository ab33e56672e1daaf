"""The receiver as users run it: CLI, exit codes, demo, shared caches, kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.lab import ROOT_DIR, independent_digest
from storage.store.local_store import LocalStore


@pytest.fixture
def cli_env(prefect_api, tmp_path):
    """Environment for CLI subprocesses: the test session's Prefect API, a private PREFECT_HOME."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith("CANONICAL_REFIT_")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_HOME=str(tmp_path / "prefect-home"),
               PYTHONPATH=str(ROOT_DIR))
    return env


def refit_cli(lab, env, *args, timeout=300):
    cmd = [sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model,
           "--cache-dir", str(lab.cache), "--seed-checkpoint", str(lab.launch), "--json", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT_DIR, timeout=timeout)


def parse(out) -> dict:
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_json_result_and_exit_codes(flow_lab, cli_env):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    out = refit_cli(lab, cli_env)
    assert out.returncode == 0, out.stderr[-2000:]
    result = parse(out)
    assert set(result) >= {"status", "version", "target_digest", "format_digest", "checkpoint_path", "stages", "error"}
    assert result["status"] == "READY" and result["version"] == "r1" and result["error"] is None
    assert result["target_digest"] == independent_digest(lab.expected("r1"))[1]
    assert [s["name"] for s in result["stages"]] == ["resolve catalog", "seed checkpoint", "fetch index",
                                                     "fetch buckets", "apply deltas", "verify digest", "install",
                                                     "activate"]
    stage_fields = {"name", "seconds", "bytes"}  # what --json promises for every stage
    assert all(stage_fields <= set(s) for s in result["stages"])
    lab.assert_checkpoint(result["checkpoint_path"], "r1")

    out = refit_cli(lab, cli_env, "--target", "r9")
    assert out.returncode == 1 and parse(out)["status"] == "FAILED" and "r9" in parse(out)["error"]
    assert parse(out)["version"] is None and parse(out)["installed_version"] == "r1"  # still installed

    store = LocalStore(lab.cache, lab.model)
    store.mark_poisoned("test: engine died mid-load", "r1", "none")
    lab.publish("delta")
    out = refit_cli(lab, cli_env)
    assert out.returncode == 3 and parse(out)["status"] == "POISONED" and "recover" in parse(out)["error"]
    assert store.active().version == "r1"

    status = subprocess.run([sys.executable, "-m", "flows.refit", "status", "--cache-dir", str(lab.cache),
                             "--model", lab.model, "--json"], capture_output=True, text=True, env=cli_env,
                            cwd=ROOT_DIR, timeout=120)
    info = json.loads(status.stdout)
    assert info["active"]["version"] == "r1" and info["poisoned"]["version"] == "r1"
    assert info["state"]["status"] == "READY" and info["state"]["version"] == "r2"
    files = info["state"]["files"]  # labelled: {"size", "mtime_ns"} per file
    checkpoint = store.root / info["state"]["source"]
    assert files and all(files[name] == {"size": (checkpoint / name).stat().st_size,
                                         "mtime_ns": (checkpoint / name).stat().st_mtime_ns} for name in files)

    recover = subprocess.run([sys.executable, "-m", "flows.refit", "recover", "--cache-dir", str(lab.cache),
                              "--model", lab.model, "--catalog", lab.catalog, "--json"], capture_output=True,
                             text=True, env=cli_env, cwd=ROOT_DIR, timeout=120)
    assert recover.returncode == 0, recover.stdout + recover.stderr[-2000:]
    assert store.poisoned() is None and store.active().version == "r2"


def test_refit_help_documents_every_flag(cli_env):
    out = subprocess.run([sys.executable, "-m", "flows.refit", "--help"], capture_output=True, text=True,
                         env=cli_env, cwd=ROOT_DIR, timeout=120)
    for flag in ("--catalog", "--model", "--target", "--initial-version", "--seed-checkpoint", "--cache-dir",
                 "--cache-max-gb", "--installer", "--engine-url", "--json", "--verify", "--no-activate"):
        assert flag in out.stdout


def test_the_no_flag_demo_runs_twice(cli_env, tmp_path):
    env = dict(cli_env, CANONICAL_REFIT_DEMO_DIR=str(tmp_path / "demo"))
    first = subprocess.run([sys.executable, "-m", "flows.refit"], capture_output=True, text=True, env=env,
                           cwd=ROOT_DIR, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "status: READY" in first.stdout and "version: r5" in first.stdout
    for stage in ("resolve catalog", "fetch buckets", "apply deltas", "verify digest", "activate"):
        assert stage in first.stdout
    second = subprocess.run([sys.executable, "-m", "flows.refit"], capture_output=True, text=True, env=env,
                            cwd=ROOT_DIR, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "published r6" in second.stdout and "version: r6" in second.stdout and "lineage: r5 -> r6" in second.stdout


def test_a_second_receiver_reuses_the_prepared_target_without_downloading(flow_lab, cli_env):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    first = refit_cli(lab, cli_env, "--no-activate")
    assert first.returncode == 0, first.stderr[-2000:]
    second = refit_cli(lab, cli_env)
    assert second.returncode == 0
    stages = {s["name"]: s["bytes"] for s in parse(second)["stages"]}
    assert stages["fetch index"] == 0 and stages["fetch buckets"] == 0 and stages["apply deltas"] == 0
    assert parse(second)["version"] == "r1"


def test_a_preparation_waits_while_another_process_is_installing(flow_lab, cli_env):
    lab = flow_lab
    lab.publish("initial")
    assert lab.refit()[0].name == "Ready"
    lab.publish("delta")
    store = LocalStore(lab.cache, lab.model)
    fence = store.shared(10, "installation").acquire()  # an engine rank loading r0
    try:
        cmd = [sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model,
               "--cache-dir", str(lab.cache), "--json"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env,
                                cwd=ROOT_DIR)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while not any("waiting for another receiver" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        assert store.state().version == "r0" and not (store.root / "deltas" / "r1").exists()
    finally:
        fence.release()
    out = proc.stdout.read()
    assert proc.wait(timeout=300) == 0, "".join(lines)[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["version"] == "r1"


def test_a_process_killed_during_apply_leaves_updating_and_the_next_run_recovers(flow_lab, cli_env):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    assert lab.refit()[0].name == "Ready"
    lab.publish("delta")
    env = dict(cli_env, CANONICAL_REFIT_KILLPOINT="apply.block:2")
    out = refit_cli(lab, env)
    assert out.returncode == -signal.SIGKILL
    store = LocalStore(lab.cache, lab.model)
    assert store.state().status == "UPDATING" and store.state().version == "r2"
    state, result = lab.refit()
    assert state.name == "Ready" and result.version == "r2"
    assert any("discarded the half-written checkpoint" in note for note in result.notes)
    lab.assert_checkpoint(result.checkpoint_path, "r2")
