"""Node status records: what each inference node runs, and how its last refit ended, next to the catalog.

After every refit — Ready, Skipped, Failed, Poisoned or Interrupted, however
it was started — the node writes one small JSON object,
``{catalog}/../nodes/{model with / as --}/{node}.json``, replacing its
previous one; only that node ever writes it (and ``forget`` removes it). A
node agent also refreshes it every ``heartbeat_s`` while it runs, asking the
engines what they run, so an idle live node and a dead one never look alike.
A fleet view lists them (``flows/fleet.py``); the format is in
docs/format.md, "Node status records".

A node with an agent is ``STALE`` once it was not seen alive for one
heartbeat plus a grace (``stale_after_s``): the grace covers one beat's own
work (asking each engine, at most ``OBSERVE_TIMEOUT_S`` = 10 s, then
reading and rewriting the record), so a live node is never called stale,
and a dead agent's record stops counting within 1.5 beats (30 s beats: 45 s).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as strict_dataclass

from storage.jsonio.bounded_json import RECORD, load_record
from storage.jsonio.canonical import canonical_json
from storage import errors
from storage.errors import FormatError, RefitError
from storage.format.status import DRIFTED, FAILED, POISONED, STALE, NodeStatus, Status
from storage.objects.store import ObjectStore
from storage.settings import NODE_PATTERN
from storage.urls import join_url, parent_url

SCHEMA = "canonical-refit.node.v1"
MAX_RECORD_BYTES = 1 * 2**20


STALE_GRACE_MIN_S = 5.0  # a node with a heartbeat is stale after one beat plus max(this, STALE_GRACE_BEATS beats)
STALE_GRACE_BEATS = 0.5


def stale_after_s(heartbeat_s: float) -> float:
    """Seconds without a sign of life after which a node beating every ``heartbeat_s`` is stale: one beat plus
    a grace of ``max(STALE_GRACE_MIN_S, STALE_GRACE_BEATS * heartbeat_s)`` (30 s beats: 45 s; 2 s beats: 7 s)."""
    return heartbeat_s + max(STALE_GRACE_MIN_S, STALE_GRACE_BEATS * heartbeat_s)


@strict_dataclass(frozen=True, config=ConfigDict(strict=True, extra="ignore"))
class NodeRecord:
    """One node's status: what its engines run, what its store installed, how its last refit ended, and when
    it was last known alive. Strict: a field of the wrong JSON type makes the record unreadable, naming the
    field; keys it does not know are ignored, fields an older writer did not write take their defaults."""

    node: str
    model: str
    version: str | None  # the version every engine confirmed running; None if they disagree or before any install
    digest: str | None
    status: NodeStatus  # of the last run (READY, SKIPPED, FAILED, POISONED, INTERRUPTED), DRIFTED or STARTED
    target: str | None = None
    error: str | None = None
    stages: dict[str, float] = field(default_factory=dict)  # stage name -> seconds
    bytes_fetched: int = 0
    attempts: int = 1
    updated_at_unix_ms: int = 0
    launch_files: str | None = None  # digest of the launch snapshot's non-weight files the installed checkpoint holds
    store_version: str | None = None  # what the store records as installed (active.json)
    engines: dict[str, str | None] = field(default_factory=dict)  # engine URL -> its version (None: no answer)
    alive_at_unix_ms: int = 0  # the last sign of life: a run's end or a heartbeat
    heartbeat_s: float | None = None  # how often the node's agent refreshes the record; None: no agent
    target_version: str | None = None  # the version the last run's target resolved to; None: it never resolved
    transient: bool = False  # the last run failed on a transient error (storage down): a later run may succeed
    failure: str | None = None  # a FAILED last run: STORAGE_FAILURE or CONTENT_FAILURE (failure_kind); else None
    rollback_from: str | None = None  # the last run was a rollback: the version it went back from
    schema: str = SCHEMA

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def age_s(self) -> float:
        """Seconds since the node was last known alive."""
        return max(0.0, time.time() - max(self.alive_at_unix_ms, self.updated_at_unix_ms) / 1000)

    def stale(self, after_s: float | None = None) -> bool:
        """Not seen alive within ``after_s`` (default: one heartbeat plus its grace, ``stale_after_s``; a node
        without an agent never goes stale by default: nothing promised to refresh it)."""
        if after_s is None:
            if not self.heartbeat_s:
                return False
            after_s = stale_after_s(self.heartbeat_s)
        return self.age_s > after_s

    @property
    def attempted(self) -> str | None:
        """The version the last run tried to reach: ``target_version``, or for a record written before that
        field existed, ``target`` when it names a version (not ``latest``)."""
        if self.target_version is not None:
            return self.target_version
        return self.target if self.target not in (None, "latest") else None

    @property
    def storage_failure(self) -> bool:
        """The last run failed because the revision could not be read (``failure`` is ``"storage"``; a record
        written before that field existed: ``transient``): a later run of the same revision may succeed, so the
        agent retries it at its next head check and a barrier counts the node behind, not failed."""
        if self.status != FAILED:
            return False
        return self.failure == STORAGE_FAILURE if self.failure is not None else self.transient

    @property
    def rejected(self) -> bool:
        """The last run failed for a reason other than storage: the revision's bytes were read and refused
        (checksum, format, record, lineage) or this node cannot take them. Not retried until a newer
        publication or an operator; a barrier counts the node as having failed the version it tried."""
        return self.status == FAILED and not self.storage_failure

    def condition(self, stale_after_s: float | None = None) -> Status:
        """What a reader acts on: POISONED, STALE (not seen alive), DRIFTED (store and engines disagree), or
        the last run's status."""
        if self.status == POISONED:
            return POISONED
        if self.stale(stale_after_s):
            return STALE
        if self.status == DRIFTED or (self.store_version is not None and self.version != self.store_version):
            return DRIFTED
        return self.status


STORAGE_FAILURE = "storage"  # NodeRecord.failure: the revision could not be read (object storage failed)
CONTENT_FAILURE = "content"  # NodeRecord.failure: the revision was read and refused, or the node could not take it


def failure_kind(error: BaseException | str | None) -> str:
    """How a failed run failed, from the typed error hierarchy (storage/errors.py): ``STORAGE_FAILURE`` for any
    ``StorageError`` (a missing object, denied access, transient errors past their retries: an outage can cause
    each) or any error marked transient; ``CONTENT_FAILURE`` for everything else (``FormatError``: checksum,
    format, catalog record, lineage; an install refused; the local store). ``error`` may also be the name of
    the error's type (a result's ``error_detail["type"]``) when the exception itself is not at hand."""
    if isinstance(error, str):
        error = getattr(errors, error, None)
        kind = error if isinstance(error, type) else None
    else:
        kind = type(error) if error is not None else None
        if getattr(error, "transient", False):
            return STORAGE_FAILURE
    storage = kind is not None and issubclass(kind, errors.StorageError) and not issubclass(kind, _NOT_READS)
    return STORAGE_FAILURE if storage else CONTENT_FAILURE


_NOT_READS = (errors.ImmutableConflict, errors.ConditionalWritesUnsupported)  # a writer's storage errors


def nodes_url(catalog: str, model: str) -> str:
    """Where the node records of ``model`` live: beside the catalog."""
    return join_url(parent_url(catalog), "nodes", model.replace("/", "--"))


def write_node_record(objects: ObjectStore, catalog: str, record: NodeRecord) -> str:
    """Replace this node's record (one atomic object write); returns its URL."""
    if not re.match(NODE_PATTERN, record.node):
        raise FormatError(f"node name {record.node!r} is not a valid id", field="node")
    url = join_url(nodes_url(catalog, record.model), f"{record.node}.json")
    objects.put_replace(url, canonical_json(record.to_json()))
    return url


def delete_node_record(objects: ObjectStore, catalog: str, model: str, node: str) -> bool:
    """Retire ``node`` from the fleet view (its record object removed); False if it had none."""
    if not re.match(NODE_PATTERN, node):
        raise FormatError(f"node name {node!r} is not a valid id", field="node")
    return objects.delete(join_url(nodes_url(catalog, model), f"{node}.json"))


@dataclass
class NodeScan:
    """One read of a fleet's records: the records, the objects that could not be read (in words), and the
    nodes whose record exists but could not be read this time (a storage error, or a malformed object)."""

    records: list[NodeRecord]
    problems: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    errors: dict[str, Exception] = field(default_factory=dict)  # node -> why its record could not be read


def scan_node_records(objects: ObjectStore, catalog: str, model: str, *, workers: int | None = None,
                      only: str | None = None) -> NodeScan:
    """Every node's record of ``model`` (sorted by node); a record that cannot be read is reported and its node
    named in ``unreadable``, never fatal. A listing that fails raises its ``StorageError``.

    The records are read ``workers`` at a time (default: the object store's connection budget): a fleet of
    a thousand nodes is a thousand small reads, which one at a time would take tens of seconds.
    """
    base = nodes_url(catalog, model)

    def read(name: str) -> NodeRecord | Exception:
        url = join_url(base, name)
        try:
            record = load_record(objects.read_bytes(url, max_size=MAX_RECORD_BYTES), NodeRecord, RECORD, file=url)
            if record.model != model or f"{record.node}.json" != name:
                raise ValueError("names another node or model")
            return record
        except (ValueError, TypeError, AttributeError, RefitError) as exc:
            exc.url = url
            return exc

    if only is not None:  # one node's own record: no listing
        names = [f"{only}.json"] if objects.exists(join_url(base, f"{only}.json")) else []
    else:
        names = objects.list_names(base, ".json")
    if len(names) <= 1:
        outcomes = [read(name) for name in names]
    else:
        with ThreadPoolExecutor(min(len(names), workers or objects.settings.concurrency),
                                thread_name_prefix="node-records") as pool:
            outcomes = list(pool.map(read, names))
    records = [o for o in outcomes if isinstance(o, NodeRecord)]
    failed = {name.removesuffix(".json"): o for name, o in zip(names, outcomes) if isinstance(o, Exception)}
    return NodeScan(sorted(records, key=lambda r: r.node), [f"{e.url}: {e}" for e in failed.values()],
                    sorted(failed), failed)


def read_node_records(objects: ObjectStore, catalog: str, model: str, *, workers: int | None = None,
                      only: str | None = None) -> tuple[list[NodeRecord], list[str]]:
    """Every node's record of ``model`` (sorted by node), and the objects that could not be read, in words
    (``scan_node_records``)."""
    scan = scan_node_records(objects, catalog, model, workers=workers, only=only)
    return scan.records, scan.problems
