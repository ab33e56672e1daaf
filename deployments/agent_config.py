"""The node agent's defaults and the values it takes and reports (Prefect-free; ``deployments.agent`` re-exports
them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

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
    heard: int = 0  # published events of the model heard (each only records the desired version and wakes the loop)
    refused: int = 0  # runs whose parameters this node's configuration does not allow (deployments/pinning.py)
    head_checks: int = 0  # reads of the catalog's head (the level check that catches a lost publication)
    catch_ups: int = 0  # refit runs the loop created: the desired version was newer than the installed one (or a retry)
    superseded: int = 0  # refit runs ended Skipped, unrun, because a newer version was due (a burst coalesced)
    started_at: float = field(default_factory=time.monotonic)
    run_starts: list[dict] = field(default_factory=list)  # flow run, expected start, claimed at

    @property
    def fan_outs(self) -> int:
        """Deprecated alias of ``catch_ups`` (the runs the loop created; there is no run per event any more)."""
        return self.catch_ups


@dataclass(frozen=True)
class Publications:
    """What the agent's loop hears and where its refits go: the published events of its model (each records the
    desired version and wakes the loop) and the deployment whose runs the loop creates for a desired version."""

    deployment: str  # the deployment whose runs the loop creates (refit-on-publish with the node's suffix)
    event: str  # the event's name
    resource_prefix: str  # the model's published events: their resource id starts so
    parameters: Callable[[str], dict]  # a run's parameters for a desired version
    catalog: str | None = None  # the node's catalog: an event naming another catalog is not heard (None: any)

    def names_other_catalog(self, payload: dict) -> str | None:
        """The catalog a published event's payload names when it is not this node's (another catalog of the same
        model on the same server: its versions are not this node's); None when it is this node's or unnamed."""
        named = payload.get("catalog")
        if self.catalog is None or not isinstance(named, str) or not named:
            return None
        from storage.urls import normalize_url

        try:
            same = normalize_url(named).rstrip("/") == normalize_url(self.catalog).rstrip("/")
        except Exception:  # not a URL this program reads: not this node's catalog
            return named
        return None if same else named


PublishFanOut = Publications  # deprecated alias: the agent's loop, not a run per event, is the one fan-out path
