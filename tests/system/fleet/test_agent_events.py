"""The node agent's event subscription keeps one receive across its one-second wake-ups.

A receive (the subscriber's ``__anext__``, which reconnects and re-handshakes inside) that takes longer than
the agent's one-second stop check must not be cancelled by that check: the event it brings still arrives.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from deployments.agent_events import EventListening
from tests.support.subscriber import SubscriberStandIn


class SlowSubscriber(SubscriberStandIn):
    """A stand-in for Prefect's event subscriber: its first receive takes 2.5 s (a slow reconnect), then brings
    one scheduled-run event; the next receive stops the agent and waits until it is cancelled."""

    def __init__(self, agent: "Agent") -> None:
        super().__init__()
        self.agent = agent
        self.started = 0
        self.cancelled = 0

    async def __anext__(self):
        self.started += 1
        first = self.started == 1
        if not first:
            self.agent.stop.stopped = True
        try:
            await asyncio.sleep(2.5 if first else 3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return SimpleNamespace(event="prefect.flow-run.Scheduled")


class Agent(EventListening):
    def __init__(self) -> None:
        self.stop = SimpleNamespace(stopped=False)
        self._wake = threading.Event()
        self.stats = SimpleNamespace(wakeups=0)
        self.cancelled_runs: list[str] = []

    def _cancelled(self, run_id: str) -> None:
        self.cancelled_runs.append(run_id)


def test_a_receive_slower_than_the_stop_check_is_not_cancelled(monkeypatch):
    agent = Agent()
    stream = SlowSubscriber(agent).install(monkeypatch)
    watchdog = threading.Timer(20, lambda: setattr(agent.stop, "stopped", True))  # a broken loop fails, never hangs
    watchdog.start()
    try:
        asyncio.run(agent._subscribe("http://127.0.0.1:1/api", []))
    finally:
        watchdog.cancel()
    assert len(stream.subscriptions) == 1  # the agent subscribed once
    assert agent.stats.wakeups == 1  # the slow receive's event arrived
    assert stream.started == 2  # one receive for it (not one a second), then the one pending at the stop
    assert stream.cancelled == 1  # only the receive still pending when the agent stopped
