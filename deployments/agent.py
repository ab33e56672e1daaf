"""The warm node agent: one long-running process per node that runs its deployments' flow runs in-process.

Prefect's own runner starts a new Python process for every flow run: a refit
then pays for an interpreter, Prefect's import and its client set-up (seconds)
before the first byte moves. The agent keeps all of that warm. It registers
the node's deployments, asks the Prefect server for their runs that are due
(scheduled, or created by the publication event's automation), claims each
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
safe point (the run's state is read every ``cancel_poll_s`` while it runs);
SIGTERM or Ctrl-C stop the agent the same way: the run in progress ends
``INTERRUPTED`` with its store recoverable, then the agent exits.

A run the agent claims carries its claimant in the ``Pending`` state's
message (host, boot, pid and process start time). A node whose agent was
killed (SIGKILL, a crashed host) leaves that run ``Running`` on the server;
when the node's agent starts again it finds its deployments' runs still
``Pending``, ``Running`` or ``Cancelling`` whose claimant process is gone
from this host, and marks them ``Crashed``. Runs claimed on another host or
by a live process are left alone.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

from storage.cancel import StopToken, current_stop

log = logging.getLogger("canonical_refit.agent")
POLL_S = 10.0  # default seconds between polls (serve passes ServeSettings.poll_s)
FOLLOW_UP_S = (0.2, 0.5, 1.0)  # polls after a wake-up that found nothing due yet (the run may not be visible yet)
CANCEL_POLL_S = 2.0  # seconds between reads of a running run's state (cancellation from the UI or the API)
MAX_BACKOFF_S = 30.0  # longest wait between polls while the API fails
CLAIM = "claimed by node agent"
_CLAIM_RE = re.compile(rf"{CLAIM} host=(?P<host>\S+) boot=(?P<boot>\S+) pid=(?P<pid>\d+) start=(?P<start>\d+)")


@dataclass
class AgentStats:
    """What the agent did and what it cost the API (for the benchmarks and the docs)."""

    polls: int = 0
    runs: int = 0
    claims_lost: int = 0
    api_requests: int = 0  # polls, claims, run reads and cancellation reads (not the flow runs' own requests)
    api_errors: int = 0
    orphans_crashed: int = 0
    wakeups: int = 0  # scheduled-run events received from the server's event stream
    started_at: float = field(default_factory=time.monotonic)
    run_starts: list[dict] = field(default_factory=list)  # flow run, expected start, claimed at


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8] or "unknown"
    except OSError:
        return "unknown"


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None if there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def agent_identity(pid: int | None = None) -> str:
    """``host=... boot=... pid=... start=...``: this process, told apart from a later one with the same pid."""
    pid = os.getpid() if pid is None else pid
    return f"host={socket.gethostname()} boot={_boot_id()} pid={pid} start={_start_ticks(pid) or 0}"


def claimant_gone(message: str | None) -> bool:
    """True if ``message`` names a claimant process on this host that no longer runs (never for another host)."""
    found = _CLAIM_RE.search(message or "")
    if found is None or found["host"] != socket.gethostname():
        return False
    if found["boot"] != _boot_id():
        return True  # the host rebooted since
    start = _start_ticks(int(found["pid"]))
    return start is None or str(start) != found["start"]


class NodeAgent:
    """Runs the flow runs of ``deployments`` (runner deployments of the ``flows`` named by their flow_name) in
    this process, one at a time, polling every ``poll_s``."""

    def __init__(self, deployments: list, flows: dict[str, Any], *, poll_s: float = POLL_S,
                 start_now: str | None = None, stop: StopToken | None = None,
                 cancel_poll_s: float = CANCEL_POLL_S, wake_on_events: bool = True):
        self.deployments = deployments
        self.flows = flows
        self.poll_s = poll_s
        self.cancel_poll_s = cancel_poll_s
        self.start_now = start_now  # a deployment to run once at start-up (the node catches up at once)
        self.stop = stop or current_stop.get()
        self.wake_on_events = wake_on_events
        self.stats = AgentStats()
        self.identity = agent_identity()
        self._flows: dict[UUID, Any] = {}
        self._wake = threading.Event()  # set by a scheduled-run event, and by stopping

    def register(self, client) -> list[UUID]:
        """Create or update every deployment on the server; their ids."""
        ids = []
        for deployment in self.deployments:
            deployment_id = deployment.apply()
            self._flows[deployment_id] = self.flows[deployment.flow_name]
            ids.append(deployment_id)
            log.info("registered deployment %s (%s)", deployment.name, deployment_id)
        self.crash_orphans(client, ids)
        if self.start_now:
            for deployment_id, deployment in zip(ids, self.deployments):
                if deployment.name == self.start_now:
                    client.create_flow_run_from_deployment(deployment_id)
                    log.info("scheduled %s once at start-up: the node catches up to latest", deployment.name)
        return ids

    def crash_orphans(self, client, ids: list[UUID]) -> int:
        """Mark ``Crashed`` the runs of these deployments left in progress by an agent process that is gone."""
        from prefect.client.schemas.filters import (
            DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.states import Crashed

        in_progress = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
            any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])))
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=ids)),
                                     flow_run_filter=in_progress)
        crashed = 0
        for run in runs:
            claims = [s.message for s in client.read_flow_run_states(run.id)
                      if s.type == StateType.PENDING and s.message and CLAIM in s.message]
            if not claims or not claimant_gone(claims[-1]):
                continue
            owner = _CLAIM_RE.search(claims[-1])
            message = (f"the node agent that ran it (pid {owner['pid']} on {owner['host']}) is gone; the node's "
                       "store recovers on its next refit")
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
            log.warning("flow run %s was left %s by a node agent that is gone: marked Crashed", run.name,
                        run.state_name)
            crashed += 1
        self.stats.orphans_crashed += crashed
        return crashed

    def run(self) -> AgentStats:
        """Serve until stopped (SIGTERM, Ctrl-C, or ``stop``)."""
        from prefect.context import SyncClientContext
        from prefect.settings import get_current_settings

        api_url = str(get_current_settings().api.url).rstrip("/")
        self.stop.add_listener(self._wake.set)
        try:
            # one client for the agent's life: the flow runs it executes take this context's client too
            with SyncClientContext.get_or_create() as context:
                client = context.client
                ids = self._until_registered(client)
                if ids is not None:
                    if self.wake_on_events:
                        threading.Thread(target=self._listen, args=(api_url, ids), name="run-wakeup",
                                         daemon=True).start()
                    log.info("node agent ready: %d deployment(s), woken by their scheduled-run events, polling "
                             "every %.1fs", len(ids), self.poll_s)
                    self._serve(client, ids)
        finally:
            self.stop.remove_listener(self._wake.set)
        log.info("node agent stopped after %d run(s)", self.stats.runs)
        return self.stats

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

    def _serve(self, client, ids: list[UUID]) -> None:
        backoff = min(self.poll_s, 1.0)
        follow_ups: list[float] = []
        while not self.stop.stopped:
            try:
                due = self._due(client, ids)
                for run in due:
                    if self.stop.stopped:
                        break
                    if self._claim(client, run):
                        self._execute(client, run)
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
            if self._wake.wait(self.poll_s):
                self._wake.clear()
                follow_ups = list(FOLLOW_UP_S)

    def _listen(self, api_url: str, ids: list[UUID]) -> None:
        """Set ``_wake`` on every ``prefect.flow-run.Scheduled`` event of these deployments, until stopped.

        A failed subscription is retried with a backoff; meanwhile the node still polls every ``poll_s``.
        """
        backoff, failures = 1.0, 0
        while not self.stop.stopped:
            started = time.monotonic()
            try:
                asyncio.run(self._subscribe(api_url, ids))
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

        wanted = EventFilter(event=EventNameFilter(name=["prefect.flow-run.Scheduled"]),
                             related=EventRelatedFilter(id=[f"prefect.deployment.{i}" for i in ids]))
        async with PrefectEventSubscriber(api_url=api_url, filter=wanted, reconnect_on_clean_close=True) as events:
            self._wake.set()  # runs scheduled while the stream was down are picked up now
            stream = events.__aiter__()
            while not self.stop.stopped:
                try:  # wake up every second to notice a stop (cancelling a websocket receive is safe)
                    await asyncio.wait_for(stream.__anext__(), timeout=1.0)
                except asyncio.TimeoutError:
                    continue
                self.stats.wakeups += 1
                self._wake.set()

    def _due(self, client, ids: list[UUID]) -> list:
        self.stats.polls += 1
        self.stats.api_requests += 1
        runs = client.get_scheduled_flow_runs_for_deployments(deployment_ids=ids,
                                                               scheduled_before=datetime.now(timezone.utc))
        return sorted(runs, key=lambda r: (r.next_scheduled_start_time or r.expected_start_time or r.created))

    def _claim(self, client, run) -> bool:
        """Move the run to Pending; another agent (or a second copy of this one) may have been first."""
        from prefect.client.schemas.responses import SetStateStatus
        from prefect.states import Pending

        self.stats.api_requests += 1
        result = client.set_flow_run_state(run.id, Pending(message=f"{CLAIM} {self.identity}"), force=False)
        if result.status != SetStateStatus.ACCEPT:
            self.stats.claims_lost += 1
            return False
        self.stats.run_starts.append({"flow_run": str(run.id), "name": run.name,
                                      "expected_start": str(run.expected_start_time),
                                      "claimed_at": datetime.now(timezone.utc).isoformat()})
        return True

    def _execute(self, client, run) -> None:
        """Run one claimed flow run in this process; cancellation from the server stops it cooperatively."""
        from prefect.flow_engine import run_flow

        flow = self._flows[run.deployment_id]
        run_stop = self.stop.child()
        watcher_done = threading.Event()
        watcher = threading.Thread(target=self._watch_cancellation, args=(client, run.id, run_stop, watcher_done),
                                   name="cancel-watch", daemon=True)
        token = current_stop.set(run_stop)
        started = time.perf_counter()
        try:
            self.stats.api_requests += 1
            claimed = client.read_flow_run(run.id)
            watcher.start()
            state = run_flow(flow, flow_run=claimed, parameters=run.parameters, return_type="state")
            log.info("flow run %s ended %s in %.2fs", run.name, getattr(state, "name", state),
                     time.perf_counter() - started)
        except BaseException as exc:  # the engine reported it on the run; the agent serves on
            log.error("flow run %s failed in the agent: %s", run.name, exc)
            if isinstance(exc, KeyboardInterrupt):
                raise
        finally:
            current_stop.reset(token)
            watcher_done.set()
            run_stop.close()
            self.stats.runs += 1

    def _watch_cancellation(self, client, run_id: UUID, run_stop: StopToken, done: threading.Event) -> None:
        while not done.wait(self.cancel_poll_s):
            try:
                self.stats.api_requests += 1
                state = client.read_flow_run(run_id).state
            except Exception as exc:  # the API hiccupped: keep watching
                log.debug("cancellation watch: %s", exc)
                continue
            if state is not None and state.is_cancelling():
                log.warning("flow run %s is being cancelled: stopping at the next safe point", run_id)
                run_stop.stop("cancelled from Prefect", interrupt=True)  # ends Interrupted, the fast path
                return


def serve_in_process(deployments: list, flows: dict[str, Any], *, poll_s: float = POLL_S,
                     start_now: str | None = None, cancel_poll_s: float = CANCEL_POLL_S,
                     wake_on_events: bool = True) -> AgentStats:
    """Run a ``NodeAgent`` in a worker thread while the main thread owns the signals."""
    from storage.cancel import signals_stop_the_run

    outcome: dict = {}
    with signals_stop_the_run() as stop:
        agent = NodeAgent(deployments, flows, poll_s=poll_s, start_now=start_now, cancel_poll_s=cancel_poll_s,
                          wake_on_events=wake_on_events, stop=stop)
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(lambda: outcome.update(stats=agent.run()),),
                                  name="node-agent", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
    return outcome.get("stats", agent.stats)
