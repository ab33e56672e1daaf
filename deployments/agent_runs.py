"""One flow run in the agent: find it due, claim it, run it in this process, settle its final state.

``RunExecution`` is a part of ``deployments.agent.NodeAgent``. A run's
parameters are vetted against the node's own configuration before anything
runs (``deployments/pinning.py``); a cancellation from the server stops it
cooperatively at its next safe point.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable
from uuid import UUID

from deployments.orphans import CLAIM
from deployments.pinning import RunRefused
from flows.prefect_adapter import run_claimed_flow
from storage.runtime.cancel import StopToken, current_stop

log = logging.getLogger("canonical_refit.agent")


class RunExecution:
    """Claiming and running the agent's due flow runs, one at a time."""

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
            state = run_claimed_flow(flow, claimed, parameters)
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
