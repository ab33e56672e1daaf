"""A fleet of three nodes on one Prefect server (PostgreSQL), with S3 (moto) for catalog, payloads and node records.

Each node is ``python -m deployments.serve --node nodeK`` in a process of
its own, with its own store; node2 reaches S3 through a fault proxy (so the
test can hold one of its downloads), node3 installs into a mock SGLang engine
(so the test can break it). The trainer publishes with ``python -m
flows.publish``, whose event wakes each node's agent (its loop creates one
refit run when the version is newer than the installed one; the agent's
head check catches what no event announced), and asks ``python -m flows.fleet`` what the fleet runs. Everything
the test checks is observable: flow runs and their states on the server,
each node's own ``active.json``, the fleet view and ``wait``'s exit codes.
"""

from __future__ import annotations

from datetime import datetime, timezone
from itertools import pairwise

import pytest

from tests.support.fleet_support import (  # noqa: F401 - fleet_server is a fixture
    HELD_BUCKET, MODEL, SHAPE, Fleet, Inbox, assert_zombie_automation, create_poisoned_alert, fleet_server,
    held_mid_refit, spans,
)
from tests.support.s3_support import s3  # noqa: F401  (s3 is a fixture)
from tests.support.sglang_mock import MockSGLang
from testbed.prefect_server import is_final, target_of
from testbed.processes import wait_until
from testbed.s3proxy import Faults

pytestmark = pytest.mark.server
NODES = ("node1", "node2", "node3")


def _stores(fleet: Fleet) -> dict[str, tuple]:
    """(version, digest) each node's own store says is installed."""
    out = {}
    for name, node in fleet.nodes.items():
        active = node.store().active() if node.store().exists else None
        out[name] = (active.version, active.digest) if active else (None, None)
    return out


def _view(fleet: Fleet) -> dict[str, dict]:
    code, view = fleet.fleet("status")
    assert code == 0 and view["problems"] == []
    return {record["node"]: record for record in view["nodes"]}


def test_one_publication_reaches_every_node(fleet_server, s3, tmp_path):
    fleet = Fleet(fleet_server, s3.endpoint, tmp_path, f"{s3.prefix('fleet')}/catalog")
    with s3.proxy(Faults(), lifetime_s=900) as node2_s3, MockSGLang(fleet.trainer.launch, SHAPE) as engine, \
            Inbox() as alerts:
        fleet.node("node1")
        fleet.node("node2", endpoint=node2_s3.url)
        node3 = fleet.node("node3", installer=("--installer", "sglang-disk", "--engine-url", engine.url))
        try:
            for node in fleet.nodes.values():
                node.start()
            for name in NODES:
                fleet.registered(fleet.nodes[name])
                # each agent refits to latest once at start-up: the catalog is empty, so it is Skipped
                (startup,) = fleet.final_runs(name, "latest", which=("latest",))
                assert startup.state_name == "Skipped", startup.state.message

            # -- one publication: one event, one refit run per node, every node Ready --------------------
            for kind, version in (("initial", "r0"), ("delta", "r1")):
                assert fleet.publish(kind)["version"] == version
                for name in NODES:
                    (run,) = fleet.final_runs(name, version)  # exactly one run per node for each publication
                    assert run.state_name == "Ready", f"{name} {version}: {run.state.message}"
            stores = _stores(fleet)
            assert {version for version, _ in stores.values()} == {"r1"}
            view = _view(fleet)
            assert set(view) == set(NODES)
            for name in NODES:  # the fleet view says what each node's own store says
                assert (view[name]["version"], view[name]["digest"]) == stores[name]
                assert view[name]["status"] == "READY" and view[name]["target"] == "r1"
            code, waited = fleet.fleet("wait", "--version", "r1", "--nodes", "3", "--timeout", "60")
            assert (code, waited["outcome"], sorted(waited["reached"])) == (0, "reached", list(NODES))

            # -- a repeated event and a late one for an older version make no run (checked below, once the
            # next publication, heard after them, has run) ------------------------------------------------
            announced = datetime.now(timezone.utc)
            fleet.announce("r1", "r0")
            assert _stores(fleet) == stores

            # -- a node that was down catches up to latest, not only to the event it missed -------------
            assert node3.stop() is not None and not node3.alive
            assert fleet.publish("delta")["version"] == "r2"  # announced while node3 is down
            for name in ("node1", "node2"):
                (run,) = fleet.final_runs(name, "r2")
                assert run.state_name == "Ready"
                assert not [r for r in fleet.runs(name, ("on_publish",)) if r.created > announced
                            and target_of(r) in ("r0", "r1")]  # the events announced again made no run
            assert fleet.publish("delta", "--no-event")["version"] == "r3"  # never announced
            code, waited = fleet.fleet("wait", "--version", "r3", "--all-seen-within", "600", "--timeout", "2")
            assert (code, waited["outcome"]) == (1, "timeout")
            assert sorted(waited["laggards"]) == list(NODES)  # nobody runs r3 yet, and wait names them all
            restarted = datetime.now(timezone.utc)
            node3.start()
            # no run was created for the event node3 missed: its start-up refit to latest catches up to r3
            (caught_up,) = fleet.final_runs("node3", "latest", which=("latest",), since=restarted)
            assert caught_up.state_name == "Ready" and caught_up.state.message.startswith("r3 ")
            assert node3.active_version() == "r3"
            assert engine.weight_version == "r3"
            # node3 runs r3 (above); the publication nobody announced reaches the others through their agents' head
            # checks (one poll: 30 s)
            code, waited = fleet.fleet("wait", "--version", "r3", "--all-seen-within", "600", "--timeout", "150")
            assert (code, sorted(waited["reached"])) == (0, list(NODES))

            # -- kill -9 node2's agent in the middle of a refit ------------------------------------------
            node2 = fleet.nodes["node2"]
            node2_s3.faults.get_latency_s, node2_s3.faults.latency_suffix = 600.0, HELD_BUCKET
            assert fleet.publish("delta", "--bucket-mib", "1")["version"] == "r4"
            interrupted = held_mid_refit(fleet, node2, node2_s3, "r4")
            node2.kill()
            node2_s3.faults.get_latency_s = 0.0
            for name in ("node1", "node3"):  # the others are not affected
                (run,) = fleet.final_runs(name, "r4")
                assert run.state_name == "Ready", run.state.message
            assert node2.active_version() == "r3" and node2.store().state().status == "UPDATING"  # r3: its head check
            # whatever host the node comes back on, or if it never does, the server closes the orphan: its flow-run
            # heartbeats stopped, and every agent made sure the server has Prefect's zombie automation for our runs
            # (the server doing so takes a window of 45 s after the last 30 s heartbeat: the long harness,
            # test_fleet_zombie.py, waits for it)
            assert_zombie_automation(fleet)
            # node2 comes back on the same host: its agent closes its predecessor's run at once and catches up
            restarted = datetime.now(timezone.utc)
            node2.start()
            (caught_up,) = fleet.final_runs("node2", "latest", which=("latest",), since=restarted)
            assert caught_up.state_name == "Ready" and caught_up.state.message.startswith("r4 ")
            orphan = next(r for r in fleet.runs("node2", ("on_publish",)) if r.id == interrupted.id)
            assert orphan.state_type.value == "CRASHED" and "is gone" in orphan.state.message, orphan.state
            assert node2.active_version() == "r4" and node2.store().state().status == "READY"
            stores = _stores(fleet)
            assert {version for version, _ in stores.values()} == {"r4"}
            view = _view(fleet)
            assert {name: (view[name]["version"], view[name]["digest"]) for name in NODES} == stores

            # -- node3's engine restarts on its launch weights: the agent's heartbeat sees the drift (the node's
            # record and event say DRIFTED) and heals the node by itself: a re-install of the verified r4 --------
            engine_restarted = datetime.now(timezone.utc)
            engine.restart()
            healed = wait_until("node3's agent to heal the drift by itself", lambda: [
                r for r in fleet.runs("node3", ("latest",)) if r.created > engine_restarted and is_final(r)], 60,
                every_s=0.5, diagnostics=fleet.diagnostics)
            assert healed[-1].state_name == "Ready" and healed[-1].state.message.startswith("r4 "), healed[-1].state
            assert engine.weight_version == "r4" and node3.active_version() == "r4"
            assert any("refitting to heal" in line for line in node3.diagnostics().splitlines())
            drift = wait_until("the server to store the drifted event (events are written in batches)", lambda: fleet.events(
            "canonical-refit.node.drifted", since=engine_restarted) or None, 30, every_s=0.5,
            diagnostics=fleet.diagnostics)
            assert [e.resource.name for e in drift] == ["node3"]
            # the beat that saw it found the engine restarting (no answer) or back on its launch weights
            assert drift[0].payload["engines"][engine.url] in (None, "default"), drift[0].payload
            assert _view(fleet)["node3"]["engines"] == {engine.url: "r4"}
            code, waited = fleet.fleet("wait", "--version", "r4", "--timeout", "60")
            assert (code, sorted(waited["reached"])) == (0, list(NODES))

            # -- a node whose engine breaks is Poisoned: the view, wait and an alert say so ---------------
            create_poisoned_alert(fleet_server, MODEL, alerts.url)  # the automation of docs/fleet.md
            engine.faults.fail_load_after = 1  # the engine fails part-way through loading the weights
            assert fleet.publish("delta")["version"] == "r5"
            for name, expected in (("node1", "Ready"), ("node2", "Ready"), ("node3", "Poisoned")):
                (run,) = fleet.final_runs(name, "r5")
                assert run.state_name == expected, f"{name}: {run.state.message}"
            view = _view(fleet)
            assert [view[name]["status"] for name in NODES] == ["READY", "READY", "POISONED"]
            assert view["node3"]["version"] == "r4" and "partially written" in view["node3"]["error"]
            code, waited = fleet.fleet("wait", "--version", "r5", "--nodes", "2", "--timeout", "300")
            assert (code, waited["outcome"], waited["poisoned"]) == (3, "poisoned", ["node3"])
            (alert,) = wait_until("the poisoned alert", lambda: alerts.messages, 60, diagnostics=fleet.diagnostics)
            assert alert["subject"] == "canonical-refit: node node3 is poisoned"
            assert "refitting to r5; it still runs r4" in alert["body"], alert
            now = _stores(fleet)
            assert [now[name][0] for name in NODES] == ["r5", "r5", "r4"] and now["node3"] == stores["node3"]

            # -- through all of it: one run per node for each version its loop found newer (an event, or the head
            # check for the unannounced r3; node3 caught up to r3 by its start-up refit), never one for an event
            # announced again, and never two refits of a node at once -----------------------------------------
            for name in NODES:
                targets = [target_of(r) for r in fleet.runs(name, ("on_publish",))]
                wanted = ["r0", "r1", "r4", "r5"] if name == "node3" else ["r0", "r1", "r2", "r3", "r4", "r5"]
                assert targets == wanted, f"{name}: {targets}"
                started = wait_until(f"{name}'s runs to end", lambda: (lambda runs: all(
                    is_final(r) for r in runs) and runs)([r for r in fleet.runs(name) if r.start_time]), 60,
                    diagnostics=fleet.diagnostics)
                assert len(started) >= 7
                for (_, end, first), (start, _, second) in pairwise(spans(started)):
                    assert end <= start, f"{name}: {first} and {second} overlapped"
        finally:
            fleet.stop_all()
