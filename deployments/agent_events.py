"""The agent's event subscriptions: scheduled and cancelling runs of its deployments, and published versions.

``EventListening`` is a part of ``deployments.agent.NodeAgent``: a
scheduled-run event wakes the poll loop at once, a ``Cancelling`` event stops
the run in progress (``_cancelled``, in ``deployments.agent_runs``), and with
``PublishFanOut`` each published event becomes a run of the node's own
deployment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable
from uuid import UUID

from deployments.agent_config import CANCELLING_EVENT, MAX_BACKOFF_S

log = logging.getLogger("canonical_refit.agent")


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
            stream = events.__aiter__()
            while not self.stop.stopped:
                try:  # wake up every second to notice a stop (cancelling a websocket receive is safe)
                    event = await asyncio.wait_for(stream.__anext__(), timeout=1.0)
                except asyncio.TimeoutError:
                    continue
                if event.event == CANCELLING_EVENT:
                    self._cancelled(event.resource.id.rsplit(".", 1)[-1])
                    continue
                self.stats.wakeups += 1
                self._wake.set()

    async def _subscribe_published(self, api_url: str) -> None:
        """Create a run of the fan-out deployment for every published event of the model, until stopped."""
        from prefect.client.orchestration import get_client
        from prefect.events.clients import PrefectEventSubscriber
        from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

        fan = self.fan_out
        wanted = EventFilter(event=EventNameFilter(name=[fan.event]),
                             resource=EventResourceFilter(id_prefix=[fan.resource_prefix]))
        async with get_client() as client, PrefectEventSubscriber(api_url=api_url, filter=wanted,
                                                                    reconnect_on_clean_close=True) as events:
            if self._subscribed_once:  # a reconnect: what was published meanwhile
                if self._latest_id is not None:
                    await client.create_flow_run_from_deployment(self._latest_id)
                    log.info("the published-event stream is back: one refit to latest for what it missed")
            self._subscribed_once = True
            stream = events.__aiter__()
            while not self.stop.stopped:
                try:
                    event = await asyncio.wait_for(stream.__anext__(), timeout=1.0)
                except asyncio.TimeoutError:
                    continue
                version = (event.payload or {}).get("version")
                if not isinstance(version, str):
                    log.warning("published event %s carries no version: ignored", event.id)
                    continue
                self.stats.api_requests += 1
                run = await client.create_flow_run_from_deployment(
                    self._fan_out_id, parameters=fan.parameters(version),
                    idempotency_key=f"{event.id}:{self._fan_out_id}")  # one run per event and node
                self.stats.fan_outs += 1
                log.info("published %s: created flow run %s of %s", version, run.id, fan.deployment)
                self._wake.set()
