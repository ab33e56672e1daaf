"""The agents fan a publication out themselves (``deployments.serve --fan-out agent``): no server automation.

Two node agents against a Prefect server on PostgreSQL. Node a first serves
with the default fan-out (its refit-on-publish deployment owns one
automation), then restarts with ``--fan-out agent``: the automation is gone.
With both agents fanning out, every publication becomes exactly one
refit-on-publish run per node, created by the node itself and run to Ready,
and an event announced again is one more run, skipped as not newer.
"""

from __future__ import annotations

from datetime import datetime, timezone

from tests.support.fleet_support import Fleet, fleet_server  # noqa: F401  (fleet_server is a fixture)
from tests.support.s3_support import s3  # noqa: F401  (a fixture)
from testbed.prefect_server import target_of

AGENT = ("--fan-out", "agent")


def owned_automations(fleet: Fleet, name: str) -> list:
    with fleet.server.client() as client:
        return client.read_resource_related_automations(
            f"prefect.deployment.{fleet.deployment_ids[name]['on_publish']}")


def test_agents_fan_a_publication_out_without_a_server_automation(fleet_server, s3, tmp_path):
    fleet = Fleet(fleet_server, s3.endpoint, tmp_path, f"{s3.prefix('fan-out')}/catalog")
    a = fleet.node("fan-a")
    try:
        a.start()
        fleet.registered(a)
        assert len(owned_automations(fleet, "fan-a")) == 1  # the default: the server's automation
        a.stop()
        a = fleet.nodes["fan-a"] = fleet.node("fan-a", serve_args=AGENT)
        b = fleet.node("fan-b", serve_args=AGENT)
        started = datetime.now(timezone.utc)
        for node in (a, b):
            node.start()
        for name in ("fan-a", "fan-b"):
            fleet.registered(fleet.nodes[name])
            (startup,) = fleet.final_runs(name, "latest", which=("latest",), since=started)
            assert startup.state_name == "Skipped", startup.state.message
            assert owned_automations(fleet, name) == []  # nothing for the server to evaluate per node

        for version, kind in (("r0", "initial"), ("r1", "delta")):
            assert fleet.publish(kind)["version"] == version
            for name in ("fan-a", "fan-b"):
                (run,) = fleet.final_runs(name, version)
                assert run.state_name == "Ready", run.state
        fleet.announce("r1")  # the same publication announced again: one more run each, nothing to do
        for name in ("fan-a", "fan-b"):
            runs = fleet.final_runs(name, "r1", count=2)
            assert sorted(r.state_name for r in runs) == ["Ready", "Skipped"]
            assert [target_of(r) for r in fleet.runs(name, ("on_publish",))] == ["r0", "r1", "r1"]
        assert "created flow run" in a.log.read_text()
        assert (a.active_version(), b.active_version()) == ("r1", "r1")
    finally:
        fleet.stop_all()
