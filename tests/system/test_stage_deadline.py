"""A stage's deadline: a stage that overruns it stops the run as a cancellation would, and the run fails.

The CLI runs as an operator runs it (``python -m flows.refit --json``),
held inside ``apply deltas`` (the store already UPDATING) at a named point
of the product (``CANONICAL_REFIT_KILLPOINT_GATE``) until its deadline has
tripped (the warning on its stderr). Released, the stage stops at its next
safe point: the store is rolled back to the previous verified version, the
run ends FAILED (not INTERRUPTED) with ``StageDeadlineExceeded`` naming the
stage, the revision and the seconds, ``status`` shows the store as it was,
and the ``next:`` command works as printed. The whole-run retry treats the
error as transient (a retried attempt starts over from the rolled-back
store). Without a deadline nothing changes.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.lab import ROOT_DIR, Lab, independent_digest, tiny_shape
from storage.store.local_store import LocalStore

BOUND_S = 180  # generous bound on how long a command may take: the test fails instead of hanging
DEADLINE_S = 5  # far longer than any stage of the tiny model takes unheld (~0.1 s), even on a loaded machine
TRIPPED = "exceeded its deadline"


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("deadline"), shape=tiny_shape())
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    return lab


def _env(**extra: str) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith(("CANONICAL_REFIT_", "PREFECT_API_URL"))}
    env.update(PREFECT_API_URL=str(PREFECT_API_URL.value()), PYTHONPATH=str(ROOT_DIR), **extra)
    return env


def _held_run(lab: Lab, cache: Path, tmp_path: Path, *flags: str) -> tuple[int, dict, str]:
    """Refit to r2 with a deadline, held in ``apply deltas`` until the deadline tripped; (exit, JSON, stderr)."""
    gate, errors = tmp_path / "gate", tmp_path / "stderr.log"
    env = _env(CANONICAL_REFIT_KILLPOINT_GATE=f"apply.block:{gate}")
    argv = [sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model,
            "--cache-dir", str(cache), "--seed-checkpoint", str(lab.launch), "--target", "r2",
            "--stage-deadline-seconds", str(DEADLINE_S), *flags, "--json"]
    with open(errors, "w") as err_file:
        proc = subprocess.Popen(argv, cwd=ROOT_DIR, env=env, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                start_new_session=True)
        try:
            bound = time.monotonic() + BOUND_S
            while TRIPPED not in errors.read_text():
                assert proc.poll() is None, f"the command ended before its deadline tripped: {errors.read_text()}"
                assert time.monotonic() < bound, "the deadline never tripped"
                time.sleep(0.1)
            gate.touch()  # the held stage goes on, and meets the stop at its next safe point
            out, _ = proc.communicate(timeout=BOUND_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    lines = [x for x in out.splitlines() if x.startswith("{")]
    assert lines, f"no JSON line on stdout (exit {proc.returncode}):\n{out}\n{errors.read_text()[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), errors.read_text()


def _status(lab: Lab, cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "flows.refit", "status", "--cache-dir", str(cache), "--model",
                          lab.model, "--json"], capture_output=True, text=True, env=_env(), cwd=ROOT_DIR,
                         timeout=BOUND_S)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_a_stage_past_its_deadline_fails_the_run_and_leaves_the_previous_version(world, tmp_path):
    lab = world
    cache = tmp_path / "cache"
    assert lab.refit(cache_dir=cache, target="r1")[0].name == "Ready"

    code, result, err = _held_run(lab, cache, tmp_path, "--retries", "0")

    assert result["status"] == "FAILED" and code not in (0, 130), (code, err[-3000:])
    detail = result["error_detail"]
    assert detail["type"] == "StageDeadlineExceeded", result["error"]
    assert (detail["stage"], detail["revision"], detail["seconds"]) == ("apply deltas", "r2", DEADLINE_S)
    assert f"stage 'apply deltas' of r2 exceeded its deadline of {DEADLINE_S}s" in result["error"]
    statuses = {s["name"]: s["status"] for s in result["stages"]}
    assert statuses["apply deltas"] == "FAILED" and "INTERRUPTED" not in statuses.values(), statuses
    assert result["installed_version"] == "r1"
    # the store: rolled back to the previous verified version, and status says so
    info = _status(lab, cache)
    assert info["active"]["version"] == "r1"
    assert info["state"]["status"] == "READY" and info["state"]["version"] == "r1", info["state"]
    store = LocalStore(cache, lab.model)
    lab.assert_checkpoint(store.root / info["state"]["source"], "r1")

    # the next command, as printed, works (it keeps the run's deadline)
    command = result["next_step"].split("  (", 1)[0]
    assert "--stage-deadline-seconds" in command and "longer --stage-deadline-seconds" in result["next_step"]
    again = subprocess.run(shlex.split(command) + ["--json"], capture_output=True, text=True, env=_env(),
                           cwd=ROOT_DIR, timeout=BOUND_S)
    after = json.loads([x for x in again.stdout.splitlines() if x.startswith("{")][-1])
    assert again.returncode == 0 and after["status"] == "READY" and after["version"] == "r2", again.stderr[-3000:]
    assert after["target_digest"] == independent_digest(lab.expected("r2"))[1]
    lab.assert_checkpoint(Path(after["checkpoint_path"]), "r2")


def test_the_whole_run_is_retried_after_a_deadline_as_after_a_transient_failure(world, tmp_path):
    lab = world
    cache = tmp_path / "cache"
    assert lab.refit(cache_dir=cache, target="r1")[0].name == "Ready"

    code, result, err = _held_run(lab, cache, tmp_path, "--retries", "1", "--retry-delay", "0")

    assert code == 0 and result["status"] == "READY" and result["version"] == "r2", err[-3000:]
    first, second = result["attempts"]
    assert first["status"] == "FAILED" and "stage 'apply deltas' of r2 exceeded its deadline" in first["error"]
    assert second["status"] == "READY"
    lab.assert_checkpoint(Path(result["checkpoint_path"]), "r2")


def test_without_a_deadline_a_run_is_unchanged(world, tmp_path):
    lab = world
    state, result = lab.refit(cache_dir=tmp_path / "cache", target="r2")
    assert lab.refit_params(cache_dir=tmp_path / "cache").stage_deadline_s is None
    assert state.name == "Ready", result.error
    assert len(result.attempts) == 1 and TRIPPED not in " ".join(result.notes)
    assert {row["status"] for row in result.stages} <= {"COMPLETED", "PENDING"}, result.stages
    assert "--stage-deadline-seconds" not in (result.next_step or "")
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")
