"""One path from a publication to a node's refit: the agent's level-based reconcile loop, no server automation.

Node agents (``python -m deployments.serve``) against a Prefect server on
PostgreSQL. A published event only records the desired version and wakes
the agent's loop; the loop compares the desired version (the newest heard,
and the catalog's head) with the installed one and creates at most one
refit-on-publish run, for the newest. Shown here:

* an upgraded node: the automation an older version of ``serve`` attached
  to its refit-on-publish deployment is removed when the agent registers it
  again (``--fan-out automation`` still parses, warns and changes nothing);
* an event while the agent is idle starts a run at once (the head check is
  a minute away);
* a burst of publications heard while the node is busy makes one run per
  node, to the newest;
* an event delivered again (and a late one for an older version) makes no
  run;
* with ``--no-event-wakeups`` the head check alone carries publications (a
  third node, beside the two, on the same publications).
"""

from __future__ import annotations

import contextlib
from datetime import datetime, timezone

from storage.store.local_store import LocalStore
from tests.support.fleet_support import MODEL, Fleet, fleet_server  # noqa: F401  (fleet_server is a fixture)
from tests.support.s3_support import s3  # noqa: F401  (a fixture)
from testbed.prefect_server import target_of
from testbed.processes import wait_until

QUIET_HEAD = ("--head-poll-seconds", "60")  # the slowest head check: what moves the node within it is an event


def owned_automations(fleet: Fleet, deployment_id) -> list:
    with fleet.server.client() as client:
        return client.read_resource_related_automations(f"prefect.deployment.{deployment_id}")


def older_deployment(fleet: Fleet, node: str):
    """What an older ``deployments.serve`` registered for ``node``: its refit-on-publish deployment with the
    server automation (the event trigger) attached; the deployment's id."""
    from deployments.serve import on_publish_trigger, parse_args

    params, _, _ = parse_args(["--catalog", fleet.catalog, "--model", MODEL, "--node", node])
    with fleet.server.client() as client:
        deployment_id = client.create_deployment(flow_id=client.create_flow_from_name("refit"),
                                                 name=f"refit-on-publish-{node}")
        trigger = on_publish_trigger(params, f"-{node}")
        trigger.set_deployment_id(deployment_id)
        client.create_automation(trigger.as_automation())
    return deployment_id


def created_since(fleet: Fleet, name: str, since: datetime) -> list:
    return [r for r in fleet.runs(name, ("on_publish",)) if r.created > since]


def log_order(node, *lines: str) -> list[int]:
    text = node.log.read_text()
    return [text.find(line) for line in lines]


def _carried_by_the_head_check(fleet: Fleet, node, version: str, why: str) -> None:
    """With ``--no-event-wakeups`` the head check alone carries the publication: one run, Ready, for the reason
    the agent logs."""
    (run,) = fleet.final_runs(node.name, version)
    assert run.state_name == "Ready", run.state.message
    assert why in node.log.read_text()
    assert node.active_version() == version and node.alive


def test_events_wake_the_loop_which_runs_one_refit_to_the_newest(fleet_server, s3, tmp_path):
    fleet = Fleet(fleet_server, s3.endpoint, tmp_path, f"{s3.prefix('fan-out')}/catalog")
    old = older_deployment(fleet, "fan-a")
    assert len(owned_automations(fleet, old)) == 1
    a = fleet.node("fan-a", serve_args=("--fan-out", "automation", *QUIET_HEAD))
    b = fleet.node("fan-b", serve_args=QUIET_HEAD)
    quiet = fleet.node("quiet", serve_args=("--no-event-wakeups", "--head-poll-seconds", "1"))  # no event stream
    try:
        started = datetime.now(timezone.utc)
        for node in (a, b, quiet):
            node.start()
        for node in (a, b, quiet):
            fleet.registered(node)
            (startup,) = fleet.final_runs(node.name, "latest", which=("latest",), since=started)
            assert startup.state_name == "Skipped", startup.state.message
        # the upgraded node re-registered its deployment: the older version's automation is gone (same deployment)
        assert fleet.deployment_ids["fan-a"]["on_publish"] == old
        wait_until("the older automation to be removed", lambda: owned_automations(fleet, old) == [], 60,
                   diagnostics=fleet.diagnostics)
        assert "--fan-out automation is deprecated" in a.log.read_text()

        # -- an event while the agents are idle: the loop creates the run at once, the head check is 60 s away --
        assert fleet.publish("initial")["version"] == "r0"
        for node in (a, b):
            (run,) = fleet.final_runs(node.name, "r0")
            assert run.state_name == "Ready", run.state.message
            assert run.name == f"refit {node.name}: {MODEL} none -> r0" and f"node:{node.name}" in run.tags
            heard, created = log_order(node, "heard that r0 was published",
                                       f"created flow run refit {node.name} none -> r0")
            assert 0 <= heard < created, node.log.read_text()[-3000:]
        _carried_by_the_head_check(fleet, quiet, "r0", "the node has no installed version; the catalog's head is r0")

        # -- a burst heard while each node is busy (its refit to r1 waits for the store lock the test holds):
        # the loop then runs one refit, to the newest, r3; r2 never gets a run ---------------------------------
        since = datetime.now(timezone.utc)
        with contextlib.ExitStack() as held:
            for node in (a, b):
                held.enter_context(LocalStore(node.cache, MODEL).exclusive(120, "the test"))
            assert fleet.publish("delta")["version"] == "r1"
            for node in (a, b):
                wait_until(f"{node.name}'s run to r1", lambda: [r for r in created_since(fleet, node.name, since)
                                                                if target_of(r) == "r1"], 120,
                           diagnostics=fleet.diagnostics)
            _carried_by_the_head_check(fleet, quiet, "r1", "the catalog's head is r1, the node runs r0")
            assert [fleet.publish("delta")["version"] for _ in range(2)] == ["r2", "r3"]
            for node in (a, b):
                wait_until(f"{node.name} to hear r3", lambda: "heard that r3 was published" in node.log.read_text(),
                           120, diagnostics=fleet.diagnostics)
        for node in (a, b):
            (newest,) = fleet.final_runs(node.name, "r3", since=since)
            assert newest.state_name == "Ready", newest.state.message
            runs = created_since(fleet, node.name, since)
            assert [(target_of(r), r.state_name) for r in runs] == [("r1", "Ready"), ("r3", "Ready")]
            assert node.active_version() == "r3"

        # -- r3 announced again and the older r1 late: no run; the next publication is the next run ------------
        since = datetime.now(timezone.utc)
        fleet.announce("r3", "r1")
        assert fleet.publish("delta")["version"] == "r4"
        for node in (a, b):
            (run,) = fleet.final_runs(node.name, "r4", since=since)
            assert run.state_name == "Ready", run.state.message
            assert [target_of(r) for r in created_since(fleet, node.name, since)] == ["r4"]
        assert quiet.alive and "heard that" not in quiet.log.read_text()  # no event stream: its head check found all
        wait_until("quiet to run r4", lambda: quiet.active_version() == "r4", 120, diagnostics=fleet.diagnostics)
    finally:
        fleet.stop_all()
