"""The fleet view: what each node's engines run, whether the node is alive, and a barrier a trainer can trust.

    python -m flows.fleet status --catalog s3://bucket/models/org-name/catalog --model org/name
    python -m flows.fleet wait --catalog ... --model org/name --version r42 --all-seen-within 120 --timeout 300
    python -m flows.fleet forget --catalog ... --model org/name --node scratch

Every node writes its own status record beside the catalog after each refit,
and its agent refreshes it on an interval (``storage/catalog/nodes.py``,
``flows/node_report.py``); this reads them. A node's ``version`` is what
every one of its engines confirmed running. ``wait`` is the question an RL
loop asks after each publication, answered within one poll of the moment
the answer is known:

* 0 ``reached``: every expected node is alive and runs the version or a
  newer one (or ``--nodes N`` of them do);
* 3 ``poisoned``: an expected node is poisoned (at once);
* 4 ``failed``: every expected node that has not reached the version failed
  it: its last refit toward the version, or toward a newer one, rejected
  the revision (its bytes were read and refused: a corrupt or malformed
  revision, a wrong base); ``failures`` names each with its error;
* 1 ``timeout``: each node still on its way is named: behind (alive,
  older), stale (not seen alive), drifted (its engines disagree with its
  store), unseen (expected, no record) or unreadable (its record could not
  be read).

A node whose last refit failed on storage (the revision could not be read:
an outage, a missing object, denied access; ``NodeRecord.storage_failure``)
has not refused anything: it is behind (storage error, retrying), its agent
tries again at its next head check, and it keeps the barrier waiting until
it gets there or the timeout; ``retrying`` names it with its error.

A catalog or a node-record folder that cannot be read (storage down) is
read again at the next poll until the timeout; the outcome says so
(``problems``). The same as Python functions: ``fleet_status``, ``wait_for``
(which raises ``VersionFailed`` for ``failed``) and ``forget``.
``poisoned_alert`` is the Prefect automation that notifies someone when a
node reports itself poisoned (docs/fleet.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

from typing import TYPE_CHECKING

from pydantic import Field

from flows.options import add_flags, build, field_errors, flags as field_flags, given, with_values
from storage.errors import RefitError
from storage.format.status import DRIFTED, POISONED, STALE
from storage.settings import MODEL_PATTERN, VERSION_PATTERN, ObjectStoreSettings, Settings, settings_config

if TYPE_CHECKING:  # the catalog and object-store stack is imported where a command reads the records
    from storage.catalog.nodes import NodeRecord
    from storage.catalog.records import Catalog
    from storage.objects.store import ObjectStore


class FleetParams(Settings):
    """Where the fleet's records are, and what to wait for (env prefix ``CANONICAL_REFIT_FLEET_``)."""

    model_config = settings_config("CANONICAL_REFIT_FLEET_")

    catalog: str = Field(..., description="catalog URL: s3://bucket/prefix, file:///path or a local path")
    model: str = Field(..., pattern=MODEL_PATTERN, description="model id, e.g. org/name")
    version: str | None = Field(None, pattern=VERSION_PATTERN,
                                description="wait: the version (or any newer one) the nodes must run")
    nodes: int | None = Field(None, ge=1, description="wait: enough once this many nodes run it (default: every "
                                                      "expected node)")
    expect: list[str] = Field(default_factory=list, description="wait: nodes that must be there even without a "
                                                                "record yet (repeat the flag; every node with a "
                                                                "record is expected too)")
    all_seen_within_s: float | None = Field(
        None, gt=0, description="wait: a node not seen alive within this many seconds is stale (default: one of "
                                "its agent's heartbeats plus a grace of max(5 s, half a beat)); a stale node is "
                                "never counted as reached", json_schema_extra={"flag": "--all-seen-within"})
    node: str | None = Field(None, description="forget: the node whose record to remove")
    timeout_s: float = Field(600.0, gt=0, description="wait: give up after this many seconds (exit 1); an "
                                                      "unreadable catalog is read again until then",
                           json_schema_extra={"flag": "--timeout"})
    poll_s: float = Field(1.0, gt=0, description="wait: seconds between reads of the node records",
                          json_schema_extra={"flag": "--poll"})
    storage: ObjectStoreSettings = Field(default_factory=ObjectStoreSettings,
                                         json_schema_extra={"flags": {"endpoint_url": "--s3-endpoint-url"}})


@dataclass
class FleetView:
    """Every node's record, and the objects that could not be read."""

    nodes: list[NodeRecord]
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"nodes": [n.to_json() for n in self.nodes], "problems": self.problems}


OUTCOME_EXIT_CODES = {"reached": 0, "timeout": 1, "poisoned": 3, "failed": 4}


@dataclass
class WaitOutcome:
    """How a wait ended: ``reached`` (exit 0), ``timeout`` (1), ``poisoned`` (3) or ``failed`` (4), and every
    node's place.

    ``laggards`` is every expected node not counted as reached (behind, stale, drifted, unseen, unreadable or
    failed). ``failures`` maps each failed node to what it tried (``version``: the version its last refit
    resolved, the waited one or a newer one) and its ``error``. ``retrying`` maps each node that is behind
    because its last refit failed on storage (it is retried; never counted failed) to the same. ``problems``
    says what could not be read at the last poll (the catalog record of the version, the node-record folder, a
    record).
    """

    outcome: str
    version: str
    reached: list[str]
    laggards: list[str]
    poisoned: list[str]
    seconds: float
    view: FleetView
    behind: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    drifted: list[str] = field(default_factory=list)
    unseen: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    failures: dict[str, dict] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    retrying: dict[str, dict] = field(default_factory=dict)

    def describe(self) -> str:
        if self.outcome == "reached":
            return f"{len(self.reached)} node(s) run {self.version} or newer: {', '.join(self.reached)}"
        if self.outcome == "poisoned":
            return (f"poisoned: {', '.join(self.poisoned)} (on that node run the `next:` command its refit "
                    "printed: `python -m flows.refit recover --model ... --cache-dir ...`)")
        if self.outcome == "failed":
            done = f"; reached: {', '.join(self.reached)}" if self.reached else ""
            return (f"every node that does not run {self.version} failed it: "
                    + "; ".join(f"{name} ({failure['version']}): {failure['error']}"
                                for name, failure in self.failures.items()) + done)
        retrying = [f"{name} ({failure['version'] or 'latest'}): {failure['error']}"
                    for name, failure in self.retrying.items()]
        parts = [f"{label}: {', '.join(names)}" for label, names in (
            ("behind", [n for n in self.behind if n not in self.retrying]),
            ("behind (storage error, retrying)", retrying), ("stale (not seen alive)", self.stale),
            ("drifted", self.drifted), ("unseen", self.unseen), ("unreadable record", self.unreadable),
            ("failed", self.failed)) if names]
        text = f"timed out after {self.seconds:.0f}s; " + ("; ".join(parts) or "no node has a record")
        return text + "".join(f"; could not read {problem}" for problem in self.problems)

    @property
    def exit_code(self) -> int:
        return OUTCOME_EXIT_CODES[self.outcome]

    def to_json(self) -> dict:
        out = asdict(self)
        out["view"] = self.view.to_json()
        return out


class VersionFailed(RefitError):
    """``wait_for``: every expected node that does not run the version rejected it (or a newer one) in its last
    refit: the revision was read and refused (a node that failed on storage is retried, never counted).
    ``outcome`` is the ``WaitOutcome``; ``failures`` maps each failed node to the version it tried and its
    error."""

    def __init__(self, outcome: WaitOutcome):
        self.outcome = outcome
        self.failures = outcome.failures
        super().__init__(f"wait for {outcome.version}: {outcome.describe()}", revision=outcome.version)


def fleet_status(catalog: str, model: str, *, storage: ObjectStoreSettings | None = None) -> FleetView:
    """Every node's status record of ``model``."""
    from storage.catalog.nodes import read_node_records
    from storage.objects.store import ObjectStore

    records, problems = read_node_records(ObjectStore.shared(storage), catalog, model)
    return FleetView(records, problems)


def forget(catalog: str, model: str, node: str, *, storage: ObjectStoreSettings | None = None) -> bool:
    """Retire ``node`` from the fleet view (a one-off node, a decommissioned host); False if it had no record.

    A node that is still alive writes its record again at its next heartbeat or run.
    """
    from storage.catalog.nodes import delete_node_record
    from storage.objects.store import ObjectStore

    return delete_node_record(ObjectStore.shared(storage), catalog, model, node)


def wait_for(version: str, *, catalog: str, model: str, nodes: int | None = None, expect: list[str] | None = None,
             all_seen_within_s: float | None = None, timeout_s: float = 600.0, poll_s: float = 1.0,
             storage: ObjectStoreSettings | None = None, check: bool = True) -> WaitOutcome:
    """Wait until every expected node (or ``nodes`` of them) is alive and runs ``version`` or newer (by catalog
    sequence), an expected node is poisoned, or every expected node that does not run it failed it; see the
    module. Returns the ``WaitOutcome`` (``reached``, ``timeout``, ``poisoned``); ``failed`` raises
    ``VersionFailed`` carrying it (with ``check=False``, returns it).

    Expected nodes: every node with a record, and each name in ``expect``. A node is stale when not seen alive
    within ``all_seen_within_s`` (default: one of its agent's heartbeats plus a grace). ``poll_s``: seconds
    between reads of the records; ``timeout_s``: when to give up. An unreadable catalog or node-record folder
    is read again at every poll until the timeout.
    """
    from storage.catalog.records import Catalog
    from storage.objects.store import ObjectStore

    objects = ObjectStore.shared(storage)
    revisions = Catalog(objects, catalog, model)
    started = time.monotonic()
    while True:
        problems: list[str] = []
        places = _places(revisions, objects, catalog, model, version, expect, all_seen_within_s, problems)
        elapsed = round(time.monotonic() - started, 3)
        kind = _ended(places, nodes)
        if kind is None and elapsed >= timeout_s:
            kind = "timeout"
        if kind is not None:
            outcome = WaitOutcome(
                kind, version, places.reached, sorted(places.pending + places.failed), places.poisoned, elapsed,
                places.view, places.behind, places.stale, places.drifted, places.unseen, places.unreadable,
                places.failed, places.failures, problems, places.retrying)
            if kind == "failed" and check:
                raise VersionFailed(outcome)
            return outcome
        time.sleep(min(poll_s, max(0.0, timeout_s - elapsed)))


@dataclass
class _Places:
    """One poll's answer: where each expected node stands."""

    view: FleetView
    reached: list[str] = field(default_factory=list)
    behind: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    drifted: list[str] = field(default_factory=list)
    unseen: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    poisoned: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    failures: dict[str, dict] = field(default_factory=dict)
    retrying: dict[str, dict] = field(default_factory=dict)  # behind: the last refit failed on storage

    @property
    def pending(self) -> list[str]:
        """Nodes that may still get there."""
        return self.behind + self.stale + self.drifted + self.unseen + self.unreadable


def _ended(places: _Places, nodes: int | None) -> str | None:
    """How the wait ends after this poll, or None to poll again."""
    if places.poisoned:
        return "poisoned"
    if nodes is not None:
        if len(places.reached) >= nodes:
            return "reached"
    elif places.reached and not places.pending and not places.failed:
        return "reached"
    if places.failed and not places.pending:
        return "failed"
    return None


def _places(revisions: Catalog, objects: ObjectStore, catalog: str, model: str, version: str,
            expect: list[str] | None, all_seen_within_s: float | None, problems: list[str]) -> _Places:
    """Read the records once and place every expected node; what could not be read goes to ``problems``."""
    from storage.catalog.nodes import scan_node_records

    try:
        scan = scan_node_records(objects, catalog, model)
    except RefitError as exc:  # the folder could not be listed: no node is placed from a guess
        problems.append(f"the node records: {exc}")
        scan = None
    records = scan.records if scan is not None else []
    places = _Places(FleetView(records))
    by_name = {r.node: r for r in records}
    sequences: dict[str, int | None] = {}  # this poll's catalog reads (successful reads stay memoised in it)

    def sequence_of(v: str | None, *, waited: bool = False) -> int | None:
        if v is None:
            return None
        if v not in sequences:
            try:
                sequences[v] = revisions.read(v).sequence
            except RefitError as exc:  # storage down, or a record that is not (yet) there: read again next poll
                sequences[v] = None
                if waited:
                    problems.append(f"the catalog record of {v}: {exc}")
        return sequences[v]

    wanted = sequence_of(version, waited=True)

    def at_or_above(v: str | None) -> bool:
        if v is None:
            return False
        if v == version:
            return True
        sequence = sequence_of(v) if wanted is not None else None
        return sequence is not None and sequence >= wanted

    unreadable = set(scan.unreadable) if scan is not None else set()
    for name in sorted(set(expect or ()) | set(by_name) | unreadable):
        record = by_name.get(name)
        if record is None:
            (places.unreadable if name in unreadable else places.unseen).append(name)
            continue
        condition = record.condition(all_seen_within_s)
        if condition == POISONED:
            places.poisoned.append(name)
        elif condition == STALE:
            places.stale.append(name)
        elif condition == DRIFTED:
            places.drifted.append(name)
        elif at_or_above(record.version):
            places.reached.append(name)
        elif record.rejected and at_or_above(record.attempted):
            places.failed.append(name)
            places.failures[name] = {"version": record.attempted, "status": record.status, "error": record.error}
        else:
            places.behind.append(name)
            if record.storage_failure:  # nothing was refused: its agent retries it at its next head check
                places.retrying[name] = {"version": record.attempted, "status": record.status,
                                         "error": record.error}
    places.view.problems = problems + (scan.problems if scan is not None else [])
    return places


NODE_EVENT_PREFIX = "canonical-refit.node"  # flows.node_report.NODE_EVENT, without importing the refit flow here


def poisoned_alert(model: str, block_document_id, *, name: str | None = None):
    """A Prefect automation (not yet created: call ``.create()``) that sends a notification through the
    notification block ``block_document_id`` each time a node of ``model`` emits ``canonical-refit.node.poisoned``.
    """
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    return Automation(
        name=name or f"canonical-refit: node of {model} poisoned",
        description="A node's refit ended POISONED: its engine may hold partial weights and it refuses installs "
                    "until `python -m flows.refit recover` succeeds there.",
        trigger=EventTrigger(expect={f"{NODE_EVENT_PREFIX}.poisoned"},
                             match={"prefect.resource.id": f"{NODE_EVENT_PREFIX}.{model}.*"},
                             posture=Posture.Reactive, threshold=1, within=0),
        actions=[SendNotification(
            block_document_id=block_document_id,
            subject="canonical-refit: node {{ event.resource.name }} is poisoned",
            body="Node {{ event.resource.name }} ({{ event.payload.model }}) ended POISONED refitting to "
                 "{{ event.payload.target }}; it still runs {{ event.payload.version }}. Error: "
                 "{{ event.payload.error }}. Run `python -m flows.refit recover` on that node.")],
    )


STATUS_FLAGS = field_flags(FleetParams, "catalog", "model", "storage.endpoint_url")
WAIT_FLAGS = STATUS_FLAGS + field_flags(FleetParams, "version", "nodes", "expect", "all_seen_within_s",
                                         "timeout_s", "poll_s")
FORGET_FLAGS = STATUS_FLAGS + field_flags(FleetParams, "node")
FLEET_FLAGS_BY_COMMAND = {"status": STATUS_FLAGS, "wait": WAIT_FLAGS, "forget": FORGET_FLAGS}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.fleet", description=(
        "The fleet view: what each node's engines run, its condition and its age. Exit codes of wait: 0 every "
        "expected node is alive and runs the version, 1 timeout (each node not there is named), 2 usage, 3 a "
        "node is poisoned, 4 failed (every expected node that does not run the version failed it; each is named "
        "with its error)."))
    commands = parser.add_subparsers(dest="command", required=True)
    for name, flags, text in (("status", STATUS_FLAGS, "print every node's version, condition, age and last error"),
                              ("wait", WAIT_FLAGS, "wait until every expected node is alive and runs a version or "
                                                   "a newer one"),
                              ("forget", FORGET_FLAGS, "remove a node's record from the view (a one-off or retired "
                                                       "node)")):
        sub = commands.add_parser(name, help=text, description=text)
        add_flags(sub, FleetParams, flags)
        sub.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def print_view(view: FleetView, stale_after_s: float | None = None) -> None:
    print(f"{'node':<24}{'version':<12}{'store':<12}{'condition':<13}{'age':>8}  engines / last error")
    for r in view.nodes:
        engines = ", ".join(f"{url} {version or '?'}" for url, version in sorted(r.engines.items()))
        error = f"storage error, retrying: {r.error}" if r.error and r.storage_failure else r.error or ""
        detail = "; ".join(x for x in (engines, error) if x)
        print(f"{r.node:<24}{r.version or '-':<12}{r.store_version or '-':<12}{r.condition(stale_after_s):<13}"
              f"{_age(r.age_s):>8}  {detail[:100]}")
    for problem in view.problems:
        print(f"unreadable record: {problem}")


def _age(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.0f}h"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(with_values(sys.argv[1:] if argv is None else argv, WAIT_FLAGS + FORGET_FLAGS))
    flags = FLEET_FLAGS_BY_COMMAND[args.command]
    from pydantic import ValidationError

    try:
        params = build(FleetParams, given(args, flags))
    except ValidationError as exc:
        parser.error(field_errors(exc, flags))
    if args.command == "status":
        view = fleet_status(params.catalog, params.model, storage=params.storage)
        print(json.dumps(view.to_json(), sort_keys=True)) if args.json else print_view(view)
        return 0
    if args.command == "forget":
        if not params.node:
            parser.error("forget needs --node")
        gone = forget(params.catalog, params.model, params.node, storage=params.storage)
        text = f"forgot node {params.node}" if gone else f"no record of node {params.node}: nothing to forget"
        print(json.dumps({"node": params.node, "forgotten": gone}) if args.json else text)
        return 0
    if params.version is None:
        parser.error("wait needs --version")
    outcome = wait_for(params.version, catalog=params.catalog, model=params.model, nodes=params.nodes,
                       expect=params.expect, all_seen_within_s=params.all_seen_within_s,
                       timeout_s=params.timeout_s, poll_s=params.poll_s, storage=params.storage, check=False)
    if args.json:
        print(json.dumps(outcome.to_json(), sort_keys=True))
    else:
        print_view(outcome.view, params.all_seen_within_s)
        print(f"{outcome.outcome}: {outcome.describe()}")
    return outcome.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
