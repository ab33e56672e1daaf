"""The Prefect flows themselves: each way a run ends is a final state a person reads in the UI.

Most tests build their worlds with the plain runbooks the flows run (``Lab``);
these run the ``refit`` and ``publish`` flows against the session's Prefect
API and read back what the server recorded: the final state's name, one task
run per stage under the stage's name, and the run's stage table and summary
artifacts — for a failed reconstruction too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab import independent_digest
from storage.store.local_store import LocalStore


def _server_view(flow_run_id):
    """(flow run, its task runs by name, its artifacts by key) as the API has them."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return run, {t.name: t for t in tasks}, {a.key: a for a in artifacts}


STAGES = ["resolve catalog", "seed checkpoint", "fetch index", "fetch buckets", "apply deltas", "verify digest",
          "install", "activate"]


def test_a_ready_refit_is_a_flow_run_with_a_task_run_per_stage_and_its_artifacts(flow_lab):
    lab = flow_lab
    published = lab.publish("initial", flow=True)
    assert published.version == "r0"
    lab.publish("delta", flow=True)
    state, result = lab.refit(flow=True)
    assert state.name == "Ready" and state.is_completed() and result.version == "r1"
    assert result.target_digest == independent_digest(lab.expected("r1"))[1]
    run, tasks, artifacts = _server_view(state.state_details.flow_run_id)
    assert run.state_name == "Ready" and run.name == f"refit {lab.model} to latest"
    assert set(STAGES) <= set(tasks) and all(tasks[s].state_name == "Completed" for s in STAGES)
    table = next(a for key, a in artifacts.items() if key.startswith("refit-stages-"))
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data  # the API stores it as JSON text
    assert [row["stage"] for row in rows if row["stage"] in STAGES] == STAGES
    assert any(key.startswith("refit-summary-") for key in artifacts)


def test_a_failed_reconstruction_shows_the_failed_stage_and_its_summary(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    assert lab.refit()[0].name == "Ready"
    lab.publish("delta")
    bucket = next((lab.root / "revisions" / "r2").glob("bucket-*.safetensors"))
    raw = bytearray(bucket.read_bytes())
    raw[-1] ^= 0xFF  # a corrupt frame: refused while applying
    bucket.write_bytes(bytes(raw))
    state, result = lab.refit(flow=True)
    assert state.name == "Failed" and state.is_failed() and result.installed_version == "r1"
    run, tasks, artifacts = _server_view(state.state_details.flow_run_id)
    assert run.state_name == "Failed" and "r2" in run.state.message
    failed = [name for name, task in tasks.items() if task.state_type.value == "FAILED"]
    assert failed and set(failed) <= {"fetch buckets", "apply deltas"}
    summary = next(a for key, a in artifacts.items() if key.startswith("refit-summary-"))
    assert "## Failure" in summary.data and "r2" in summary.data and "unchanged" in summary.data
    assert LocalStore(lab.cache, lab.model).active().version == "r1"


def test_skipped_and_poisoned_runs_end_in_states_of_their_name(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    assert lab.refit()[0].name == "Ready"
    state, result = lab.refit(flow=True, target="r0", only_if_newer=True)
    assert state.name == "Skipped" and state.is_completed() and "not newer" in result.notes[-1]
    store = LocalStore(lab.cache, lab.model)
    store.mark_poisoned("test: an engine died mid-load", "r1", "none")
    lab.publish("delta")
    state, result = lab.refit(flow=True)
    assert state.name == "Poisoned" and state.is_failed() and result.status == "POISONED"
    assert "recover" in result.next_step


def test_a_plain_run_ends_in_the_state_the_flow_would(flow_lab):
    """The worlds of the other tests are built plainly: the same result gives the same final state."""
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    plain_state, plain = lab.refit(cache_dir=lab.root / "plain")
    flow_state, flowed = lab.refit(cache_dir=lab.root / "flowed", flow=True)
    assert (plain_state.name, plain_state.type) == (flow_state.name, flow_state.type) == ("Ready", flow_state.type)
    assert (plain.version, plain.target_digest) == (flowed.version, flowed.target_digest)
    assert [s["name"] for s in plain.stages] == [s["name"] for s in flowed.stages]


@pytest.mark.parametrize("kind", ["full"])
def test_the_publish_flow_records_what_it_published(flow_lab, kind):
    lab = flow_lab
    lab.publish("initial")
    result = lab.publish(kind, flow=True)
    record = json.loads((Path(lab.catalog_dir) / f"{result.version}.json").read_text())
    assert record["payload_format"] == "full_hf_checkpoint" and record["target_digest"] == result.target_digest
    assert result.target_digest == independent_digest(lab.expected(result.version))[1]
    assert [s["name"] for s in result.stages] == ["plan revision", "encode payload", "upload payload", "write record"]
    assert all(s["status"] == "ok" for s in result.stages) and result.stages[2]["bytes"] == result.bytes_written
