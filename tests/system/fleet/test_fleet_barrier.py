"""A barrier that fails fast: ``wait`` ends as soon as every expected node has reached the version or failed it.

The nodes are real refits of named nodes over a ``file://`` catalog whose
newest revision is corrupt, so every node that tries it fails it and says
so in its record (the version it tried, and the error naming revision,
file and tensor). ``python -m flows.fleet wait`` (its ``main``) and
``flows.api.wait_for`` read those records: a failed barrier is exit 4 and
``VersionFailed``, with each failed node and its error; a catalog that
cannot be read is read again until the timeout, never an exit 2.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from flows import api
from flows.fleet import main as fleet_main
from tests.support.s3_support import s3, s3_lab  # noqa: F401  (s3 is a fixture)
from testbed.s3proxy import Faults


def fleet(capsys, lab, *args: str) -> tuple[int, dict]:
    """``python -m flows.fleet ARGS --json`` as a trainer runs it: its exit code and its JSON."""
    capsys.readouterr()
    code = fleet_main([args[0], "--catalog", lab.catalog, "--model", lab.model, *args[1:], "--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def corrupt(lab, version: str) -> None:
    """Flip the last bytes of the revision's first bucket: a checksum no receiver accepts."""
    bucket = lab.root / "revisions" / version / "bucket-00000.safetensors"
    data = bucket.read_bytes()
    bucket.write_bytes(data[:-64] + bytes(b ^ 0xFF for b in data[-64:]))


def node(lab, name: str, target: str = "latest"):
    """A refit of node ``name`` with a store of its own, as its agent runs it (only if newer)."""
    return lab.run(target=target, node=name, cache_dir=lab.root / f"cache-{name}", only_if_newer=True)


@pytest.fixture
def broken(lab):
    """r0 and r1 published, r2 corrupt; node a runs r1, and every node tried latest (r2) and failed it."""
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    corrupt(lab, "r2")
    assert node(lab, "a", "r1").status == "READY"
    for name in ("a", "b", "c"):
        result = node(lab, name)
        assert result.status == "FAILED" and result.error_detail["revision"] == "r2", result.error
    return lab


def test_wait_ends_failed_once_every_node_that_does_not_run_the_version_failed_it(broken, capsys):
    lab = broken
    code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--timeout", "60")
    assert (code, waited["outcome"], waited["failed"], waited["reached"]) == (4, "failed", ["a", "b", "c"], [])
    failures = waited["failures"]
    assert {name: failure["version"] for name, failure in failures.items()} == {"a": "r2", "b": "r2", "c": "r2"}
    assert "'r2'" in failures["b"]["error"] and "bucket-00000.safetensors" in failures["b"]["error"]

    # r1: a runs it; b and c failed the newer r2, so they will not get to r1 by themselves either
    code, waited = fleet(capsys, lab, "wait", "--version", "r1", "--timeout", "60")
    assert (code, waited["outcome"], waited["reached"], waited["failed"]) == (4, "failed", ["a"], ["b", "c"])
    code, waited = fleet(capsys, lab, "wait", "--version", "r1", "--nodes", "1", "--timeout", "60")
    assert (code, waited["outcome"], waited["reached"]) == (0, "reached", ["a"])  # one node is all it asks

    capsys.readouterr()
    assert fleet_main(["wait", "--catalog", lab.catalog, "--model", lab.model, "--version", "r1"]) == 4
    text = capsys.readouterr().out.splitlines()[-1]
    assert text.startswith("failed: every node that does not run r1 failed it: b (r2): ")
    assert "; c (r2): " in text and text.endswith("; reached: a")


def test_a_node_still_on_its_way_keeps_the_barrier_open(broken, capsys):
    lab = broken
    code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--expect", "gpu9", "--timeout", "0.3",
                         "--poll", "0.1")  # gpu9 has no record yet: it may still get there
    assert (code, waited["outcome"], waited["unseen"], waited["failed"]) == (1, "timeout", ["gpu9"], ["a", "b", "c"])
    assert waited["laggards"] == ["a", "b", "c", "gpu9"]

    lab.publish("full")  # r3, whole (it does not need r2): a node that takes it has reached r2 too
    assert node(lab, "b").status == "READY"
    code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--timeout", "60")
    assert (code, waited["reached"], waited["failed"]) == (4, ["b"], ["a", "c"])
    for name in ("a", "c"):
        assert node(lab, name).status == "READY"
    code, waited = fleet(capsys, lab, "wait", "--version", "r2", "--timeout", "60")
    assert (code, waited["outcome"], waited["reached"]) == (0, "reached", ["a", "b", "c"])


def test_wait_for_raises_version_failed_carrying_the_outcome(broken):
    lab = broken
    with pytest.raises(api.VersionFailed) as raised:
        api.wait_for("r2", catalog=lab.catalog, model=lab.model, timeout_s=60)
    error = raised.value
    assert error.revision == "r2" and error.outcome.outcome == "failed" and sorted(error.failures) == ["a", "b", "c"]
    assert "b (r2): " in str(error) and "bucket-00000.safetensors" in error.failures["c"]["error"]
    outcome = api.wait_for("r2", catalog=lab.catalog, model=lab.model, timeout_s=60, check=False)
    assert (outcome.outcome, outcome.exit_code, outcome.failed) == ("failed", 4, ["a", "b", "c"])


def test_a_catalog_that_cannot_be_read_is_waited_through(lab, capsys):
    lab.publish("initial")
    lab.publish("delta")
    assert node(lab, "a", "r1").status == "READY"  # newer than r0: only the catalog's sequences say so
    away = lab.root / "catalog-away"
    lab.catalog_dir.rename(away)  # the catalog is gone (an outage) when wait starts
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--timeout", "0.3", "--poll", "0.1")
    assert (code, waited["outcome"]) == (1, "timeout")  # not a usage error: the catalog was read again
    assert any(p.startswith("the catalog record of r0: ") for p in waited["problems"]), waited["problems"]

    back = threading.Timer(0.5, lambda: away.rename(lab.catalog_dir))  # it comes back while wait polls
    back.start()
    try:
        outcome = api.wait_for("r0", catalog=lab.catalog, model=lab.model, timeout_s=60, poll_s=0.1)
    finally:
        back.join()
    assert (outcome.outcome, outcome.reached, outcome.problems) == ("reached", ["a"], [])


def test_a_node_whose_record_cannot_be_read_is_never_counted_as_there_until_it_is_rewritten(lab, capsys):
    from storage.catalog.nodes import nodes_url

    lab.publish("initial")
    for name in ("a", "b"):
        assert node(lab, name, "r0").status == "READY"
    record = Path(nodes_url(lab.catalog, lab.model).removeprefix("file://")) / "b.json"
    record.write_text('{"node": "b", "model"')  # a torn or corrupt object: b cannot be placed
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--timeout", "0.3", "--poll", "0.1")
    assert (code, waited["outcome"], waited["reached"], waited["unreadable"]) == (1, "timeout", ["a"], ["b"])
    assert any(str(record.name) in problem for problem in waited["view"]["problems"])
    # its agent's next heartbeat writes it whole again (a storage error would be a missed beat instead)
    from flows import node_report
    from tasks.installers import make_installer

    params = lab.refit_params(node="b", cache_dir=lab.root / "cache-b")
    assert node_report.refresh_node(params, make_installer(params.installer)).version == "r0"
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--timeout", "60")
    assert (code, waited["reached"], waited["unreadable"]) == (0, ["a", "b"], [])


def test_a_storage_outage_is_waited_through_on_s3(s3, tmp_path):  # noqa: F811 - s3 is a fixture
    """The node records and the catalog on a real S3 server (moto) behind a proxy that refuses them (403)
    when wait starts: each poll reads them again, and the outage ending lets the wait end."""
    lab = s3_lab(tmp_path, s3, "barrier")
    for kind in ("initial", "delta"):
        lab.publish(kind, storage=s3.settings())
    result = lab.run(target="r1", node="a", cache_dir=tmp_path / "cache-a", storage=s3.settings())
    assert result.status == "READY", result.error
    with s3.proxy(Faults(deny=("nodes", "catalog")), lifetime_s=120) as proxy:  # listings and reads
        storage = s3.settings(proxy.url)
        outcome = api.wait_for("r0", catalog=lab.catalog, model=lab.model, storage=storage, timeout_s=0.5,
                               poll_s=0.1)
        assert (outcome.outcome, outcome.reached) == ("timeout", [])
        assert [p.split(":")[0] for p in outcome.problems] == ["the node records", "the catalog record of r0"]
        assert all("AccessDenied" in p or "denied" in p.lower() for p in outcome.problems), outcome.problems

        back = threading.Timer(0.5, lambda: setattr(proxy.faults, "deny", ()))  # the outage ends meanwhile
        back.start()
        try:
            outcome = api.wait_for("r0", catalog=lab.catalog, model=lab.model, storage=storage, timeout_s=60,
                                   poll_s=0.1)
        finally:
            back.join()
    assert (outcome.outcome, outcome.reached, outcome.problems) == ("reached", ["a"], [])
