"""The warm node agent: one long-running process per node that runs its deployments' flow runs in-process.

Prefect's own runner starts a new Python process for every flow run: a refit
then pays for an interpreter, Prefect's import and its client set-up (seconds)
before the first byte moves. The agent keeps all of that warm. It registers
the node's deployments, asks the Prefect server every ``poll_s`` for their
runs that are due (scheduled, or created by the publication event's
automation), claims each one (``Pending``) and runs it in this process with
Prefect's flow engine — still a flow run with its states, task runs, logs and
artifacts in the UI. Runs are executed one at a time, so two refits of the
node never overlap (the store lock also guarantees it across processes).

Cancelling a run from the UI (or the API) stops it cooperatively at its next
safe point; SIGTERM or Ctrl-C stop the agent the same way: the run in
progress ends ``INTERRUPTED`` with its store recoverable, then the agent exits.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from storage.cancel import PROCESS, StopToken, current_stop

log = logging.getLogger("canonical_refit.agent")


@dataclass
class AgentStats:
    """What the agent did and what it cost the API (for the benchmarks and the docs)."""

    polls: int = 0
    runs: int = 0
    claims_lost: int = 0
    api_requests: int = 0
    started_at: float = field(default_factory=time.monotonic)
    run_starts: list[dict] = field(default_factory=list)  # flow run, expected start, claimed at


class NodeAgent:
    """Runs the flow runs of ``deployments`` (runner deployments of the ``flows`` named by their flow_name) in
    this process, one at a time, polling every ``poll_s``."""

    def __init__(self, deployments: list, flows: dict[str, Any], *, poll_s: float = 0.5,
                 start_now: str | None = None, stop: StopToken | None = None):
        self.deployments = deployments
        self.flows = flows
        self.poll_s = poll_s
        self.start_now = start_now  # a deployment to run once at start-up (the node catches up at once)
        self.stop = stop or PROCESS
        self.stats = AgentStats()
        self._flows: dict[UUID, Any] = {}

    def register(self, client) -> list[UUID]:
        """Create or update every deployment on the server; their ids."""
        ids = []
        for deployment in self.deployments:
            deployment_id = deployment.apply()
            self._flows[deployment_id] = self.flows[deployment.flow_name]
            ids.append(deployment_id)
            log.info("registered deployment %s (%s)", deployment.name, deployment_id)
        if self.start_now:
            for deployment_id, deployment in zip(ids, self.deployments):
                if deployment.name == self.start_now:
                    client.create_flow_run_from_deployment(deployment_id)
                    log.info("scheduled %s once at start-up: the node catches up to latest", deployment.name)
        return ids

    def run(self) -> AgentStats:
        """Serve until stopped (SIGTERM, Ctrl-C, or ``stop``)."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            ids = self.register(client)
            log.info("node agent ready: %d deployment(s), polling every %.1fs", len(ids), self.poll_s)
            while not self.stop.stopped:
                due = self._due(client, ids)
                for run in due:
                    if self.stop.stopped:
                        break
                    if self._claim(client, run):
                        self._execute(client, run)
                if not due:
                    self.stop.wait(self.poll_s)
        log.info("node agent stopped after %d run(s)", self.stats.runs)
        return self.stats

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
        result = client.set_flow_run_state(run.id, Pending(), force=False)
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
        watcher = threading.Thread(target=self._watch_cancellation, args=(run.id, run_stop, watcher_done),
                                   name="cancel-watch", daemon=True)
        watcher.start()
        token = current_stop.set(run_stop)
        started = time.perf_counter()
        try:
            state = run_flow(flow, flow_run=client.read_flow_run(run.id), parameters=run.parameters,
                             return_type="state")
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

    def _watch_cancellation(self, run_id: UUID, run_stop: StopToken, done: threading.Event) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while not done.wait(1.0):
                try:
                    state = client.read_flow_run(run_id).state
                except Exception as exc:  # the API hiccupped: keep watching
                    log.debug("cancellation watch: %s", exc)
                    continue
                if state is not None and state.is_cancelling():
                    log.warning("flow run %s is being cancelled: stopping at the next safe point", run_id)
                    run_stop.stop("cancelled from Prefect")
                    return


def serve_in_process(deployments: list, flows: dict[str, Any], *, poll_s: float,
                     start_now: str | None) -> AgentStats:
    """Run a ``NodeAgent`` in a worker thread while the main thread owns the signals."""
    from storage.cancel import signals_stop_the_run

    agent = NodeAgent(deployments, flows, poll_s=poll_s, start_now=start_now)
    outcome: dict = {}
    with signals_stop_the_run():
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(lambda: outcome.update(stats=agent.run()),),
                                  name="node-agent", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
    return outcome.get("stats", agent.stats)
