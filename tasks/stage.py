"""How a plain stage function becomes a pipeline stage: named, measured, retried, a Prefect task in a flow.

A ``Stage`` runs its function the same way everywhere: measured into the
run's ledger, transient failures of read-only stages retried with backoff
(inside the stage, in the calling thread, so a retry never outlives the
store lock), every attempt checking the run's stop token first. Inside a
Prefect flow run it runs as a task of the same name (one task run per
stage, states and timings in the UI); outside one (the crash harness, a
trainer process, the benchmarks) it runs as the plain function. The
composition that calls the stages is the same either way.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Generic, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE

from storage.retry import RetryPolicy

log = logging.getLogger("canonical_refit.stage")
R = TypeVar("R")


def in_flow_run() -> bool:
    """True inside a Prefect flow run (stages then run as its tasks)."""
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


class Running(Generic[R]):
    """A stage started in the background: ``join`` waits for it to end, ``result`` also returns or raises."""

    def __init__(self, join: Callable[[], None], result: Callable[[], R]):
        self.join, self.result = join, result


class Stage(Generic[R]):
    """One pipeline stage over a plain function ``fn(rx, ...)``.

    ``read_only`` stages (they change nothing in the store, or only caches
    that are safe to write again) retry transient errors; stages that write
    the store never do: a second attempt could act on a half-written state.
    A stage that is not ``interruptible`` runs even when the run was asked to
    stop (activation, once the engine has loaded the new weights).
    """

    def __init__(self, name: str, fn: Callable[..., R], *, read_only: bool, interruptible: bool = True):
        self.name, self.fn, self.read_only, self.interruptible = name, fn, read_only, interruptible
        self.task = task(name=name, task_run_name=name, cache_policy=NO_CACHE, persist_result=False,
                         retries=0)(self._measured)
        functools.update_wrapper(self, fn)

    def _measured(self, rx, *args, **kwargs) -> R:
        policy = rx.params.stage_retry_policy() if self.read_only else RetryPolicy(1, 0.0)

        def attempt() -> R:
            if self.interruptible:
                rx.stop.check()
            with rx.stage(self.name) as record:
                result = self.fn(rx, *args, **kwargs)
                record.bytes = int(getattr(result, "bytes", 0) or 0)
                record.detail = str(getattr(result, "summary", "") or "")
                return result

        return policy.call(f"stage {self.name}", attempt, wait=rx.stop.wait)

    def __call__(self, rx, *args, **kwargs) -> R:
        if in_flow_run():
            return self._task_for(rx)(rx, *args, **kwargs)
        return self._measured(rx, *args, **kwargs)

    def _task_for(self, rx):
        """The task; named with its attempt when the whole run is being retried, so the UI shows each."""
        attempt = getattr(rx, "attempt", 1)
        return self.task if attempt == 1 else self.task.with_options(task_run_name=f"{self.name} (attempt {attempt})")

    def start(self, rx, *args, **kwargs) -> Running[R]:
        """Run the stage beside the caller (a submitted task in a flow run, else a thread)."""
        if in_flow_run():
            future = self._task_for(rx).submit(rx, *args, **kwargs)
            return Running(lambda: future.wait(), lambda: future.result())
        outcome: dict[str, Any] = {}

        def body() -> None:
            try:
                outcome["value"] = self._measured(rx, *args, **kwargs)
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


def stage(name: str, *, read_only: bool) -> Callable[[Callable[..., R]], Stage[R]]:
    """Decorator form: ``@stage("fetch index", read_only=True)`` over the plain function."""
    return lambda fn: Stage(name, fn, read_only=read_only)


def step(name: str, *, retry: Callable[..., RetryPolicy] | None = None):
    """A plain function that runs as a Prefect task of ``name`` inside a flow run, plainly outside one.

    ``retry(*args, **kwargs)`` gives the policy that re-runs it after a
    transient error (from the call's own settings), the same way in both cases.
    """

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def retried(*args, **kwargs) -> R:
            if retry is None:
                return fn(*args, **kwargs)
            return retry(*args, **kwargs).call(name, lambda: fn(*args, **kwargs))

        as_task = task(name=name, task_run_name=name, cache_policy=NO_CACHE, persist_result=False)(retried)

        @functools.wraps(fn)
        def call(*args, **kwargs) -> R:
            return as_task(*args, **kwargs) if in_flow_run() else retried(*args, **kwargs)

        call.fn = fn
        call.task = as_task
        return call

    return decorate
