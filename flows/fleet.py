"""The fleet view: which node runs which version, and waiting until enough of them run a version.

    python -m flows.fleet status --catalog s3://bucket/models/org-name/catalog --model org/name
    python -m flows.fleet wait --catalog ... --model org/name --version r42 --all-seen-within 600 --timeout 300

Every node writes its own status record beside the catalog after each refit
(``storage/catalog/nodes.py``); this reads them. ``wait`` returns as soon as enough
nodes run the version or a newer one (exit 0), at the timeout naming the
laggards (exit 1), or as soon as a node is poisoned (exit 3) — the question an
RL loop asks after each publication. The same as Python functions:
``fleet_status`` and ``wait_for``. ``poisoned_alert`` is the Prefect
automation that notifies someone when a node reports itself poisoned
(docs/fleet.md, "Running a fleet").
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
from storage.catalog.nodes import NodeRecord, read_node_records
from storage.objects.store import ObjectStore
from storage.settings import MODEL_PATTERN, ObjectStoreSettings

READY_STATUSES = ("READY", "SKIPPED")


class FleetParams(BaseSettings):
    """Where the fleet's records are, and what to wait for (env prefix ``CANONICAL_REFIT_FLEET_``)."""

    model_config = SettingsConfigDict(env_prefix="CANONICAL_REFIT_FLEET_", extra="ignore")

    catalog: str = Field(..., description="catalog URL: s3://bucket/prefix, file:///path or a local path")
    model: str = Field(..., pattern=MODEL_PATTERN, description="model id, e.g. org/name")
    version: str | None = Field(None, description="wait: the version (or any newer one) the nodes must run")
    nodes: int | None = Field(None, ge=1, description="wait: how many nodes must run it (default: every node "
                                                      "with a record)")
    all_seen_within_s: float | None = Field(
        None, gt=0, description="wait: every node whose record is newer than this many seconds must run it "
                                "(nodes silent for longer are left out as down)")
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
    """How a wait ended: ``reached`` (exit 0), ``timeout`` (1) or ``poisoned`` (3)."""

    outcome: str
    version: str
    reached: list[str]
    laggards: list[str]
    poisoned: list[str]
    seconds: float
    view: FleetView

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


def wait_for(version: str, *, catalog: str, model: str, nodes: int | None = None,
             all_seen_within_s: float | None = None, timeout_s: float = 600.0, poll_s: float = 1.0,
             storage: ObjectStoreSettings | None = None) -> WaitOutcome:
    """Wait until enough nodes run ``version`` or newer (by catalog sequence); see the module."""
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
        if all_seen_within_s is not None:
            considered = [r for r in records if r.age_s <= all_seen_within_s]
        else:
            considered = records
        at = [r.node for r in considered if (sequence_of(r.version) or -1) >= wanted]
        behind = [r.node for r in considered if r.node not in at]
        poisoned = [r.node for r in records if r.status == "POISONED"]
        elapsed = round(time.monotonic() - started, 3)
        if poisoned:
            return WaitOutcome("poisoned", version, at, behind, poisoned, elapsed, view)
        enough = len(at) >= nodes if nodes is not None else (bool(considered) and not behind)
        if enough:
            return WaitOutcome("reached", version, at, behind, poisoned, elapsed, view)
        if elapsed >= timeout_s:
            return WaitOutcome("timeout", version, at, behind, poisoned, elapsed, view)
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
WAIT_FLAGS = STATUS_FLAGS + [Flag("version"), Flag("nodes"), Flag("all_seen_within_s", "--all-seen-within"),
                             Flag("timeout_s", "--timeout"), Flag("poll_s", "--poll")]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.fleet", description=(
        "The fleet view: each node's installed version and last refit. Exit codes of wait: 0 enough nodes "
        "run the version, 1 timeout (the laggards are named), 3 a node is poisoned."))
    commands = parser.add_subparsers(dest="command", required=True)
    for name, flags, text in (("status", STATUS_FLAGS, "print every node's version, status, age and last error"),
                              ("wait", WAIT_FLAGS, "wait until enough nodes run a version or a newer one")):
        sub = commands.add_parser(name, help=text, description=text)
        add_flags(sub, FleetParams, flags)
        sub.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def print_view(view: FleetView) -> None:
    print(f"{'node':<24}{'version':<12}{'status':<13}{'age':>8}  last error")
    for r in view.nodes:
        print(f"{r.node:<24}{str(r.version):<12}{r.status:<13}{_age(r.age_s):>8}  {(r.error or '')[:80]}")
    for problem in view.problems:
        print(f"unreadable record: {problem}")


def _age(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.0f}h"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    flags = STATUS_FLAGS if args.command == "status" else WAIT_FLAGS
    try:
        params = build(FleetParams, given(args, flags))
    except ValidationError as exc:
        parser.error("; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()))
    if args.command == "status":
        view = fleet_status(params.catalog, params.model, storage=params.storage)
        print(json.dumps(view.to_json(), sort_keys=True)) if args.json else print_view(view)
        return 0
    if params.version is None:
        parser.error("wait needs --version")
    try:
        outcome = wait_for(params.version, catalog=params.catalog, model=params.model, nodes=params.nodes,
                           all_seen_within_s=params.all_seen_within_s, timeout_s=params.timeout_s,
                           poll_s=params.poll_s, storage=params.storage)
    except RefitError as exc:
        print(json.dumps({"error": str(exc)}) if args.json else f"error: {exc}")
        return 2
    if args.json:
        print(json.dumps(outcome.to_json(), sort_keys=True))
    else:
        print_view(outcome.view)
        detail = {"reached": f"{len(outcome.reached)} node(s) run {outcome.version} or newer",
                  "timeout": f"timed out after {outcome.seconds:.0f}s; behind: {', '.join(outcome.laggards)}",
                  "poisoned": f"poisoned: {', '.join(outcome.poisoned)} (run `python -m flows.refit recover` there)"}
        print(f"{outcome.outcome}: {detail[outcome.outcome]}")
    return outcome.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
