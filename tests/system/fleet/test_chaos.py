"""The chaos command's small mode, as the suite runs it: ``python -m testbed.chaos --small --spacing 3``.

Two nodes (each an agent process installing into an engine stand-in
process) on a Prefect server on PostgreSQL, three publications; one agent
killed with SIGKILL while its engine restarts on its launch weights, one
engine killed and restarted. The command itself judges the fleet
(testbed/chaos_watch.py): no second in which a node's record claimed a
version its engine had not run for longer than one heartbeat plus the
grace, no wrong answer of ``flows.fleet wait`` or ``flows.api.wait_for``,
and every node on the newest revision after the faults.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testbed.processes import ROOT, quiet_env


def test_the_small_chaos_run_finds_no_false_ready_no_wrong_answer_and_converges(tmp_path):
    done = subprocess.run([sys.executable, "-m", "testbed.chaos", "--small", "--seed", "3", "--spacing", "3", "--root",
                           str(tmp_path / "chaos"), "--json"], cwd=ROOT, env=quiet_env(), capture_output=True,
                          text=True, timeout=400)
    lines = done.stdout.strip().splitlines()
    assert lines, f"the chaos command printed nothing (exit {done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads(lines[-1])
    context = f"{json.dumps({k: result[k] for k in ('false_ready', 'wrong', 'where_at_end')})}\n{done.stderr[-3000:]}"

    # the faults the small mode promises were injected, and healed
    kinds = sorted(f["kind"] for f in result["faults"])
    assert kinds == ["agent", "engine"] and all(f["fired_at_s"] is not None and f["healed_at_s"] is not None
                                                 and f["error"] is None for f in result["faults"]), result["faults"]
    assert next(f for f in result["faults"] if f["kind"] == "agent")["engine_too"] is True
    assert result["faults_healed"] is True

    # the watcher saw the fleet throughout, and the barrier answered for every publication and once more at the end
    assert result["samples"] > 20
    assert [p["version"] for p in result["publications"]] == ["r0", "r1", "r2", "r3"]
    assert {a["version"] for a in result["answers_list"]} == {"r1", "r2", "r3"}, context
    assert {a["how"] for a in result["answers_list"]} == {"cli", "api"}

    # the verdict: no false READY, no wrong answer, converged, and the command's exit code says so
    assert (result["false_ready_s"], result["false_ready_samples"]) == (0, 0), context
    assert result["wrong_answers"] == 0, context
    assert result["converged"] is True and result["convergence_s"] is not None, context
    assert result["ok"] is True and done.returncode == 0, context


def test_the_chaos_command_refuses_a_storage_outage_on_file_storage():
    done = subprocess.run([sys.executable, "-m", "testbed.chaos", "--faults", "storage", "--storage", "file"],
                          cwd=ROOT, env=quiet_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "a storage outage needs --storage s3" in done.stderr
    done = subprocess.run([sys.executable, "-m", "testbed.chaos", "--faults", "agent,meteor"],
                          cwd=ROOT, env=quiet_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "meteor" in done.stderr


# -- the judge can fail: a claim that outlives its engine, and a barrier that says reached too early ----------------


class FakeEngine:
    def __init__(self, version: str | None):
        self.version = version

    def report(self) -> str | None:
        return self.version


def fake_fleet(tmp_path, **engines):
    from types import SimpleNamespace

    from storage.settings import ObjectStoreSettings

    return SimpleNamespace(nodes={name: SimpleNamespace(engine=FakeEngine(v)) for name, v in engines.items()},
                           catalog=(tmp_path / "objects" / "catalog").as_uri(), moto=None,
                           storage_settings=lambda endpoint: ObjectStoreSettings())


def write_record(fleet, node: str, version: str | None, *, status: str = "READY", store_version: str | None = None,
                 alive_s_ago: float = 0.0, heartbeat_s: float = 30.0) -> None:
    import time

    from storage.catalog.nodes import NodeRecord, write_node_record
    from storage.objects.store import ObjectStore
    from testbed.chaos_fleet import MODEL

    now = int((time.time() - alive_s_ago) * 1000)
    write_node_record(ObjectStore.shared(), fleet.catalog, NodeRecord(
        node=node, model=MODEL, version=version, digest=None, status=status, updated_at_unix_ms=now,
        alive_at_unix_ms=now, heartbeat_s=heartbeat_s, store_version=store_version or version))


def test_the_watcher_counts_a_claim_that_outlives_its_engine_beyond_the_window_and_nothing_within_it(tmp_path):
    import time

    from testbed.chaos_watch import Watcher

    fleet = fake_fleet(tmp_path, a="r1", b="r1", c="r1")
    for node in ("a", "b", "c"):
        write_record(fleet, node, "r1")
    watcher = Watcher(fleet, window_s=0.3)
    watcher.sample(0.1)
    assert watcher.on_latest("r1") and all(t.false_ready_s == 0 for t in watcher.tracks.values())

    # a's engine restarts on its launch weights and its record keeps claiming r1; b's record says DRIFTED at once;
    # c's agent died with its engine: its record stops counting once stale (one beat + grace: 7 s at 2 s beats)
    fleet.nodes["a"].engine.version = fleet.nodes["b"].engine.version = "default"
    fleet.nodes["c"].engine.version = None
    write_record(fleet, "b", None, status="DRIFTED", store_version="r1")
    write_record(fleet, "c", "r1", alive_s_ago=10.0, heartbeat_s=2.0)
    watcher.sample(0.1)
    assert all(t.false_ready_s == 0 for t in watcher.tracks.values())  # a: within the window still
    time.sleep(0.4)
    watcher.sample(0.1)
    watcher.sample(0.1)
    tracks = watcher.tracks
    assert tracks["a"].false_samples == 2 and round(tracks["a"].false_ready_s, 2) == 0.2
    assert tracks["a"].episodes[0]["version"] == "r1" and tracks["a"].episodes[0]["engine"] == "default"
    assert tracks["b"].false_ready_s == 0 and tracks["c"].false_ready_s == 0
    assert (tracks["b"].claim, tracks["c"].claim) == (None, None)


def test_the_judge_calls_reached_wrong_when_an_engine_does_not_run_the_version(tmp_path):
    import time

    from testbed.chaos_watch import Judge, Watcher

    fleet = fake_fleet(tmp_path, a="r2", b="r1")
    watcher = Watcher(fleet, window_s=0.3)
    watcher.sample(0.1)
    judge = Judge(fleet, watcher, {"r0": 0, "r1": 1, "r2": 2})
    judge._judge("api", "r1", "reached", None, [], time.monotonic(), time.monotonic())  # a runs r2: newer counts
    judge._judge("api", "r2", "reached", None, [], time.monotonic(), time.monotonic())  # b runs r1 only
    judge._judge("cli", "r2", "failed", 4, [], time.monotonic(), time.monotonic(), detail={"b": "?"})
    judge._judge("cli", "r2", "timeout", 1, [], time.monotonic(), time.monotonic())
    judge._judge("cli", "r2", "poisoned", 3, ["b"], time.monotonic(), time.monotonic())
    verdicts = [(a["version"], a["outcome"], bool(a["wrong"])) for a in judge.answers]
    assert verdicts == [("r1", "reached", False), ("r2", "reached", True), ("r2", "failed", True),
                        ("r2", "timeout", False), ("r2", "poisoned", True)]
    assert "b" in judge.answers[1]["wrong"] and "a" not in judge.answers[1]["wrong"].split("of ")[1]


def test_an_agent_started_while_the_server_is_down_beats_and_registers_once_it_is_back(tmp_path):
    """What the chaos run found: an agent (re)started while the Prefect server was down exited at once (Prefect's
    client checks the API on entry), leaving its node stale for good. Now it writes its record from its first
    heartbeat (storage and engines need no API) and registers once the server answers."""
    from storage.catalog.nodes import nodes_url
    from testbed.nodes import NodeProcess
    from testbed.prefect_server import PrefectServer, deployment_ids
    from testbed.processes import wait_until
    from testbed.trainer import Trainer

    catalog = (tmp_path / "objects" / "catalog").as_uri()
    trainer = Trainer(tmp_path / "trainer", catalog, "lab/down", endpoint=None)
    server = PrefectServer(tmp_path / "server", migrated=True)  # its port chosen, nothing listening yet
    node = NodeProcess("n1", tmp_path / "nodes", catalog, "lab/down", trainer.launch,
                       server.client_env(tmp_path / "home"), poll_s=1.0,
                       extra=("--heartbeat-seconds", "1", "--head-poll-seconds", "5"))
    record = Path(nodes_url(catalog, "lab/down").removeprefix("file://")) / "n1.json"
    node.start()
    try:
        wait_until("the node's first heartbeat, the server down", record.exists, 120, every_s=0.2,
                   diagnostics=node.diagnostics)
        assert node.alive, node.diagnostics()
        with server:
            with server.client() as client:
                wait_until("the agent to register once the server answers", lambda: deployment_ids(
                    client, list(node.deployments.values())), 120, every_s=0.5, diagnostics=node.diagnostics)
            assert node.alive
    finally:
        node.stop(timeout_s=20)
    assert "Prefect API does not answer" in node.log.read_text()
