"""The agent's level check: the catalog's head against what the node runs, and coalescing a burst of refits.

``HeadCheck`` is a part of ``deployments.agent.NodeAgent`` (it reads the
agent's ``head_watch``, ``head_poll_s``, ``node``, ``stats`` and ``_latest_id``).

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
import time
from uuid import UUID

from flows.run_labels import node_tag

log = logging.getLogger("canonical_refit.agent")
HEAD_POLL_CAP_S = 60.0  # the longest interval between head checks, backing off or not (serve: --head-poll-seconds <= 60)


class HeadCheck:
    """Refit-latest runs created by the agent itself: at start-up, to heal a drift, and when the head moved."""

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

    def head_interval_s(self) -> float:
        """Seconds until the next head check: ``head_poll_s``, doubled for each storage retry after the first
        that is still failing, at most ``HEAD_POLL_CAP_S`` (or ``head_poll_s`` if that is longer)."""
        backoff = 2 ** max(0, self._storage_retries - 1)
        return min(max(self.head_poll_s, HEAD_POLL_CAP_S), self.head_poll_s * backoff)

    def _check_head(self, client, ids: list[UUID]) -> list:
        """Every ``head_interval_s()`` with no run due: if the catalog's head is newer than what the node runs (a
        publication whose event was lost) or the last refit failed on storage, create one refit-latest run; the
        runs due afterwards (that one)."""
        self._next_head_check = time.monotonic() + self.head_interval_s()
        if self.head_watch is None or self._latest_id is None:
            return []
        self.stats.head_checks += 1
        try:
            due = self.head_watch.due()
        except Exception as exc:  # storage down: the next check tries again
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


def _target(run) -> str | None:
    params = (run.parameters or {}).get("params")
    return params.get("target", "latest") if isinstance(params, dict) else None


def _only_if_newer(run) -> bool:
    params = (run.parameters or {}).get("params")
    return isinstance(params, dict) and params.get("only_if_newer") is True
