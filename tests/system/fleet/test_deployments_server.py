"""The deployments against a real ``prefect server``: published events trigger refits, failures are inspectable.

One server (own PREFECT_HOME, 127.0.0.1) serves the module. ``deployments.serve``
and a process worker run as subprocesses pointed at it; the trainer side is
``python -m flows.publish``, which emits the published event. The tests read
outcomes back through Prefect's client: final state names, messages, artifacts.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from itertools import combinations
from pathlib import Path

import pytest

from tests.support.deployments_support import (
    artifacts_of, delete_deployments, emit_published, flip_tensor_byte, publish, refit_runs, run, spawn,
    wait_for_final_run,
)
from flows.synthetic import random_model, train_step, write_checkpoint
from tests.support.lab import independent_digest, tiny_shape
from storage.store.local_store import LocalStore
from storage.urls import normalize_url
from testbed.prefect_server import PREFECT, PrefectServer, target_of
from testbed.processes import PYTHON, ROOT, stop_group, tail, wait_until

pytestmark = pytest.mark.server
MODEL = "lab/tiny"
CORRUPT_TENSOR = "model.layers.0.mlp.down_proj.weight"
POLL_S = 1  # how often serve looks for runs to start


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = PrefectServer(tmp_path_factory.mktemp("prefect-server"), migrated=True).start()
    yield srv
    srv.stop()


class Trainer:
    """Checkpoints of a tiny model, one per training step, and the launch snapshot."""

    def __init__(self, root: Path, steps: int):
        shape = tiny_shape()
        self.launch = root / "launch"
        tensors = random_model(shape, seed=7)
        write_checkpoint(self.launch, tensors, shards=shape.shards)
        self.tensors, self.folders = [], []
        for step in range(steps):
            if step:
                tensors = train_step(tensors, seed=100 + step)
            self.tensors.append(tensors)
            self.folders.append(write_checkpoint(root / f"step-{step}", tensors, shards=shape.shards))

    def digest(self, step: int) -> str:
        return independent_digest(self.tensors[step])[1]


def _deployments(client, names):
    from prefect.exceptions import ObjectNotFound

    try:
        return {name: client.read_deployment_by_name(name) for name in names}
    except ObjectNotFound:
        return None


def _created_after(client, deployment_id, since: datetime, target: str):
    return [r for r in refit_runs(client, deployment_id) if target_of(r) == target and r.created > since]


def _active(run) -> bool:
    return run.state_type is not None and run.state_type.value in ("PENDING", "RUNNING")


def test_serve_refits_published_revisions_and_reports_a_corrupt_one(server, tmp_path):
    trainer = Trainer(tmp_path / "trainer", steps=3)
    catalog, cache = normalize_url(str(tmp_path / "catalog")), tmp_path / "cache"
    env = server.client_env(tmp_path / "client-home")
    state_dir = tmp_path / "publisher"
    log = tmp_path / "serve.log"
    serve = spawn([PYTHON, "-m", "deployments.serve", "--catalog", catalog, "--model", MODEL,
                   "--seed-checkpoint", str(trainer.launch), "--cache-dir", str(cache), "--installer", "none",
                   "--apply-workers", "2", "--poll-seconds", str(POLL_S), "--node", "lab1",
                   "--allow-remote-rollback",  # the rollback recipe below: this node allows it
                   "--head-poll-seconds", "60"], env, log)  # the slowest head check: r2 below is announced by hand
    diagnostics = lambda: tail(log)  # noqa: E731
    names = ["refit/refit-latest-lab1", "refit/refit-on-publish-lab1"]
    try:
        with server.client() as client:
            deployments = wait_until("serve to register its deployments", lambda: _deployments(client, names),
                                     120, diagnostics=diagnostics)
            on_publish, latest = deployments["refit/refit-on-publish-lab1"], deployments["refit/refit-latest-lab1"]
            assert latest.schedules[0].schedule.interval == timedelta(hours=1)
            assert latest.parameters["params"]["target"] == "latest"

            # the trainer publishes the launch revision and one delta; each emits the published event
            # a started run: the server's scheduler also creates the interval schedule's runs, never started
            wait_until("serve's start-up refit to latest", lambda: [r for r in refit_runs(client, latest.id)
                                                                    if r.start_time], 60, diagnostics=diagnostics)
            before_publishing = datetime.now(timezone.utc)
            r0 = publish(env, catalog, MODEL, trainer.folders[0], state_dir, "--kind", "initial")
            assert r0["version"] == "r0"
            assert publish(env, catalog, MODEL, trainer.folders[1], state_dir)["version"] == "r1"
            ready = wait_for_final_run(client, on_publish.id, "r1", 120, diagnostics)
            assert ready.state_name == "Ready", ready.state.message
            assert ready.state.message == f"r1 {trainer.digest(1)}"
            assert ready.parameters["params"]["only_if_newer"] is True
            assert set(artifacts_of(client, ready.id)) == {"refit-stages-lab-tiny"}  # a Ready run: its table only

            # r2's bucket is corrupted after publication; then r2 and the older r1 are announced together,
            # while the test holds the receiver's store lock so that the run cannot finish: the agent's loop
            # creates one run, to the newest (r2); the late r1 (installed already) makes none
            since = datetime.now(timezone.utc)
            r2 = publish(env, catalog, MODEL, trainer.folders[2], state_dir, "--no-event")
            bucket = tmp_path / "revisions" / "r2" / "bucket-00000.safetensors"
            flip_tensor_byte(bucket, CORRUPT_TENSOR)

            def triggered():
                runs = [r for target in ("r2", "r1") for r in _created_after(client, on_publish.id, since, target)]
                return runs if any(_active(r) for r in runs) else None

            with LocalStore(cache, MODEL).exclusive(60, "the test"):
                emit_published(env, catalog, MODEL, "r2", "r1")
                wait_until("the run to r2 started", triggered, 120, diagnostics=diagnostics)
                time.sleep(3 * POLL_S)  # several polls of the agent: a second run would have been created by now
                assert [target_of(r) for r in triggered()] == ["r2"]

            failed = wait_for_final_run(client, on_publish.id, "r2", 120, diagnostics)
            assert (failed.state_type.value, failed.state_name) == ("FAILED", "Failed")
            bucket_url = f"{r2['uri'].rsplit('/', 1)[0]}/bucket-00000.safetensors"
            for fact in ("'r2'", bucket_url, CORRUPT_TENSOR):
                assert fact in failed.state.message
            artifacts = artifacts_of(client, failed.id)
            summary = artifacts["refit-summary-lab-tiny"].data
            for line in ("- stage: **apply deltas**", "- revision: `r2`", f"- file: `{bucket_url}`",
                         f"- tensor: `{CORRUPT_TENSOR}`", "installed: `r1`"):
                assert line in summary, summary
            stages = {row["stage"]: row for row in json.loads(artifacts["refit-stages-lab-tiny"].data)}
            assert stages["apply deltas"]["status"] == "FAILED" and "attempts" not in stages["apply deltas"]
            assert CORRUPT_TENSOR in stages["apply deltas"]["detail"]
            assert stages["fetch buckets"]["bytes"] == bucket.stat().st_size
            # this run waited for the test's lock first: long enough for a progress artifact, which stopped where
            # the run did (fetched all, failed applying); a refit of a few seconds has none
            progress = artifacts.get("refit-progress-lab-tiny")
            assert progress is None or 50 <= progress.data < 90, progress

            assert _created_after(client, on_publish.id, since, "r1") == []  # the late event made no run
            assert LocalStore(cache, MODEL).active().version == "r1"

            # at start-up serve started a refit to latest at once (not an hour later), before anything
            # was published; it ended Skipped (empty catalog) or Ready, depending on when it ran
            # (the server's scheduler also creates the interval schedule's runs, an hour out: never started)
            first = min((r for r in refit_runs(client, latest.id) if r.start_time), key=lambda r: r.start_time)
            assert first.created < before_publishing
            assert first.state_name in ("Skipped", "Ready"), first.state.message

            # the README's rollback recipe: an ad-hoc run whose parameters carry only catalog, model and
            # target acts on this node's store (seed, cache and installer come from the node); the node allows
            # rollbacks (--allow-remote-rollback), and the run says it was one
            printed = run([PYTHON, "-m", "deployments.serve", "--print-params", "--catalog", catalog, "--model",
                           MODEL, "--target", "r0"], env).strip().splitlines()[-1]
            assert set(json.loads(printed)["params"]) == {"catalog", "model", "target", "only_if_newer"}
            run([PREFECT, "deployment", "run", "refit/refit-latest-lab1", "--params", printed], env)
            rollback = wait_for_final_run(client, latest.id, "r0", 120, diagnostics)
            assert rollback.state_name == "Ready", rollback.state.message
            assert LocalStore(cache, MODEL).active().version == "r0"
            assert "- rollback: from `r1`" in artifacts_of(client, rollback.id)["refit-summary-lab-tiny"].data

            # one flow run at a time: no two refits of the model overlapped
            runs = [r for d in (on_publish, latest) for r in refit_runs(client, d.id) if r.start_time]
            assert {target_of(r) for r in runs} >= {"r0", "r1", "r2"} and len(runs) >= 4
            wait_until("every started refit to finish", lambda: all(
                client.read_flow_run(r.id).end_time for r in runs), 60, diagnostics=diagnostics)
            spans = sorted((r.start_time, r.end_time) for r in (client.read_flow_run(r.id) for r in runs))
            for (_, end), (start, _) in combinations(spans, 2):
                assert end <= start, spans
    finally:
        stop_group(serve)
        delete_deployments(server, names)  # leave the names free for the other test on this server


def test_prefect_yaml_deploys_to_a_process_work_pool(server, tmp_path):
    trainer = Trainer(tmp_path / "trainer", steps=1)
    model = "lab/yaml"
    catalog, cache = normalize_url(str(tmp_path / "catalog")), tmp_path / "cache"
    env = server.client_env(tmp_path / "client-home")
    run([PREFECT, "work-pool", "create", "canonical-refit", "--type", "process", "--overwrite"], env)
    run([PREFECT, "work-queue", "create", "refit", "--pool", "canonical-refit", "--limit", "1"], env)
    run([PREFECT, "deploy", "--prefect-file", "deployments/prefect.yaml", "--all"],
        {**env, "CANONICAL_REFIT_CATALOG": catalog, "CANONICAL_REFIT_MODEL": model, "CANONICAL_REFIT_NODE": "yaml1"},
        cwd=ROOT)
    log = tmp_path / "worker.log"
    worker_env = {**env, "CANONICAL_REFIT_SEED_CHECKPOINT": str(trainer.launch),
                  "CANONICAL_REFIT_CACHE_DIR": str(cache), "CANONICAL_REFIT_INSTALLER_KIND": "none",
                  "CANONICAL_REFIT_NODE": "yaml1", "PREFECT_WORKER_QUERY_SECONDS": "1"}
    names = ["refit/refit-latest-yaml1", "refit/refit-on-publish-yaml1", "publish/publish-yaml1"]  # a worker pool
    worker = spawn([PREFECT, "worker", "start", "--pool", "canonical-refit", "--work-queue", "refit",
                    "--limit", "1"], worker_env, log)
    diagnostics = lambda: tail(log)  # noqa: E731
    try:
        with server.client() as client:
            deployments = {name: client.read_deployment_by_name(name) for name in names}
            for deployment in deployments.values():
                assert deployment.work_pool_name == "canonical-refit"
                assert deployment.pull_steps == [
                    {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
            on_publish, latest = deployments["refit/refit-on-publish-yaml1"], deployments["refit/refit-latest-yaml1"]
            assert latest.work_queue_name == on_publish.work_queue_name == "refit"
            assert deployments["publish/publish-yaml1"].work_queue_name == "publish"
            assert client.read_work_queue_by_name("refit", work_pool_name="canonical-refit").concurrency_limit == 1
            assert latest.parameters == {"params": {"catalog": catalog, "model": model, "node": "yaml1",
                                                    "target": "latest", "only_if_newer": True}}

            # the published event reaches the yaml's trigger, and the worker runs the refit
            publish(env, catalog, model, trainer.folders[0], tmp_path / "publisher", "--kind", "initial")
            ready = wait_for_final_run(client, on_publish.id, "r0", 120, diagnostics)
            assert ready.state_name == "Ready", ready.state.message
            assert ready.state.message == f"r0 {trainer.digest(0)}"

            # triggered by hand: the scheduled deployment finds nothing newer
            run([PREFECT, "deployment", "run", "refit/refit-latest-yaml1"], env)
            skipped = wait_for_final_run(client, latest.id, "latest", 120, diagnostics)
            assert skipped.state_name == "Skipped", skipped.state.message
    finally:
        stop_group(worker, timeout_s=5)
        delete_deployments(server, names)  # leave the names free for the other test on this server


@pytest.mark.parametrize("point", ["fetch.file", "apply.materialized", "activate.written"])
def test_cancelling_a_run_from_prefect_never_leaves_it_cancelling(server, tmp_path, point):
    """What the UI's Cancel button does (`prefect flow-run cancel`). During the fetch or the apply the run
    ends Cancelled (named Interrupted), the store goes back to the installed version through the interrupted
    path, and the next run is Ready. A cancellation that arrives once the new version is activated ends the
    run Ready, as it is. Either way the server never keeps the run Cancelling."""
    trainer = Trainer(tmp_path / "trainer", steps=2)
    # a model of its own: an agent hears the published events of its model the server still streams, and the
    # previous case's "r1 was published" (another catalog) would make this case's own event a repeat
    model = f"lab/cancel-{point.split('.')[0]}"
    catalog, cache = normalize_url(str(tmp_path / "catalog")), tmp_path / "cache"
    env = server.client_env(tmp_path / "client-home")
    state_dir, gate = tmp_path / "publisher", tmp_path / "go"
    assert publish(env, catalog, model, trainer.folders[0], state_dir, "--kind", "initial",
                   "--no-event")["version"] == "r0"
    log = tmp_path / "serve.log"
    node = "cancel-" + point.replace(".", "-")
    serve = spawn([PYTHON, "-m", "deployments.serve", "--catalog", catalog, "--model", model, "--node", node,
                   "--seed-checkpoint", str(trainer.launch), "--cache-dir", str(cache), "--installer", "none",
                   "--apply-workers", "2", "--poll-seconds", str(POLL_S)],
                  {**env, "CANONICAL_REFIT_KILLPOINT_GATE": f"{point}:{gate}"}, log)
    diagnostics = lambda: tail(log)  # noqa: E731
    names = [f"refit/refit-latest-{node}", f"refit/refit-on-publish-{node}"]
    try:
        with server.client() as client:
            deployments = wait_until("serve to register its deployments", lambda: _deployments(client, names),
                                     120, diagnostics=diagnostics)
            on_publish, latest = deployments[names[1]], deployments[names[0]]
            if point == "activate.written":  # the start-up refit (seeding r0) activates too: let it pass
                gate.touch()
            startup = wait_for_final_run(client, latest.id, "latest", 120, diagnostics)
            assert startup.state_name == "Ready" and LocalStore(cache, model).active().version == "r0"
            if point == "activate.written":
                gate.unlink()
                stop_group(serve)  # a fresh agent, whose gate holds its first activation (r1's)
                serve = spawn(serve.args, {**env, "CANONICAL_REFIT_KILLPOINT_GATE": f"{point}:{gate}"}, log)
                wait_until("the agent to start again", lambda: "node agent ready" in log.read_text(), 120,
                           diagnostics=diagnostics)

            assert publish(env, catalog, model, trainer.folders[1], state_dir)["version"] == "r1"
            held = wait_until(f"the refit to r1 to be held at {point}", lambda: [
                r for r in refit_runs(client, on_publish.id) if target_of(r) == "r1"
                and r.state_type and r.state_type.value == "RUNNING"], 120, diagnostics=diagnostics)[0]
            run([PREFECT, "flow-run", "cancel", str(held.id)], env)
            wait_until("the server to say Cancelling", lambda: client.read_flow_run(held.id).state_type.value
                       in ("CANCELLING", "CANCELLED"), 30, diagnostics=diagnostics)
            if point != "activate.written":  # the agent saw the cancellation before the held step goes on
                wait_until("the agent to see the cancellation", lambda: "is being cancelled" in log.read_text(), 30,
                           diagnostics=diagnostics)
            gate.touch()

            ended = wait_until("the cancelled run to end", lambda: (lambda r: r.state_type.value not in (
                "RUNNING", "CANCELLING", "PENDING") and r)(client.read_flow_run(held.id)), 60,
                diagnostics=diagnostics)
            store = LocalStore(cache, model)
            if point == "activate.written":  # activated before the stop could matter: it is Ready, and says so
                assert (ended.state_type.value, ended.state_name) == ("COMPLETED", "Ready"), ended.state
                assert store.active().version == "r1"
                return
            assert (ended.state_type.value, ended.state_name) == ("CANCELLED", "Interrupted"), ended.state
            assert "cancelled from Prefect" in ended.state.message, ended.state.message
            assert store.active().version == "r0" and store.poisoned() is None
            assert "failed after the store changed" not in log.read_text()

            run([PREFECT, "deployment", "run", names[0]], env)
            # the run by hand, or the agent's head check if it came first (its run is refit-on-publish's)
            ready = wait_until("the next refit to r1", lambda: [
                r for r in refit_runs(client, latest.id) + refit_runs(client, on_publish.id)
                if r.created > ended.created and r.state_name == "Ready"], 120, diagnostics=diagnostics)[0]
            assert ready.state_name == "Ready" and ready.state.message == f"r1 {trainer.digest(1)}", ready.state
            assert LocalStore(cache, model).active().version == "r1"
    finally:
        stop_group(serve)
        delete_deployments(server, names)
