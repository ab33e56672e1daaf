"""The fleet table artifact: node -> version -> condition -> engines, and each node's last sign of life.

The rows come from the nodes' status records (``flows.fleet_table.fleet_rows``);
one node agent at a time, the keeper (the smallest live name, found by one
listing), rewrites the ``fleet-<model>`` table artifact when a row changed
state, at its beats and after each refit (``FleetTable``); the others only list. Read back through the Prefect client from the session's
Prefect API, as the UI reads it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace

from flows import node_report
from flows.fleet_table import FleetTable, TableHeartbeat, fleet_rows, fleet_table_key
from storage.catalog.nodes import NodeRecord, nodes_url, write_node_record
from storage.objects.store import ObjectStore
from tasks.installers.base import EngineReport, NoEngineInstaller

ENGINE = "http://127.0.0.1:30000"


class Engine(NoEngineInstaller):
    """An engine that runs what it was last given, and says so when asked (the record asks ``observe``)."""

    engine_urls = (ENGINE,)

    def __init__(self):
        self.version: str | None = "default"  # its launch weights

    def install(self, request):
        self.version = request.version
        return super().install(request)

    def observe(self):
        return (EngineReport(ENGINE, self.version),)


def table_versions(model: str) -> list[list[dict]]:
    """Every version of the model's fleet table the API holds, oldest first, as rows."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[fleet_table_key(
            model)])), sort=ArtifactSort.CREATED_DESC)
    assert all(a.type == "table" for a in found)
    return [json.loads(a.data) if isinstance(a.data, str) else a.data for a in reversed(found)]


def record(node: str, **kw) -> NodeRecord:
    now = int(time.time() * 1000)
    base = dict(node=node, model="me/m", version="r2", digest="d", status="READY", store_version="r2",
                engines={ENGINE: "r2"}, updated_at_unix_ms=now, alive_at_unix_ms=now, heartbeat_s=2.0)
    base.update(kw)
    return NodeRecord(**base)


def test_the_rows_name_each_node_its_version_condition_engines_and_age():
    old = int((time.time() - 100) * 1000)
    rows = fleet_rows([
        record("gpu3", version=None, status="DRIFTED", engines={ENGINE: "default"}),
        record("gpu1"),
        record("gpu2", alive_at_unix_ms=old, updated_at_unix_ms=old),  # its agent died: no beat for 100 s
        record("gpu4", version="r1", store_version="r1", status="FAILED", engines={ENGINE: "r1"},
               error="checksum mismatch (revision 'r2', file 'bucket-0.safetensors', tensor 'w')"),
        record("gpu5", status="POISONED", version=None),
    ], unreadable={"gpu0": "object not found"})
    assert [(r["node"], r["version"], r["condition"], r["engines"]) for r in rows] == [
        ("gpu0", "-", "UNREADABLE", "-"),
        ("gpu1", "r2", "READY", f"{ENGINE}: r2"),
        ("gpu2", "r2", "STALE", f"{ENGINE}: r2"),
        ("gpu3", "-", "DRIFTED", f"{ENGINE}: default"),
        ("gpu4", "r1", "FAILED", f"{ENGINE}: r1"),
        ("gpu5", "-", "POISONED", f"{ENGINE}: r2"),
    ]
    assert rows[2]["heartbeat_age_s"] >= 100 and rows[1]["heartbeat_age_s"] < 100
    assert "revision 'r2'" in rows[4]["error"] and rows[4]["last_run"] == "FAILED"
    assert fleet_table_key("Org/Name_1") == "fleet-org-name-1"


def test_the_table_is_written_from_the_records_and_rewritten_only_when_a_node_changes_state(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    engine, other = Engine(), Engine()
    for node, its in (("gpu1", engine), ("gpu2", other)):  # each node's refit writes its record beside the catalog
        assert lab.run(installer=its, node=node, cache_dir=lab.root / node).status == "READY"
    params = lab.refit_params(node="gpu1", cache_dir=lab.root / "gpu1")
    table = FleetTable(lab.catalog, lab.model, node="gpu1")
    heartbeat = table.beat(lambda busy: node_report.refresh_node(params, engine, busy=busy))

    heartbeat(False)  # the first beat: the table is written
    assert table.flush(60)
    (rows,) = table_versions(lab.model)
    assert [(r["node"], r["version"], r["condition"], r["engines"]) for r in rows] == [
        ("gpu1", "r1", "READY", f"{ENGINE}: r1"), ("gpu2", "r1", "READY", f"{ENGINE}: r1")]

    heartbeat(False)  # nothing changed: no new version of the table
    assert table.flush(60) and len(table_versions(lab.model)) == 1

    engine.version = "default"  # the engine restarted on its launch weights: the next beat says DRIFTED
    assert heartbeat(False).condition() == "DRIFTED"
    assert table.flush(60)
    drifted = table_versions(lab.model)[-1]
    assert len(table_versions(lab.model)) == 2
    assert [(r["node"], r["version"], r["condition"], r["engines"]) for r in drifted] == [
        ("gpu1", "-", "DRIFTED", f"{ENGINE}: default"), ("gpu2", "r1", "READY", f"{ENGINE}: r1")]

    # a refit settles (here gpu2's, which the agent of gpu1 does not see in its beats): the table is rewritten
    lab.publish("delta")
    assert lab.run(installer=other, node="gpu2", cache_dir=lab.root / "gpu2").status == "READY"
    heartbeat.settled()
    assert table.flush(60)
    assert [(r["node"], r["version"]) for r in table_versions(lab.model)[-1]] == [("gpu1", "-"), ("gpu2", "r2")]
    heartbeat(False)  # gpu1 is as the last table says: no rewrite
    assert table.flush(60) and len(table_versions(lab.model)) == 3
    assert table.writes == 3 and table.failures == 0


def test_a_table_that_cannot_be_written_never_holds_the_heartbeat(lab, monkeypatch):
    """The API down: the beat returns its record at once (the write fails in the table's thread and is counted);
    the next change tries again."""
    entered, release = threading.Event(), threading.Event()

    def stuck(self):  # storage or an API that does not answer, then an error
        entered.set()
        release.wait(30)
        raise ConnectionError("the Prefect API does not answer")

    monkeypatch.setattr(FleetTable, "_update", stuck)
    table = FleetTable(lab.catalog, lab.model, node="gpu1")
    beat = table.beat(lambda busy: record("gpu1", model=lab.model))
    assert beat(False).node == "gpu1"  # returned while the write hangs
    assert entered.wait(30) and not table.flush(0)
    beat.heartbeat = lambda busy: replace(record("gpu1", model=lab.model), status="FAILED")
    beat(False)  # a change while the write hangs: one more write, after it
    release.set()
    assert table.flush(30) and table.failures == 2 and table.writes == 0


def test_a_node_agent_keeps_the_fleet_table_current(flow_lab):
    """A node agent (``deployments.agent.NodeAgent`` with the heartbeat ``deployments.serve`` gives it) runs its
    start-up refit and its beats; the table shows the node READY at the catalog's head."""
    from deployments.agent import NodeAgent
    from deployments.serve import ServeSettings, build_deployments, run_vetting
    from flows.refit import refit
    from storage.runtime.cancel import StopToken
    from tasks.installers import make_installer

    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    params = lab.refit_params(node="tbl-agent", cache_dir=lab.root / "agent")
    settings = ServeSettings(name_suffix="-tbl-agent")
    installer = make_installer(params.installer)
    table = FleetTable(params.catalog, params.model, node=params.node, storage=params.storage)
    settled = []

    class Heartbeat(TableHeartbeat):
        def settled(self):
            settled.append(time.monotonic())
            super().settled()

    stop = StopToken()
    # one beat at start-up (before any refit), then none for an hour: what the table shows after the run, the
    # agent asked for after the run settled
    agent = NodeAgent(build_deployments(params, settings), {"refit": refit}, vet=run_vetting(params, settings),
                      poll_s=0.5, start_now="refit-latest-tbl-agent", stop=stop, wake_on_events=False,
                      heartbeat=Heartbeat(lambda busy: node_report.refresh_node(params, installer, busy=busy), table),
                      heartbeat_s=3600.0, node=params.node)
    thread = threading.Thread(target=agent.run, name="test-agent", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            versions = table_versions(lab.model)
            mine = [r for rows in versions for r in rows if r["node"] == "tbl-agent"]
            if any((r["version"], r["condition"]) == ("r1", "READY") for r in mine):
                break
            time.sleep(0.5)
        assert any((r["version"], r["condition"]) == ("r1", "READY") for r in mine), versions
        assert agent.stats.runs >= 1 and settled and agent.stats.heartbeats == 1
    finally:
        stop.stop("test over")
        thread.join(60)
    assert not thread.is_alive()


def test_only_the_keeper_reads_the_records_and_writes_the_table(flow_lab, monkeypatch):
    """Four nodes' records; each node's table updates once: the smallest live name (gpu1) reads the four records and
    writes one table, correct for all four; the others list once each and read no record. Once gpu1's record has
    aged out of the live window (its agent died), gpu2 is the keeper and its table shows gpu1 STALE."""
    import storage.catalog.nodes as nodes

    lab = flow_lab
    objects = ObjectStore.shared(None)
    for name in ("gpu3", "gpu1", "gpu4", "gpu2"):
        write_node_record(objects, lab.catalog, record(name, model=lab.model))
    reads, lists = [], []
    real_scan, real_walk = nodes.scan_node_records, ObjectStore.walk
    monkeypatch.setattr("flows.fleet_table.scan_node_records",
                        lambda *a, **kw: reads.append(1) or real_scan(*a, **kw))
    monkeypatch.setattr(ObjectStore, "walk", lambda self, url: lists.append(url) or real_walk(self, url))
    tables = {name: FleetTable(lab.catalog, lab.model, node=name, heartbeat_s=2.0)
              for name in ("gpu4", "gpu3", "gpu2", "gpu1")}
    before = len(table_versions(lab.model))  # the session's API may hold tables of this model from other tests
    for table in tables.values():
        table.request()
        assert table.flush(60) and table.failures == 0
    assert [name for name, t in tables.items() if t.writes] == ["gpu1"] and tables["gpu1"].keeper
    assert [t.skips for t in tables.values()] == [1, 1, 1, 0]
    assert len(lists) == 4 and len(reads) == 1  # one listing per node; the records read once, by the keeper
    (rows,) = table_versions(lab.model)[before:]
    assert [(r["node"], r["version"], r["condition"]) for r in rows] == [
        (name, "r2", "READY") for name in ("gpu1", "gpu2", "gpu3", "gpu4")]

    tables["gpu1"].request()  # nothing changed: the keeper reads, and writes no new version
    assert tables["gpu1"].flush(60) and len(table_versions(lab.model)) == before + 1

    # gpu1's agent died: its record (last beat 100 s ago) is out of the window; gpu2 takes over
    old = time.time() - 100
    write_node_record(objects, lab.catalog, record("gpu1", model=lab.model, alive_at_unix_ms=int(old * 1000),
                                                   updated_at_unix_ms=int(old * 1000)))
    os.utime(nodes_url(lab.catalog, lab.model).removeprefix("file://") + "/gpu1.json", (old, old))
    for table in tables.values():
        if table.node != "gpu1":
            table.request()
            assert table.flush(60)
    assert [name for name, t in tables.items() if t.writes] == ["gpu2", "gpu1"] and tables["gpu2"].keeper
    assert len(table_versions(lab.model)) == before + 2
    rows = table_versions(lab.model)[-1]
    assert [(r["node"], r["condition"]) for r in rows] == [
        ("gpu1", "STALE"), ("gpu2", "READY"), ("gpu3", "READY"), ("gpu4", "READY")]
