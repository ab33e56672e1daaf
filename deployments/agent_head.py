"""The agent's reconcile loop step: desired version against installed version, at most one refit run for it.

``HeadCheck`` is a part of ``deployments.agent.NodeAgent`` (it reads the
agent's ``head_watch``, ``head_poll_s``, ``node``, ``stats``,
``publications`` and the deployment ids ``register`` found).

Level-based, in the manner of a Kubernetes controller: a published event
only records the version it names (``_hear``) and wakes the loop; the loop
compares the desired version (the newest of the versions heard and the
catalog's head, ``HeadWatch.due``) with the observed one (what the node's
store installed) and creates at most ONE refit run, for the newest desired
version, when it is newer than the installed one. A burst of publications
is coalesced to the newest by construction; an event delivered again finds
nothing newer (or its run already created) and makes no run. The check runs
at once when an event names a version not heard before, else every
``head_interval_s()`` while no run is due: the timer, not events, governs
retries.

A refit that failed on storage (the revision could not be read: an outage,
a missing object, denied access) is retried at the next check. While such
retries keep failing, the checks back off: the interval doubles after each
one, from ``head_poll_s`` up to ``HEAD_POLL_CAP_S`` (60 s, the most
``--head-poll-seconds`` allows), so a node retries an outage at most once a
minute and still catches up within a minute of storage coming back. Any
other answer (nothing due, a newer head, a refit that got through) resets
the interval. A refit whose revision was refused (a corrupt revision) is not
retried: the same bytes would be refused again.
"""

from __future__ import annotations

import logging
import threading
import time
from uuid import UUID

from flows.run_labels import node_tag

log = logging.getLogger("canonical_refit.agent")
HEAD_POLL_CAP_S = 60.0  # the longest interval between head checks, backing off or not (serve: --head-poll-seconds <= 60)


class HeadCheck:
    """The refit runs the agent creates itself: at start-up, to heal a drift, and when the desired version (heard
    on an event or read as the catalog's head) is newer than the installed one."""

    def _init_reconcile(self) -> None:
        self._heard_lock = threading.Lock()
        self._heard: list[str] = []  # versions heard on published events, not yet compared by a check
        self._heard_ever: set[str] = set()  # every version heard: one delivered again does not bypass the timer
        self._check_now = threading.Event()  # an event named a version not heard before: check without waiting
        self._refit_id: UUID | None = None  # the deployment the loop's refit runs belong to (register sets it)

    def _hear(self, version: str) -> None:
        """A published event named ``version``: record it as desired and wake the loop (no run is created here)."""
        self.stats.heard += 1
        with self._heard_lock:
            if version in self._heard_ever:
                return  # delivered again: the loop already knows (a run for it exists, or it is not newer)
            self._heard_ever.add(version)
            self._heard.append(version)
        log.info("heard that %s was published: checking it against the installed version", version)
        self._check_now.set()
        self._wake.set()

    def _check_soon(self) -> None:
        """The event stream (re)connected: what was published meanwhile is read from the catalog's head now."""
        self._check_now.set()
        self._wake.set()

    def _check_due(self) -> bool:
        return self._check_now.is_set() or time.monotonic() >= self._next_head_check

    def _run_name(self, detail: str) -> str:
        return f"refit {self.node} {detail}" if self.node else f"refit {detail}"

    def _create_latest(self, client, why: str, name: str | None = None):
        """One run of refit-latest (the start_now deployment), named for the node and the versions."""
        self.stats.api_requests += 1
        run = client.create_flow_run_from_deployment(
            self._latest_id, name=name or self._run_name("-> latest"),
            tags=[node_tag(self.node)] if self.node else None)
        log.info("created flow run %s (%s): %s", run.name, run.id, why)
        return run

    def _create_refit(self, client, installed: str | None, version: str, why: str):
        """The loop's one refit run for the desired ``version``: of the publications' deployment with that target
        (without one configured: of refit-latest). Its idempotency key names this process, the versions and the
        runs it executed so far: until one more run was executed, asking again (a re-delivered event, a request
        the client re-sends) gives the same run, not a second one."""
        name = self._run_name(f"{installed or 'none'} -> {version}")
        if self.publications is None or self._refit_id is None:
            return self._create_latest(client, why, name)
        self.stats.api_requests += 1
        key = f"{self.identity} {installed or 'none'} -> {version} after {self.stats.runs} run(s)"
        run = client.create_flow_run_from_deployment(
            self._refit_id, parameters=self.publications.parameters(version), name=name,
            tags=[node_tag(self.node)] if self.node else None, idempotency_key=key)
        log.info("created flow run %s (%s): %s", run.name, run.id, why)
        return run

    def head_interval_s(self) -> float:
        """Seconds until the next head check: ``head_poll_s``, doubled for each storage retry after the first
        that is still failing, at most ``HEAD_POLL_CAP_S`` (or ``head_poll_s`` if that is longer)."""
        backoff = 2 ** max(0, self._storage_retries - 1)
        return min(max(self.head_poll_s, HEAD_POLL_CAP_S), self.head_poll_s * backoff)

    def _check_head(self, client, ids: list[UUID]) -> list:
        """Compare the desired version (the newest of the versions heard since the last check and the catalog's
        head) with the installed one; if it is newer (or the last refit failed on storage), create one refit run
        for it; the runs due afterwards (that one)."""
        self._check_now.clear()
        with self._heard_lock:
            heard, self._heard = self._heard, []
        self._next_head_check = time.monotonic() + self.head_interval_s()
        if self.head_watch is None or (self._latest_id is None and self._refit_id is None):
            return []
        self.stats.head_checks += 1
        try:
            due = self.head_watch.due(heard=heard) if heard else self.head_watch.due()
        except Exception as exc:  # storage down: the next check tries again (what was heard is in the head too)
            log.warning("could not check the catalog's head (next check in %.0fs): %s", self.head_interval_s(), exc)
            return []
        # one rate limiter: consecutive storage retries lengthen the interval, anything else resets it
        self._storage_retries = self._storage_retries + 1 if getattr(due, "storage_retry", False) else 0
        self._next_head_check = time.monotonic() + self.head_interval_s()
        if due is None:
            return []
        version, why = due[0], due[1]
        if self._storage_retries > 1:
            why += f" (retry {self._storage_retries}; next check in {self.head_interval_s():.0f}s)"
        installed = getattr(self.head_watch, "installed", lambda: None)()
        self._create_refit(client, installed, version, why)
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


def _target(run) -> str | None:
    params = (run.parameters or {}).get("params")
    return params.get("target", "latest") if isinstance(params, dict) else None


def _only_if_newer(run) -> bool:
    params = (run.parameters or {}).get("params")
    return isinstance(params, dict) and params.get("only_if_newer") is True
