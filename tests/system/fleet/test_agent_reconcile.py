"""The agent's reconcile step without a server: events record the desired version, the loop creates one run.

``NodeAgent._hear`` is what the published-event subscription calls for each
event; ``_check_due`` is the loop's question (an event named a new version,
or the head check's timer is up); ``_check_head`` compares the desired
version with the installed one and creates at most one refit run. The
catalog and the Prefect client are stand-ins that answer as the real ones do
and record what they were asked.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace
from uuid import uuid4

from deployments.agent import NodeAgent, Publications
from deployments.serve import EVENT, resource_id
from flows import node_report
from storage.runtime.cancel import StopToken
from tests.support.subscriber import SubscriberStandIn

ORDER = {"r1": 1, "r2": 2, "r3": 3, "r4": 4, "r5": 5}


class Catalog:
    """``HeadWatch`` as the agent uses it: the desired version is the newest of the head and the versions heard."""

    def __init__(self, head: str, installed: str):
        self.head, self.version, self.asked = head, installed, []

    def due(self, heard=()):
        self.asked.append(list(heard))
        desired = max([self.head, *heard], key=ORDER.get)
        if ORDER[desired] <= ORDER[self.version]:
            return None
        return node_report.Due(desired, f"the desired version is {desired}, the node runs {self.version}")

    def installed(self):
        return self.version


class Client:
    def __init__(self):
        self.created: list[dict] = []

    def create_flow_run_from_deployment(self, deployment_id, **kw):
        self.created.append({"deployment": deployment_id, **kw})
        return SimpleNamespace(name=kw.get("name"), id=uuid4())


def agent_with(catalog: Catalog, monkeypatch) -> NodeAgent:
    publications = Publications("refit-on-publish-gpu1", EVENT, resource_id("org/name", ""),
                                lambda version: {"params": {"target": version, "only_if_newer": True}})
    agent = NodeAgent([], {}, head_watch=catalog, head_poll_s=30.0, node="gpu1", publications=publications)
    agent._latest_id, agent._refit_id = uuid4(), uuid4()
    monkeypatch.setattr(agent, "_due", lambda client, ids: [])
    return agent


def test_a_burst_of_events_wakes_one_check_that_creates_one_run_for_the_newest(monkeypatch):
    catalog, client = Catalog(head="r4", installed="r1"), Client()  # r2, r3 and r4 published, r1 installed
    agent = agent_with(catalog, monkeypatch)
    agent._next_head_check = time.monotonic() + 3600  # the timer is an hour away: only an event wakes a check
    assert not agent._check_due()

    for version in ("r2", "r3", "r4"):  # a burst, heard while the loop was busy
        agent._hear(version)
    assert agent._check_due() and agent._wake.is_set()
    agent._check_head(client, [])
    assert catalog.asked == [["r2", "r3", "r4"]]
    (run,) = client.created
    assert (run["deployment"], run["name"], run["parameters"], run["tags"]) == (
        agent._refit_id, "refit gpu1 r1 -> r4", {"params": {"target": "r4", "only_if_newer": True}}, ["node:gpu1"])
    assert run["idempotency_key"] and agent.stats.catch_ups == 1

    agent._hear("r4")  # delivered again, and a late one for an older version: no check, no run
    agent._hear("r2")
    assert not agent._check_due() and len(client.created) == 1 and agent.stats.heard == 5
    agent._check_head(client, [])  # even if the timer checks before the run is executed: the same request again
    assert client.created[1]["idempotency_key"] == run["idempotency_key"]  # which the server answers with that run
    del client.created[1]

    catalog.version = catalog.head = "r4"  # the run got there; a new publication is heard: checked at once
    agent._hear("r5")
    assert agent._check_due()
    agent._check_head(client, [])
    assert [r["name"] for r in client.created] == ["refit gpu1 r1 -> r4", "refit gpu1 r4 -> r5"]
    assert len({r["idempotency_key"] for r in client.created}) == 2


def test_without_events_the_timer_carries_a_publication_and_nothing_newer_makes_no_run(monkeypatch):
    catalog, client = Catalog(head="r1", installed="r1"), Client()
    agent = agent_with(catalog, monkeypatch)
    agent._next_head_check = 0.0  # the timer is up
    assert agent._check_due()
    agent._check_head(client, [])
    assert client.created == [] and not agent._check_due()  # nothing newer; the next check a whole interval away

    catalog.head = "r2"  # published, no event heard: the next timer check finds it
    agent._next_head_check = 0.0
    agent._check_head(client, [])
    assert catalog.asked == [[], []]
    assert [(r["name"], r["parameters"]["params"]["target"]) for r in client.created] == [("refit gpu1 r1 -> r2",
                                                                                           "r2")]


class Published(SubscriberStandIn):
    """Prefect's event subscriber as the agent's published-event subscription uses it, bringing ``events`` (each
    a payload) in order, then stopping the agent."""

    def __init__(self, agent: NodeAgent, payloads: list[dict]):
        super().__init__()
        self.agent, self.payloads = agent, list(payloads)

    async def __anext__(self):
        if not self.payloads:
            self.agent.stop.stop("the test's events are all delivered")
            await asyncio.sleep(3600)  # cancelled when the agent's receive loop ends
        return SimpleNamespace(id=uuid4(), payload=self.payloads.pop(0))


def test_a_published_event_of_another_catalog_is_not_heard_and_does_not_hide_this_catalogs(monkeypatch, tmp_path):
    catalog, client = Catalog(head="r1", installed="r1"), Client()
    agent = agent_with(catalog, monkeypatch)
    ours = tmp_path / "catalog"
    agent.publications = replace(agent.publications, catalog=str(ours))
    agent.stop = StopToken()  # this test's own: stopping it stops nothing else
    agent._next_head_check = time.monotonic() + 3600  # only an event can wake a check
    Published(agent, [
        {"model": "org/name", "version": "r2", "sequence": 2, "catalog": "s3://other-bucket/catalog"},  # not ours
        {"model": "org/name", "version": "r3", "sequence": 3, "catalog": f"file://{ours}/"},  # ours, as a URL
        {"model": "org/name", "version": "r2", "sequence": 2, "catalog": str(ours)},  # ours: r2 not hidden
    ]).install(monkeypatch)
    asyncio.run(agent._subscribe_published("http://127.0.0.1:1/api"))

    assert agent.stats.heard == 2 and agent._check_due()  # the other catalog's r2 was never heard
    catalog.head = "r3"
    agent._check_head(client, [])
    assert catalog.asked == [["r3", "r2"]]
    assert [r["name"] for r in client.created] == ["refit gpu1 r1 -> r3"]
