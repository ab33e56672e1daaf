"""What a node tells the fleet: its status record beside the catalog, and a Prefect event.

The record says what the engines run, not what the store remembers: the
installer is asked (``observe``), and ``version`` is set only when every
engine reports the store's installed version; otherwise the record is
``DRIFTED`` and names what each engine reports. A run writes it when it
ends (``report_node``); a node agent refreshes it every ``heartbeat_s``
while it runs (``refresh_node``), so readers can tell a live idle node from
a dead one, and a drift (an engine restarted on its launch weights) is seen
within one beat, whether or not a run is in progress.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import NamedTuple

from flows.prefect_adapter import can_emit_events
from flows.outcome import retryable_run
from flows.report import RefitResult
from storage.catalog.nodes import NodeRecord, failure_kind, scan_node_records, write_node_record
from storage.errors import RefitError, StorageError
from storage.format.status import DRIFTED, FAILED, POISONED, READY, STARTED, SUCCEEDED
from storage.objects.store import ObjectStore
from storage.settings import RefitParams
from storage.store.local_store import ActiveIdentity, LocalStore
from tasks.installers.base import confirmed, engine_reports

log = logging.getLogger("canonical_refit.refit")
NODE_EVENT = "canonical-refit.node.{status}"
heartbeat_interval_s: float | None = None  # set by a node agent: how often it refreshes this node's record
_writing = threading.Lock()  # a heartbeat's read-and-rewrite never interleaves with a run's write (one process)


def _installed(params: RefitParams) -> ActiveIdentity | None:
    try:
        store = LocalStore(params.cache_dir, params.model, create=False)
        return store.active() if store.exists else None
    except RefitError:
        return None


def _store_poisoned(params: RefitParams) -> bool:
    """The node's store carries a poisoned mark (one that cannot be read counts, as it does for a run)."""
    try:
        store = LocalStore(params.cache_dir, params.model, create=False)
    except RefitError:
        return False
    try:
        return store.exists and store.poisoned() is not None
    except RefitError:
        return True


def observed(params: RefitParams, installer) -> dict:
    """The record's fields that say what the node runs: the store's installed identity and the engines' word."""
    active = _installed(params)
    try:
        reports = engine_reports(installer)
    except Exception as exc:  # an installer of the caller's own that fails to observe: nothing is confirmed
        log.warning("could not ask the engines of node %s what they run: %s", params.node, exc)
        reports = None
    agreed = active is not None and reports is not None and confirmed(reports, active.version)
    return {"version": active.version if agreed else None, "digest": active.digest if agreed else None,
            "store_version": active.version if active else None,
            "engines": {r.url: None if r.version is None else str(r.version) for r in reports or ()},  # as said
            "launch_files": active.launch_files if active else None}


def report_node(params: RefitParams, result: RefitResult, installer) -> NodeRecord:
    """Tell the fleet how this run ended: this node's status record beside the catalog, and an event.

    Best effort: a node whose record cannot be written still did (or did not
    do) its refit; the run's own outcome is what counts, so this never fails it.
    """
    seen = observed(params, installer)
    status = result.status
    if status in SUCCEEDED and seen["store_version"] is not None and seen["version"] is None:
        status = DRIFTED  # the run ended well, but an engine does not run what the store installed
    now = int(time.time() * 1000)
    record = NodeRecord(node=params.node, model=params.model, status=status, target=params.target,
                        error=result.error, stages={s["name"]: s["seconds"] for s in result.stages},
                        bytes_fetched=next((s["bytes"] for s in result.stages if s["name"] == "fetch buckets"), 0),
                        attempts=max(1, len(result.attempts)), updated_at_unix_ms=now, alive_at_unix_ms=now,
                        heartbeat_s=heartbeat_interval_s, target_version=attempted_version(params, result),
                        transient=retryable_run(result), failure=_failure(result),
                        rollback_from=result.rollback_from, **seen)
    with _writing:
        _write(params, record)
    _emit(params, record)
    return record


def _failure(result: RefitResult) -> str | None:
    """A FAILED run's ``failure`` field: storage (retried at the next head check) or content (``failure_kind``)."""
    if result.status != FAILED:
        return None
    return failure_kind(result.exception if result.exception is not None else
                        (result.error_detail or {}).get("type"))


def attempted_version(params: RefitParams, result: RefitResult) -> str | None:
    """The version this run tried to reach: the end of the lineage it resolved, else the version it was asked
    for; None for ``latest`` when the run failed before resolving it. A barrier counts a node that failed this
    version (or a newer one) as having failed the version it waits for (``flows.fleet.wait_for``)."""
    if result.lineage:
        return result.lineage[-1]
    return params.target if params.target != "latest" else None


def refresh_node(params: RefitParams, installer, *, busy: bool = False) -> NodeRecord | None:
    """A heartbeat: the node is alive; ask its engines again and rewrite its record (a run's outcome kept).

    Busy (a run in progress) or not, the engines are asked what they run
    now and the record says it: ``version`` only while every engine confirms
    the store's installed version, else ``DRIFTED`` with each engine's word
    (while a run installs, the engines may briefly be ahead of the store: the
    record then says DRIFTED until the run writes its outcome). A busy beat
    never turns a DRIFTED record back to READY: the run's own record does.
    A store marked poisoned makes the record POISONED whatever the engines
    say (a heal cannot install into it); once ``recover`` cleared the mark
    and the engines confirm the installed version, an idle beat says READY.
    Returns the record written, whose ``condition()`` is ``DRIFTED`` when an
    engine no longer runs what the store installed (an idle agent then
    refits to heal it); None if nothing could be written.
    """
    with _writing:
        written = _refresh(params, installer, busy)
    if written is not None and written[0].status == DRIFTED and written[1] != DRIFTED:
        _emit(params, written[0])
    return written[0] if written is not None else None


def _refresh(params: RefitParams, installer, busy: bool) -> tuple[NodeRecord, str] | None:
    objects = ObjectStore.shared(params.storage)
    try:
        scan = scan_node_records(objects, params.catalog, params.model, only=params.node)
    except RefitError as exc:
        log.warning("heartbeat of node %s: could not read its record: %s", params.node, exc)
        return None  # a missed beat (storage down): rewriting the record now could drop its last outcome
    error = scan.errors.get(params.node)
    if isinstance(error, StorageError):  # a missed beat: the record may hold an outcome worth keeping
        log.warning("heartbeat of node %s: could not read its record: %s", params.node, "; ".join(scan.problems))
        return None
    if error is not None:
        log.warning("heartbeat of node %s: its record is malformed and is written anew: %s", params.node,
                    "; ".join(scan.problems))
    previous = next((r for r in scan.records if r.node == params.node), None)
    now = int(time.time() * 1000)
    if previous is None:
        previous = NodeRecord(node=params.node, model=params.model, version=None, digest=None, status=STARTED,
                              updated_at_unix_ms=now)
    record = replace(previous, alive_at_unix_ms=now, heartbeat_s=heartbeat_interval_s)
    # busy or not, the engines are asked: a run may sit in bookkeeping (or in API retries) long after its record
    # was written, and an engine restarted meanwhile must not be left claimed at the version it no longer runs
    seen = observed(params, installer)
    status = record.status
    if _store_poisoned(params):
        status = POISONED  # the store refuses installs until `recover`: never DRIFTED, which a heal would try
    elif seen["store_version"] is not None and seen["version"] is None:
        status = DRIFTED
    elif status in (DRIFTED, POISONED) and not busy:
        status = READY  # healed (by a refit, by `recover`, or the engine came back on the installed version)
    record = replace(record, status=status, **seen)
    return (record, previous.status) if _write(params, record) else None


def _write(params: RefitParams, record: NodeRecord) -> bool:
    try:
        write_node_record(ObjectStore.shared(params.storage), params.catalog, record)
        return True
    except RefitError as exc:
        log.warning("could not write the status record of node %s: %s", params.node, exc)
        return False


def _emit(params: RefitParams, record: NodeRecord) -> None:
    if not can_emit_events():
        return
    try:
        from prefect.events import emit_event

        emit_event(event=NODE_EVENT.format(status=record.status.lower()),
                   resource={"prefect.resource.id": f"canonical-refit.node.{params.model}.{params.node}",
                             "prefect.resource.name": params.node},
                   payload=record.to_json())
    except Exception as exc:  # events are a view of the outcome, never part of it
        log.warning("could not emit the node event of %s: %s", params.node, exc)


class Due(NamedTuple):
    """A refit to latest the head check wants now: the head's version, why, and whether it retries a run that
    failed on storage (the agent backs off while such retries keep failing)."""

    version: str
    why: str
    storage_retry: bool = False


class HeadWatch:
    """The agent's level check against the catalog: is the catalog's head newer than what this node runs?

    ``due(heard)`` reads the head (``Catalog.head()``: a few requests on a flat
    catalog), what the store installed, and this node's record, and returns
    ``(desired version, why)`` when a refit to it should run now, else None;
    the desired version is the newest of the head and the versions ``heard``
    on published events:

    * the head is newer than the installed version (a publication whose
      event was lost, or made while the agent was down), unless this node's
      last run rejected that version (or a newer one): its bytes were read
      and refused (``NodeRecord.rejected``), or the node is poisoned: those
      wait for a new publication or an operator;
    * so a refit that failed on storage (``NodeRecord.storage_failure``: an
      outage, transient or not: a missing object, denied access) is tried
      again at the next check, not left until the next publication; the
      ``Due`` says so (``storage_retry``) and the agent backs off while it
      keeps failing (``deployments/agent_head.py``).

    ``sequence_of(version)`` orders versions (for coalescing a burst of
    publications); None when the catalog cannot say. Storage errors raise
    (``RefitError``): the agent logs them and checks again at its next poll.
    """

    def __init__(self, params: RefitParams):
        from storage.catalog.records import Catalog
        from storage.catalog.signing import RecordVerifier

        self.params = params
        self.catalog = Catalog(ObjectStore.shared(params.storage), params.catalog, params.model,
                               verify=RecordVerifier.from_settings(params.trusted_keys))

    def sequence_of(self, version: str | None) -> int | None:
        if version is None:
            return None
        try:
            return self.catalog.read(version).sequence
        except RefitError:
            return None

    def installed(self) -> str | None:
        """The version the store records as installed (None: none yet)."""
        active = _installed(self.params)
        return active.version if active is not None else None

    def head(self) -> tuple[str, int] | None:
        record = self.catalog.head()
        return None if record is None else (record.version, record.sequence)

    def due(self, heard: list[str] | tuple[str, ...] = ()) -> "Due | None":
        """The refit the node needs now for the desired version: the newest of the catalog's head and the
        versions ``heard`` on published events (one the catalog cannot place is not desired); None if none."""
        head = self.head()
        for version in heard:
            sequence = self.sequence_of(version)
            if sequence is not None and (head is None or sequence > head[1]):
                head = (version, sequence)
        if head is None:
            return None
        version, sequence = head
        active = _installed(self.params)
        installed = active.version if active is not None else None
        if installed == version:
            return None
        installed_sequence = self.sequence_of(installed)
        if installed_sequence is not None and installed_sequence >= sequence:
            return None
        scan = scan_node_records(ObjectStore.shared(self.params.storage), self.params.catalog, self.params.model,
                                 only=self.params.node)
        record = next((r for r in scan.records if r.node == self.params.node), None)
        if record is not None and record.status == POISONED:
            return None
        if record is not None and record.storage_failure:  # the same bytes may be read now: try again
            kind = "transient storage failure" if record.transient else "storage failure"
            return Due(version, f"retrying {version} after a {kind} ({record.error})", storage_retry=True)
        if record is not None and record.rejected:
            failed = self.sequence_of(record.attempted)
            if failed is not None and failed >= sequence:
                return None  # this version was refused for good: a new publication or an operator moves it on
        if installed is None:
            return Due(version, f"the node has no installed version; the catalog's head is {version}")
        if installed_sequence is None:
            return None  # the installed version is not in this catalog (a launch version): latest decides once
        return Due(version, f"the catalog's head is {version}, the node runs {installed}")
