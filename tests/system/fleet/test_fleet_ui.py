"""What the Prefect UI shows of a node's refits, read back through the Prefect client.

* a run is named for its node and the versions (``refit NODE: MODEL FROM ->
  TO``), whoever started it; a name the agent gave (``refit gpu1 r0 -> r1``)
  keeps its versions instead of giving way to the flow's template;
* a one-off run (``python -m flows.refit``, ``flows.api.refit`` inside a flow
  run) carries its node's tag ``node:NAME``, as the agent's runs do;
* a failed refit logs its error at ERROR in the run's logs, naming the
  revision, the file and the tensor at fault.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.lab import ROOT_DIR


@pytest.fixture
def cli_env(prefect_api, tmp_path):
    """A CLI subprocess's environment: the test session's Prefect API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CANONICAL_REFIT_")}
    env.update(PREFECT_API_URL=prefect_api, PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(ROOT_DIR))
    return env


def one_off(lab, env, node: str, *args: str) -> dict:
    """``python -m flows.refit`` on the host of ``node``; its JSON result."""
    out = subprocess.run([sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model,
                          "--node", node, "--cache-dir", str(lab.root / node), "--seed-checkpoint", str(lab.launch),
                          "--json", *args], capture_output=True, text=True, env=env, cwd=ROOT_DIR, timeout=300)
    assert out.stdout.strip(), out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def runs_of(node: str) -> list:
    """The refit runs tagged with ``node``, oldest first."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"node:{node}"])),
                                     sort=FlowRunSort.START_TIME_ASC)
    return runs


def error_logs(flow_run_id) -> list:
    """The run's log lines at ERROR or above, once the API has them (logs are sent in batches)."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel

    wanted = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]), level=LogFilterLevel(ge_=40))
    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=wanted)
            if logs or time.monotonic() > deadline:
                return logs
            time.sleep(0.3)


def corrupt_latest_bucket(lab, version: str) -> str:
    """Flip the last byte of the revision's bucket (a corrupt frame: refused while applying); its file name."""
    bucket = next((lab.root / "revisions" / version).glob("bucket-*.safetensors"))
    raw = bytearray(bucket.read_bytes())
    raw[-1] ^= 0xFF
    bucket.write_bytes(bytes(raw))
    return bucket.name


def test_one_off_runs_carry_their_node_tag_and_names_with_both_versions_and_a_failure_is_an_error_log(
        flow_lab, cli_env):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    assert one_off(lab, cli_env, "ui-one")["status"] == "READY"
    lab.publish("delta")
    bucket = corrupt_latest_bucket(lab, "r2")
    failed = one_off(lab, cli_env, "ui-one", "--target", "r2")
    assert failed["status"] == "FAILED" and failed["installed_version"] == "r1"

    first, second = runs_of("ui-one")
    assert (first.name, first.state_name) == (f"refit ui-one: {lab.model} none -> latest", "Ready")
    assert (second.name, second.state_name) == (f"refit ui-one: {lab.model} r1 -> r2", "Failed")
    assert "node:ui-one" in first.tags and "node:ui-one" in second.tags

    # the failure is logged at ERROR in the run's logs, naming revision, file and tensor (the error's words)
    logs = error_logs(second.id)
    line = next((log.message for log in logs if "ended FAILED" in log.message), None)
    assert line is not None, [log.message for log in logs]
    assert "node ui-one" in line and "revision 'r2'" in line and bucket in line and "tensor '" in line
    assert failed["error"] in line
    assert error_logs(first.id) == []  # a Ready run logs nothing at ERROR


def test_a_name_the_agent_gives_keeps_its_versions_and_a_generated_one_gives_way_to_the_nodes(flow_lab):
    """The agent names the runs it creates (``refit NODE FROM -> TO``); Prefect's flow-run-name template
    used to overwrite that when the run started. The run is started as the agent starts it (Prefect's flow
    engine with the claimed run)."""
    from prefect import get_client
    from prefect.flow_engine import run_flow

    from deployments.serve import refit_parameters
    from flows.refit import refit

    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    lab.publish("delta")
    params = lab.refit_params(node="ui-agent", cache_dir=lab.root / "ui-agent")
    assert lab.run(node="ui-agent", cache_dir=lab.root / "ui-agent", target="r1").status == "READY"
    deployment = refit.to_deployment("refit-ui-agent", parameters=refit_parameters(params, target="latest"),
                                     tags=["node:ui-agent"])
    with get_client(sync_client=True) as client:
        deployment_id = deployment.apply()
        named = client.create_flow_run_from_deployment(deployment_id, name="refit ui-agent r1 -> r2",
                                                       parameters=refit_parameters(params, target="r2"))
        state = run_flow(refit, flow_run=client.read_flow_run(named.id), parameters={"params": params.model_copy(
            update={"target": "r2"})}, return_type="state")
        assert state.name == "Ready"
        generated = client.create_flow_run_from_deployment(deployment_id)  # a name like "crimson-fox"
        state = run_flow(refit, flow_run=client.read_flow_run(generated.id), parameters={"params": params.model_copy(
            update={"only_if_newer": True})}, return_type="state")
        assert state.name == "Skipped"  # already at the head
        assert client.read_flow_run(named.id).name == f"refit ui-agent: {lab.model} r1 -> r2"
        assert client.read_flow_run(generated.id).name == f"refit ui-agent: {lab.model} r2 -> latest"


def test_a_refit_through_the_python_api_inside_a_flow_run_is_a_subflow_tagged_with_its_node(flow_lab):
    from prefect import flow

    from flows import api

    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")

    @flow(name="rl-step")
    def rl_step():
        return api.refit(catalog=lab.catalog, model=lab.model, node="ui-api", cache_dir=lab.root / "ui-api",
                         seed_checkpoint=lab.launch, installer={"kind": "none"}).status

    assert rl_step() == "READY"
    (run,) = runs_of("ui-api")
    assert run.parent_task_run_id is not None  # a subflow of the caller's run
    assert (run.name, run.state_name) == (f"refit ui-api: {lab.model} none -> latest", "Ready")
