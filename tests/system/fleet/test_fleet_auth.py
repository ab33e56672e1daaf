"""A fleet whose Prefect server has authentication on: the product's commands work with the credentials, and a
client without them is refused (401) and starts nothing.

The server runs with Prefect's basic authentication
(``PREFECT_SERVER_API_AUTH_STRING``); the node agent, the publisher (and its
published event), ``flows.fleet`` and the test's own client carry
``PREFECT_API_AUTH_STRING`` (``PrefectServer.client_env``), as docs/fleet.md
says to run them. A publication reaches the node; then an outsider without the
credentials (or with wrong ones) reads, creates and deletes nothing.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from tests.support.fleet_support import Fleet
from tests.support.s3_support import s3  # noqa: F401 (the fixture)
from testbed.prefect_server import PREFECT, PrefectServer, auth_headers
from testbed.processes import ROOT

pytestmark = pytest.mark.server
AUTH = "fleet-admin:a-long-random-password"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    server = PrefectServer(tmp_path_factory.mktemp("auth-server"), auth_string=AUTH, migrated=True)
    try:
        yield server.start()
    finally:
        server.stop()


def test_an_authenticated_fleet_works_and_refuses_clients_without_credentials(auth_server, s3, tmp_path):
    fleet = Fleet(auth_server, s3.endpoint, tmp_path, f"{s3.prefix('auth')}/catalog")
    node = fleet.node("locked", poll_s=1.0)
    try:
        node.start()
        ids = fleet.registered(node)
        fleet.final_runs("locked", "latest", which=("latest",))  # the start-up refit, through the API

        # the trainer publishes with the credentials: its event reaches the node, which refits
        assert fleet.publish("initial")["version"] == "r0"
        assert fleet.publish()["version"] == "r1"
        (ready,) = fleet.final_runs("locked", "r1")
        assert ready.state_name == "Ready", ready.state.message
        assert node.active_version() == "r1"
        code, waited = fleet.fleet("wait", "--version", "r1", "--nodes", "1", "--timeout", "60")
        assert code == 0, waited
        code, status = fleet.fleet("status")
        assert code == 0 and [n["node"] for n in status["nodes"]] == ["locked"], status
        # a one-off refit on the node's host reports its flow run to the server, with the credentials
        done = fleet.run("-m", "flows.refit", "--catalog", fleet.catalog, "--model", node.model, "--node", "locked",
                         "--cache-dir", str(node.cache), "--seed-checkpoint", str(node.seed), "--installer", "none",
                         "--s3-endpoint-url", s3.endpoint, "--only-if-newer", "--json")
        assert json.loads(done.stdout.strip().splitlines()[-1])["status"] == "SKIPPED"
        with auth_server.client() as client:
            one_offs = [r for r in client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["refit"])))
                        if r.deployment_id is None]
        assert [r.state_name for r in one_offs] == ["Skipped"], one_offs

        # an outsider with network access but no (or wrong) credentials: 401 for every request
        runs_before = len(fleet.runs("locked", scheduled=True))
        url = auth_server.url
        deployment = ids["latest"]
        for headers in ({}, auth_headers("fleet-admin:guessed"), {"Authorization": "Bearer " + AUTH}):
            with httpx.Client(timeout=10, headers=headers) as outsider:
                answers = [
                    outsider.get(f"{url}/deployments/name/refit/refit-latest-locked"),
                    outsider.get(f"{url}/deployments/{deployment}"),
                    outsider.post(f"{url}/deployments/{deployment}/create_flow_run",
                                  json={"parameters": {"params": {"target": "r0"}}}),
                    outsider.post(f"{url}/flow_runs/filter", json={}),
                    outsider.delete(f"{url}/flow_runs/{ready.id}"),
                    outsider.delete(f"{url}/deployments/{deployment}"),
                ]
            assert [a.status_code for a in answers] == [401] * len(answers), [a.text for a in answers]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # probes need no credentials

        # Prefect's own CLI, without the credentials, starts nothing either
        env = {k: v for k, v in fleet.env.items() if k != "PREFECT_API_AUTH_STRING"}
        done = subprocess.run([PREFECT, "deployment", "run", "refit/refit-latest-locked"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "401" in done.stdout + done.stderr, done.stdout + done.stderr

        with auth_server.client() as client:  # nothing was created, read back with the credentials
            assert client.read_flow_run(ready.id).state_name == "Ready"
            assert client.read_deployment(deployment).name == "refit-latest-locked"
        assert len(fleet.runs("locked", scheduled=True)) == runs_before
        assert node.active_version() == "r1"
    finally:
        fleet.stop_all()
