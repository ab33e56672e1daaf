"""The fleet tells the truth: what the engines run, which nodes are alive, and a barrier a trainer can trust.

Each test drives the product's own entry points (the refit runbook, the node
agent's heartbeat, ``python -m flows.fleet``'s ``main``) over a ``file://``
catalog; the node records they read are the ones the refits and heartbeats
wrote. ``test_fleet.py`` runs the same against agents on a Prefect server.
"""

from __future__ import annotations

import time

import pytest

from flows import node_report
from flows.fleet import main as fleet_main
from tests.support.fleet_cli import fleet, record_of
from tests.support.sglang_flows import disk, engine_lab, holds_exactly, http_json, published, sglang  # noqa: F401  (fixtures)
from tests.support.sglang_mock import MockSGLang
from tests.support.sglang_support import fake_sglang  # noqa: F401  (fixture)
from tasks.installers import make_installer


def two_nodes(lab, a_target: str = "r1", b_target: str = "r1"):
    """Nodes a and b, each with its own store, refitted to their targets (their records written by the runs)."""
    for node, target in (("a", a_target), ("b", b_target)):
        result = lab.run(target=target, node=node, cache_dir=lab.root / f"cache-{node}")
        assert result.status == "READY", result.error


# -- the engine is the truth ---------------------------------------------------------------------------------


def test_an_engine_restart_is_seen_by_the_heartbeat_and_healed_by_the_next_refit_without_a_download(
        engine_lab, capsys):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape, custom_weight_loader=[]) as engine:  # stock SGLang
        state, result = lab.refit(target="r2", installer=disk(engine), node="gpu1")
        assert state.name == "Ready", result.error
        assert (record_of(lab, "gpu1")["version"], record_of(lab, "gpu1")["engines"]) == ("r2", {engine.url: "r2"})

        engine.restart()  # back on its launch weights, as every SGLang restart is
        assert holds_exactly(engine, lab, "r0") and http_json(engine.url, "/model_info")["weight_version"] == "default"

        # the node agent's heartbeat asks the engine: the record says DRIFTED, never r2
        params = lab.refit_params(installer=disk(engine), node="gpu1")
        beat = node_report.refresh_node(params, make_installer(params.installer))
        assert beat.condition() == "DRIFTED"
        record = record_of(lab, "gpu1")
        assert (record["version"], record["store_version"], record["engines"]) == (None, "r2", {engine.url: "default"})
        code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--timeout", "0.5", "--poll", "0.1")
        assert (code, waited["outcome"], waited["drifted"], waited["reached"]) == (1, "timeout", ["gpu1"], [])

        # the refit the deployments run (latest, only if newer) re-installs the verified r2: no download
        state, result = lab.refit(target="latest", only_if_newer=True, installer=disk(engine), node="gpu1")
        assert state.name == "Ready", result.error
        assert any("recorded as installed" in note and "installing it again" in note for note in result.notes)
        assert {s["name"]: s["bytes"] for s in result.stages}["fetch buckets"] == 0
        assert holds_exactly(engine, lab, "r2") and http_json(engine.url, "/model_info")["weight_version"] == "r2"
        record = record_of(lab, "gpu1")
        assert (record["version"], record["status"], record["engines"]) == ("r2", "READY", {engine.url: "r2"})
        code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--timeout", "5")
        assert (code, waited["reached"]) == (0, ["gpu1"])

        # now the engine confirms r2: the same refit skips
        state, result = lab.refit(target="latest", only_if_newer=True, installer=disk(engine), node="gpu1")
        assert state.name == "Skipped" and "which every engine runs" in result.notes[-1]


def test_an_engine_that_does_not_answer_is_not_counted_as_running_the_version(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape, custom_weight_loader=[]) as engine:
        state, result = lab.refit(target="r1", installer=disk(engine), node="gpu1")
        assert state.name == "Ready", result.error
        params = lab.refit_params(installer=disk(engine), node="gpu1")
        installer = make_installer(params.installer)
    beat = node_report.refresh_node(params, installer)  # the engine is gone
    record = record_of(lab, "gpu1")
    assert beat.condition() == "DRIFTED" and record["version"] is None and record["engines"] == {engine.url: None}


# -- a barrier the trainer can trust -------------------------------------------------------------------------


def test_wait_for_the_launch_revision_succeeds(lab, capsys):
    lab.publish("initial")
    two_nodes(lab, "r0", "r0")
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--timeout", "5")
    assert (code, waited["outcome"], waited["reached"]) == (0, "reached", ["a", "b"])


def test_wait_names_a_live_node_that_is_behind_and_never_counts_it_as_absent(lab, capsys):
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    two_nodes(lab, "r2", "r1")  # b is alive (its record is fresh) but runs r1
    code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--all-seen-within", "30", "--timeout", "0.3",
                         "--poll", "0.1")
    assert (code, waited["outcome"], waited["reached"], waited["behind"]) == (1, "timeout", ["a"], ["b"])
    code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--nodes", "1", "--timeout", "5")
    assert (code, waited["reached"]) == (0, ["a"])  # enough when the trainer asks for one node only
    code, waited = fleet(capsys, lab, "wait", "--version", "r1", "--timeout", "5")
    assert (code, waited["reached"]) == (0, ["a", "b"])  # r2 is newer than r1: it counts


def test_a_node_not_seen_alive_is_stale_and_an_expected_node_without_a_record_is_unseen(lab, capsys):
    lab.publish("initial")
    two_nodes(lab, "r0", "r0")
    time.sleep(1.2)
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--all-seen-within", "1", "--timeout", "0.2",
                         "--poll", "0.1")
    assert (code, waited["stale"], waited["reached"]) == (1, ["a", "b"], [])

    # a heartbeat makes a alive again; gpu9 is expected but has never written a record
    node_report.refresh_node(lab.refit_params(node="a", cache_dir=lab.root / "cache-a"),
                             make_installer(lab.refit_params().installer))
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--all-seen-within", "1", "--expect", "gpu9",
                         "--timeout", "0.2", "--poll", "0.1")
    assert (code, waited["reached"], waited["stale"], waited["unseen"]) == (1, ["a"], ["b"], ["gpu9"])
    code, view = fleet(capsys, lab, "status")
    assert code == 0 and {n["node"] for n in view["nodes"]} == {"a", "b"}


def test_a_node_whose_agent_stopped_beating_goes_stale_by_itself(lab, capsys, monkeypatch):
    import types

    from storage.catalog import nodes

    lab.publish("initial")
    monkeypatch.setattr(node_report, "heartbeat_interval_s", 0.3)  # as a node agent sets it
    two_nodes(lab, "r0", "r0")
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--timeout", "5")
    assert (code, waited["reached"]) == (0, ["a", "b"])
    # the readers' clock moves on while nobody writes: one beat plus the grace (max(5 s, half a beat)) and
    # the records stop counting; three beats, as the old rule had it, are not enough to call a live node dead
    assert nodes.stale_after_s(0.3) == 5.3 and nodes.stale_after_s(30) == 45.0
    now = time.time()
    monkeypatch.setattr(nodes, "time", types.SimpleNamespace(time=lambda: now + 1.2))
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--timeout", "5")
    assert (code, waited["reached"], waited["stale"]) == (0, ["a", "b"], [])
    monkeypatch.setattr(nodes, "time", types.SimpleNamespace(time=lambda: now + nodes.stale_after_s(0.3) + 0.5))
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--timeout", "0.2", "--poll", "0.1")
    assert (code, waited["stale"]) == (1, ["a", "b"])
    capsys.readouterr()
    assert fleet_main(["status", "--catalog", lab.catalog, "--model", lab.model]) == 0
    table = capsys.readouterr().out
    assert table.count("STALE") == 2 and "READY" not in table


def test_forget_retires_a_one_off_node_so_that_a_plain_wait_succeeds(lab, capsys):
    for kind in ("initial", "delta"):
        lab.publish(kind)
    two_nodes(lab, "r1", "r1")
    result = lab.run(target="r0", node="scratch", cache_dir=lab.root / "cache-scratch")  # a one-off refit
    assert result.status == "READY"
    code, waited = fleet(capsys, lab, "wait", "--version", "r1", "--timeout", "0.2", "--poll", "0.1")
    assert (code, waited["behind"]) == (1, ["scratch"])

    code, said = fleet(capsys, lab, "forget", "--node", "scratch")
    assert (code, said) == (0, {"node": "scratch", "forgotten": True})
    code, waited = fleet(capsys, lab, "wait", "--version", "r1", "--timeout", "5")
    assert (code, waited["reached"]) == (0, ["a", "b"])
    code, said = fleet(capsys, lab, "forget", "--node", "scratch")
    assert (code, said["forgotten"]) == (0, False)


def test_wait_stops_at_once_on_a_poisoned_node(lab, capsys, tmp_path):
    from storage.store.local_store import LocalStore

    lab.publish("initial")
    two_nodes(lab, "r0", "r0")
    LocalStore(lab.root / "cache-b", lab.model).mark_poisoned("test: the engine failed mid-load", "r0", "none")
    lab.run(target="r0", node="b", cache_dir=lab.root / "cache-b")  # refused: the record now says POISONED
    started = time.monotonic()
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--timeout", "30")
    assert (code, waited["outcome"], waited["poisoned"]) == (3, "poisoned", ["b"])
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("form", [["--name-suffix", "-gpu3"], ["--name-suffix", "gpu3"], []])
def test_the_documented_serve_command_parses_as_printed(form):
    from deployments.serve import build_deployments, parse_args

    params, settings, _ = parse_args(["--node", "gpu3", *form, "--catalog", "s3://bucket/models/org-name/catalog",
                                      "--model", "org/name", "--seed-checkpoint", "/models/launch",
                                      "--installer", "sglang", "--engine-url", "http://127.0.0.1:30000"])
    assert [d.name for d in build_deployments(params, settings)] == ["refit-latest-gpu3", "refit-on-publish-gpu3"]
