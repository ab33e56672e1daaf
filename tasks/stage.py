"""How a plain function becomes a pipeline stage: named, measured, retried, a Prefect task inside a flow run.

The one Prefect adapter of the project. A stage's function takes its run
first — a ``Receiver`` (``tasks/receiver.py``) or a ``Publisher``
(``tasks/publisher.py``): anything with ``stage(name)`` (which measures the
stage into the run's ledger), ``stop`` and ``stage_retry_policy()``. A
``Stage`` runs it the same way everywhere: measured, each attempt checking
the run's stop token first, transient failures retried inside the stage
under the run's stage retry policy when the stage is ``retried`` (inside:
in the calling thread, so a retry never outlives the store lock). Inside a
Prefect flow run it runs as a task of its name (one task run per stage,
states and timings in the UI); outside one (the crash harness, a trainer
process, the benchmarks) as the plain function. The composition that calls
the stages is the same either way.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Sequence, TypeVar

from storage.retry import RetryPolicy

R = TypeVar("R")
ONCE = RetryPolicy(1, 0.0)


def in_flow_run() -> bool:
    """True inside a Prefect flow run (stages then run as its tasks)."""
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


@dataclass
class StageRecord:
    """Wall time, bytes and transfer counts of one stage, as shown in the run's table."""

    name: str
    seconds: float = 0.0
    bytes: int = 0
    attempts: int = 0
    requests: int = 0
    retries: int = 0
    backoff_s: float = 0.0
    status: str = "pending"
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
            "attempts": self.attempts,
            "requests": self.requests,
            "retries": self.retries,
            "backoff_s": round(self.backoff_s, 2),
            "detail": self.detail,
        }

    def summary(self) -> dict:
        """What a run's result lists for the stage (``--json``)."""
        return {"name": self.name, "seconds": round(self.seconds, 3), "bytes": self.bytes,
                "attempts": self.attempts, "requests": self.requests, "retries": self.retries,
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


def report_task_run(prefect_task, name: str, context, started, ended, error: BaseException | None, *,
                    interrupted: bool) -> None:
    """Tell Prefect about a stage that ran from ``started`` to ``ended`` in the flow run of ``context``: one task
    run, in its final state (Completed, Failed, or Cancelled named Interrupted or Cancelled), with its times.

    Prefect's own task engine sends three events per task run (Pending, Running, then the final state) and
    reads the server's result storage settings for each; the server records a task run from any of its
    state events, so one event, sent when the stage ends, gives the UI the same task run, state and timing
    for a third of the cost (docs/fleet.md, "What a refit costs the server"). Best effort: a stage is never
    failed by its report.
    """
    try:
        from uuid import uuid4

        from prefect._internal.uuid7 import uuid7
        from prefect.client.schemas.objects import StateDetails, TaskRun, TaskRunPolicy
        from prefect.states import Cancelled, Completed, Failed
        from prefect.utilities.engine import emit_task_run_state_change_event

        from storage.errors import Cancelled as StageCancelled, Interrupted

        flow_run = getattr(context, "flow_run", None)
        if flow_run is None:
            return
        task_run_id = uuid7()
        details = StateDetails(task_run_id=task_run_id, flow_run_id=flow_run.id)
        if error is None:
            state = Completed(state_details=details)
        elif interrupted or isinstance(error, (Interrupted, KeyboardInterrupt)):
            state = Cancelled(name="Interrupted", message=str(error), state_details=details)
        elif isinstance(error, StageCancelled):
            state = Cancelled(message=str(error), state_details=details)
        else:
            state = Failed(message=str(error) or type(error).__name__, state_details=details)
        state.timestamp = ended
        task_run = TaskRun(
            id=task_run_id, name=name, flow_run_id=flow_run.id, task_key=prefect_task.task_key,
            dynamic_key=str(uuid4()), task_version=prefect_task.version,
            empirical_policy=TaskRunPolicy(retries=0), tags=list(prefect_task.tags), labels={}, task_inputs={},
            state=state, state_type=state.type, state_name=state.name, run_count=1, flow_run_run_count=1,
            expected_start_time=started, start_time=started, end_time=ended, total_run_time=ended - started)
        emit_task_run_state_change_event(task_run=task_run, initial_state=None, validated_state=state)
    except Exception as exc:  # the UI misses a task run; the refit goes on
        import logging

        logging.getLogger("canonical_refit.stage").debug("could not report the task run of %s: %s", name, exc)


def unpersisted_results():
    """Where results would go, named so that Prefect does not ask the server (one ``GET /admin/storage`` per
    flow and task run otherwise): results are never persisted (``persist_result=False`` everywhere), so this
    folder is only ever named, never written."""
    from prefect.settings import get_current_settings

    return Path(get_current_settings().results.local_storage_path)


def stage_status(error: BaseException, interrupted: bool) -> str:
    """How a stage that raised ``error`` ended: ``interrupted`` (Ctrl-C, SIGTERM, a cancellation), ``cancelled``
    (stopped because another stage failed) or ``failed``."""
    from storage.errors import Cancelled, Interrupted

    if interrupted or isinstance(error, (Interrupted, KeyboardInterrupt)):
        return "interrupted"
    if isinstance(error, Cancelled):
        return "cancelled"
    return "failed"


class measuring:
    """``with measuring(record, stop) as record:`` times a stage and sets its status (the runs' ``stage``)."""

    def __init__(self, record: StageRecord, stop):
        self.record, self.stop = record, stop

    def __enter__(self) -> StageRecord:
        self.record.attempts += 1
        self.started = time.perf_counter()
        return self.record

    def __exit__(self, kind, error, _tb) -> None:
        self.record.seconds += time.perf_counter() - self.started
        if error is None:
            self.record.status = "ok"
            return
        from storage.errors import RefitError

        self.record.status = stage_status(error, bool(self.stop is not None and self.stop.interrupted))
        self.record.detail = str(error) if isinstance(error, RefitError) else f"{type(error).__name__}: {error}"


class Running(Generic[R]):
    """A stage started in the background: ``join`` waits for it to end, ``result`` also returns or raises."""

    def __init__(self, join: Callable[[], None], result: Callable[[], R]):
        self.join, self.result = join, result


class Stage(Generic[R]):
    """One pipeline stage over a plain function ``fn(run, ...)``.

    ``retried`` stages retry transient errors under the run's stage retry
    policy (read-only stages, an idempotent upload); stages that change the
    store never do: a second attempt could act on a half-written state. A
    stage that is not ``interruptible`` runs even when the run was asked to
    stop (activation, once the engine has loaded the new weights).
    """

    def __init__(self, name: str, fn: Callable[..., R], *, retried: bool, interruptible: bool = True):
        self.name, self.fn, self.retried, self.interruptible = name, fn, retried, interruptible
        functools.update_wrapper(self, fn)

    @functools.cached_property
    def task(self):
        """The Prefect task this stage is a run of (its name, key and version); it is reported, not run by
        Prefect's task engine: ``report_task_run``. Built on first use, inside a flow run: importing a stage
        (a command that runs no flow) never imports Prefect."""
        from prefect import task
        from prefect.cache_policies import NO_CACHE

        return task(name=self.name, task_run_name=self.name, cache_policy=NO_CACHE, persist_result=False,
                    result_storage=unpersisted_results(), retries=0)(self._measured)

    def _measured(self, run, *args, **kwargs) -> R:
        def attempt() -> R:
            if self.interruptible:
                run.stop.check()
            with run.stage(self.name) as record:
                result = self.fn(run, *args, **kwargs)
                record.bytes = int(getattr(result, "bytes", 0) or 0)
                record.detail = str(getattr(result, "summary", "") or "")
                return result

        policy = run.stage_retry_policy() if self.retried else ONCE
        return policy.call(f"stage {self.name}", attempt, wait=run.stop.wait)

    def __call__(self, run, *args, **kwargs) -> R:
        if in_flow_run():
            return self._as_task_run(run, lambda: self._measured(run, *args, **kwargs))
        return self._measured(run, *args, **kwargs)

    def _run_name(self, run) -> str:
        """The task run's name; with its attempt when the whole run is being retried, so the UI shows each."""
        attempt = getattr(run, "attempt", 1)
        return self.name if attempt == 1 else f"{self.name} (attempt {attempt})"

    def _as_task_run(self, run, body: Callable[[], R]) -> R:
        """``body()``, reported to Prefect as this stage's task run: one event when it ends, with its final state
        and its start and end (see ``report_task_run``)."""
        from prefect.context import FlowRunContext
        from prefect.types._datetime import now

        context = FlowRunContext.get()
        started = now("UTC")
        error: BaseException | None = None
        try:
            return body()
        except BaseException as exc:
            error = exc
            raise
        finally:
            report_task_run(self.task, self._run_name(run), context, started, now("UTC"), error,
                            interrupted=bool(run.stop is not None and run.stop.interrupted))

    def start(self, run, *args, **kwargs) -> Running[R]:
        """Run the stage beside the caller (in a thread; inside a flow run, reported as its task run)."""
        if in_flow_run():
            import contextvars

            context = contextvars.copy_context()  # the flow run's, for the thread
            return self._in_thread(run, lambda: context.run(
                self._as_task_run, run, lambda: self._measured(run, *args, **kwargs)))
        return self._in_thread(run, lambda: self._measured(run, *args, **kwargs))

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
