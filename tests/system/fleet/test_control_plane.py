"""What an outsider with access to the Prefect API can make a node do: nothing the node's configuration forbids.

Two node agents (``python -m deployments.serve``) serve one catalog on moto S3
from one ``prefect server``: ``guard`` as an inference node is configured by
default, ``open`` allows remote rollbacks and serves the publish deployment
from one checkpoint root. Every attack is a flow run created through the API,
as anyone who can reach it can; each must end Failed with a message that names
every offending parameter, having run nothing (no task run, the installed
version and the store as they were), and nothing may reach the outsider: its
listener (as engine or S3 endpoint) gets no connection, its folders stay empty.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.deployments_support import Listener, artifacts_of, files_under, final_run, start_run
from tests.support.s3_support import aws_environment, s3  # noqa: F401 (the fixture)
from storage.urls import normalize_url
from testbed.nodes import NodeProcess
from testbed.prefect_server import PrefectServer, deployment_ids, is_final, runs_of
from testbed.processes import wait_until
from testbed.trainer import Trainer

pytestmark = pytest.mark.server
MODEL = "lab/guarded"
ADMIN_KEY = "the-engines-admin-key"


@dataclass
class Plane:
    server: PrefectServer
    catalog: str
    trainer: Trainer
    guard: NodeProcess
    open: NodeProcess
    outsider: Path  # the outsider's folders (a catalog, a store)
    engine: Listener  # the outsider's "engine"
    endpoint: Listener  # the outsider's "S3 endpoint"
    s3_settings: object

    def diagnostics(self) -> str:
        return self.guard.diagnostics() + "\n" + self.open.diagnostics()

    def run(self, node: NodeProcess, which: str, params: dict, timeout_s: float = 120):
        run_id = start_run(self.server, node.deployments[which], params)
        return final_run(self.server, run_id, timeout_s, self.diagnostics)

    def task_runs(self, run_id) -> list:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with self.server.client() as client:
            return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))

    def catalog_versions(self) -> list[str]:
        from storage.catalog.records import Catalog
        from storage.objects.store import ObjectStore

        return [r.version for r in Catalog(ObjectStore(self.s3_settings), self.catalog, MODEL).list()]

    def node_record(self, node: NodeProcess):
        from storage.catalog.nodes import read_node_records
        from storage.objects.store import ObjectStore

        records, _ = read_node_records(ObjectStore(self.s3_settings), self.catalog, MODEL, only=node.name)
        return next(r for r in records if r.node == node.name)


@pytest.fixture(scope="module")
def plane(tmp_path_factory, s3):
    root = tmp_path_factory.mktemp("control-plane")
    server = PrefectServer(root / "server", migrated=True)
    with ThreadPoolExecutor(1) as starting:  # the server starts while the trainer publishes (no event: no server)
        started = starting.submit(server.start)
        try:
            catalog = f"{s3.prefix('guarded')}/catalog"
            trainer = Trainer(root / "trainer", catalog, MODEL, endpoint=s3.endpoint)
            trainer.publish("initial", emit_event=False)
            trainer.publish("delta", emit_event=False)
            started.result()
        except BaseException:
            started.exception()  # once it is done starting (or failed to), it is stopped
            server.stop()
            raise
    outsider = root / "outsider"
    (outsider / "catalog").mkdir(parents=True)
    nodes = []
    with Listener() as engine, Listener() as endpoint:
        try:
            for name, extra in (("guard", ()), ("open", ("--allow-remote-rollback", "--serve-publish",
                                                         "--publish-checkpoint-root", str(trainer.root)))):
                env = server.client_env(root / f"{name}-home", **aws_environment(),
                                        CANONICAL_REFIT_INSTALLER_API_KEY=ADMIN_KEY)
                nodes.append(NodeProcess(name, root / "nodes", catalog, MODEL, trainer.launch, env,
                                         s3_endpoint=s3.endpoint, poll_s=1.0, extra=extra).start())
            plane = Plane(server, catalog, trainer, *nodes, outsider, engine, endpoint, s3.settings())
            with server.client() as client:
                for node in nodes:
                    ids = wait_until(f"{node.name} to register", lambda: deployment_ids(
                        client, list(node.deployments.values())), 120, every_s=0.5, diagnostics=plane.diagnostics)
                    wait_until(f"{node.name}'s start-up refit", lambda: [
                        r for r in runs_of(client, [ids[node.deployments["latest"]]])
                        if is_final(r) and not r.auto_scheduled], 120, every_s=0.5, diagnostics=plane.diagnostics)
                    assert node.active_version() == "r1", plane.diagnostics()
            yield plane
        finally:
            for node in nodes:
                node.stop(timeout_s=15)
            server.stop()


def _refused(run, *names: str) -> str:
    assert (run.state_type.value, run.state_name) == ("FAILED", "Refused"), run.state
    for name in names:
        assert name in run.state.message, run.state.message
    return run.state.message


def test_a_run_cannot_point_a_node_at_another_catalog_store_engine_or_endpoint(plane):
    node, before = plane.guard, plane.guard.active_version()
    store = node.store()
    inventory = sorted(store.inventory())
    mine = {"catalog": plane.catalog, "model": MODEL}
    attacks = {
        "a foreign catalog": ({**mine, "catalog": normalize_url(str(plane.outsider / "catalog")), "target": "r1",
                               "only_if_newer": False}, ["params.catalog"]),
        "a store outside the node's": ({**mine, "cache_dir": str(plane.outsider / "store"), "target": "r1",
                                        "only_if_newer": False}, ["params.cache_dir"]),
        "the outsider's engine": ({**mine, "installer": {"kind": "sglang-disk", "engine_urls": [plane.engine.url]},
                                   "target": "r1", "only_if_newer": False},
                                  ["params.installer.kind", "params.installer.engine_urls"]),
        "the outsider's S3 endpoint": ({**mine, "storage": {"endpoint_url": plane.endpoint.url}, "target": "r1",
                                        "only_if_newer": False}, ["params.storage.endpoint_url"]),
        "all of them, and more": ({**mine, "catalog": normalize_url(str(plane.outsider / "catalog")),
                                   "cache_dir": str(plane.outsider / "store"), "seed_checkpoint": "/",
                                   "cache_max_gb": 1e6, "node": "someone-else",
                                   "installer": {"engine_urls": [plane.engine.url], "api_key": "guess"},
                                   "storage": {"endpoint_url": plane.endpoint.url, "anonymous": True},
                                   "verify": "full", "target": "r1"},
                                  ["params.catalog", "params.cache_dir", "params.seed_checkpoint",
                                   "params.cache_max_gb", "params.node", "params.installer.engine_urls",
                                   "params.installer.api_key", "params.storage.endpoint_url",
                                   "params.storage.anonymous", "params.verify"]),
    }
    run_ids = {what: start_run(plane.server, node.deployments["latest"], params)
               for what, (params, _) in attacks.items()}
    for what, (params, names) in attacks.items():
        run = final_run(plane.server, run_ids[what], 120, plane.diagnostics)
        message = _refused(run, *names)
        assert "a run may set only target, only_if_newer" in message
        for other in ("params.catalog", "params.cache_dir", "params.storage.endpoint_url"):
            assert (other in message) == (other in names), (what, message)
        assert plane.task_runs(run.id) == [], what  # not one stage ran
        assert f"flow run {run.name} refused" in node.log.read_text()

    # nothing reached the outsider, nothing of the node changed
    assert plane.engine.connections == 0 and plane.engine.requests == []
    assert plane.endpoint.connections == 0 and plane.endpoint.requests == []
    assert files_under(plane.outsider) == []
    assert node.active_version() == before and sorted(store.inventory()) == inventory
    assert node.store().poisoned() is None
    assert " WARNING canonical_refit.agent: flow run " in node.log.read_text()

    # the node's own values, named in full (as the deployments' own parameters do), are no change: it runs
    same = plane.run(node, "on_publish", {**mine, "cache_dir": f"{node.cache}/", "installer": {"kind": "none"},
                                         "seed_checkpoint": str(plane.trainer.launch), "target": "r1",
                                         "only_if_newer": True})
    assert (same.state_type.value, same.state_name) == ("COMPLETED", "Skipped"), same.state
    assert ADMIN_KEY not in node.log.read_text()


def test_a_remote_rollback_is_refused_unless_the_node_allows_it(plane):
    mine = {"catalog": plane.catalog, "model": MODEL}
    guard, before = plane.guard, plane.guard.active_version()
    assert before == "r1"  # no test of this module moves the guard node

    refused = plane.run(guard, "latest", {**mine, "target": "r0"})
    assert (refused.state_type.value, refused.state_name) == ("FAILED", "Failed"), refused.state
    for fact in ("target r0", "older than the installed r1", "allow_remote_rollback=True"):  # the field
        assert fact in refused.state.message, refused.state.message
    stages = {t.name.rsplit("-", 1)[0] for t in plane.task_runs(refused.id)}
    assert "resolve catalog" in stages and "fetch buckets" not in stages, stages  # refused before any download
    assert guard.active_version() == "r1"
    flipped = plane.run(guard, "latest", {**mine, "target": "r0", "rollbacks": "allow"})
    _refused(flipped, "params.rollbacks")
    assert guard.active_version() == "r1"

    # where the agent allows rollbacks, one is done, and recorded as one
    node = plane.open
    start = node.active_version()
    rollback = plane.run(node, "latest", {**mine, "target": "r0"})
    assert (rollback.state_type.value, rollback.state_name) == ("COMPLETED", "Ready"), rollback.state
    assert node.active_version() == "r0"
    with plane.server.client() as client:
        summary = artifacts_of(client, rollback.id)["refit-summary-lab-guarded"]
    assert f"- rollback: from `{start}`" in summary.data
    assert f"a rollback from {start}" in summary.description
    record = plane.node_record(node)
    assert (record.store_version, record.rollback_from) == ("r0", start)
    forward = plane.run(node, "latest", {**mine, "target": "r1"})  # and back: no rollback
    assert forward.state_name == "Ready" and plane.node_record(node).rollback_from is None


def test_publishing_is_off_by_default_and_pinned_where_it_is_on(plane):
    from prefect.exceptions import ObjectNotFound

    with plane.server.client() as client, pytest.raises(ObjectNotFound):
        client.read_deployment_by_name("publish/publish-guard")  # an inference node publishes nothing
    assert "publish" not in plane.guard.deployments

    store = plane.guard.store()
    node_folder = store.absolute(store.current().path)  # the guard node's installed weights
    assert files_under(node_folder)
    link = plane.trainer.root / "looks-inside"
    link.symlink_to(node_folder, target_is_directory=True)
    inside = plane.trainer.checkpoint()  # a step under the node's checkpoint root
    published = plane.catalog_versions()
    mine = {"catalog": plane.catalog, "model": MODEL}
    outsider = normalize_url(str(plane.outsider / "catalog"))
    attacks = [
        ({"catalog": outsider, "model": MODEL, "checkpoint": str(node_folder)},
         ["params.catalog", "params.checkpoint (outside the checkpoint roots)"]),
        ({**mine, "checkpoint": str(link)}, ["params.checkpoint (outside the checkpoint roots)"]),
        ({**mine, "checkpoint": str(inside), "base_checkpoint": str(node_folder)}, ["params.base_checkpoint"]),
        ({**mine, "checkpoint": str(inside), "storage": {"endpoint_url": plane.endpoint.url}},
         ["params.storage.endpoint_url"]),
        ({**mine, "checkpoint": str(inside), "payload_url": normalize_url(str(plane.outsider / "payload")),
          "state_dir": str(plane.outsider / "state")}, ["params.payload_url", "params.state_dir"]),
    ]
    for params, names in attacks:
        run = plane.run(plane.open, "publish", params)
        _refused(run, *names)
        assert plane.task_runs(run.id) == []
    assert files_under(plane.outsider) == []
    assert plane.endpoint.connections == 0
    assert plane.catalog_versions() == published

    # what the node allows: a checkpoint under its root into its own catalog
    good = plane.run(plane.open, "publish", {**mine, "checkpoint": str(inside), "kind": "full",
                                             "emit_event": False})
    assert good.state_type.value == "COMPLETED", good.state
    assert plane.catalog_versions() == published + [f"r{len(published)}"]
    assert files_under(plane.outsider) == []
    os.unlink(link)
