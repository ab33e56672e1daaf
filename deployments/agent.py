"""The warm node agent: one long-running process per node that runs its deployments' flow runs in-process.

Prefect's own runner starts a new Python process for every flow run: a refit
then pays for an interpreter, Prefect's import and its client set-up (seconds)
before the first byte moves. The agent keeps all of that warm. It registers
the node's deployments, asks the Prefect server for their runs that are due
(scheduled, created by its own reconcile loop, or from the UI), claims each
one (``Pending``) and runs it in this process with Prefect's flow engine —
still a flow run with its states, task runs, logs and artifacts in the UI.
Runs are executed one at a time, so two refits of the node never overlap (the
store lock also guarantees it across processes).

When to ask: the agent subscribes to the server's event stream for
``prefect.flow-run.Scheduled`` events of its own deployments (Prefect's
``/events/out`` websocket, as Prefect's own engine does) and asks at once
when one arrives, so a triggered run starts within a fraction of a second
whatever ``poll_s`` is. It also asks every ``poll_s`` (runs of the interval
schedule become due without an event, and a broken event stream must not
stall the node); each of those polls is one API request. Measured on a
loaded 2-core machine (docs/fleet.md), a poll costs the server about 20 ms
of CPU: polling alone at 0.5 s is 3-4 % of a core per idle node, so the
event stream, not a fast poll, carries the latency.

One API client (and its connections) serves the agent's whole life: the
polls, the claims, the cancellation watch and the flow runs it executes
(Prefect's engine takes the client of the current ``SyncClientContext``), so
a run pays for no new client, TLS context or connection. An API that is down
or answers errors does not stop the agent: it logs, backs off and polls again.

Cancelling a run from the UI (or the API) stops it cooperatively at its next
safe point (its ``Cancelling`` event arrives on the agent's event stream; the
run's state is also read every ``cancel_poll_s`` while it runs, a fallback);
SIGTERM or Ctrl-C stop the agent the same way: the run in progress ends
``INTERRUPTED`` with its store recoverable, then the agent exits.

A publication reaches the node through one path, the agent's reconcile loop
(``deployments/agent_head.py``), level-based in the manner of a Kubernetes
controller: a published event of its model (``Publications``) only records
the version it names as desired and wakes the loop; the loop compares the
desired version (the newest heard, and the catalog's head) with the
installed one and creates at most one ``refit-on-publish`` run, for the
newest, when it is newer. Events and timers only wake the loop; the head
check's interval (with its backoff) governs retries; a burst of
publications coalesces to the newest; an event delivered again makes no
run. Without the event stream (``--no-event-wakeups``) the head check alone
carries publications, within ``head_poll_s``. The server evaluates no
per-node automation. Flow runs are the record of each refit, not the source
of truth.

A node whose agent was killed (SIGKILL, a crashed host, a rescheduled pod)
leaves its run ``Running`` on the server; ``deployments/orphans.py`` closes
such runs (the agent's claims, and Prefect's zombie-run automation).

The agent's parts: ``agent_config`` (defaults, ``AgentStats``,
``Publications``), ``agent_runs`` (claim, run, settle one flow run),
``agent_events`` (the event subscriptions) and ``agent_head`` (the reconcile
step and coalescing); this module composes them into ``NodeAgent`` and runs
it (``serve_in_process``). Every public name stays importable from here.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from typing import Any, Callable
from uuid import UUID

from deployments.agent_config import (  # noqa: F401 (re-exported: the agent's public names)
    CANCEL_POLL_NO_EVENTS_S, CANCEL_POLL_S, CANCELLING_EVENT, FOLLOW_UP_S, HEAD_POLL_S, HEARTBEAT_S, MAX_BACKOFF_S,
    POLL_S, SHUTDOWN_S, AgentStats, Publications, PublishFanOut,
)
from deployments.agent_events import EventListening
from deployments.agent_head import HeadCheck, _only_if_newer, _target  # noqa: F401 (re-exported)
from deployments.agent_runs import RunExecution
from deployments.orphans import agent_identity, crash_orphans, ensure_zombie_automation
from storage.runtime.cancel import StopToken, current_stop
from storage.format.status import DRIFTED

log = logging.getLogger("canonical_refit.agent")


class NodeAgent(HeadCheck, EventListening, RunExecution):
    """Runs the flow runs of ``deployments`` (runner deployments of the ``flows`` named by their flow_name) in
    this process, one at a time, polling every ``poll_s``."""

    def __init__(self, deployments: list, flows: dict[str, Any], *, poll_s: float = POLL_S,
                 start_now: str | None = None, stop: StopToken | None = None,
                 cancel_poll_s: float = CANCEL_POLL_S, wake_on_events: bool = True,
                 heartbeat: Callable[[bool], Any] | None = None, heartbeat_s: float = HEARTBEAT_S,
                 zombie_after_s: float | None = None, outcomes: dict[str, Callable[..., Any]] | None = None,
                 publications: Publications | None = None, vet: dict[str, Callable[[dict], dict]] | None = None,
                 head_watch: Any = None, head_poll_s: float = HEAD_POLL_S, node: str | None = None):
        self.deployments = deployments
        # flows.node_report.HeadWatch: the catalog's head against what the node runs (None: events and the interval
        # schedule only); checked every head_poll_s while no run is due, and before a burst of refits is run
        self.head_watch = head_watch
        self.head_poll_s = head_poll_s
        self._next_head_check = 0.0
        self._storage_retries = 0  # head checks in a row that retried a refit failed on storage (they back off)
        self.node = node
        # flow name -> the run's parameters as this node runs them, or RunRefused (deployments/pinning.py); a flow
        # with no entry is not run at all (a run's parameters are never run as they come)
        self.vet = vet or {}
        self.publications = publications  # the published events that wake the loop, and where its refits go
        # flow name -> outcome(reset=False): the final state the flow's last run reached in this process
        self.outcomes = outcomes or {}
        self.zombie_after_s = zombie_after_s  # None: no zombie automation (flow-run heartbeats are off)
        self.flows = flows
        self.poll_s = poll_s
        # the event stream delivers a cancellation at once; the watch's reads are the fallback
        self.cancel_poll_s = cancel_poll_s if wake_on_events else min(cancel_poll_s, CANCEL_POLL_NO_EVENTS_S)
        self._running: tuple[UUID, StopToken] | None = None  # the run executing now, and its stop
        self.start_now = start_now  # a deployment to run once at start-up (the node catches up at once)
        self.stop = stop or current_stop.get()
        self.wake_on_events = wake_on_events
        self.stats = AgentStats()
        self.identity = agent_identity()
        self._flows: dict[UUID, Any] = {}
        self._wake = threading.Event()  # set by a scheduled-run event, a drift to heal, and by stopping
        self.heartbeat, self.heartbeat_s = heartbeat, heartbeat_s
        self._busy = threading.Event()  # a flow run is executing
        self._heal = threading.Event()  # a heartbeat saw the engines drift from the store: refit to heal
        self._latest_id: UUID | None = None  # the start_now deployment, which a heal runs
        self._init_reconcile()

    def register(self, client) -> list[UUID]:
        """Create or update every deployment on the server; their ids."""
        ids = []
        for deployment in self.deployments:
            deployment_id = deployment.apply()
            self._flows[deployment_id] = self.flows[deployment.flow_name]
            ids.append(deployment_id)
            if self.publications is not None and deployment.name == self.publications.deployment:
                self._refit_id = deployment_id
            log.info("registered deployment %s (%s)", deployment.name, deployment_id)
        if self.zombie_after_s:
            ensure_zombie_automation(client, self.zombie_after_s)
        self.crash_orphans(client, ids)
        if self.start_now:
            for deployment_id, deployment in zip(ids, self.deployments):
                if deployment.name == self.start_now:
                    self._latest_id = deployment_id
                    self._create_latest(client, "start-up", self._run_name("-> latest (start-up)"))
                    log.info("scheduled %s once at start-up: the node catches up to latest", deployment.name)
        return ids

    def crash_orphans(self, client, ids: list[UUID]) -> int:
        """Mark ``Crashed`` the runs of these deployments left in progress by an agent process that is gone."""
        crashed = crash_orphans(client, ids)
        self.stats.orphans_crashed += crashed
        return crashed

    def run(self) -> AgentStats:
        """Serve until stopped (SIGTERM, Ctrl-C, or ``stop``)."""
        from prefect.context import SyncClientContext
        from prefect.settings import get_current_settings

        api_url = str(get_current_settings().api.url).rstrip("/")
        self.stop.add_listener(self._wake.set)
        try:
            if self.heartbeat is not None:  # the record needs storage and the engines, not the API: beat at once
                threading.Thread(target=self._beat, name="node-heartbeat", daemon=True).start()
            # one client for the agent's life: the flow runs it executes take this context's client too
            with self._connected(SyncClientContext) as context:
                client = context.client if context is not None else None  # None: stopped before the API answered
                ids = self._until_registered(client) if client is not None else None
                if ids is not None:
                    if self.wake_on_events:
                        threading.Thread(target=self._listen, args=(lambda: self._subscribe(api_url, ids),),
                                         name="run-wakeup", daemon=True).start()
                    if self.wake_on_events and self._refit_id is not None:
                        threading.Thread(target=self._listen, args=(lambda: self._subscribe_published(api_url),),
                                         name="published-wakeup", daemon=True).start()
                    log.info("node agent ready: %d deployment(s), woken by their scheduled-run events, polling "
                             "every %.1fs", len(ids), self.poll_s)
                    self._serve(client, ids)
        finally:
            self.stop.remove_listener(self._wake.set)
        log.info("node agent stopped after %d run(s)", self.stats.runs)
        return self.stats

    @contextlib.contextmanager
    def _connected(self, context_type):
        """Prefect's client context, once the API answers: an agent started while the server is down waits for
        it (Prefect's client checks the API version on entry and raises) instead of exiting; None if stopped."""
        backoff, stack, context = min(self.poll_s, 1.0), contextlib.ExitStack(), None
        while not self.stop.stopped:
            try:
                context = stack.enter_context(context_type.get_or_create())
                break
            except Exception as exc:
                self.stats.api_errors += 1
                log.warning("the Prefect API does not answer (retrying in %.0fs): %s", backoff, exc)
                self.stop.wait(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
        with stack:
            yield context

    def _until_registered(self, client) -> list[UUID] | None:
        backoff = self.poll_s
        while not self.stop.stopped:
            try:
                return self.register(client)
            except Exception as exc:  # the API is not there yet: keep trying, the node is useless without it
                self.stats.api_errors += 1
                log.warning("could not register the deployments (retrying in %.0fs): %s", backoff, exc)
                self.stop.wait(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
        return None

    def _beat(self) -> None:
        """Every ``heartbeat_s``: refresh this node's record (alive, and what its engines run); a drift found
        while idle asks the agent for a healing refit."""
        while not self.stop.stopped:
            try:
                record = self.heartbeat(self._busy.is_set())
                self.stats.heartbeats += 1
                if record is not None and record.condition() == DRIFTED and not self._busy.is_set():
                    log.warning("node heartbeat: the engines do not run the installed %s (%s): refitting to heal",
                                record.store_version, record.engines)
                    self._heal.set()
                    self._wake.set()
            except Exception as exc:  # a missed beat: the next one tries again
                log.warning("node heartbeat failed: %s", exc)
            self.stop.wait(self.heartbeat_s)

    def _serve(self, client, ids: list[UUID]) -> None:
        backoff = min(self.poll_s, 1.0)
        follow_ups: list[float] = []
        while not self.stop.stopped:
            try:
                if self._heal.is_set() and self._latest_id is not None:
                    self._heal.clear()
                    self._create_latest(client, "heal: the engines drifted from the installed version")
                    self.stats.heals += 1
                due = self._coalesce(client, self._due(client, ids))
                if not due and self._check_due():  # an event named a new version, or the timer
                    due = self._check_head(client, ids)
                for run in due:
                    if self.stop.stopped:
                        break
                    if self._claim(client, run):
                        self._execute(client, run)
                        if hasattr(self.heartbeat, "settled"):  # flows.fleet_table.TableHeartbeat: after each run
                            self.heartbeat.settled()  # the fleet table artifact is rewritten (in its own thread)
                        # the head is checked a whole interval after the node was last busy: a run may
                        # have just been created for what a check would find (backing off storage retries)
                        self._next_head_check = time.monotonic() + self.head_interval_s()
                backoff = min(self.poll_s, 1.0)
            except Exception as exc:  # the API is down or erring: the agent outlives it
                self.stats.api_errors += 1
                log.warning("polling the Prefect API failed (next try in %.0fs): %s", backoff, exc)
                self.stop.wait(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
                continue
            if due:
                follow_ups = []
                continue  # ask again at once: more may have come while a run went on
            if follow_ups:
                self.stop.wait(follow_ups.pop(0))
                continue
            wait_s = self.poll_s
            if self.head_watch is not None:
                wait_s = max(0.05, min(wait_s, self._next_head_check - time.monotonic()))
            if self._wake.wait(wait_s):
                self._wake.clear()
                follow_ups = list(FOLLOW_UP_S)


def serve_in_process(deployments: list, flows: dict[str, Any], *, poll_s: float = POLL_S,
                     start_now: str | None = None, cancel_poll_s: float = CANCEL_POLL_S,
                     wake_on_events: bool = True, heartbeat: Callable[[bool], Any] | None = None,
                     heartbeat_s: float = HEARTBEAT_S, zombie_after_s: float | None = None,
                     outcomes: dict[str, Callable[..., Any]] | None = None,
                     publications: Publications | None = None,
                     vet: dict[str, Callable[[dict], dict]] | None = None, head_watch: Any = None,
                     head_poll_s: float = HEAD_POLL_S, node: str | None = None,
                     shutdown_s: float = SHUTDOWN_S) -> AgentStats:
    """Run a ``NodeAgent`` in a worker thread while the main thread owns the signals.

    Once stopped (SIGTERM, Ctrl-C) the process ends within ``shutdown_s``
    whatever the Prefect API does: the agent thread gets until then to end
    its run (``INTERRUPTED``, the store recoverable) and say so to the
    server; an API that does not answer cannot hold it longer. If the
    thread (or Prefect's own workers draining their logs and events to a
    server that is gone) still holds the process then, it exits anyway
    (``os._exit``): the store is crash-safe at every point, the next start
    recovers it, and the run left ``Running`` on the server is closed by the
    next start's orphan check (``deployments/orphans.py``).
    """
    from storage.runtime.cancel import signals_stop_the_run

    outcome: dict = {}
    stopped_at: list[float] = []
    with signals_stop_the_run() as stop:
        stop.add_listener(lambda: stopped_at.append(time.monotonic()))
        agent = NodeAgent(deployments, flows, poll_s=poll_s, start_now=start_now, cancel_poll_s=cancel_poll_s,
                          wake_on_events=wake_on_events, stop=stop, heartbeat=heartbeat, heartbeat_s=heartbeat_s,
                          zombie_after_s=zombie_after_s, outcomes=outcomes, publications=publications, vet=vet,
                          head_watch=head_watch, head_poll_s=head_poll_s, node=node)
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(lambda: outcome.update(stats=agent.run()),),
                                  name="node-agent", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if stopped_at and time.monotonic() - stopped_at[0] > shutdown_s * 0.75:
                log.warning("the agent did not finish stopping within %.1fs (the Prefect API does not answer?): "
                            "exiting; the next start recovers the store and closes the run left in progress",
                            shutdown_s * 0.75)
                break
    if stopped_at:
        _exit_by(stopped_at[0] + shutdown_s)
    return outcome.get("stats", agent.stats)


def _exit_by(deadline: float) -> None:
    """Make sure the process is gone by ``deadline`` (monotonic): Prefect's log and event workers drain to the
    API at interpreter exit, and an API that does not answer would hold the exit for their retries."""
    import os

    def force() -> None:
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), force)
    timer.daemon = True
    timer.start()
