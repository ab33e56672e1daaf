"""The one module that touches Prefect's internals, and the stage reporter the entry points inject.

What is Prefect's public API is used as such elsewhere (``@flow``, states,
artifacts, ``emit_event``, the client, deployments, automations). What is not
public lives here, each piece with the reason it is custom:

======================  ==========================================  ==========================================
piece                   Prefect internals it uses                   why not the public API
======================  ==========================================  ==========================================
``PrefectTaskRuns``     ``TaskRun``/``StateDetails`` built by hand,  a stage reported as a task run with one
(stage reports)         ``prefect._internal.uuid7``,                state event when it ends: a third of the
                        ``prefect.utilities.engine.emit_task_run_   server load of Prefect's task engine
                        state_change_event``                        (three events and a storage read a task)
``send_heartbeats``     ``prefect.flow_engine._send_heartbeats``    Prefect's sender sleeps in 1 s steps and
(flow-run heartbeats)   replaced; ``FlowRunEngine._build_heartbeat  is joined at the end of every run: up to a
                        _event_template``/``_emit_flow_run_          second (0.6 s on average) of each refit
                        heartbeat``                                 
``run_claimed_flow``    ``prefect.flow_engine.run_flow``            the node agent runs a claimed flow run in
(the agent's runs)                                                  its warm process (a worker would start a
                                                                    new interpreter per run)
======================  ==========================================  ==========================================

``check_prefect`` tells at start-up whether the installed Prefect is one
these were written against (``SUPPORTED``, pinned the same in
pyproject.toml) and has every one of them; if not it raises
``UnsupportedPrefect`` naming the version and what is missing, instead of
a UI that silently loses its task runs after an upgrade. ``start`` runs it
once per process, installs the heartbeat sender and hands the product's
logger Prefect's handlers; the entry points call it (``flows.bootstrap``),
and so does every flow run of ours (``flow_run_reporting``), for a program
that imports a flow and calls it.

A flow of ours injects ``PrefectTaskRuns`` as the stage reporter for its
body (``flow_run_reporting``); everywhere else (the crash harness, a trainer
process, the benchmarks, ``flows.api`` outside a flow run) the stages run
with the null reporter of ``tasks/stage.py``. Nothing in ``tasks/`` or
``storage/`` imports Prefect.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

from storage.errors import RefitError
from storage.format.status import CANCELLED, INTERRUPTED
from tasks.stage import reporting_stages, stage_status

log = logging.getLogger("canonical_refit.prefect")
R = TypeVar("R")

SUPPORTED = ((3, 9), (3, 10))  # the Prefect versions this module was written and tested against: >=3.9,<3.10
PINNED = "prefect>=3.9,<3.10"  # pyproject.toml's requirement, the same range (tests/system/test_prefect_adapter.py)
REQUIRED = (  # module, attribute (dotted inside the module): every internal this module touches
    ("prefect._internal.uuid7", "uuid7"),
    ("prefect.client.schemas.objects", "TaskRun"),
    ("prefect.client.schemas.objects", "TaskRunPolicy"),
    ("prefect.client.schemas.objects", "StateDetails"),
    ("prefect.utilities.engine", "emit_task_run_state_change_event"),
    ("prefect.flow_engine", "run_flow"),
    ("prefect.flow_engine", "_send_heartbeats"),
    ("prefect.flow_engine", "MINIMUM_HEARTBEAT_INTERVAL"),
    ("prefect.flow_engine", "FlowRunEngine.heartbeat_seconds"),
    ("prefect.flow_engine", "FlowRunEngine._build_heartbeat_event_template"),
    ("prefect.flow_engine", "FlowRunEngine._emit_flow_run_heartbeat"),
    ("prefect.types._datetime", "now"),
)


class UnsupportedPrefect(RefitError):
    """The installed Prefect is not one this product supports: its version, or the internals it lacks."""

    def __init__(self, version: str, missing: list[str]):
        self.version, self.missing = version, list(missing)
        wanted = f"{PINNED} (pip install '{PINNED}')"
        if missing:
            detail = f"it lacks {', '.join(missing)}"
        else:
            detail = "its version is outside the supported range"
        super().__init__(f"Prefect {version} is not supported: {detail}; canonical-refit needs {wanted}")


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def missing_internals() -> list[str]:
    """The entries of ``REQUIRED`` this Prefect lacks, as ``module.attribute``."""
    missing = []
    for module_name, dotted in REQUIRED:
        try:
            __import__(module_name)  # the import statement's path (python -X importtime lists it)
            target: Any = sys.modules[module_name]
            for name in dotted.split("."):
                target = getattr(target, name)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{dotted}")
    return missing


def check_prefect(version: str | None = None) -> None:
    """Raise ``UnsupportedPrefect`` unless ``version`` (default: the installed one) is in ``SUPPORTED`` and every
    internal of ``REQUIRED`` is there."""
    if version is None:
        import prefect

        version = prefect.__version__
    missing = missing_internals()
    low, high = SUPPORTED
    if missing or not (low <= _version_tuple(version) < high):
        raise UnsupportedPrefect(version, missing)


_started: list[bool] = []
_start_lock = threading.Lock()


def start() -> None:
    """Once per process: check the installed Prefect, install the heartbeat sender and give the product's logger
    Prefect's handlers (if Prefect was imported before ``flows.bootstrap`` set its environment)."""
    with _start_lock:
        if _started:
            return
        check_prefect()
        install_heartbeats()
        _attach_product_logger()
        _started.append(True)


def _attach_product_logger() -> None:
    """What Prefect does for ``PREFECT_LOGGING_EXTRA_LOGGERS`` at import: the product's logger gets the handlers
    of ``prefect.extra`` (its lines go to the flow run's logs), at INFO unless a level was set."""
    product = logging.getLogger("canonical_refit")
    for handler in logging.getLogger("prefect.extra").handlers:
        if handler not in product.handlers:
            product.addHandler(handler)
    if product.level == logging.NOTSET:
        product.setLevel(logging.INFO)


def in_flow_run() -> bool:
    """True inside a Prefect flow run; False at once (no import) in a process that never imported Prefect."""
    if "prefect" not in sys.modules:
        return False
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def can_emit_events() -> bool:
    """Events have somewhere to go: this is a flow run, or a Prefect API is configured."""
    from flows.prefect_api import configured_api_url

    return in_flow_run() or configured_api_url() is not None


def unpersisted_results():
    """Where results would go, named so that Prefect does not ask the server (one ``GET /admin/storage`` per
    flow and task run otherwise): results are never persisted (``persist_result=False`` everywhere), so this
    folder is only ever named, never written."""
    from pathlib import Path

    from prefect.settings import get_current_settings

    return Path(get_current_settings().results.local_storage_path)


@contextmanager
def flow_run_reporting() -> Iterator[None]:
    """Inside a flow of ours: Prefect checked and set up (``start``), and the stages of the body reported as the
    flow run's task runs."""
    start()
    with reporting_stages(PrefectTaskRuns()):
        yield


# -- stage reports ------------------------------------------------------------------------------------------


class PrefectTaskRuns:
    """The stage reporter inside a flow run: each stage becomes one task run of its name, sent when it ends."""

    reporting = True
    _tasks: dict[str, Any] = {}  # stage name -> its Prefect task, built once per process

    def task_of(self, stage) -> Any:
        """The Prefect task a stage is a run of (its name, key and version); reported, never run by Prefect's
        task engine."""
        task = self._tasks.get(stage.name)
        if task is None:
            from prefect import task as make_task
            from prefect.cache_policies import NO_CACHE

            task = make_task(name=stage.name, task_run_name=stage.name, cache_policy=NO_CACHE,
                             persist_result=False, result_storage=unpersisted_results(), retries=0)(stage.fn)
            PrefectTaskRuns._tasks[stage.name] = task
        return task

    def run(self, stage, run, body: Callable[[], R]) -> R:
        """``body()``, reported to Prefect as the stage's task run: one event when it ends, with its final state
        and its start and end."""
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
            if context is not None:
                stop = getattr(run, "stop", None)
                try:
                    task = self.task_of(stage)
                except Exception as exc:  # never the stage's failure: the UI misses its task run
                    log.warning("could not report the task run of stage %s to Prefect: %s: %s", stage.name,
                                type(exc).__name__, exc)
                else:
                    report_task_run(task, stage.run_name(run), context, started, now("UTC"), error,
                                    interrupted=bool(stop is not None and stop.interrupted))


def report_task_run(prefect_task, name: str, context, started, ended, error: BaseException | None, *,
                    interrupted: bool) -> bool:
    """Tell Prefect about a stage that ran from ``started`` to ``ended`` in the flow run of ``context``: one task
    run, in its final state (Completed, Failed, or Cancelled named Interrupted or Cancelled), with its times.

    Prefect's own task engine sends three events per task run (Pending, Running, then the final state) and
    reads the server's result storage settings for each; the server records a task run from any of its
    state events, so one event, sent when the stage ends, gives the UI the same task run, state and timing
    for a third of the cost (docs/fleet.md, "What a refit costs the server"). A stage is never failed by its
    report; a report that fails is logged at WARNING (the UI misses that task run). True if it was sent.
    """
    try:
        from uuid import uuid4

        from prefect._internal.uuid7 import uuid7
        from prefect.client.schemas.objects import StateDetails, TaskRun, TaskRunPolicy
        from prefect.utilities.engine import emit_task_run_state_change_event

        flow_run = getattr(context, "flow_run", None)
        if flow_run is None:
            return False
        task_run_id = uuid7()
        state = _final_state(StateDetails(task_run_id=task_run_id, flow_run_id=flow_run.id), error, interrupted)
        state.timestamp = ended
        task_run = TaskRun(
            id=task_run_id, name=name, flow_run_id=flow_run.id, task_key=prefect_task.task_key,
            dynamic_key=str(uuid4()), task_version=prefect_task.version,
            empirical_policy=TaskRunPolicy(retries=0), tags=list(prefect_task.tags), labels={}, task_inputs={},
            state=state, state_type=state.type, state_name=state.name, run_count=1, flow_run_run_count=1,
            expected_start_time=started, start_time=started, end_time=ended, total_run_time=ended - started)
        emit_task_run_state_change_event(task_run=task_run, initial_state=None, validated_state=state)
        return True
    except Exception as exc:  # the UI misses a task run; the refit goes on
        log.warning("could not report the task run of stage %s to Prefect (the UI will not show it): %s: %s",
                    name, type(exc).__name__, exc)
        return False


def _final_state(details, error: BaseException | None, interrupted: bool):
    """The Prefect state of a stage that ended with ``error``, as the stage table tells it (``stage_status``)."""
    from prefect.states import Cancelled, Completed, Failed

    if error is None:
        return Completed(state_details=details)
    status = stage_status(error, interrupted)
    if status == INTERRUPTED:
        return Cancelled(name="Interrupted", message=str(error), state_details=details)
    if status == CANCELLED:
        return Cancelled(message=str(error), state_details=details)
    return Failed(message=str(error) or type(error).__name__, state_details=details)


# -- flow-run heartbeats ------------------------------------------------------------------------------------


@contextmanager
def send_heartbeats(engine, join_on_exit: bool = True) -> Iterator[None]:
    """What Prefect's ``_send_heartbeats`` does (a ``prefect.flow-run.heartbeat`` event every
    ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds, how a server tells a dead run from a slow one), from a
    thread waiting on an event, so it stops the moment the run ends."""
    from prefect.flow_engine import MINIMUM_HEARTBEAT_INTERVAL

    interval = engine.heartbeat_seconds
    if interval is None:
        yield
        return
    interval = max(interval, MINIMUM_HEARTBEAT_INTERVAL)
    resource, related = engine._build_heartbeat_event_template()
    stopped = threading.Event()

    def beat() -> None:
        while not stopped.is_set():
            run = engine.flow_run
            if run is not None and run.state is not None and run.state.is_final():
                return
            try:
                engine._emit_flow_run_heartbeat(resource, related)
            except Exception:  # a missed heartbeat is not the run's failure
                log.debug("could not emit a flow-run heartbeat", exc_info=True)
            stopped.wait(interval)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,), name="flow-heartbeat",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        stopped.set()
        if join_on_exit:
            thread.join(timeout=2)


def install_heartbeats() -> None:
    """Every flow run of this process sends its heartbeats with ``send_heartbeats`` (``check_prefect`` has made
    sure the engine has what it needs)."""
    import prefect.flow_engine as engine

    engine._send_heartbeats = send_heartbeats


# -- the node agent's runs ----------------------------------------------------------------------------------


def run_claimed_flow(flow, flow_run, parameters: dict):
    """Run a flow run the agent claimed, in this process, with Prefect's flow engine; its final State."""
    from prefect.flow_engine import run_flow

    return run_flow(flow, flow_run=flow_run, parameters=parameters, return_type="state")
