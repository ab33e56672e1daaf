"""Node status records: what each inference node runs, and how its last refit ended, next to the catalog.

After every refit — Ready, Skipped, Failed, Poisoned or Interrupted, however
it was started — the node writes one small JSON object,
``{catalog}/../nodes/{model with / as --}/{node}.json``, replacing its
previous one; only that node ever writes it. A fleet view lists them
(``flows/fleet.py``); the format is in docs/format.md, "Node status records".
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields

from storage.canonical import canonical_json
from storage.errors import FormatError
from storage.objects.store import ObjectStore
from storage.settings import NODE_PATTERN
from storage.urls import join_url, parent_url

SCHEMA = "canonical-refit.node.v1"
MAX_RECORD_BYTES = 1 * 2**20


@dataclass(frozen=True)
class NodeRecord:
    """One node's status: its installed identity and the outcome of its last refit."""

    node: str
    model: str
    version: str | None  # installed (active) version, None before the first install
    digest: str | None
    status: str  # of the last run: READY, SKIPPED, FAILED, POISONED or INTERRUPTED
    target: str | None = None
    error: str | None = None
    stages: dict = field(default_factory=dict)  # stage name -> seconds
    bytes_fetched: int = 0
    attempts: int = 1
    updated_at_unix_ms: int = 0
    launch_files: str | None = None  # digest of the launch snapshot's non-weight files the installed checkpoint holds
    schema: str = SCHEMA

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.updated_at_unix_ms / 1000)


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


def read_node_records(objects: ObjectStore, catalog: str, model: str, *,
                      workers: int | None = None) -> tuple[list[NodeRecord], list[str]]:
    """Every node's record of ``model`` (sorted by node), and the objects that could not be read, in words.

    The records are read ``workers`` at a time (default: the object store's connection budget): a fleet of
    a thousand nodes is a thousand small reads, which one at a time would take tens of seconds.
    """
    base = nodes_url(catalog, model)
    fieldnames = {f.name for f in fields(NodeRecord)}

    def read(name: str) -> NodeRecord | str:
        url = join_url(base, name)
        try:
            raw = json.loads(objects.read_bytes(url, max_size=MAX_RECORD_BYTES))
            record = NodeRecord(**{k: v for k, v in raw.items() if k in fieldnames})
            if record.model != model or f"{record.node}.json" != name:
                raise ValueError("names another node or model")
            return record
        except (ValueError, TypeError, AttributeError) as exc:
            return f"{url}: {exc}"

    names = objects.list_names(base, ".json")
    if len(names) <= 1:
        outcomes = [read(name) for name in names]
    else:
        with ThreadPoolExecutor(min(len(names), workers or objects.settings.concurrency),
                                thread_name_prefix="node-records") as pool:
            outcomes = list(pool.map(read, names))
    records = [o for o in outcomes if isinstance(o, NodeRecord)]
    problems = [o for o in outcomes if isinstance(o, str)]
    return sorted(records, key=lambda r: r.node), problems
