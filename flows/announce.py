"""Announcing a published revision: the ``canonical-refit.revision.published`` event, delivered and confirmed.

Prefect's ``emit_event`` hands an event to a background worker and returns;
when the API is down for longer than that worker re-sends it (10 to 17 s
here), the event is gone and nobody is told. A publication sends its event
through an events client of its own instead: the event over the websocket,
then a ping whose answer proves the server has received it; an attempt that
fails is made again with backoff (0.5 s, doubled, at most 8 s apart) until
``PublishParams.event_delivery_s`` is spent. The publication's result says
how it went (``event_delivered``, ``event_error``), and an undelivered event
is a WARNING naming the revision. The event never fails the publication:
the record is written, and nodes still find the revision by reading the
catalog.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from flows.prefect_api import configured_api_url
from storage.catalog.records import Catalog, Revision
from tasks.write_record import EVENT, emit_published

log = logging.getLogger("canonical_refit.publish")
ATTEMPT_TIMEOUT_S = 10.0  # one connection, send and confirmation
FIRST_DELAY_S, MAX_DELAY_S = 0.5, 8.0


@dataclass(frozen=True)
class Delivery:
    """How a revision's event went: ``delivered`` True (the server confirmed it), False (not within the
    budget; ``error`` says why) or None (handed to Prefect's own event worker, unconfirmed)."""

    delivered: bool | None
    attempts: int = 0
    seconds: float = 0.0
    error: str | None = None


def announce(record: Revision, catalog: Catalog, *, budget_s: float) -> Delivery:
    """Send ``record``'s published event and wait for the server to confirm it, trying again with backoff for
    at most ``budget_s`` seconds (at least one attempt); logs a WARNING naming the revision if it was not
    delivered."""
    api_url = configured_api_url()
    if api_url is None:  # a flow run on an API Prefect chose itself: its own worker is the only way there
        emit_published(record, catalog)
        return Delivery(None, 1, 0.0, "handed to Prefect's event worker (no PREFECT_API_URL): not confirmed")
    event = published_event(record, catalog)
    started = time.monotonic()
    attempts, delay, error = 0, FIRST_DELAY_S, None
    while True:
        attempts += 1
        remaining = budget_s - (time.monotonic() - started)
        error = _attempt(event, min(ATTEMPT_TIMEOUT_S, max(1.0, remaining)))
        elapsed = time.monotonic() - started
        if error is None:
            if attempts > 1:
                log.info("the %s event of %s %s was delivered at attempt %d, after %.1fs", EVENT, record.model,
                         record.version, attempts, elapsed)
            return Delivery(True, attempts, round(elapsed, 3))
        if elapsed + delay >= budget_s:
            break
        time.sleep(delay)
        delay = min(MAX_DELAY_S, delay * 2)
    log.warning("published %s of %s, but its %s event was not delivered to the Prefect API at %s (%d attempt(s) "
                "in %.0fs: %s); nodes that refit on the event learn of %s only when they next read the catalog",
                record.version, record.model, EVENT, api_url, attempts, elapsed, error, record.version)
    return Delivery(False, attempts, round(elapsed, 3), error)


def published_event(record: Revision, catalog: Catalog):
    """The event (docs/format.md, "Events"), with the flow run it is sent from as a related resource; one id
    for every attempt, so a server that got it twice can tell."""
    from prefect.events import Event

    return Event(
        event=EVENT, id=uuid.uuid4(),
        resource={"prefect.resource.id": f"canonical-refit.revision.{record.model}.{record.version}",
                  "prefect.resource.name": f"{record.model} {record.version}"},
        related=_run_resources(),
        payload={"model": record.model, "version": record.version, "sequence": record.sequence,
                 "catalog": catalog.url},
    )


def _run_resources() -> list[dict]:
    """The flow run (and its flow) this is sent from, as Prefect's worker would have attached them."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run = getattr(context, "flow_run", None)
    if run is None:
        return []
    related = [{"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.role": "flow-run",
                "prefect.resource.name": run.name}]
    if getattr(run, "flow_id", None):
        related.append({"prefect.resource.id": f"prefect.flow.{run.flow_id}", "prefect.resource.role": "flow",
                        "prefect.resource.name": getattr(context.flow, "name", "") or ""})
    return related


THREAD_NAME = "published-event"


def _quiet_client_warnings() -> None:
    """Prefect's events client warns at each failed connection without naming the event; our own WARNING
    names the revision once, after the last attempt. Only this module's threads are quieted."""
    client_log = logging.getLogger("prefect.events.clients")
    if not any(getattr(f, "canonical_refit", False) for f in client_log.filters):
        def not_ours(record: logging.LogRecord) -> bool:
            return record.threadName != THREAD_NAME

        not_ours.canonical_refit = True
        client_log.addFilter(not_ours)


def _attempt(event, timeout_s: float) -> str | None:
    """One delivery: connect, send, and wait for the server's answer to a ping sent after it; None if it was
    confirmed, else why not. Runs on a loop of its own in a thread of its own (the caller may be on a loop),
    with the caller's Prefect settings."""
    outcome: list[str | None] = []

    async def send() -> None:
        from prefect.events.clients import get_events_client

        # no reconnection inside the client (the backoff is ours); a ping after every event (its answer
        # means the server has read everything sent before it)
        async with get_events_client(reconnection_attempts=0, checkpoint_every=1) as client:
            await client.emit(event)

    def run() -> None:
        try:
            asyncio.run(asyncio.wait_for(send(), timeout_s))
            outcome.append(None)
        except TimeoutError:
            outcome.append(f"no confirmation within {timeout_s:.0f}s")
        except Exception as exc:  # refused, reset, closed, a server that rejects the handshake
            outcome.append(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    _quiet_client_warnings()
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(run,), name=THREAD_NAME, daemon=True)
    thread.start()
    thread.join(timeout_s + 5.0)
    return outcome[0] if outcome else f"no confirmation within {timeout_s:.0f}s"
