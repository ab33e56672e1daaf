"""The agent's event subscriptions: scheduled and cancelling runs of its deployments, and published versions.

``EventListening`` is a part of ``deployments.agent.NodeAgent``: a
scheduled-run event wakes the poll loop at once, a ``Cancelling`` event stops
the run in progress (``_cancelled``, in ``deployments.agent_runs``), and a
published event of the model records the version it names as desired and
wakes the loop (``_hear``, in ``deployments.agent_head``): the loop, not the
event, decides whether a refit runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable
from uuid import UUID

from deployments.agent_config import CANCELLING_EVENT, MAX_BACKOFF_S

log = logging.getLogger("canonical_refit.agent")


class _Receiving:
    """One pending receive (``__anext__``) of an event stream, kept across the agent's one-second wake-ups.

    A wake-up that finds no event leaves the receive running: cancelling it
    would also cancel the subscriber's own reconnect (its handshake) halfway,
    every second. It is cancelled only by ``close``, when the listening ends.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._pending: asyncio.Future | None = None

    async def next(self, *, timeout_s: float) -> Any | None:
        """The next event, or None when none came within ``timeout_s`` (the receive goes on)."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._stream.__anext__())
        done, _ = await asyncio.wait({self._pending}, timeout=timeout_s)
        if not done:
            return None
        received, self._pending = self._pending, None
        return received.result()  # the stream's error (or its end) is raised here, as the receive's own

    async def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})  # ended; its cancellation is not this task's
            if not pending.cancelled():
                pending.exception()  # it ended on its own meanwhile: retrieved, never reported as lost


class EventListening:
    """The agent's event-stream threads (``run`` starts them; each reconnects with a backoff until stopped)."""

    def _listen(self, subscription: Callable[[], Any]) -> None:
        """Run an event subscription (``_subscribe``, ``_subscribe_published``) until stopped.

        A failed subscription is retried with a backoff; meanwhile the node still polls every ``poll_s``.
        """
        backoff, failures = 1.0, 0
        while not self.stop.stopped:
            started = time.monotonic()
            try:
                asyncio.run(subscription())
            except Exception as exc:  # the event stream is down: the polls go on
                failures += 1
                (log.warning if failures == 1 else log.debug)(
                    "the event stream failed (%s); polling every %.1fs until it is back", exc, self.poll_s)
            if time.monotonic() - started > 60:
                backoff, failures = 1.0, 0
            self.stop.wait(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)

    async def _subscribe(self, api_url: str, ids: list[UUID]) -> None:
        from prefect.events.clients import PrefectEventSubscriber
        from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

        wanted = EventFilter(event=EventNameFilter(name=["prefect.flow-run.Scheduled", CANCELLING_EVENT]),
                             related=EventRelatedFilter(id=[f"prefect.deployment.{i}" for i in ids]))
        async with PrefectEventSubscriber(api_url=api_url, filter=wanted, reconnect_on_clean_close=True) as events:
            self._wake.set()  # runs scheduled while the stream was down are picked up now
            receiving = _Receiving(events.__aiter__())
            try:
                while not self.stop.stopped:
                    event = await receiving.next(timeout_s=1.0)  # wakes up every second to notice a stop
                    if event is None:
                        continue
                    if event.event == CANCELLING_EVENT:
                        self._cancelled(event.resource.id.rsplit(".", 1)[-1])
                        continue
                    self.stats.wakeups += 1
                    self._wake.set()
            finally:
                await receiving.close()

    async def _subscribe_published(self, api_url: str) -> None:
        """Hear the model's published events until stopped: each records the version it names as desired and
        wakes the loop (``_hear``), which decides whether a refit runs; no run is created here."""
        from prefect.events.clients import PrefectEventSubscriber
        from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

        wanted = EventFilter(event=EventNameFilter(name=[self.publications.event]),
                             resource=EventResourceFilter(id_prefix=[self.publications.resource_prefix]))
        async with PrefectEventSubscriber(api_url=api_url, filter=wanted, reconnect_on_clean_close=True) as events:
            self._check_soon()  # (re)connected: what was published while the stream was down is in the head
            receiving = _Receiving(events.__aiter__())
            try:
                while not self.stop.stopped:
                    event = await receiving.next(timeout_s=1.0)
                    if event is None:
                        continue
                    payload = event.payload or {}
                    version = payload.get("version")
                    if not isinstance(version, str):
                        log.warning("published event %s carries no version: ignored", event.id)
                        continue
                    other = self.publications.names_other_catalog(payload)
                    if other is not None:  # the same model in another catalog: not a version of this node's
                        log.debug("published event %s names %s of catalog %s, not this node's: ignored",
                                  event.id, version, other)
                        continue
                    self._hear(version)
            finally:
                await receiving.close()
