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
safe point (its ``Cancelling`` event arrives on the agent's event stream; the
run's state is also read every ``cancel_poll_s`` while it runs, a fallback);
SIGTERM or Ctrl-C stop the agent the same way: the run in progress ends
``INTERRUPTED`` with its store recoverable, then the agent exits.

Fan-out of a publication (``PublishFanOut``, ``deployments.serve --fan-out
agent``): instead of a server automation per node, each agent subscribes to
the published events of its model and creates its own ``refit-on-publish``
run for the event's version (one API request per node, idempotent per event
and deployment), so the server evaluates no per-node automation; the run is
still a flow run of that deployment in the UI. When its event subscription
(re)connects, the agent creates one ``refit-latest`` run, for publications
it could not hear while the stream was down.

A node whose agent was killed (SIGKILL, a crashed host, a rescheduled pod)
leaves its run ``Running`` on the server; ``deployments/orphans.py`` closes
such runs (the agent's claims, and Prefect's zombie-run automation).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable
from uuid import UUID

from deployments.orphans import CLAIM, agent_identity, crash_orphans, ensure_zombie_automation
from deployments.pinning import RunRefused
from storage.cancel import StopToken, current_stop

log = logging.getLogger("canonical_refit.agent")
POLL_S = 10.0  # default seconds between polls (serve passes ServeSettings.poll_s)
FOLLOW_UP_S = (0.2, 0.5, 1.0)  # polls after a wake-up that found nothing due yet (the run may not be visible yet)
HEARTBEAT_S = 30.0  # default seconds between refreshes of the node's record (serve passes ServeSettings.heartbeat_s)
CANCEL_POLL_S = 10.0  # seconds between reads of a running run's state: a fallback, the event stream tells at once
CANCEL_POLL_NO_EVENTS_S = 2.0  # the same without the event stream (--no-event-wakeups)
MAX_BACKOFF_S = 30.0  # longest wait between polls while the API fails
HEAD_POLL_S = 30.0  # default seconds between checks of the catalog's head (serve passes ServeSettings.head_poll_s)
SHUTDOWN_S = 4.0  # after SIGTERM the process exits within this, whether or not the Prefect API answers
CANCELLING_EVENT = "prefect.flow-run.Cancelling"


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
    heartbeats: int = 0  # node record refreshes (no Prefect API request)
    heals: int = 0  # refits started because a heartbeat saw the engines drift from the store
    fan_outs: int = 0  # refit-on-publish runs this agent created for published events (--fan-out agent)
    refused: int = 0  # runs whose parameters this node's configuration does not allow (deployments/pinning.py)
    head_checks: int = 0  # reads of the catalog's head (the level check that catches a lost publication)
    catch_ups: int = 0  # refit-latest runs created because the head was newer than the node (or to retry)
    superseded: int = 0  # refit runs ended Skipped, unrun, because a newer version was due (a burst coalesced)
    started_at: float = field(default_factory=time.monotonic)
    run_starts: list[dict] = field(default_factory=list)  # flow run, expected start, claimed at


@dataclass(frozen=True)
class PublishFanOut:
    """The agent turns each published event into a run of its own deployment (no server automation)."""

    deployment: str  # the deployment whose runs it creates (refit-on-publish with the node's suffix)
    event: str  # the event's name
    resource_prefix: str  # the model's published events: their resource id starts so
    parameters: Callable[[str], dict]  # the run's parameters for a published version


class NodeAgent:
    """Runs the flow runs of ``deployments`` (runner deployments of the ``flows`` named by their flow_name) in
    this process, one at a time, polling every ``poll_s``."""

    def __init__(self, deployments: list, flows: dict[str, Any], *, poll_s: float = POLL_S,
                 start_now: str | None = None, stop: StopToken | None = None,
                 cancel_poll_s: float = CANCEL_POLL_S, wake_on_events: bool = True,
                 heartbeat: Callable[[bool], Any] | None = None, heartbeat_s: float = HEARTBEAT_S,
                 zombie_after_s: float | None = None, outcomes: dict[str, Callable[..., Any]] | None = None,
                 fan_out: PublishFanOut | None = None, vet: dict[str, Callable[[dict], dict]] | None = None,
                 head_watch: Any = None, head_poll_s: float = HEAD_POLL_S, node: str | None = None):
        self.deployments = deployments
        # flows.node_report.HeadWatch: the catalog's head against what the node runs (None: events and the interval
        # schedule only); checked every head_poll_s while no run is due, and before a burst of refits is run
        self.head_watch = head_watch
        self.head_poll_s = head_poll_s
        self._next_head_check = 0.0
        self.node = node
        # flow name -> the run's parameters as this node runs them, or RunRefused (deployments/pinning.py); a flow
        # with no entry is not run at all (a run's parameters are never run as they come)
        self.vet = vet or {}
        self.fan_out = fan_out
        self._fan_out_id: UUID | None = None
        self._subscribed_once = False
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

    def register(self, client) -> list[UUID]:
        """Create or update every deployment on the server; their ids."""
        ids = []
        for deployment in self.deployments:
            deployment_id = deployment.apply()
            self._flows[deployment_id] = self.flows[deployment.flow_name]
            ids.append(deployment_id)
            if self.fan_out is not None and deployment.name == self.fan_out.deployment:
                self._fan_out_id = deployment_id
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
            # one client for the agent's life: the flow runs it executes take this context's client too
            with SyncClientContext.get_or_create() as context:
                client = context.client
                ids = self._until_registered(client)
                if ids is not None:
                    if self.heartbeat is not None:
                        threading.Thread(target=self._beat, name="node-heartbeat", daemon=True).start()
                    if self.wake_on_events:
                        threading.Thread(target=self._listen, args=(lambda: self._subscribe(api_url, ids),),
                                         name="run-wakeup", daemon=True).start()
                    if self._fan_out_id is not None:
                        threading.Thread(target=self._listen, args=(lambda: self._subscribe_published(api_url),),
                                         name="publish-fan-out", daemon=True).start()
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

    def _beat(self) -> None:
        """Every ``heartbeat_s``: refresh this node's record (alive, and what its engines run); a drift found
        while idle asks the agent for a healing refit."""
        while not self.stop.stopped:
            try:
                record = self.heartbeat(self._busy.is_set())
                self.stats.heartbeats += 1
                if record is not None and record.condition() == "DRIFTED" and not self._busy.is_set():
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
                if not due and time.monotonic() >= self._next_head_check:
                    due = self._check_head(client, ids)
                for run in due:
                    if self.stop.stopped:
                        break
                    if self._claim(client, run):
                        self._execute(client, run)
                        # the head is checked a whole interval after the node was last busy: a run may
                        # have just been created for what a check would find
                        self._next_head_check = time.monotonic() + self.head_poll_s
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

    # -- the level check: the catalog's head against what the node runs ---------------------------------------

    def _run_name(self, detail: str) -> str:
        return f"refit {self.node} {detail}" if self.node else f"refit {detail}"

    def _create_latest(self, client, why: str, name: str | None = None):
        """One run of refit-latest (the start_now deployment), named for the node and the versions."""
        self.stats.api_requests += 1
        run = client.create_flow_run_from_deployment(
            self._latest_id, name=name or self._run_name("-> latest"),
            tags=[f"node:{self.node}"] if self.node else None)
        log.info("created flow run %s (%s): %s", run.name, run.id, why)
        return run

    def _check_head(self, client, ids: list[UUID]) -> list:
        """Every ``head_poll_s`` with no run due: if the catalog's head is newer than what the node runs (a
        publication whose event was lost) or the last refit failed on a transient error, create one refit-latest
        run; the runs due afterwards (that one)."""
        self._next_head_check = time.monotonic() + self.head_poll_s
        if self.head_watch is None or self._latest_id is None:
            return []
        self.stats.head_checks += 1
        try:
            due = self.head_watch.due()
        except Exception as exc:  # storage down: the next check tries again
            log.warning("could not check the catalog's head (next check in %.0fs): %s", self.head_poll_s, exc)
            return []
        if due is None:
            return []
        version, why = due
        installed = getattr(self.head_watch, "installed", lambda: None)()
        self._create_latest(client, why, self._run_name(f"{installed or 'none'} -> {version}"))
        self.stats.catch_ups += 1
        return self._due(client, ids)

    def _coalesce(self, client, due: list) -> list:
        """A burst of publications runs one refit: of the refit runs due together that name a version and only
        move forward (``only_if_newer``), those whose version is newer than the installed one run only the
        newest; the others end Skipped, unrun, naming the run that supersedes them. A run whose version is
        not newer runs as it is (it ends Skipped itself, saying so); a ``latest`` run is never skipped here."""
        if self.head_watch is None:
            return due
        forward = [r for r in due if getattr(self._flows.get(r.deployment_id), "name", None) == "refit"
                   and _only_if_newer(r) and _target(r) not in (None, "latest")]
        if len(forward) < 2:
            return due
        try:
            installed = self.head_watch.installed()
            floor = self.head_watch.sequence_of(installed) if installed is not None else -1
            keys = {r.id: self.head_watch.sequence_of(_target(r)) for r in forward}
        except Exception as exc:  # the store or the catalog cannot say: run them as they are
            log.debug("coalescing: %s", exc)
            return due
        if floor is None or any(k is None for k in keys.values()):
            return due  # a version the catalog cannot place: nothing is skipped on a guess
        newer = [r for r in forward if keys[r.id] > floor]
        if len(newer) < 2:
            return due
        newest = max(newer, key=lambda r: (keys[r.id], r.created))
        from prefect.states import Completed

        keeper = f"flow run {newest.name} to {_target(newest)}"
        skipped = set()
        for run in newer:
            if run.id == newest.id:
                continue
            self.stats.api_requests += 1
            client.set_flow_run_state(run.id, Completed(
                name="Skipped", message=f"superseded by a newer version: {keeper} runs instead"), force=True)
            skipped.add(run.id)
            self.stats.superseded += 1
            log.info("flow run %s to %s skipped: superseded by %s", run.name, _target(run), keeper)
        return [r for r in due if r.id not in skipped]

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

    def _cancelled(self, run_id: str) -> None:
        """The server says a run is being cancelled (the UI's Cancel): stop it if it is the one running here."""
        running = self._running
        if running is not None and str(running[0]) == run_id and not running[1].stopped:
            log.warning("flow run %s is being cancelled: stopping at the next safe point", run_id)
            running[1].stop("cancelled from Prefect", interrupt=True)  # ends Interrupted, the fast path

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
        self.stats.api_requests += 1
        claimed = client.read_flow_run(run.id)  # its parameters as they are now, after the claim
        try:
            parameters = self._vetted(flow.name, claimed.parameters)
        except Exception as exc:  # refused; anything else that went wrong reading them refuses it too
            self._refuse(client, run, exc if isinstance(exc, RunRefused) else RunRefused(
                flow.name, ["params"], (), f"its parameters could not be read: {exc}"))
            return
        run_stop = self.stop.child()
        watcher_done = threading.Event()
        watcher = threading.Thread(target=self._watch_cancellation, args=(client, run.id, run_stop, watcher_done),
                                   name="cancel-watch", daemon=True)
        token = current_stop.set(run_stop)
        started = time.perf_counter()
        self._running = (run.id, run_stop)
        self._busy.set()
        try:
            watcher.start()
            outcome = self.outcomes.get(flow.name)
            if outcome is not None:
                outcome(reset=True)
            state = run_flow(flow, flow_run=claimed, parameters=parameters, return_type="state")
            failed = state is not None and hasattr(state, "is_failed") and (state.is_failed() or state.is_crashed())
            (log.error if failed else log.info)(
                "flow run %s ended %s in %.2fs%s", run.name, getattr(state, "name", state),
                time.perf_counter() - started, f": {state.message}" if failed and state.message else "")
            self._settle(client, run, state, outcome)
        except BaseException as exc:  # the engine reported it on the run; the agent serves on
            log.error("flow run %s failed in the agent: %s", run.name, exc)
            if isinstance(exc, KeyboardInterrupt):
                raise
        finally:
            self._running = None
            self._busy.clear()
            current_stop.reset(token)
            watcher_done.set()
            run_stop.close()
            self.stats.runs += 1

    def _vetted(self, flow_name: str, parameters: dict | None) -> dict:
        vet = self.vet.get(flow_name)
        if vet is None:
            raise RunRefused(flow_name, ["the flow"], (), "this agent runs no flow of that name with its own "
                                                        "configuration")
        return vet(dict(parameters or {}))

    def _refuse(self, client, run, exc: RunRefused) -> None:
        """End a claimed run Failed (named Refused) without running any of it; the node's log says why."""
        from prefect.states import Failed

        log.warning("flow run %s refused, not run: %s", run.name, exc)
        self.stats.refused += 1
        self.stats.api_requests += 1
        client.set_flow_run_state(run.id, Failed(name="Refused", message=str(exc)), force=True)

    def _settle(self, client, run, state, outcome: Callable[[], Any] | None) -> None:
        """A run that ended before its cancellation reached it is left ``Cancelling`` by the server (which
        refuses the engine's final state, and the engine returns ``Cancelling``): give it the state it really
        ended in (``outcome()``), so that no run stays Cancelling."""
        from prefect.states import Cancelled, Completed

        if state is not None and state.is_final():
            return
        reached = outcome() if outcome is not None else None
        if reached is None:
            final = Cancelled(name="Interrupted", message="cancelled; the run ended while its cancellation was "
                                                          "being delivered")
        elif reached.is_completed():  # it finished (installed and activated, or nothing to do): say so
            final = Completed(name=reached.name, message=f"{reached.message} (it finished before the "
                                                         "cancellation reached it)")
        elif reached.is_cancelled():
            final = Cancelled(name=reached.name, message=reached.message)
        else:
            final = reached.model_copy(update={"data": None})
        self.stats.api_requests += 1
        client.set_flow_run_state(run.id, final, force=True)
        log.warning("flow run %s ended while the server had it %s: set %s", run.name,
                    getattr(state, "name", state), final.name)

    def _watch_cancellation(self, client, run_id: UUID, run_stop: StopToken, done: threading.Event) -> None:
        while not done.wait(self.cancel_poll_s):
            try:
                self.stats.api_requests += 1
                state = client.read_flow_run(run_id).state
            except Exception as exc:  # the API hiccupped: keep watching
                log.debug("cancellation watch: %s", exc)
                continue
            if state is not None and state.is_cancelling():
                self._cancelled(str(run_id))
                return


def _target(run) -> str | None:
    params = (run.parameters or {}).get("params")
    return params.get("target", "latest") if isinstance(params, dict) else None


def _only_if_newer(run) -> bool:
    params = (run.parameters or {}).get("params")
    return isinstance(params, dict) and params.get("only_if_newer") is True


def serve_in_process(deployments: list, flows: dict[str, Any], *, poll_s: float = POLL_S,
                     start_now: str | None = None, cancel_poll_s: float = CANCEL_POLL_S,
                     wake_on_events: bool = True, heartbeat: Callable[[bool], Any] | None = None,
                     heartbeat_s: float = HEARTBEAT_S, zombie_after_s: float | None = None,
                     outcomes: dict[str, Callable[..., Any]] | None = None,
                     fan_out: PublishFanOut | None = None,
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
    from storage.cancel import signals_stop_the_run

    outcome: dict = {}
    stopped_at: list[float] = []
    with signals_stop_the_run() as stop:
        stop.add_listener(lambda: stopped_at.append(time.monotonic()))
        agent = NodeAgent(deployments, flows, poll_s=poll_s, start_now=start_now, cancel_poll_s=cancel_poll_s,
                          wake_on_events=wake_on_events, stop=stop, heartbeat=heartbeat, heartbeat_s=heartbeat_s,
                          zombie_after_s=zombie_after_s, outcomes=outcomes, fan_out=fan_out, vet=vet,
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
