"""A storage outage at refit time is retried once storage is back; a rejected revision is not.

A refit whose storage is out fails on a ``StorageError``: a connection error
(transient), or a file:// catalog whose mount is gone, or an S3 endpoint
answering 403 ExpiredToken or 404 during an incident (``ObjectNotFound`` /
``AccessDenied``, permanent for that one request). Either way the revision
could not be *read*: the node's record says so (``failure: "storage"``), the
agent's head check (``flows.node_report.HeadWatch``, what the agent asks
every ``--head-poll-seconds``) tries it again, and ``flows.fleet wait`` /
``flows.api.wait_for`` count the node behind (storage error, retrying), never
failed. A revision whose bytes were read and refused (a checksum mismatch)
is a rejection (``failure: "content"``): not retried (the same bytes would be
refused again) until a newer publication, and counted failed by ``wait``.
The agent backs off while storage retries keep failing, never beyond the
head check's cap of 60 s.
"""

from __future__ import annotations

from types import SimpleNamespace
from uuid import uuid4

import pytest

from deployments.agent import NodeAgent
from deployments.agent_head import HEAD_POLL_CAP_S
from flows import api, node_report
from flows.fleet import main as fleet_main
from tests.support.fleet_cli import fleet
from tests.support.fleet_support import fleet_server  # noqa: F401  (a fixture)
from tests.support.s3_support import s3, s3_lab  # noqa: F401  (s3 is a fixture)
from storage.catalog.nodes import failure_kind
from storage.errors import (
    AccessDenied, ChecksumMismatch, FormatError, ImmutableConflict, LineageError, ObjectNotFound, PoisonedError,
    TransientStorageError,
)
from testbed.s3proxy import Faults


def record(capsys, lab, node: str) -> dict:
    code, view = fleet(capsys, lab, "status")
    assert code == 0
    return next(n for n in view["nodes"] if n["node"] == node)


def at_r1_with_r2_published(lab):
    lab.publish("initial")
    lab.publish("delta")
    assert lab.run(node="gpu1", target="r1").status == "READY"
    lab.publish("delta")


def test_a_refit_that_failed_while_file_storage_was_out_is_retried_once_it_is_back(lab, capsys):
    at_r1_with_r2_published(lab)
    payload = lab.root / "revisions"
    payload.rename(lab.root / "revisions.out")  # the payload's storage is out (a mount gone)
    failed = lab.run(node="gpu1", target="r2", only_if_newer=True)  # a refit-on-publish run for r2
    assert failed.status == "FAILED" and "r2" in failed.error
    assert failed.error_detail["type"] == "ObjectNotFound"  # permanent for the request, an outage for the node
    written = record(capsys, lab, "gpu1")
    assert (written["status"], written["failure"], written["target_version"]) == ("FAILED", "storage", "r2")

    # while storage is out: the barrier waits (behind, storage error, retrying), naming the node and its error
    code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--timeout", "0.3", "--poll", "0.1")
    assert (code, waited["outcome"], waited["failed"], waited["behind"]) == (1, "timeout", [], ["gpu1"])
    assert waited["retrying"]["gpu1"]["version"] == "r2" and "r2" in waited["retrying"]["gpu1"]["error"]
    capsys.readouterr()
    assert fleet_main(["wait", "--catalog", lab.catalog, "--model", lab.model, "--version", "r2",
                       "--timeout", "0.3", "--poll", "0.1"]) == 1
    assert "behind (storage error, retrying): gpu1 (r2): " in capsys.readouterr().out.splitlines()[-1]
    assert fleet_main(["status", "--catalog", lab.catalog, "--model", lab.model]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gpu1"))
    assert "FAILED" in row and "storage error, retrying: " in row  # the status view says the same

    (lab.root / "revisions.out").rename(payload)  # storage is back
    watch = node_report.HeadWatch(lab.refit_params(node="gpu1"))
    outcome = api.wait_for("r2", catalog=lab.catalog, model=lab.model, timeout_s=1, poll_s=0.5, check=False)
    assert outcome.outcome != "failed", outcome.failures  # nothing is wrong with r2
    assert list(outcome.retrying) == ["gpu1"] and "storage error, retrying" in outcome.describe()
    due = watch.due()
    assert due is not None and due[0] == "r2" and due.storage_retry  # the next head check tries r2 again
    assert "storage failure" in due.why

    # the refit-latest run the head check creates gets there, and the barrier is reached
    caught_up = lab.run(node="gpu1", target="latest", only_if_newer=True)
    assert (caught_up.status, caught_up.version) == ("READY", "r2"), caught_up.error
    assert watch.due() is None
    assert record(capsys, lab, "gpu1")["failure"] is None
    code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--timeout", "60")
    assert (code, waited["outcome"], waited["reached"], waited["retrying"]) == (0, "reached", ["gpu1"], {})


def test_a_revision_whose_bytes_were_refused_is_not_retried_and_wait_counts_the_node_failed(lab, capsys):
    at_r1_with_r2_published(lab)
    bucket = lab.root / "revisions" / "r2" / "bucket-00000.safetensors"
    data = bucket.read_bytes()
    bucket.write_bytes(data[:-64] + bytes(b ^ 0xFF for b in data[-64:]))  # a checksum no receiver accepts
    failed = lab.run(node="gpu1", target="r2", only_if_newer=True)
    assert failed.status == "FAILED" and isinstance(failed.exception, FormatError), failed.error  # refused bytes
    written = record(capsys, lab, "gpu1")
    assert (written["status"], written["failure"], written["target_version"]) == ("FAILED", "content", "r2")

    watch = node_report.HeadWatch(lab.refit_params(node="gpu1"))
    assert watch.due() is None  # the same bytes would be refused again: not retried
    code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--timeout", "60")
    assert (code, waited["outcome"], waited["failed"], waited["retrying"]) == (4, "failed", ["gpu1"], {})
    assert "bucket-00000.safetensors" in waited["failures"]["gpu1"]["error"]
    with pytest.raises(api.VersionFailed) as raised:
        api.wait_for("r2", catalog=lab.catalog, model=lab.model, timeout_s=60)
    assert list(raised.value.failures) == ["gpu1"] and raised.value.outcome.retrying == {}

    lab.publish("full")  # a newer publication moves it on
    due = watch.due()
    assert due is not None and due[0] == "r3" and not due.storage_retry


def test_a_denied_s3_read_is_a_storage_failure_that_the_barrier_waits_through(s3, tmp_path, capsys):  # noqa: F811
    """S3 answering 403 (an expired token) for the revision's payload: AccessDenied, retried, never failed."""
    lab = s3_lab(tmp_path, s3, "outage-retry")
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind, storage=s3.settings())
    assert lab.run(target="r1", node="gpu1", storage=s3.settings()).status == "READY"
    with s3.proxy(Faults(deny=("/revisions/r2/",)), lifetime_s=120) as proxy:
        failed = lab.run(target="r2", node="gpu1", only_if_newer=True, storage=s3.settings(proxy.url))
    assert failed.status == "FAILED" and failed.error_detail["type"] == "AccessDenied", failed.error
    outcome = api.wait_for("r2", catalog=lab.catalog, model=lab.model, storage=s3.settings(), timeout_s=0.3,
                           poll_s=0.1)
    assert (outcome.outcome, outcome.failed, outcome.behind) == ("timeout", [], ["gpu1"])
    assert outcome.retrying["gpu1"]["version"] == "r2" and "denied" in outcome.retrying["gpu1"]["error"].lower()
    due = node_report.HeadWatch(lab.refit_params(node="gpu1", storage=s3.settings())).due()
    assert due is not None and due[0] == "r2" and due.storage_retry


@pytest.mark.parametrize("error, kind", [
    (ObjectNotFound("gone"), "storage"), (AccessDenied("403 ExpiredToken"), "storage"),
    (TransientStorageError("reset"), "storage"), ("ObjectNotFound", "storage"),
    (ChecksumMismatch("bad"), "content"), (LineageError("wrong base"), "content"),
    (PoisonedError("partial"), "content"), (ImmutableConflict("other bytes"), "content"),
    (RuntimeError("bug"), "content"), ("ChecksumMismatch", "content"), (None, "content"),
])
def test_a_failure_is_storage_when_the_revision_could_not_be_read_and_content_otherwise(error, kind):
    assert failure_kind(error) == kind


class _StubClient:
    """The two Prefect client calls a head check makes: it creates a refit-latest run, then asks what is due."""

    def __init__(self):
        self.created: list[str] = []

    def create_flow_run_from_deployment(self, deployment_id, name=None, tags=None):
        self.created.append(name)
        return SimpleNamespace(name=name, id=uuid4())


class _Watch:
    def __init__(self, due):
        self.answer = due

    def due(self):
        return self.answer

    def installed(self):
        return "r1"


def test_the_agent_backs_off_storage_retries_up_to_the_cap_and_resets_once_they_stop(monkeypatch):
    watch = _Watch(node_report.Due("r2", "retrying r2 after a storage failure (gone)", storage_retry=True))
    agent = NodeAgent([], {}, head_watch=watch, head_poll_s=10.0, node="gpu1")
    agent._latest_id = uuid4()
    monkeypatch.setattr(agent, "_due", lambda client, ids: ["the run it created"])
    client = _StubClient()
    intervals = []
    for _ in range(6):  # storage keeps failing: each check retries, each a longer interval after it
        assert agent._check_head(client, []) == ["the run it created"]
        intervals.append(agent.head_interval_s())
    assert intervals == [10.0, 20.0, 40.0, HEAD_POLL_CAP_S, HEAD_POLL_CAP_S, HEAD_POLL_CAP_S]
    assert client.created == ["refit gpu1 r1 -> r2"] * 6 and agent.stats.catch_ups == 6

    watch.answer = None  # the retry got through: the node runs the head
    assert agent._check_head(client, []) == [] and agent.head_interval_s() == 10.0
    watch.answer = node_report.Due("r3", "the catalog's head is r3, the node runs r2")
    agent._check_head(client, [])
    assert agent.head_interval_s() == 10.0 and client.created[-1] == "refit gpu1 r1 -> r3"


@pytest.mark.server
def test_the_agent_retries_a_refit_that_failed_on_storage_and_gets_there_once_storage_is_back(
        fleet_server, s3, tmp_path):  # noqa: F811 - fixtures
    """A node agent (``python -m deployments.serve``) on a Prefect server, reading S3 through a proxy of its
    own: the refit-on-publish run of r1 meets 403 on r1's payload and fails; wait says the node is behind
    (storage error, retrying), never failed; once the 403s stop, the agent's head check gets it to r1."""
    from tests.support.fleet_support import Fleet

    fleet = Fleet(fleet_server, s3.endpoint, tmp_path, f"{s3.prefix('outage-agent')}/catalog")
    with s3.proxy(Faults(), lifetime_s=900) as proxy:
        node = fleet.node("outage", endpoint=proxy.url, serve_args=("--head-poll-seconds", "2"))
        try:
            node.start()
            fleet.registered(node)
            assert fleet.publish("initial")["version"] == "r0"
            (run,) = fleet.final_runs("outage", "r0")
            assert run.state_name == "Ready", run.state.message

            proxy.faults.deny = ("/revisions/r1/",)  # 403 on r1's payload: an expired token, an incident
            assert fleet.publish("delta")["version"] == "r1"
            # the run the event made fails on the 403; the agent's head check (every 2 s here) may already have
            # retried it after that storage failure: every run to r1 so far met the 403 and failed
            failed = fleet.final_runs("outage", "r1")
            assert [run.state_name for run in failed] == ["Failed"] * len(failed), [r.state.message for r in failed]
            code, waited = fleet.fleet("wait", "--version", "r1", "--timeout", "1", "--poll", "0.2")
            assert (code, waited["outcome"], waited["failed"], list(waited["retrying"])) == (
                1, "timeout", [], ["outage"]), waited
            assert "denied" in waited["retrying"]["outage"]["error"].lower()

            proxy.faults.deny = ()  # storage is back: the next head check gets the node there
            code, waited = fleet.fleet("wait", "--version", "r1", "--timeout", "150", timeout_s=200)
            assert (code, waited["outcome"], waited["reached"]) == (0, "reached", ["outage"]), waited
            assert node.active_version() == "r1"
            assert "after a storage failure" in node.log.read_text()
        finally:
            fleet.stop_all()


def test_the_proxy_logs_a_client_that_hung_up_at_debug_and_keeps_other_tracebacks(capsys):
    """A reset or broken pipe (the proxy's own faults, a killed agent) is a debug line of the proxy's logger, not a
    traceback on stderr; any other error in a request is still printed as socketserver prints it."""
    from testbed.s3proxy import _Server
    from tests.support.logs import emitted

    server = _Server(("127.0.0.1", 0), None)
    try:
        with emitted("canonical_refit.testbed.s3proxy") as records:
            for error in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe")):
                try:
                    raise error
                except OSError:
                    server.handle_error(None, ("127.0.0.1", 40000))
        # socketserver's own report is absent (a handler another test left on a parent logger may print its own
        # complaints here: not the proxy's)
        assert "Exception occurred during processing of request" not in capsys.readouterr().err
        assert [(r.levelname, "hung up" in r.getMessage()) for r in records] == [("DEBUG", True)] * 2
        try:
            raise ValueError("a bug in the proxy")
        except ValueError:
            server.handle_error(None, ("127.0.0.1", 40000))
        printed = capsys.readouterr().err
        assert "Exception occurred during processing of request" in printed and "ValueError: a bug" in printed
    finally:
        server.server_close()
