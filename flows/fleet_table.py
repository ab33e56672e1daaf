"""The fleet table in the Prefect UI: node -> version -> condition -> engines, and each node's last sign of life.

One keyed table artifact per model, ``fleet-<model>`` (the model id in
lowercase, every other character a ``-``), so Artifacts -> ``fleet-org-name``
shows the fleet as the newest version of the artifact and its history
version by version. Its rows come from the node status records beside the
catalog (``storage/catalog/nodes.py``), read once (one listing, then each
record): ``fleet_rows`` turns records into rows (no Prefect, no I/O),
``write_fleet_table`` reads them and writes the artifact.

The node agents keep it current (``FleetTable``), and one of them at a time
writes it: the keeper, the node with the smallest name among the live ones
(``fleet_keeper``: ONE listing of the records' prefix, a record object
modified within one heartbeat plus its grace counting as live; a node
counts itself live). At each beat and after each refit every agent lists
(one request); only the keeper then reads the N records and rewrites the
table, and only when a row changed state (a condition, a version, a last
run, an engine's word; not an age). A publication thus costs the fleet N
listings and N record reads, not N x N reads; a keeper that dies is
replaced by the next name once its record ages out of the window. The
object times are the storage's clock, compared with this host's: a skew
larger than the window can make two keepers (two writers of the same
table, harmless) or none for a while. The writes happen in a thread of
their own, one at a time, the latest request winning: a Prefect API that is
down never holds the heartbeat (which keeps the node from looking stale) or
the agent's loop. The table is a snapshot: its ages are as of the write,
which its description states; ``python -m flows.fleet status`` reads the
records live.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

from storage.catalog.nodes import NodeRecord, nodes_url, scan_node_records, stale_after_s
from storage.objects.store import ObjectStore
from storage.settings import ObjectStoreSettings

log = logging.getLogger("canonical_refit.fleet_table")
COLUMNS = ("node", "version", "condition", "engines", "heartbeat_age_s", "store_version", "last_run", "error")
ERROR_CHARS = 300  # a row's error is cut here (the node's record and its run keep it whole)


def fleet_table_key(model: str) -> str:
    """The artifact key of ``model``'s fleet table: ``fleet-`` and the model id as lowercase letters, digits
    and dashes (``org/Name_1`` -> ``fleet-org-name-1``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"fleet-{slug}"[:100]


def fleet_rows(records: list[NodeRecord], *, unreadable: dict[str, Any] | None = None,
               stale_after_s: float | None = None) -> list[dict]:
    """One row per node, sorted by node: what its engines run (``version``: what every engine confirmed),
    its ``condition`` (``NodeRecord.condition``: POISONED, STALE, DRIFTED or its last run's status), each
    engine's word, the seconds since it was last seen alive, what its store installed, its last run's status
    and error. A node whose record could not be read (``unreadable``: node -> why) has a row that says so."""
    rows = []
    for record in records:
        engines = ", ".join(f"{url}: {version or '?'}" for url, version in sorted(record.engines.items()))
        rows.append({"node": record.node, "version": record.version or "-",
                     "condition": record.condition(stale_after_s), "engines": engines or "-",
                     "heartbeat_age_s": round(record.age_s), "store_version": record.store_version or "-",
                     "last_run": record.status, "error": (record.error or "")[:ERROR_CHARS]})
    for node, why in (unreadable or {}).items():
        rows.append({"node": node, "version": "-", "condition": "UNREADABLE", "engines": "-",
                     "heartbeat_age_s": None, "store_version": "-", "last_run": "-", "error": str(why)[:ERROR_CHARS]})
    return sorted(rows, key=lambda row: row["node"])


def describe(model: str, rows: list[dict], *, by: str | None = None) -> str:
    """The artifact's description: when it was written, by whom, and how many nodes are in each condition."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["condition"]] = counts.get(row["condition"], 0) + 1
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    tally = ", ".join(f"{n} {condition}" for condition, n in sorted(counts.items())) or "no node has a record"
    return f"fleet of {model} as of {when}{f' (written by node {by})' if by else ''}: {tally}"[:2000]


def read_fleet_rows(catalog: str, model: str, *, storage: ObjectStoreSettings | None = None) -> list[dict]:
    """Every node record of ``model`` (one listing, then each record) as the table's rows. Storage errors raise."""
    scan = scan_node_records(ObjectStore.shared(storage), catalog, model)
    return fleet_rows(scan.records, unreadable={node: scan.errors[node] for node in scan.unreadable})


def write_fleet_table(catalog: str, model: str, *, storage: ObjectStoreSettings | None = None,
                      by: str | None = None, client=None, rows: list[dict] | None = None) -> list[dict]:
    """Write the ``fleet-<model>`` table artifact of ``rows`` (default: ``read_fleet_rows``) through the Prefect
    API (``client``: a sync Prefect client; default, one for this call); returns the rows. Storage or API errors
    raise."""
    from prefect.client.schemas.actions import ArtifactCreate

    rows = read_fleet_rows(catalog, model, storage=storage) if rows is None else rows
    artifact = ArtifactCreate(key=fleet_table_key(model), type="table", description=describe(model, rows, by=by),
                              data=json.dumps(rows))  # as Prefect's own table artifacts: the rows as JSON text
    if client is not None:
        client.create_artifact(artifact)
    else:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as own:
            own.create_artifact(artifact)
    return rows


def fleet_keeper(catalog: str, model: str, node: str, *, window_s: float,
                 storage: ObjectStoreSettings | None = None) -> str:
    """The node that writes ``model``'s fleet table: the smallest name among ``node`` and the nodes whose record
    object was modified within ``window_s`` seconds, found by ONE listing of the records' prefix (no record is
    read). Storage errors raise."""
    now = time.time()
    live = {name.removesuffix(".json") for name, _size, modified in
            ObjectStore.shared(storage).walk(nodes_url(catalog, model))
            if name.endswith(".json") and "/" not in name and now - modified <= window_s}
    return min(live | {node})


STATE_COLUMNS = ("condition", "version", "store_version", "last_run", "engines")  # what a change of state is


def _state_of(row: dict) -> tuple:
    """What makes a node's row change: its condition, versions, last run and the engines' word (not its age)."""
    return tuple(row[column] for column in STATE_COLUMNS)


def _table_state(rows: list[dict]) -> tuple:
    return tuple((row["node"], *_state_of(row)) for row in rows)


class FleetTable:
    """Keeps ``model``'s fleet table current from a node agent's process.

    Each beat of this node (``changed(record)``) and each refit that ended
    (``settled()``) asks for an update; a daemon thread serves the requests,
    one at a time, several requests made during one coalesced. An update lists
    the records' prefix once (``fleet_keeper``); unless this node is the
    keeper it stops there (``skips``); the keeper reads the records and
    rewrites the table when a row changed state since its last write
    (``writes``). ``beat(heartbeat)`` wraps an agent's heartbeat callable so
    each beat reports here. ``heartbeat_s`` (the fleet's beat) sets the
    window in which a record counts as live: one beat plus its grace.
    """

    def __init__(self, catalog: str, model: str, *, node: str | None = None,
                 storage: ObjectStoreSettings | None = None, heartbeat_s: float = 30.0):
        self.catalog, self.model, self.node, self.storage = catalog, model, node, storage
        self.window_s = stale_after_s(heartbeat_s)
        self.writes = 0  # tables written by this process
        self.skips = 0  # updates that found another node the keeper (one listing, no record read)
        self.failures = 0  # updates that failed (storage or the API down): the next request tries again
        self.keeper: bool | None = None  # whether this node was the keeper at its last update
        self._written: tuple | None = None  # the rows' states of the last table this process wrote
        self._wanted = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._client = None

    def changed(self, record: NodeRecord | None) -> None:
        """A heartbeat of this node (its record, None if none could be written): update the table (the keeper
        rewrites it if a row changed; another node only lists)."""
        self.request()

    def settled(self) -> None:
        """A refit of this node ended: update the table."""
        self.request()

    def request(self) -> None:
        with self._lock:
            self._idle.clear()
            self._wanted.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="fleet-table", daemon=True)
                self._thread.start()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every request made so far was served (written, skipped, or failed); False on timeout."""
        return self._idle.wait(timeout_s)

    def beat(self, heartbeat: Callable[[bool], Any]) -> "TableHeartbeat":
        return TableHeartbeat(heartbeat, self)

    def _serve(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            try:
                self._update()
            except Exception as exc:  # storage or the API down: the table is a view, the next request retries
                self.failures += 1
                self._close_client()
                (log.warning if self.failures == 1 else log.debug)("could not update the fleet table of %s: %s",
                                                                    self.model, exc)
            with self._lock:
                if not self._wanted.is_set():
                    self._idle.set()

    def _update(self) -> None:
        """One update: list; as the keeper, read the records and write the table if a row changed state."""
        node = self.node or ""
        self.keeper = fleet_keeper(self.catalog, self.model, node, window_s=self.window_s,
                                   storage=self.storage) == node
        if not self.keeper:
            self.skips += 1
            self._written = None  # keeper again later: its first update writes
            return
        rows = read_fleet_rows(self.catalog, self.model, storage=self.storage)
        if _table_state(rows) == self._written:
            return
        self._write(rows)
        self._written = _table_state(rows)
        self.writes += 1

    def _write(self, rows: list[dict]) -> None:
        if self._client is None:
            from prefect.client.orchestration import get_client

            self._client = get_client(sync_client=True)
            self._client.__enter__()
        write_fleet_table(self.catalog, self.model, by=self.node, client=self._client, rows=rows)

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.__exit__(None, None, None)
            except Exception:  # a client of a server that is gone: nothing to close cleanly
                pass


class TableHeartbeat:
    """An agent's heartbeat callable that also keeps the fleet table current: each beat's record goes to
    ``FleetTable.changed``; ``settled()`` is what the agent calls after each refit."""

    def __init__(self, heartbeat: Callable[[bool], Any], table: FleetTable):
        self.heartbeat, self.table = heartbeat, table

    def __call__(self, busy: bool):
        record = self.heartbeat(busy)
        self.table.changed(record)
        return record

    def settled(self) -> None:
        self.table.settled()
