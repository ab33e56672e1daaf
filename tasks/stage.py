"""How a plain function becomes a pipeline stage: named, measured, stopped, reported to whoever is listening.

A stage's function takes its run first — a ``Receiver``
(``tasks/receiver.py``) or a ``Publisher`` (``tasks/publisher.py``):
anything with ``stage(name)`` (which measures the stage into the run's
ledger) and ``stop``. A ``Stage`` runs it the same way everywhere: measured,
after checking the run's stop token, once. A stage does not retry: its
requests retry transient I/O, and the whole run retries after a rollback
(``storage/retry.py`` says which layer retries what). A stage has a
deadline instead (``deadline_s`` of its run: ``RefitParams.stage_deadline_s``):
past it, a timer stops the run's token with a ``StageDeadlineExceeded``
cause, so the run stops at its next safe point as on a cancellation, and
fails with that error (not interrupted).

Who hears of a stage is injected, not looked up: the stage reporter of the
current context (``reporting_stages``). By default it is the null reporter
(the crash harness, a trainer process, the benchmarks); a flow of ours
injects Prefect's (``flows/prefect_adapter.py``), which reports each stage
as a task run of the flow run. This module never imports Prefect.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

from storage.errors import Cancelled, StageDeadlineExceeded
from storage.format.status import CANCELLED, COMPLETED, FAILED, INTERRUPTED, PENDING, Status

R = TypeVar("R")
log = logging.getLogger("canonical_refit.stage")


class NullStages:
    """The stage reporter outside a flow run of ours: nobody to tell, the stage just runs."""

    reporting = False

    def run(self, stage: "Stage", run, body: Callable[[], R]) -> R:
        return body()


NULL_STAGES = NullStages()
_reporter: contextvars.ContextVar = contextvars.ContextVar("canonical_refit_stage_reporter", default=NULL_STAGES)


def stage_reporter():
    """The stage reporter of this context: ``run(stage, run, body)`` runs ``body`` and reports it."""
    return _reporter.get()


@contextmanager
def reporting_stages(reporter) -> Iterator[None]:
    """Inside, the stages run in this context (and the threads they start) are reported to ``reporter``."""
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)


@dataclass
class StageRecord:
    """Wall time, bytes and transfer counts of one stage, as shown in the run's table.

    A stage runs once per run attempt (no ``attempts``: earlier releases wrote
    ``"attempts": 1`` in each row, which readers ignore). ``retries`` are its
    requests' retries of transient I/O. ``status`` is one of
    ``storage.format.status.StageStatus``.
    """

    name: str
    seconds: float = 0.0
    bytes: int = 0
    requests: int = 0
    retries: int = 0
    backoff_s: float = 0.0
    status: Status = PENDING
    detail: str = ""

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def row(self) -> dict:
        return {
            "stage": self.name,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "bytes": self.bytes,
            "MB/s": round(self.mb_per_s, 1),
            "requests": self.requests,
            "retries": self.retries,
            "backoff_s": round(self.backoff_s, 2),
            "detail": self.detail,
        }

    def summary(self) -> dict:
        """What a run's result lists for the stage (``--json``)."""
        return {"name": self.name, "seconds": round(self.seconds, 3), "bytes": self.bytes,
                "requests": self.requests, "retries": self.retries,
                "backoff_s": round(self.backoff_s, 2), "status": self.status}


@dataclass
class Ledger:
    """Per-stage records of one run, listed in ``order`` (stages that overlap arrive in any order)."""

    order: Sequence[str] = ()
    records: dict[str, StageRecord] = field(default_factory=dict)
    lineage: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    log: Any = None  # the logger notes go to
    rollback_from: str | None = None  # the installed version a rollback left (resolve catalog sets it)

    def record(self, name: str) -> StageRecord:
        return self.records.setdefault(name, StageRecord(name))

    @property
    def stages(self) -> dict[str, StageRecord]:
        rank = {name: i for i, name in enumerate(self.order)}
        return dict(sorted(self.records.items(), key=lambda kv: rank.get(kv[0], len(rank))))

    def note(self, message: str) -> None:
        if self.log is not None:
            self.log.info(message)
        self.notes.append(message)


def stage_status(error: BaseException, interrupted: bool, name: str | None = None) -> Status:
    """How stage ``name`` that raised ``error`` ended: ``INTERRUPTED`` (Ctrl-C, SIGTERM, a cancellation),
    ``CANCELLED`` (stopped because another stage failed or overran its deadline) or ``FAILED`` (its own
    deadline included)."""
    from storage.errors import Cancelled, Interrupted, StageDeadlineExceeded

    if interrupted or isinstance(error, (Interrupted, KeyboardInterrupt)):
        return INTERRUPTED
    if isinstance(error, StageDeadlineExceeded) and error.stage == name:
        return FAILED
    if isinstance(error, Cancelled):
        return CANCELLED
    return FAILED


class measuring:
    """``with measuring(record, stop) as record:`` times a stage and sets its status (the runs' ``stage``)."""

    def __init__(self, record: StageRecord, stop):
        self.record, self.stop = record, stop

    def __enter__(self) -> StageRecord:
        self.started = time.perf_counter()
        return self.record

    def __exit__(self, kind, error, _tb) -> None:
        self.record.seconds += time.perf_counter() - self.started
        if error is None:
            self.record.status = COMPLETED
            return
        from storage.errors import RefitError

        self.record.status = stage_status(error, bool(self.stop is not None and self.stop.interrupted),
                                          self.record.name)
        self.record.detail = str(error) if isinstance(error, RefitError) else f"{type(error).__name__}: {error}"


class Deadline:
    """``with Deadline(stage, run):`` the stage's deadline: ``run.deadline_s`` seconds (None: none), armed for an
    interruptible stage only (the others run even when the run is stopped).

    A timer thread trips it: it stops the run's token with a
    ``StageDeadlineExceeded`` cause naming the stage, the run's ``revision`` and
    the seconds. The work stops at its next safe point as on a cancellation;
    a stop the body raised (``Cancelled``) leaves it as the typed error, so this
    stage's row says FAILED and the stages it stopped say CANCELLED.
    """

    def __init__(self, stage: "Stage", run):
        self.stage, self.run = stage, run
        self.seconds: float | None = getattr(run, "deadline_s", None) if stage.interruptible else None
        self._timer: threading.Timer | None = None

    def __enter__(self) -> "Deadline":
        if self.seconds is not None:
            self._timer = threading.Timer(self.seconds, self._trip)
            self._timer.name = f"deadline-{self.stage.name.replace(' ', '-')}"
            self._timer.daemon = True
            self._timer.start()
        return self

    def error(self) -> StageDeadlineExceeded:
        return StageDeadlineExceeded(self.stage.name, self.seconds or 0.0, revision=getattr(self.run, "revision", None))

    def _trip(self) -> None:
        error = self.error()
        log.warning("%s: stopping the run at its next safe point", error)
        self.run.stop.stop(str(error), cause=self.error)

    def __exit__(self, kind, error, _tb) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if isinstance(error, Cancelled) and not isinstance(error, StageDeadlineExceeded) \
                and not self.run.stop.interrupted:
            cause = self.run.stop.cause()
            if cause is not None:
                raise cause from error


class Running(Generic[R]):
    """A stage started in the background: ``join`` waits for it to end, ``result`` also returns or raises."""

    def __init__(self, join: Callable[[], None], result: Callable[[], R]):
        self.join, self.result = join, result


class Stage(Generic[R]):
    """One pipeline stage over a plain function ``fn(run, ...)``, run once, measured and reported.

    A stage that is not ``interruptible`` runs even when the run was asked to
    stop (activation, once the engine has loaded the new weights). A stage is
    never retried by itself (``storage/retry.py`` says which layer retries what).
    """

    def __init__(self, name: str, fn: Callable[..., R], *, interruptible: bool = True):
        self.name, self.fn, self.interruptible = name, fn, interruptible
        functools.update_wrapper(self, fn)

    def _measured(self, run, *args, **kwargs) -> R:
        if self.interruptible:
            run.stop.check()  # past another stage's deadline: raises that stage's StageDeadlineExceeded
        with run.stage(self.name) as record, Deadline(self, run):
            result = self.fn(run, *args, **kwargs)
            record.bytes = int(getattr(result, "bytes", 0) or 0)
            record.detail = str(getattr(result, "summary", "") or "")
            return result

    def __call__(self, run, *args, **kwargs) -> R:
        return stage_reporter().run(self, run, lambda: self._measured(run, *args, **kwargs))

    def run_name(self, run) -> str:
        """The stage's name in a report; with its attempt when the whole run is being retried, so each shows."""
        attempt = getattr(run, "attempt", 1)
        return self.name if attempt == 1 else f"{self.name} (attempt {attempt})"

    def start(self, run, *args, **kwargs) -> Running[R]:
        """Run the stage beside the caller, in a thread that sees this context (its stage reporter included)."""
        context = contextvars.copy_context()
        return self._in_thread(run, lambda: context.run(self, run, *args, **kwargs))

    def _in_thread(self, run, call: Callable[[], R]) -> Running[R]:
        outcome: dict[str, Any] = {}

        def body() -> None:
            try:
                outcome["value"] = call()
            except BaseException as exc:  # handed to whoever asks for the result
                outcome["error"] = exc

        thread = threading.Thread(target=body, name=f"stage-{self.name.replace(' ', '-')}", daemon=True)
        thread.start()

        def result() -> R:
            thread.join()
            if "error" in outcome:
                raise outcome["error"]
            return outcome["value"]

        return Running(thread.join, result)
