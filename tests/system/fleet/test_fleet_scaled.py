"""The fleet on Prefect scaled out as Prefect documents: two API processes, the background services in a
process of their own, PostgreSQL and Redis messaging (``testbed/scaled_server.py``).

The trainer talks to the first API process; node a is attached to it, node b to
the second. A publication posted through the first starts node b's refit (the
event crosses Redis to the services' automations, the run's scheduled event
back to node b's event stream); a cancellation posted through the first stops
node b's run; a node killed mid-refit is closed and catches up. Everything the
test checks is observable: runs and states on the server, each node's store.
"""

from __future__ import annotations

import subprocess
from datetime import datetime, timezone

import pytest

from tests.support.fleet_support import Fleet
from tests.support.s3_support import s3  # noqa: F401  (s3 is a fixture)
from testbed.prefect_server import PREFECT, migrated_postgres, target_of
from testbed.processes import wait_until
from testbed.scaled_server import ScaledPrefectServer

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def scaled_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaled-server")
    database = migrated_postgres()
    server = ScaledPrefectServer(root, database.url, apis=2)
    try:
        yield server.start()
    finally:
        server.stop()
        database.drop()


def _running(fleet: Fleet, name: str, target: str):
    return next((r for r in fleet.runs(name, ("on_publish",)) if target_of(r) == target
                 and r.state_type is not None and r.state_type.value == "RUNNING"), None)


def test_one_publication_through_one_api_process_reaches_agents_on_the_other(scaled_server, s3, tmp_path):
    server = scaled_server
    fleet = Fleet(server, s3.endpoint, tmp_path, f"{s3.prefix('scaled')}/catalog")
    gate_b, gate_a = tmp_path / "go-b", tmp_path / "go-a"
    a = fleet.node("node-a")
    b = fleet.node("node-b", api_url=server.urls[1], CANONICAL_REFIT_KILLPOINT_GATE=f"fetch.file:{gate_b}")
    try:
        for node in (a, b):
            node.start()
        for name in ("node-a", "node-b"):
            fleet.registered(fleet.nodes[name])
            (startup,) = fleet.final_runs(name, "latest", which=("latest",))
            assert startup.state_name == "Skipped", startup.state.message

        # published through API process 1: both nodes refit, node b through API process 2
        assert fleet.publish("initial")["version"] == "r0"
        for name in ("node-a", "node-b"):
            assert fleet.final_runs(name, "r0")[0].state_name == "Ready"

        # node b's first download is held: cancelled through API process 1, it ends Cancelled (Interrupted)
        assert fleet.publish("delta")["version"] == "r1"
        assert fleet.final_runs("node-a", "r1")[0].state_name == "Ready"
        held = wait_until("node b's refit to r1 to be held", lambda: _running(fleet, "node-b", "r1"), 120,
                          diagnostics=fleet.diagnostics)
        done = subprocess.run([PREFECT, "flow-run", "cancel", str(held.id)], env=fleet.env, capture_output=True,
                              text=True, timeout=120)  # the trainer's API process: the first
        assert done.returncode == 0, done.stdout + done.stderr
        wait_until("node b to see the cancellation", lambda: "is being cancelled" in b.log.read_text(), 60,
                   diagnostics=fleet.diagnostics)
        gate_b.touch()
        (cancelled,) = fleet.final_runs("node-b", "r1")
        assert (cancelled.state_type.value, cancelled.state_name) == ("CANCELLED", "Interrupted"), cancelled.state
        assert b.active_version() == "r0"

        # node a is killed in the middle of its refit to r2; restarted, it closes its orphan and catches up
        a.stop()
        a.env["CANONICAL_REFIT_KILLPOINT_GATE"] = f"fetch.file:{gate_a}"
        gated = datetime.now(timezone.utc)
        a.start()
        (startup,) = fleet.final_runs("node-a", "latest", which=("latest",), since=gated)
        assert startup.state_name == "Skipped", startup.state.message  # it runs r1 already
        assert fleet.publish("delta")["version"] == "r2"
        interrupted = wait_until("node a's refit to r2 to be held", lambda: _running(fleet, "node-a", "r2"), 120,
                                 diagnostics=fleet.diagnostics)
        a.kill()
        del a.env["CANONICAL_REFIT_KILLPOINT_GATE"]
        restarted = datetime.now(timezone.utc)
        a.start()
        (caught_up,) = fleet.final_runs("node-a", "latest", which=("latest",), since=restarted)
        assert caught_up.state_name == "Ready" and caught_up.state.message.startswith("r2 ")
        orphan = next(r for r in fleet.runs("node-a", ("on_publish",)) if r.id == interrupted.id)
        assert orphan.state_type.value == "CRASHED", orphan.state
        assert fleet.final_runs("node-b", "r2")[0].state_name == "Ready"
        assert (a.active_version(), b.active_version()) == ("r2", "r2")
        code, waited = fleet.fleet("wait", "--version", "r2", "--timeout", "60")
        assert (code, sorted(waited["reached"])) == (0, ["node-a", "node-b"])
    finally:
        fleet.stop_all()
