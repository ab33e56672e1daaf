"""The node agent tells the truth, busy or not, and stops in any weather.

* A heartbeat taken while a run is in progress asks the engines like an
  idle one: an engine restarted on its launch weights after the run wrote
  its record is never left claimed READY at the version it no longer runs
  (the record says DRIFTED and what the engine reports; ``flows.fleet wait``
  does not count the node).
* The agent's level check (``flows.node_report.HeadWatch``, what the agent
  asks every ``--head-poll-seconds``): a head newer than what the node runs
  is due (a publication whose event was lost), a version the node refused
  for good is not, and one it failed on a transient error is retried.
* ``python -m deployments.serve`` told to stop (SIGTERM) while its Prefect
  API does not answer (or is gone) exits, well before the test's bounded
  wait returns.
* On a Prefect server: a publication whose event is lost reaches the node
  by the agent's head check, and two publications made while the agent
  was down make no run until it starts again, then one refit, to the newest.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.support.fleet_support import fleet_server  # noqa: F401  (a fixture)
from flows import node_report
from tests.support.fleet_cli import fleet, record_of
from tests.support.s3_support import s3  # noqa: F401  (a fixture)
from tests.support.sglang_flows import disk, engine_lab, holds_exactly, http_json, published, sglang  # noqa: F401  (fixtures)
from tests.support.sglang_mock import MockSGLang
from tests.support.sglang_support import fake_sglang  # noqa: F401  (fixture)
from storage.catalog.nodes import write_node_record, scan_node_records
from storage.objects.store import ObjectStore
from tasks.installers import make_installer

ROOT = Path(__file__).resolve().parents[3]


# -- a busy agent is not blind ---------------------------------------------------------------------------------


def test_a_busy_heartbeat_asks_the_engine_and_never_leaves_the_node_ready_at_a_version_it_no_longer_runs(
        engine_lab, capsys):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape, custom_weight_loader=[]) as engine:
        state, result = lab.refit(target="r2", installer=disk(engine), node="gpu1")
        assert state.name == "Ready", result.error
        params = lab.refit_params(installer=disk(engine), node="gpu1")
        installer = make_installer(params.installer)
        # a run in progress (its record written, its bookkeeping not done): the busy beat confirms the engine
        beat = node_report.refresh_node(params, installer, busy=True)
        assert (beat.condition(), beat.version, beat.engines) == ("READY", "r2", {engine.url: "r2"})

        engine.restart()  # meanwhile the engine restarts on its launch weights
        assert holds_exactly(engine, lab, "r0") and http_json(engine.url, "/model_info")["weight_version"] == "default"
        beat = node_report.refresh_node(params, installer, busy=True)
        assert beat.condition() == "DRIFTED"
        record = record_of(lab, "gpu1")
        assert (record["version"], record["store_version"], record["engines"]) == (None, "r2", {engine.url: "default"})
        code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--timeout", "0.5", "--poll", "0.1")
        assert (code, waited["drifted"], waited["reached"]) == (1, ["gpu1"], [])

        # a busy beat never declares the node healed (the run's own record does): still DRIFTED while busy
        state, result = lab.refit(target="latest", only_if_newer=True, installer=disk(engine), node="gpu1")
        assert state.name == "Ready", result.error
        assert record_of(lab, "gpu1")["status"] == "READY"
        beat = node_report.refresh_node(params, installer, busy=True)
        assert (beat.condition(), beat.version) == ("READY", "r2")


# -- the level check against the catalog's head ----------------------------------------------------------------


def test_the_head_check_is_due_while_the_node_is_behind_and_quiet_once_it_runs_the_head(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape, custom_weight_loader=[]) as engine:
        state, result = lab.refit(target="r1", installer=disk(engine), node="gpu1")
        assert state.name == "Ready", result.error
        watch = node_report.HeadWatch(lab.refit_params(installer=disk(engine), node="gpu1"))
        due = watch.due()  # r2 was published but this node never heard of it
        assert due is not None and due[0] == "r2" and "the node runs r1" in due[1]
        assert watch.sequence_of("r1") < watch.sequence_of("r2") and watch.head()[0] == "r2"

        state, result = lab.refit(target="latest", only_if_newer=True, installer=disk(engine), node="gpu1")
        assert state.name == "Ready", result.error
        assert watch.due() is None


def test_a_transient_failure_is_retried_at_the_next_check_a_permanent_one_waits_for_a_new_publication(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape, custom_weight_loader=[]) as engine:
        state, result = lab.refit(target="r1", installer=disk(engine), node="gpu1")
        assert state.name == "Ready", result.error
        params = lab.refit_params(installer=disk(engine), node="gpu1")
        watch = node_report.HeadWatch(params)
        objects = ObjectStore.shared(params.storage)
        written = scan_node_records(objects, lab.catalog, lab.model, only="gpu1").records[0]

        # the last refit to r2 failed for good (a corrupt revision): the check does not try it again
        write_node_record(objects, lab.catalog, replace(written, status="FAILED", target_version="r2",
                                                        error="checksum mismatch", transient=False))
        assert watch.due() is None
        # it failed on a transient error (storage down): the next check retries it
        write_node_record(objects, lab.catalog, replace(written, status="FAILED", target_version="r2",
                                                        error="storage unreachable", transient=True))
        due = watch.due()
        assert due is not None and due[0] == "r2" and "transient" in due[1]


# -- clean shutdown in any weather -----------------------------------------------------------------------------


class _SilentAPI:
    """A Prefect API that accepts connections and never answers (a server hung, or gone behind a proxy)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.held: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/api"

    def close(self):
        self.closed = True
        for conn in self.held:
            conn.close()
        self.sock.close()


def _agent(tmp_path: Path, api_url: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "agent.log"
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "deployments.serve", "--catalog", f"file://{tmp_path}/catalog", "--model", "lab/m",
           "--node", "gpu1", "--cache-dir", str(tmp_path / "cache"), "--installer", "none"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def _until_serving(proc: subprocess.Popen, log: Path, inside_api_call) -> None:
    for _ in range(1200):  # the agent logs once its deployments are built and it starts talking to the API
        if "serving" in log.read_text() or proc.poll() is not None:
            break
        time.sleep(0.1)
    assert proc.poll() is None, log.read_text()
    assert "serving" in log.read_text(), log.read_text()
    if inside_api_call is None:
        time.sleep(1.0)  # well inside its first attempts to reach the API
        return
    for _ in range(100):  # until inside its first API call (which never gets an answer)
        if inside_api_call():
            break
        time.sleep(0.1)


def _refused_port() -> int:
    with socket.socket() as probe:  # a port nothing listens on: every request is refused at once
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("api", ["does not answer", "is gone"])
def test_sigterm_stops_the_agent_while_the_api_does_not_answer_or_is_gone(tmp_path, api):
    silent = _SilentAPI() if api == "does not answer" else None
    proc, log = _agent(tmp_path, silent.url if silent else f"http://127.0.0.1:{_refused_port()}/api")
    try:
        _until_serving(proc, log, (lambda: silent.held) if silent else None)  # the silent API holds its connection
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not exit after SIGTERM:\n{log.read_text()[-3000:]}") from None
        assert code == 0, log.read_text()[-3000:]
        assert "SIGTERM received" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        if silent:
            silent.close()


# -- on a Prefect server: a lost publication is caught up, a burst is coalesced ----------------------------------


@pytest.mark.server
def test_a_lost_publication_reaches_the_node_by_its_head_check_and_a_burst_runs_one_refit(fleet_server, s3,
                                                                                            tmp_path):
    from tests.support.fleet_support import MODEL, Fleet

    fleet = Fleet(fleet_server, s3.endpoint, tmp_path, f"{s3.prefix('agent-truth')}/catalog")
    node = fleet.node("truth", serve_args=("--head-poll-seconds", "2"))
    try:
        node.start()
        fleet.registered(node)
        assert fleet.publish("initial")["version"] == "r0"
        (run,) = fleet.final_runs("truth", "r0")
        assert run.state_name == "Ready", run.state.message

        # a publication whose event never reached the server (--no-event: the event is lost): the interval is an
        # hour, and the agent's head check finds the catalog's head newer than the installed version: one run
        since = datetime.now(timezone.utc)
        assert fleet.publish("delta", "--no-event")["version"] == "r1"
        (caught_up,) = fleet.final_runs("truth", "r1", since=since)
        assert caught_up.state_name == "Ready" and caught_up.state.message.startswith("r1 "), caught_up.state
        assert node.active_version() == "r1"
        assert [r for r in fleet.runs("truth", ("latest",)) if r.created > since and r.start_time] == []
        # the run names the node, and carries its tag (the UI's filter for one node's runs)
        assert caught_up.name == f"refit truth: {MODEL} r0 -> r1" and "node:truth" in caught_up.tags
        assert "the catalog's head is r1, the node runs r0" in node.log.read_text()
        assert "heard that r1 was published" not in node.log.read_text()

        # two publications made while the agent is down: no run is created for either (no server automation);
        # started again, the node runs one refit, to the newest (its start-up refit to latest)
        node.stop()
        since = datetime.now(timezone.utc)
        assert [fleet.publish("delta")["version"] for _ in range(2)] == ["r2", "r3"]
        assert [r for r in fleet.runs("truth") if r.created > since and r.start_time] == []
        node.start()
        (startup,) = fleet.final_runs("truth", "latest", which=("latest",), since=since)
        assert startup.state_name == "Ready" and startup.state.message.startswith("r3 "), startup.state
        assert node.active_version() == "r3"
        assert [r.name for r in fleet.runs("truth", ("on_publish",)) if r.created > since] == []
    finally:
        fleet.stop_all()
