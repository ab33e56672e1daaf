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

from tests.support.lab import independent_digest
from storage.store.local_store import LocalStore


def _server_view(flow_run_id, *, stages: int = 0):
    """(flow run, its task runs by name, its artifacts by key) as the API has them, once it has recorded at
    least ``stages`` task runs in a final state (the server records task runs from their events, a moment
    after the run ends)."""
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            if sum(t.state is not None and t.state.is_final() for t in tasks) >= stages or time.monotonic() > deadline:
                break
            time.sleep(0.2)
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
    run, tasks, artifacts = _server_view(state.state_details.flow_run_id, stages=len(STAGES))
    assert run.state_name == "Ready" and run.name.startswith("refit ")
    assert run.name.endswith(f": {lab.model} none -> latest")  # the node, and from what the store had to the target
    assert set(STAGES) <= set(tasks) and all(tasks[s].state_name == "Completed" for s in STAGES)
    table = next(a for key, a in artifacts.items() if key.startswith("refit-stages-"))
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data  # the API stores it as JSON text
    assert [row["stage"] for row in rows if row["stage"] in STAGES] == STAGES
    assert table.description.endswith(f"READY r1 {result.target_digest}")  # the outcome in a line
    # a Ready run of a few seconds sends nothing else: no summary, no progress (nobody watched it)
    assert [key.split("-")[1] for key in artifacts] == ["stages"]


def test_a_long_refit_shows_its_progress_and_a_short_one_sends_none(flow_lab, monkeypatch):
    """Progress is for a person watching a long refit: with the threshold at zero (a long refit) the run has a
    progress artifact that ends at 100; the same refit under the default threshold has none."""
    from flows import report

    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    monkeypatch.setattr(report, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0.0)
    state, _ = lab.refit(flow=True, cache_dir=lab.root / "watched")
    _, _, artifacts = _server_view(state.state_details.flow_run_id)
    progress = next(a for key, a in artifacts.items() if key.startswith("refit-progress-"))
    assert state.name == "Ready" and progress.data == 100


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
    assert all(s["status"] == "COMPLETED" for s in result.stages) and result.stages[2]["bytes"] == result.bytes_written


def test_a_failed_flow_raises_the_runs_own_typed_error_and_its_caller_reads_the_outcome(flow_lab):
    """A failed run's final state carries the run's own typed error (a plain call of the flow raises it, naming
    the revision), not a stand-in carrying the result; the caller reads the whole outcome from its watch."""
    from flows.refit import refit
    from flows.report import watching
    from storage.errors import FormatError

    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    bucket = next((lab.root / "revisions" / "r1").glob("bucket-*.safetensors"))
    raw = bytearray(bucket.read_bytes())
    raw[-1] ^= 0xFF
    bucket.write_bytes(bytes(raw))
    with watching() as watch, pytest.raises(FormatError) as caught:
        refit(lab.refit_params())
    error = caught.value
    assert error.revision == "r1" and not hasattr(error, "result")
    outcome = watch.outcome
    assert outcome.status == "FAILED" and outcome.exception is error and outcome.installed_version is None
    assert "apply deltas" in [s["name"] for s in outcome.stages] and outcome.next_step
    with pytest.raises(AttributeError):  # the outcome is a frozen value
        outcome.status = "READY"


def test_two_refits_in_one_process_each_read_their_own_outcome(flow_lab):
    """Two flow runs at once on two threads of one process (two stores): each caller's watch holds its own run's
    outcome, never the other's."""
    import threading

    from flows.refit import refit
    from flows.report import result_of, watching

    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    outcomes: dict = {}

    def run(target: str) -> None:
        with watching() as watch:
            state = refit(lab.refit_params(cache_dir=lab.root / f"cache-{target}", target=target), return_state=True)
        outcomes[target] = (watch.outcome, result_of(state, watch))

    threads = [threading.Thread(target=run, args=(target,)) for target in ("r0", "r1")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sorted(outcomes) == ["r0", "r1"]
    for target, (watched, read) in outcomes.items():
        assert watched is read and watched.status == "READY" and watched.version == target, (target, watched)
