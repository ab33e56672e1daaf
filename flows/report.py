"""What a refit run leaves behind: its outcome (``RefitResult``), a stage table and, when it failed, a summary
(Prefect artifacts).

A run's outcome is built once, after its last attempt, from the store's own
records (``flows.outcome.settle``); it is a frozen value. The run hands it
to its sinks in one place (``flows.refit.run_refit``): the node's record and
event, the caller's ``OutcomeWatch``, the artifacts; the flow returns it as
its final Prefect state. A caller that starts a refit reads the returned
outcome, or (for a flow it starts) the watch it opened with ``watching()``.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Iterator

from storage.errors import RefitError, StoreError
from storage.format.status import (  # noqa: F401  (the statuses, as this module always offered them)
    FAILED, INTERRUPTED, POISONED, READY, SKIPPED, STAGE_ENDED_BADLY, SUCCEEDED, Status, stage_status_of,
)

if TYPE_CHECKING:  # annotations only: a command that runs no flow (status, --help) never loads the stages
    from tasks.receiver import Receiver

log = logging.getLogger("canonical_refit.report")

EXIT_CODES = {READY: 0, SKIPPED: 0, FAILED: 1, POISONED: 3, INTERRUPTED: 130}
EXIT_USAGE = 2
_PROGRESS_SPANS = {"seed": (0, 5), "seed verify": (5, 10), "fetch": (10, 50), "apply": (50, 90), "verify": (90, 99)}


def artifact_key(kind: str, model: str) -> str:
    """Stable artifact key per model (lowercase letters, digits and dashes only)."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"refit-{kind}-{slug}"[:100]


@dataclass(frozen=True)
class RefitResult:
    """The outcome of one run, as the CLI prints it with ``--json``: a frozen value, built once."""

    status: Status
    version: str | None
    target_digest: str | None
    format_digest: str | None
    checkpoint_path: str | None
    stages: list[dict] = field(default_factory=list)
    error: str | None = None
    error_detail: dict | None = None
    lineage: list[str] = field(default_factory=list)
    activated: bool = False
    notes: list[str] = field(default_factory=list)
    target: str | None = None
    installed_version: str | None = None
    next_step: str | None = None
    attempts: list[dict] = field(default_factory=list)  # every attempt of the run: status, error, seconds
    rollback_from: str | None = None  # the run was a rollback: the installed version it went back from
    # the error object itself, for Python callers (not part of the JSON)
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "exception"}

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.status, 1)


@dataclass(frozen=True)
class Attempt:
    """How one attempt of the runbook ended: the receiver it ran with (its stages, notes and store), its status
    and error, and how long it took. The run's outcome is built from the last one (``flows.outcome.settle``)."""

    rx: Receiver
    status: Status
    exception: BaseException | None
    number: int
    seconds: float

    def row(self) -> dict:
        return {"attempt": self.number, "status": self.status,
                "error": str(self.exception) if self.exception is not None else None, "seconds": self.seconds}


def build_result(rx: Receiver, status: Status, error: BaseException | None = None, *, activated=False,
                 target: str | None = None, next_step: str | None = None, attempts: list[dict] | None = None,
                 notes_before: list[str] | None = None) -> RefitResult:
    """Result of the run from the store's own records.

    ``version`` is what the run leaves behind: on success the installed
    identity (or the prepared one when activation was deferred); otherwise
    ``version`` is None and ``installed_version`` says what still runs.
    ``notes_before`` (the earlier attempts') come before the receiver's notes.
    """
    active, current = _readable(rx.store.active), _readable(rx.store.current)
    if status == READY and not activated and current is not None:
        identity = (current.version, current.target_digest, current.format_digest)
    elif status in SUCCEEDED and active is not None:
        identity = (active.version, active.digest, active.format_digest)
    else:
        identity = (None, None, None)
    return RefitResult(
        status=status, version=identity[0], target_digest=identity[1], format_digest=identity[2],
        checkpoint_path=str(rx.store.absolute(current.path)) if current is not None else None,
        stages=[r.summary() for r in rx.ledger.stages.values()],
        error=str(error) if error is not None else None,
        error_detail=error.to_dict() if isinstance(error, RefitError) else (
            {"type": type(error).__name__, "message": str(error)} if error is not None else None),
        lineage=list(rx.ledger.lineage), activated=activated, notes=list(notes_before or ()) + list(rx.ledger.notes),
        target=target, installed_version=active.version if active is not None else None, next_step=next_step,
        attempts=list(attempts or ()), rollback_from=rx.ledger.rollback_from, exception=error,
    )


class OutcomeWatch:
    """Where the caller of a refit receives its outcome as soon as the run's own work has ended (its node record
    written; its artifacts and its Prefect state still to come): one per run, opened with ``watching()``."""

    def __init__(self) -> None:
        self.outcome: RefitResult | None = None
        self._delivered = threading.Event()

    def deliver(self, outcome: RefitResult) -> None:
        self.outcome = outcome
        self._delivered.set()

    def wait(self, timeout_s: float | None = None) -> RefitResult | None:
        """The outcome, waiting up to ``timeout_s`` for it; None if the run has not ended."""
        self._delivered.wait(timeout_s)
        return self.outcome


_watch: contextvars.ContextVar[OutcomeWatch | None] = contextvars.ContextVar("refit_outcome_watch", default=None)


@contextmanager
def watching() -> Iterator[OutcomeWatch]:
    """A watch for the refit started in this block (in this context, or a thread given a copy of it)."""
    watch = OutcomeWatch()
    token = _watch.set(watch)
    try:
        yield watch
    finally:
        _watch.reset(token)


def watch_next_run() -> OutcomeWatch:
    """A watch for the next refit started in the current context, kept until the next call (for a caller that
    starts its runs in one context, one after the other: the node agent)."""
    watch = OutcomeWatch()
    _watch.set(watch)
    return watch


def current_watch() -> OutcomeWatch | None:
    return _watch.get()


def result_of(state, watch: OutcomeWatch | None = None) -> RefitResult:
    """The RefitResult of a refit flow run: the outcome ``watch`` received, else the one a Ready or Skipped
    final state carries, else a FAILED result naming the state (a failed state carries the run's error)."""
    if watch is not None and watch.outcome is not None:
        return watch.outcome
    value = state.result(raise_on_failure=False)
    if isinstance(value, RefitResult):
        return value
    status = INTERRUPTED if state.is_cancelled() else FAILED
    return RefitResult(status, None, None, None, None, error=f"{state.name}: {state.message}",
                       exception=value if isinstance(value, BaseException) else None)


def failed_stage(result: RefitResult) -> str | None:
    """The stage a run that did not end well failed (or was interrupted) in; None if none did. Reads the
    lowercase statuses of earlier releases too (``stage_status_of``)."""
    return next((s["name"] for s in result.stages if stage_status_of(s.get("status")) in STAGE_ENDED_BADLY), None)


def print_result(result: RefitResult, flags: list | None = None) -> None:
    """Human-readable stage table, outcome and what to do next. ``flags``: the command's own (``flows.options``);
    the error's fields are then named as those flags (``cache_max_gb=`` as ``--cache-max-gb``)."""
    if result.stages:
        print(f"{'stage':<16}{'status':<12}{'seconds':>9}{'bytes':>15}{'MB/s':>9}{'retries':>8}")
    for s in result.stages:
        rate = s["bytes"] / s["seconds"] / 1e6 if s["seconds"] else 0.0
        print(f"{s['name']:<16}{s['status']:<12}{s['seconds']:>9.3f}{s['bytes']:>15,}{rate:>9.1f}{s['retries']:>8}")
    print(f"status: {result.status}")
    if result.status in SUCCEEDED:
        label = "prepared (not yet active)" if result.status == READY and not result.activated else "version"
        print(f"{label}: {result.version}")
        print(f"target digest: {result.target_digest}")
        print(f"format digest: {result.format_digest}")
    else:
        print(f"installed version (unchanged): {result.installed_version or 'none (nothing was installed yet)'}")
    if result.checkpoint_path:
        print(f"checkpoint: {result.checkpoint_path}")
    if result.lineage:
        print(f"lineage: {' -> '.join(result.lineage)}")
    if result.status == SKIPPED and result.notes:
        print(f"skipped: {result.notes[-1]}")
    if result.error:
        print(f"error: {error_for_command(result, flags) if flags else result.error}")
    if result.next_step:
        print(f"next: {result.next_step}")


def error_for_command(result: RefitResult, flags: list) -> str:
    """The run's error as a command's user reads it: the fields it names rendered as the command's flags
    (the API and ``--json`` keep the field names)."""
    from flows.options import as_flags, error_as_flags

    if isinstance(result.exception, RefitError) and str(result.exception) == result.error:
        return error_as_flags(result.exception, flags)
    return as_flags(result.error or "", flags)


def _readable(read):
    """A store record for the report, or None if it cannot be read (the error is the run's to report)."""
    try:
        return read()
    except StoreError:
        return None


def summary_markdown(rx: Receiver, result: RefitResult) -> str:
    """The run's markdown summary: catalog, lineage, installed identity, or what failed and how to recover."""
    params = rx.params
    lines = [f"# Refit of `{params.model}`: {result.status}", "",
             f"- catalog: `{rx.catalog.url}`", f"- target: `{params.target}`",
             f"- lineage replayed: {' -> '.join(f'`{v}`' for v in result.lineage) or 'none'}",
             f"- store: `{rx.store.root}`"]
    if result.rollback_from:
        lines += [f"- rollback: from `{result.rollback_from}`"]
    active = _readable(rx.store.active)
    if active is not None:
        lines += [f"- installed: `{active.version}` `{active.digest}` via `{active.installer}`"]
    if result.error_detail:
        d = result.error_detail
        lines += ["", "## Failure", "",
                  f"- stage: **{failed_stage(result) or '?'}**", f"- error: `{d.get('type')}`: {d.get('message')}",
                  f"- revision: `{d.get('revision')}`", f"- file: `{d.get('file')}`",
                  f"- tensor: `{d.get('tensor')}`"] + ([f"- field: `{d['field']}`"] if d.get("field") else [])
        if result.status == POISONED:
            lines += ["", "**The receiver is poisoned**: the engine may hold partially written weights; installs "
                      "are refused until a recovery re-installs a verified checkpoint through the same installer."]
        else:
            lines += ["", "The installed version and the last verified checkpoint are unchanged."]
    if result.next_step:
        lines += ["", f"**Next:** `{result.next_step}`"]
    if len(result.attempts) > 1:
        lines += ["", "## Attempts", "", "| attempt | status | seconds | error |", "|---|---|---|---|"]
        lines += [f"| {a['attempt']} | {a['status']} | {a['seconds']} | {a['error'] or ''} |" for a in result.attempts]
    if result.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in result.notes]
    lines += ["", "## Stages", "", "| stage | status | seconds | bytes | MB/s | retries | backoff s |",
              "|---|---|---|---|---|---|---|"]
    for record in rx.ledger.stages.values():
        r = record.row()
        lines.append(f"| {r['stage']} | {r['status']} | {r['seconds']} | {r['bytes']:,} | {r['MB/s']} | "
                     f"{r['retries']} | {r['backoff_s']} |")
    return "\n".join(lines) + "\n"


PROGRESS_AFTER_S = 5.0  # a refit still running after this long gets a progress artifact (someone may be watching)
PROGRESS_EVERY_S = 2.0  # and at most one update of it this often


class PrefectReporter:
    """Keyed Prefect artifacts of a run, sent only where a person reads them.

    A refit that ends Ready or Skipped leaves one artifact, its stage table
    (bytes and MB/s per stage, which the task runs do not show), its
    description the run's outcome in a line; a failed, poisoned or interrupted
    one also leaves its summary (what failed, where, and the next command). A
    progress artifact is created only once a run has lasted ``PROGRESS_AFTER_S``
    and updated at most every ``PROGRESS_EVERY_S``: a steady-state refit of a
    few seconds sends none. Every artifact goes through the run's own API
    client, one after the other (a thread of its own would open a client of
    its own, with its own handshakes).
    """

    def __init__(self, model: str, *, progress_after_s: float | None = None):
        self.model = model
        self.started = time.monotonic()
        self.progress_after_s = PROGRESS_AFTER_S if progress_after_s is None else progress_after_s
        self._progress_id = None
        self._updated = 0.0
        self._lock = threading.Lock()
        self._context = contextvars.copy_context()  # the flow run's: stages report progress from their threads

    def progress(self, label: str, done: int, total: int) -> None:
        key = label if label in _PROGRESS_SPANS else label.split(" ")[0]
        if key == "verify" and label != "verify":  # "verify r0": seeding checks the launch snapshot
            key = "seed verify"
        low, high = _PROGRESS_SPANS.get(key, (0, 99))
        share = done / total if total else 1.0
        now = time.monotonic()
        if now - self.started < self.progress_after_s or now - self._updated < PROGRESS_EVERY_S:
            return
        if not self._lock.acquire(blocking=False):  # another stage's thread is sending an update right now
            return
        try:
            self._updated = now
            self._context.copy().run(self._send_progress, low + (high - low) * min(1.0, share))
        finally:
            self._lock.release()

    def _send_progress(self, value: float) -> None:
        try:
            from prefect.artifacts import create_progress_artifact, update_progress_artifact

            if self._progress_id is None:
                self._progress_id = create_progress_artifact(
                    progress=value, key=artifact_key("progress", self.model), description=f"refit of {self.model}")
            else:
                update_progress_artifact(self._progress_id, progress=value)
        except Exception as exc:  # artifacts are best effort: never fail a refit over them
            log.debug("progress artifact: %s", exc)

    def publish_result(self, result: RefitResult, rx: Receiver) -> None:
        """The run's artifacts, from its outcome and the receiver of its last attempt (its stage table)."""
        ok = result.status in SUCCEEDED
        outcome = (f"{result.status} {result.version} {result.target_digest or ''}".strip() if ok
                   else f"{result.status}: {result.error or ''}")
        try:
            from prefect.artifacts import create_markdown_artifact, create_table_artifact, update_progress_artifact

            create_table_artifact(key=artifact_key("stages", self.model),
                                  table=[r.row() for r in rx.ledger.stages.values()],
                                  description=f"refit of {self.model}: {outcome}"[:2000])
            if not ok or result.rollback_from:  # a rollback is said so in a summary too
                create_markdown_artifact(key=artifact_key("summary", self.model), markdown=summary_markdown(rx, result),
                                         description=f"refit of {self.model}: {result.status}"
                                                     + (f", a rollback from {result.rollback_from}"
                                                        if result.rollback_from else ""))
            elif self._progress_id is not None:  # a failed run's progress stays where it stopped
                update_progress_artifact(self._progress_id, progress=100.0)
        except Exception as exc:
            log.warning("could not publish the run's artifacts: %s", exc)


class _ShortRefitErrors(logging.Filter):
    """Prefect logs a failing task's exception with its traceback; ours are expected and self-explaining."""

    def filter(self, record: logging.LogRecord) -> bool:
        from storage.errors import RefitError

        if record.exc_info and isinstance(record.exc_info[1], RefitError):
            record.msg = f"{record.getMessage()} {record.exc_info[1]}"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_expected_errors() -> None:
    """Expected errors print one line, not a traceback (Prefect logs a failing task's traceback)."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logging.getLogger(name).addFilter(_ShortRefitErrors())
