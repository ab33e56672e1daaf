"""Prefect's flow-run heartbeats, without the wait at the end of every run.

Prefect 3 sends a ``prefect.flow-run.heartbeat`` event every
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (default 180) from a thread
that sleeps in one-second steps; the end of a flow run joins that thread, so
every run waits up to a second after its last task (0.6 s on average here,
a tenth of a one-off refit's whole time). The heartbeats are worth keeping:
they are how a server tells a flow run whose process died (``kill -9``, a
lost host) from a slow one. ``install`` replaces the sender with one that
sends the same events from a thread waiting on an event, so it stops the
moment the run ends.

It relies on the flow engine's private ``_send_heartbeats`` and the engine's
``_build_heartbeat_event_template``/``_emit_flow_run_heartbeat``; a Prefect
without them keeps its own sender (slower, the same events).
"""

from __future__ import annotations

import contextvars
import logging
import threading
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger("canonical_refit.heartbeats")


@contextmanager
def send_heartbeats(engine, join_on_exit: bool = True) -> Iterator[None]:
    """What Prefect's ``_send_heartbeats`` does, stopping at once when the run ends."""
    from prefect.flow_engine import MINIMUM_HEARTBEAT_INTERVAL

    interval = engine.heartbeat_seconds
    if interval is None:
        yield
        return
    interval = max(interval, MINIMUM_HEARTBEAT_INTERVAL)
    resource, related = engine._build_heartbeat_event_template()
    stopped = threading.Event()

    def beat() -> None:
        while not stopped.is_set():
            run = engine.flow_run
            if run is not None and run.state is not None and run.state.is_final():
                return
            try:
                engine._emit_flow_run_heartbeat(resource, related)
            except Exception:  # a missed heartbeat is not the run's failure
                log.debug("could not emit a flow-run heartbeat", exc_info=True)
            stopped.wait(interval)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,), name="flow-heartbeat",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        stopped.set()
        if join_on_exit:
            thread.join(timeout=2)


def install() -> bool:
    """Use ``send_heartbeats`` for every flow run of this process; False if this Prefect has no such hook."""
    import prefect.flow_engine as engine

    original = getattr(engine, "_send_heartbeats", None)
    needed = ("_build_heartbeat_event_template", "_emit_flow_run_heartbeat", "heartbeat_seconds")
    if original is None or not all(hasattr(engine.FlowRunEngine, name) for name in needed):
        return False
    engine._send_heartbeats = send_heartbeats
    return True
