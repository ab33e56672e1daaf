"""Agents started at the same moment each ensure Prefect's zombie-run automation: the server ends with one.

The client stands in for Prefect's (its automation calls, answering with Prefect's own ``Automation``
objects); ``create_automation`` can let another agent's creation land at the same moment, as two agents
that both found none do on a real server.
"""

from __future__ import annotations

from uuid import uuid4

from deployments.orphans import ZOMBIE_AUTOMATION, ensure_zombie_automation, zombie_automation

WINDOW_S = 45  # the agents' --zombie-after


class Server:
    """The automations of one Prefect server, as its client's automation calls see them."""

    def __init__(self):
        self.automations: dict = {}
        self.deleted: list = []

    def add(self, within_s: float):
        automation = zombie_automation(within_s).model_copy(update={"id": uuid4()})
        self.automations[automation.id] = automation
        return automation


class Client:
    def __init__(self, server: Server, *, racing: int = 0):
        self.server, self.racing = server, racing  # racing: other agents whose creation lands with this one's

    def read_automations_by_name(self, name: str) -> list:
        return [a for a in self.server.automations.values() if a.name == name]

    def create_automation(self, automation) -> object:
        for _ in range(self.racing):
            self.server.add(automation.trigger.within.total_seconds())
        return self.server.add(automation.trigger.within.total_seconds()).id

    def delete_automation(self, automation_id) -> None:
        if automation_id not in self.server.automations:
            raise ValueError(f"automation {automation_id} not found")  # another agent deleted it first
        self.server.deleted.append(self.server.automations.pop(automation_id).id)

    def update_automation(self, automation_id, automation) -> None:
        self.server.automations[automation_id] = automation  # the server keeps the id; the rest is replaced


def test_agents_that_create_the_zombie_automation_at_once_leave_one():
    server = Server()
    ensure_zombie_automation(Client(server, racing=2), WINDOW_S)  # two other agents created one at the same moment
    (kept,) = server.automations.values()
    assert kept.name == ZOMBIE_AUTOMATION and kept.trigger.within == zombie_automation(WINDOW_S).trigger.within
    assert len(server.deleted) == 2


def test_every_agent_keeps_the_same_one_and_a_second_pass_changes_nothing():
    server = Server()
    created = [server.add(WINDOW_S).id for _ in range(3)]  # three agents each created one
    ensure_zombie_automation(Client(server), WINDOW_S)
    ensure_zombie_automation(Client(server), WINDOW_S)  # another agent, after: deletes nothing more
    assert list(server.automations) == [min(created, key=str)]
    assert sorted(server.deleted, key=str) == sorted(set(created) - {min(created, key=str)}, key=str)


def test_the_kept_one_is_set_to_this_agents_window():
    server = Server()
    server.add(90)
    ensure_zombie_automation(Client(server), WINDOW_S)
    (kept,) = server.automations.values()
    assert kept.trigger.within == zombie_automation(WINDOW_S).trigger.within
