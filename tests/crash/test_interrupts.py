"""Ctrl-C, SIGTERM and a dead API: the CLI as an operator runs it, in its own process group.

Each test starts ``python -m flows.refit --json`` and holds it at a named
point of the product (``CANONICAL_REFIT_KILLPOINT_GATE``) while it is seeding,
fetching or applying, signals the whole process group as a terminal would,
then lets it go on: the run must stop at its next safe point, print its final
JSON line with status INTERRUPTED, exit 130, and leave a store the next run
takes to READY with exact bytes. With no ``PREFECT_API_URL`` the CLI starts
its own Prefect API; with one, it reports to that server. A run whose API
dies after the work is done still reports what it did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.lab import Lab, independent_digest, tiny_shape
from storage.store.local_store import LocalStore

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 120  # generous bound on how long a run may take to end: the test fails instead of hanging


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("interrupts"), shape=tiny_shape())
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    return lab


@pytest.fixture(scope="module")
def private_home(tmp_path_factory):
    """One PREFECT_HOME for the commands that start their own API (its database is migrated once)."""
    return tmp_path_factory.mktemp("prefect-home")


def _env(api: str, private_home: Path, **extra: str) -> dict[str, str]:
    """A command's environment: ``server`` names the session's server in PREFECT_API_URL; ``local`` leaves it
    out, so the command finds (or starts) the local server of PREFECT_HOME; ``private`` asks for a private one."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith(("CANONICAL_REFIT_", "PREFECT_API_URL"))}
    if api == "server":
        env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    elif api == "private":
        env["PREFECT_HOME"] = str(private_home)
        env["CANONICAL_REFIT_API_MODE"] = "private"
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _start(lab: Lab, cache: Path, target: str, env: dict) -> subprocess.Popen:
    argv = [sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model,
            "--cache-dir", str(cache), "--seed-checkpoint", str(lab.launch), "--target", target,
            "--apply-workers", "2", "--json"]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(predicate, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the command ended before {what}: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _reached(trace: Path, point: str) -> bool:
    return trace.exists() and any(json.loads(x)["what"] == point for x in trace.read_text().splitlines())


def _finish(proc: subprocess.Popen) -> tuple[int, dict, str]:
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the command did not exit within {BOUND_S}s:\n{err[-3000:]}")
    lines = [x for x in out.splitlines() if x.startswith("{")]
    assert lines, f"no JSON line on stdout (exit {proc.returncode}):\n{out}\n{err[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), err


@pytest.mark.parametrize("point, start_at, api", [
    ("state.updating", None, "server"),   # seeding the launch snapshot into an empty store
    ("fetch.file", "r1", "server"),       # a bucket of r2 downloaded, the apply waiting for it
    ("apply.block", "r1", "local"),       # patching r1's taken-over checkpoint into r2; the local server
])  # a private API server (CANONICAL_REFIT_API_MODE=private) is immune the same way: the tests below use one
def test_ctrl_c_stops_the_run_at_a_safe_point_and_the_next_run_recovers(world, private_home, tmp_path, api,
                                                                          point, start_at):
    lab = world
    cache = tmp_path / "cache"
    if start_at is not None:
        assert lab.refit(cache_dir=cache, target=start_at)[0].name == "Ready"
    trace, gate = tmp_path / "trace.log", tmp_path / "gate"
    env = _env(api, private_home, CANONICAL_REFIT_KILLPOINT_TRACE=str(trace),
               CANONICAL_REFIT_KILLPOINT_GATE=f"{point}:{gate}")
    proc = _start(lab, cache, "r2", env)
    _wait_for(lambda: _reached(trace, point), point, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    time.sleep(0.2)
    gate.touch()
    code, result, err = _finish(proc)
    assert code == 130, err[-3000:]
    assert result["status"] == "INTERRUPTED" and result["version"] is None
    assert result["installed_version"] == start_at
    statuses = {s["name"]: s["status"] for s in result["stages"]}
    assert "INTERRUPTED" in statuses.values() and "FAILED" not in statuses.values(), statuses
    assert "run the refit again" in result["next_step"]
    store = LocalStore(cache, lab.model)
    state = store.state()
    assert state is None or state.status in ("READY", "UPDATING")  # recoverable either way
    state, after = lab.refit(cache_dir=cache, target="r2")
    assert state.name == "Ready", after.error
    assert after.target_digest == independent_digest(lab.expected("r2"))[1]
    lab.assert_checkpoint(Path(after.checkpoint_path), "r2")


def test_sigterm_is_an_interrupt_too(world, private_home, tmp_path):
    lab = world
    cache = tmp_path / "cache"
    assert lab.refit(cache_dir=cache, target="r1")[0].name == "Ready"
    trace, gate = tmp_path / "trace.log", tmp_path / "gate"
    env = _env("server", private_home, CANONICAL_REFIT_KILLPOINT_TRACE=str(trace),
               CANONICAL_REFIT_KILLPOINT_GATE=f"apply.block:{gate}")
    proc = _start(lab, cache, "r2", env)
    _wait_for(lambda: _reached(trace, "apply.block"), "apply.block", proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    gate.touch()
    code, result, err = _finish(proc)
    assert (code, result["status"], result["installed_version"]) == (130, "INTERRUPTED", "r1"), err[-2000:]
    assert LocalStore(cache, lab.model).active().version == "r1"


def test_a_run_that_finished_reports_ready_even_if_its_api_died(world, private_home, tmp_path):
    lab = world
    cache = tmp_path / "cache"
    trace, gate = tmp_path / "trace.log", tmp_path / "gate"
    env = _env("private", private_home, CANONICAL_REFIT_KILLPOINT_TRACE=str(trace),
               CANONICAL_REFIT_KILLPOINT_GATE=f"activate.written:{gate}")
    proc = _start(lab, cache, "r1", env)
    _wait_for(lambda: _reached(trace, "activate.written"), "activation", proc)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert children, "the command's private Prefect API server was not found"
    for pid in children:  # the API dies after the refit activated r1
        os.kill(int(pid), signal.SIGKILL)
    gate.touch()
    code, result, err = _finish(proc)
    assert code == 0 and result["status"] == "READY" and result["version"] == "r1", err[-3000:]
    assert LocalStore(cache, lab.model).active().version == "r1"


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # dead, not yet reaped
    except OSError:
        return True


def test_a_private_server_dies_with_its_command_even_when_it_is_killed(world, private_home, tmp_path):
    lab = world
    trace, gate = tmp_path / "trace.log", tmp_path / "gate"
    env = _env("private", private_home, CANONICAL_REFIT_KILLPOINT_TRACE=str(trace),
               CANONICAL_REFIT_KILLPOINT_GATE=f"lock.exclusive:{gate}")
    proc = _start(lab, tmp_path / "cache", "r1", env)
    _wait_for(lambda: _reached(trace, "lock.exclusive"), "the store lock", proc)
    servers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                              text=True).stdout.split()]
    assert servers, "the command's private Prefect API server was not found"
    os.kill(proc.pid, signal.SIGKILL)  # no handler, no atexit: only the kernel can tell the server
    proc.communicate()
    deadline = time.monotonic() + BOUND_S
    while not all(_gone(pid) for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in servers), f"the private server outlived its killed command: {servers}"


def test_the_local_server_outlives_a_killed_command_serves_the_next_and_stops_once_unused(world, private_home,
                                                                                         tmp_path):
    from flows.local_server import read_record, state_dir

    lab = world
    cache = tmp_path / "cache"
    trace, gate = tmp_path / "trace.log", tmp_path / "gate"
    env = _env("local", private_home, PREFECT_HOME=str(private_home), CANONICAL_REFIT_API_IDLE_S="6",
               CANONICAL_REFIT_KILLPOINT_TRACE=str(trace), CANONICAL_REFIT_KILLPOINT_GATE=f"apply.block:{gate}")
    status = [sys.executable, "-m", "flows.local_server", "status"]
    proc = _start(lab, cache, "r1", env)
    _wait_for(lambda: _reached(trace, "apply.block"), "apply.block", proc)
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    assert "started a local Prefect server" in err and "python -m flows.local_server stop" in err
    record = read_record(state_dir(private_home))
    assert record is not None and record.alive()  # kept for the next command, as the line said
    shown = subprocess.run(status, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BOUND_S)
    assert shown.returncode == 0 and record.url in shown.stdout

    gate.touch()
    code, result, err = _finish(_start(lab, cache, "r1", env))  # reuses it; the store recovers by itself
    assert code == 0 and result["status"] == "READY", err[-3000:]
    assert "using the local Prefect server" in err and record.url in err
    deadline = time.monotonic() + BOUND_S  # unused now (the killed command's lease is ignored): it stops
    while record.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not record.alive(), "the local server did not stop once unused"
    shown = subprocess.run(status, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BOUND_S)
    assert shown.returncode == 1 and "no local Prefect server" in shown.stdout


class _CtrlCDuringInstall:
    """An engine stand-in whose install is interrupted by the user's Ctrl-C (SIGINT to this process)."""

    name, engine_urls = "none", ()

    def install(self, request):
        from tasks.installers.base import InstallOutcome

        os.kill(os.getpid(), signal.SIGINT)  # the handler only sets the run's stop token
        return InstallOutcome(f"{request.version} loaded while the user pressed Ctrl-C")

    def is_current(self, identity) -> bool:
        return False

    def observe(self):
        return ()


def test_a_ctrl_c_stops_only_the_run_in_progress(world, tmp_path):
    """A trainer or a notebook calling ``api.refit`` again after one interrupt gets a normal run."""
    from flows import api

    lab = world
    common = dict(catalog=lab.catalog, model=lab.model, cache_dir=tmp_path / "cache",
                  seed_checkpoint=lab.launch, check=False)
    first = api.refit(target="r1", installer=_CtrlCDuringInstall(), **common)
    assert first.status in ("READY", "INTERRUPTED")  # the engine had the weights: activation is not skipped
    second = api.refit(target="r2", **common)
    assert second.status == "READY", second.error
    assert second.target_digest == independent_digest(lab.expected("r2"))[1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers were put back
