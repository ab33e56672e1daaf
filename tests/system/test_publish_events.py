"""No lost publication: a publication says whether its event reached the Prefect API.

The event is what wakes the nodes that refit on publication. When the API
does not take it, the publication still happens (its record is written and
a node can refit to it), and the result says the event was not delivered,
with a WARNING naming the revision, after trying again for the configured
time. With the API up, the server has it and the result says so.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from flows import api
from flows.prefect_api import reporting_to
from storage.catalog.records import Catalog
from storage.objects.store import ObjectStore
from testbed.prefect_server import published_events
from testbed.processes import wait_until
from tests.support.logs import emitted


@contextmanager
def api_down():
    """Every thread of this process reports to a Prefect API that is down (a closed loopback port); the API
    it reported to before is restored after (``reporting_to`` leaves none)."""
    from prefect.context import refresh_global_settings_context

    before = os.environ.get("PREFECT_API_URL")
    url = f"http://127.0.0.1:{closed_port()}/api"
    try:
        with reporting_to(url):
            yield url
    finally:
        if before is not None:
            os.environ["PREFECT_API_URL"] = before
            refresh_global_settings_context()


def closed_port() -> int:
    """A loopback port nothing listens on (a Prefect API that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publish(lab, kind: str, **kw):
    """``flows.api.publish`` of the lab's next step (the launch checkpoint for ``initial``), as a trainer calls it."""
    from flows.synthetic import write_checkpoint

    tensors = lab.current if kind == "initial" else lab.next_step()
    lab.step += 1
    folder = lab.write(tensors, f"step-{lab.step}")
    if kind == "initial":
        write_checkpoint(lab.launch, tensors, shards=lab.shape.shards)
    lab.current = tensors
    lab.revisions[f"r{lab.step - 1}"] = tensors  # r0, r1, ... in order
    return api.publish(folder, catalog=lab.catalog, model=lab.model, kind=kind,
                       state_dir=str(lab.root / "publisher"), **kw)


def test_an_event_the_api_does_not_take_is_reported_and_the_revision_is_still_published(lab):
    with api_down() as down, emitted("canonical_refit.publish", logging.WARNING) as records:
        first = publish(lab, "initial", event_delivery_s=1.5)
        pending = publish(lab, "delta", event_delivery_s=1.5, wait=False)  # retried in the background
        second = pending.result()
    for result in (first, second):
        assert result.event_delivered is False and "ConnectionRefusedError" in result.event_error
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and r.name == "canonical_refit.publish"]
    assert len(warnings) == 2
    for version, line in zip(("r0", "r1"), warnings):
        assert line.startswith(f"published {version} of {lab.model}, but its canonical-refit.revision.published "
                               f"event was not delivered to the Prefect API at {down} (")
        assert int(line.split("(")[1].split(" attempt")[0]) >= 2  # tried again before giving up

    # the publication itself is whole: the record is there and a node refits to it
    assert Catalog(ObjectStore(), lab.catalog, lab.model).read("r1").sequence == 1
    result = lab.run(target="r1")
    assert result.status == "READY"
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")


def test_without_an_api_no_event_is_due_and_none_is_claimed(lab, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # a trainer process with no Prefect API
        result = publish(lab, "initial")
    assert (result.event_delivered, result.event_error) == (None, None)


def test_a_delivered_event_is_confirmed_and_the_server_has_it(flow_lab, capsys):
    from flows.publish import main as publish_main

    lab = flow_lab
    since = datetime.now(timezone.utc)
    folder = lab.write(lab.current, "step-0")
    capsys.readouterr()
    code = publish_main(["--catalog", lab.catalog, "--model", lab.model, "--checkpoint", str(folder), "--kind",
                         "initial", "--state-dir", str(lab.root / "publisher"), "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and (result["version"], result["event_delivered"], result["event_error"]) == ("r0", True, None)
    from prefect.settings import PREFECT_API_URL

    stored = wait_until("the server to store the event (events are written in batches)", lambda: [
        e for e in published_events(str(PREFECT_API_URL.value()), since.isoformat())
        if e["payload"].get("catalog") == lab.catalog], 30, every_s=0.5)
    assert [(e["payload"]["version"], e["resource"]["prefect.resource.id"]) for e in stored] == [
        ("r0", f"canonical-refit.revision.{lab.model}.r0")]
    assert any(r["prefect.resource.role"] == "flow-run" for r in stored[0]["related"])  # sent from its flow run
