"""A fleet for the tests: one Prefect server on PostgreSQL, node agents as processes, the trainer's commands.

The machinery (server, database, agents, trainer) is ``testbed/``, shared
with the fleet benchmarks; this adds what the test drives: the
trainer publishing with ``python -m flows.publish``, the fleet view and
``wait`` as the trainer runs them (``python -m flows.fleet``), and reading
each node's runs back from the server. Every wait is bounded and fails with
the agents' logs.
"""

from __future__ import annotations

import json
import subprocess
import threading
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flows.synthetic import ModelShape
from tests.support.s3_support import aws_environment
from testbed.nodes import NodeProcess
from testbed.prefect_server import (
    PrefectServer, deployment_ids, is_final, migrated_postgres, runs_of, target_of,
)
from testbed.processes import PYTHON, ROOT, wait_until
from testbed.trainer import Trainer

MODEL = "lab/fleet"
ZOMBIE_AFTER_S = 45
HELD_BUCKET = "bucket-00001.safetensors"  # a download of it is held (a fault proxy) while a node's agent is killed
# 1.8 MB of bf16 weights: a dense step published with --bucket-mib 1 is two buckets
SHAPE = ModelShape(vocab=2048, hidden=128, intermediate=344, layers=2, shards=2)


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory):
    """A Prefect server on a database of its own (dropped after), for one test module."""
    root = tmp_path_factory.mktemp("fleet-server")
    database = migrated_postgres()
    server = PrefectServer(root, database.url)
    try:
        yield server.start()
    finally:
        server.stop()
        database.drop()


@dataclass
class Fleet:
    """The trainer and the nodes of one test, on one server and one S3 prefix."""

    server: PrefectServer
    endpoint: str  # the S3 server the trainer and the fleet view use
    root: Path
    catalog: str
    trainer: Trainer = None
    nodes: dict[str, NodeProcess] = field(default_factory=dict)
    deployment_ids: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self):
        self.trainer = Trainer(self.root / "trainer", self.catalog, MODEL, shape=SHAPE, endpoint=self.endpoint)
        self.env = self.server.client_env(self.root / "trainer-home", **aws_environment())

    # -- nodes -----------------------------------------------------------------------------------------

    def node(self, name: str, *, endpoint: str | None = None, installer: tuple[str, ...] = ("--installer", "none"),
             poll_s: float | None = None, api_url: str | None = None, serve_args: tuple[str, ...] = (),
             **extra_env: str) -> NodeProcess:
        """A node agent (not started), attached to ``api_url`` (default: the server's first API process), with
        ``serve_args`` for ``deployments.serve``."""
        # flow-run heartbeats every 30 s (Prefect's minimum) and the zombie automation at 45 s: a killed agent's
        # run is Crashed by the server within a minute; the node's own record is refreshed every 2 s
        env = self.server.client_env(self.root / "nodes" / f"{name}-home", api_url,
                                     PREFECT_FLOWS_HEARTBEAT_FREQUENCY="30", **aws_environment(), **extra_env)
        node = NodeProcess(name, self.root / "nodes", self.catalog, MODEL, self.trainer.launch, env,
                           s3_endpoint=endpoint or self.endpoint, poll_s=poll_s, installer=installer,
                           extra=("--zombie-after", str(ZOMBIE_AFTER_S), "--heartbeat-seconds", "2", *serve_args))
        self.nodes[name] = node
        return node

    def registered(self, node: NodeProcess, timeout_s: float = 120) -> dict:
        """Wait until the node's agent registered its deployments; their ids by short name."""
        names = node.deployments

        def check():
            if not node.alive:
                raise AssertionError(f"{node.name}'s agent exited with {node.proc.returncode}\n{node.diagnostics()}")
            with self.server.client() as client:
                ids = deployment_ids(client, list(names.values()))
            return ids and {short: ids[full] for short, full in names.items()}

        self.deployment_ids[node.name] = wait_until(f"{node.name} to register its deployments", check, timeout_s,
                                                    every_s=0.5, diagnostics=self.diagnostics)
        return self.deployment_ids[node.name]

    def events(self, name: str, *, since: datetime) -> list:
        """Events named ``name`` the server received since ``since``, oldest first."""
        from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter

        with self.server.client() as client:
            page = client.read_events(EventFilter(event=EventNameFilter(name=[name]),
                                                  occurred=EventOccurredFilter(since=since)), limit=50)
        return sorted(page.events, key=lambda e: e.occurred)

    def runs(self, name: str, which: tuple[str, ...] = ("latest", "on_publish"), *, scheduled: bool = False) -> list:
        """The node's refit runs (of its refit-latest and refit-on-publish deployments), oldest first; runs the
        interval schedule created ahead of time only once they started (or all of them, with ``scheduled``)."""
        ids = self.deployment_ids[name]
        with self.server.client() as client:
            runs = runs_of(client, [ids[w] for w in which])
        return [r for r in runs if scheduled or not r.auto_scheduled or r.start_time]

    def final_runs(self, name: str, target: str, count: int = 1, which=("on_publish",), timeout_s: float = 120,
                   since=None) -> list:
        """Wait until ``count`` of the node's runs for ``target`` (created after ``since``) are final; those runs."""
        def check():
            runs = [r for r in self.runs(name, which) if target_of(r) == target
                    and (since is None or r.created > since)]
            return runs if len(runs) >= count and all(is_final(r) for r in runs) else None

        return wait_until(f"{name}: {count} final run(s) to {target}", check, timeout_s, every_s=0.5,
                          diagnostics=self.diagnostics)

    def diagnostics(self) -> str:
        return "\n".join(node.diagnostics() for node in self.nodes.values())

    def stop_all(self) -> None:
        for node in self.nodes.values():
            node.stop(timeout_s=15)

    # -- the trainer's commands ------------------------------------------------------------------------

    def run(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run([PYTHON, *args], env=self.env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=timeout_s)
        if check:
            assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}" \
                                         f"\n{done.stderr[-3000:]}"
        return done

    def publish(self, kind: str = "delta", *extra: str) -> dict:
        """``python -m flows.publish`` of the trainer's next step (the launch snapshot first): its JSON result."""
        folder = self.trainer.checkpoint()
        done = self.run("-m", "flows.publish", "--catalog", self.catalog, "--model", MODEL, "--checkpoint",
                        str(folder), "--kind", kind, "--state-dir", str(self.trainer.state_dir),
                        "--s3-endpoint-url", self.endpoint, "--json", *extra)
        return json.loads(done.stdout.strip().splitlines()[-1])

    def announce(self, *versions: str) -> None:
        """Emit the published event again for versions already in the catalog (the publisher's own emitter)."""
        code = ("import sys\n"
                "from flows.publish import emit_published\n"
                "from storage.catalog.records import Catalog\n"
                "from storage.objects.store import ObjectStore\n"
                "from storage.settings import ObjectStoreSettings\n"
                "catalog = Catalog(ObjectStore(ObjectStoreSettings(endpoint_url=sys.argv[1])), sys.argv[2], sys.argv[3])\n"
                "for version in sys.argv[4:]:\n"
                "    emit_published(catalog.read(version), catalog)\n")
        self.run("-c", code, self.endpoint, self.catalog, MODEL, *versions)

    def fleet(self, command: str, *args: str, timeout_s: float = 120) -> tuple[int, dict]:
        """``python -m flows.fleet COMMAND ... --json``: (exit code, printed JSON)."""
        done = self.run("-m", "flows.fleet", command, "--catalog", self.catalog, "--model", MODEL,
                        "--s3-endpoint-url", self.endpoint, "--json", *args, check=False, timeout_s=timeout_s)
        lines = done.stdout.strip().splitlines()
        assert lines, f"flows.fleet {command} printed nothing (exit {done.returncode}):\n{done.stderr[-3000:]}"
        return done.returncode, json.loads(lines[-1])


def held_mid_refit(fleet: "Fleet", node: NodeProcess, proxy, version: str):
    """Wait until ``node``'s refit to ``version`` runs, with the store UPDATING and its download of HELD_BUCKET
    held by ``proxy``: that run."""
    def mid_refit():
        running = [r for r in fleet.runs(node.name, ("on_publish",)) if target_of(r) == version
                   and r.state_type and r.state_type.value == "RUNNING"]
        state = node.store().state()
        held = [r for r in proxy.requests(HELD_BUCKET, "GET") if f"/{version}/" in r.path and r.ended is None]
        return running and held and state is not None and state.status == "UPDATING" and running[0]

    return wait_until(f"{node.name} to hold {version} half-applied", mid_refit, 120, diagnostics=fleet.diagnostics)


def assert_zombie_automation(fleet: "Fleet") -> None:
    """The server has the zombie automation the agents ensure: a run of ours silent for ZOMBIE_AFTER_S after a
    flow-run heartbeat is Crashed (its window compared as configuration, with the one the product builds)."""
    from deployments.orphans import RUN_TAG, ZOMBIE_AUTOMATION, zombie_automation

    window = zombie_automation(ZOMBIE_AFTER_S).trigger.within

    with fleet.server.client() as client:
        automations = client.read_automations_by_name(ZOMBIE_AUTOMATION)
    assert automations, f"no automation {ZOMBIE_AUTOMATION!r}"
    for automation in automations:  # agents started at once may each have created one: every one is right
        trigger, (action,) = automation.trigger, automation.actions
        assert automation.enabled and trigger.posture.value == "Proactive", automation
        assert trigger.within == window and trigger.after == {"prefect.flow-run.heartbeat"}
        assert "prefect.flow-run.heartbeat" in trigger.expect and "prefect.flow-run.Ready" in trigger.expect
        assert f"prefect.tag.{RUN_TAG}" in str(trigger.match_related), trigger.match_related
        assert action.type == "change-flow-run-state" and action.state.value == "CRASHED", action


def spans(runs: list) -> list[tuple]:
    """(start, end) of every run that started; a run still going has no end (it overlaps whatever follows)."""
    from datetime import datetime, timezone

    far = datetime.max.replace(tzinfo=timezone.utc)
    return sorted((r.start_time, r.end_time or far, r.name) for r in runs if r.start_time)


class Inbox:
    """A loopback HTTP endpoint that keeps the JSON bodies POSTed to it: where the test's alerts go."""

    def __init__(self):
        inbox = self
        self.messages: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                inbox.messages.append(json.loads(body or b"{}"))
                self.send_response(204)
                self.end_headers()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/alerts"

    def __enter__(self) -> "Inbox":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def create_poisoned_alert(server: PrefectServer, model: str, inbox_url: str):
    """The alert of docs/fleet.md on ``server``: a webhook notification block and ``flows.fleet.poisoned_alert``."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.fleet import poisoned_alert

    with temporary_settings({PREFECT_API_URL: server.url}):
        block = CustomWebhookNotificationBlock(name="refit-alerts", url=inbox_url,
                                               json_data={"subject": "{{subject}}", "body": "{{body}}"})
        block_id = block.save("refit-alerts", overwrite=True)
        return poisoned_alert(model, block_id).create()
