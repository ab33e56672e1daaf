"""The fleet view: what each node's engines run, whether the node is alive, and a barrier a trainer can trust.

    python -m flows.fleet status --catalog s3://bucket/models/org-name/catalog --model org/name
    python -m flows.fleet wait --catalog ... --model org/name --version r42 --all-seen-within 120 --timeout 300
    python -m flows.fleet forget --catalog ... --model org/name --node scratch

Every node writes its own status record beside the catalog after each refit,
and its agent refreshes it on an interval (``storage/catalog/nodes.py``,
``flows/node_report.py``); this reads them. A node's ``version`` is what
every one of its engines confirmed running. ``wait`` is the question an RL
loop asks after each publication: it returns 0 once every expected node is
alive and runs the version or a newer one (or ``--nodes N`` of them do), 1 at
the timeout naming each node that is behind (alive, older), stale (not seen
alive), drifted (its engines disagree with its store) or unseen (expected,
no record), and 3 as soon as a node is poisoned. The same as Python
functions: ``fleet_status``, ``wait_for`` and ``forget``. ``poisoned_alert``
is the Prefect automation that notifies someone when a node reports itself
poisoned (docs/fleet.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from flows.options import Flag, add_flags, build, given
from storage.catalog.records import Catalog
from storage.errors import ObjectNotFound, RefitError
from storage.catalog.nodes import DRIFTED, STALE, NodeRecord, delete_node_record, read_node_records
from storage.objects.store import ObjectStore
from storage.settings import MODEL_PATTERN, ObjectStoreSettings



class FleetParams(BaseSettings):
    """Where the fleet's records are, and what to wait for (env prefix ``CANONICAL_REFIT_FLEET_``)."""

    model_config = SettingsConfigDict(env_prefix="CANONICAL_REFIT_FLEET_", extra="ignore")

    catalog: str = Field(..., description="catalog URL: s3://bucket/prefix, file:///path or a local path")
    model: str = Field(..., pattern=MODEL_PATTERN, description="model id, e.g. org/name")
    version: str | None = Field(None, description="wait: the version (or any newer one) the nodes must run")
    nodes: int | None = Field(None, ge=1, description="wait: enough once this many nodes run it (default: every "
                                                      "expected node)")
    expect: list[str] = Field(default_factory=list, description="wait: nodes that must be there even without a "
                                                                "record yet (repeat the flag; every node with a "
                                                                "record is expected too)")
    all_seen_within_s: float | None = Field(
        None, gt=0, description="wait: a node not seen alive within this many seconds is stale (default: three of "
                                "its agent's heartbeats); a stale node is never counted as reached")
    node: str | None = Field(None, description="forget: the node whose record to remove")
    timeout_s: float = Field(600.0, gt=0, description="wait: give up after this many seconds (exit 1)")
    poll_s: float = Field(1.0, gt=0, description="wait: seconds between reads of the node records")
    storage: ObjectStoreSettings = Field(default_factory=ObjectStoreSettings)


@dataclass
class FleetView:
    """Every node's record, and the objects that could not be read."""

    nodes: list[NodeRecord]
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"nodes": [n.to_json() for n in self.nodes], "problems": self.problems}


@dataclass
class WaitOutcome:
    """How a wait ended: ``reached`` (exit 0), ``timeout`` (1) or ``poisoned`` (3), and every node's place.

    ``laggards`` is every expected node not counted as reached (behind, stale, drifted or unseen).
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

    def describe(self) -> str:
        if self.outcome == "reached":
            return f"{len(self.reached)} node(s) run {self.version} or newer: {', '.join(self.reached)}"
        if self.outcome == "poisoned":
            return f"poisoned: {', '.join(self.poisoned)} (run `python -m flows.refit recover` there)"
        parts = [f"{label}: {', '.join(names)}" for label, names in (
            ("behind", self.behind), ("stale (not seen alive)", self.stale), ("drifted", self.drifted),
            ("unseen", self.unseen)) if names]
        return f"timed out after {self.seconds:.0f}s; " + ("; ".join(parts) or "no node has a record")

    @property
    def exit_code(self) -> int:
        return {"reached": 0, "timeout": 1, "poisoned": 3}[self.outcome]

    def to_json(self) -> dict:
        out = asdict(self)
        out["view"] = self.view.to_json()
        return out


def fleet_status(catalog: str, model: str, *, storage: ObjectStoreSettings | None = None) -> FleetView:
    """Every node's status record of ``model``."""
    records, problems = read_node_records(ObjectStore.shared(storage), catalog, model)
    return FleetView(records, problems)


def forget(catalog: str, model: str, node: str, *, storage: ObjectStoreSettings | None = None) -> bool:
    """Retire ``node`` from the fleet view (a one-off node, a decommissioned host); False if it had no record.

    A node that is still alive writes its record again at its next heartbeat or run.
    """
    return delete_node_record(ObjectStore.shared(storage), catalog, model, node)


def wait_for(version: str, *, catalog: str, model: str, nodes: int | None = None, expect: list[str] | None = None,
             all_seen_within_s: float | None = None, timeout_s: float = 600.0, poll_s: float = 1.0,
             storage: ObjectStoreSettings | None = None) -> WaitOutcome:
    """Wait until every expected node (or ``nodes`` of them) is alive and runs ``version`` or newer (by catalog
    sequence); see the module."""
    objects = ObjectStore.shared(storage)
    revisions = Catalog(objects, catalog, model)
    wanted = revisions.read(version).sequence
    sequences: dict[str, int | None] = {}

    def sequence_of(v: str | None) -> int | None:
        if v is None:
            return None
        if v not in sequences:
            try:
                sequences[v] = revisions.read(v).sequence
            except (ObjectNotFound, RefitError):
                sequences[v] = None
        return sequences[v]

    started = time.monotonic()
    while True:
        records, problems = read_node_records(objects, catalog, model)
        view = FleetView(records, problems)
        by_name = {r.node: r for r in records}
        places: dict[str, list[str]] = {k: [] for k in ("reached", "behind", "stale", "drifted", "unseen",
                                                        "poisoned")}
        for name in sorted(set(expect or ()) | set(by_name)):
            record = by_name.get(name)
            if record is None:
                places["unseen"].append(name)
                continue
            condition = record.condition(all_seen_within_s)
            sequence = sequence_of(record.version)
            if condition == "POISONED":
                places["poisoned"].append(name)
            elif condition == STALE:
                places["stale"].append(name)
            elif condition == DRIFTED:
                places["drifted"].append(name)
            elif sequence is not None and sequence >= wanted:
                places["reached"].append(name)
            else:
                places["behind"].append(name)
        missing = places["behind"] + places["stale"] + places["drifted"] + places["unseen"]
        elapsed = round(time.monotonic() - started, 3)

        def outcome(kind: str) -> WaitOutcome:
            return WaitOutcome(kind, version, places["reached"], sorted(missing), places["poisoned"], elapsed,
                               view, places["behind"], places["stale"], places["drifted"], places["unseen"])

        if places["poisoned"]:
            return outcome("poisoned")
        if len(places["reached"]) >= nodes if nodes is not None else (places["reached"] and not missing):
            return outcome("reached")
        if elapsed >= timeout_s:
            return outcome("timeout")
        time.sleep(min(poll_s, max(0.0, timeout_s - elapsed)))


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


STATUS_FLAGS = [Flag("catalog"), Flag("model"), Flag("storage.endpoint_url", "--s3-endpoint-url")]
WAIT_FLAGS = STATUS_FLAGS + [Flag("version"), Flag("nodes"), Flag("expect"),
                             Flag("all_seen_within_s", "--all-seen-within"), Flag("timeout_s", "--timeout"),
                             Flag("poll_s", "--poll")]
FORGET_FLAGS = STATUS_FLAGS + [Flag("node")]
FLEET_FLAGS_BY_COMMAND = {"status": STATUS_FLAGS, "wait": WAIT_FLAGS, "forget": FORGET_FLAGS}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.fleet", description=(
        "The fleet view: what each node's engines run, its condition and its age. Exit codes of wait: 0 every "
        "expected node is alive and runs the version, 1 timeout (each node not there is named), 3 a node is "
        "poisoned."))
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
        detail = "; ".join(x for x in (engines, r.error or "") if x)
        print(f"{r.node:<24}{r.version or '-':<12}{r.store_version or '-':<12}{r.condition(stale_after_s):<13}"
              f"{_age(r.age_s):>8}  {detail[:100]}")
    for problem in view.problems:
        print(f"unreadable record: {problem}")


def _age(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.0f}h"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    flags = FLEET_FLAGS_BY_COMMAND[args.command]
    try:
        params = build(FleetParams, given(args, flags))
    except ValidationError as exc:
        parser.error("; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()))
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
    try:
        outcome = wait_for(params.version, catalog=params.catalog, model=params.model, nodes=params.nodes,
                           expect=params.expect, all_seen_within_s=params.all_seen_within_s,
                           timeout_s=params.timeout_s, poll_s=params.poll_s, storage=params.storage)
    except RefitError as exc:
        print(json.dumps({"error": str(exc)}) if args.json else f"error: {exc}")
        return 2
    if args.json:
        print(json.dumps(outcome.to_json(), sort_keys=True))
    else:
        print_view(outcome.view, params.all_seen_within_s)
        print(f"{outcome.outcome}: {outcome.describe()}")
    return outcome.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
