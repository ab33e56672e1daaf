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
import random
import threading
import time
from typing import Any, Callable, Generic, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE

from storage.errors import RefitError

log = logging.getLogger("canonical_refit.stage")
R = TypeVar("R")
READ_ONLY_RETRY_DELAYS_S = (1.0, 4.0)


def in_flow_run() -> bool:
    """True inside a Prefect flow run (stages then run as its tasks)."""
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def retryable(exc: BaseException) -> bool:
    """A transient error, raised before the checkpoint was touched."""
    return isinstance(exc, RefitError) and exc.transient and not exc.mutation_started


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
        delays = READ_ONLY_RETRY_DELAYS_S if self.read_only else ()
        for attempt in range(len(delays) + 1):
            if self.interruptible:
                rx.stop.check()
            try:
                with rx.stage(self.name) as record:
                    result = self.fn(rx, *args, **kwargs)
                    record.bytes = int(getattr(result, "bytes", 0) or 0)
                    record.detail = str(getattr(result, "summary", "") or "")
                    return result
            except BaseException as exc:
                if attempt == len(delays) or not retryable(exc):
                    raise
                delay = delays[attempt] * (0.5 + random.random() / 2)
                log.warning("stage %s failed (attempt %d of %d), retrying in %.1fs: %s", self.name, attempt + 1,
                            len(delays) + 1, delay, exc)
                rx.stop.wait(delay)
        raise AssertionError("unreachable")

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


def step(name: str, *, retries: int = 0, retry_delays_s: tuple[float, ...] = (), retry_if=retryable):
    """A plain function that runs as a Prefect task of ``name`` inside a flow run, plainly outside one.

    ``retries`` (with ``retry_delays_s``) re-run it for errors ``retry_if``
    accepts, the same way in both cases.
    """

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def retried(*args, **kwargs) -> R:
            for attempt in range(retries + 1):
                try:
                    return fn(*args, **kwargs)
                except BaseException as exc:
                    if attempt == retries or not retry_if(exc):
                        raise
                    delay = retry_delays_s[min(attempt, len(retry_delays_s) - 1)] if retry_delays_s else 0.0
                    log.warning("%s failed (attempt %d of %d), retrying in %.1fs: %s", name, attempt + 1,
                                retries + 1, delay, exc)
                    time.sleep(delay)
            raise AssertionError("unreachable")

        as_task = task(name=name, task_run_name=name, cache_policy=NO_CACHE, persist_result=False)(retried)

        @functools.wraps(fn)
        def call(*args, **kwargs) -> R:
            return as_task(*args, **kwargs) if in_flow_run() else retried(*args, **kwargs)

        call.fn = fn
        call.task = as_task
        return call

    return decorate
