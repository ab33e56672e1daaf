"""How a plain stage function becomes a Prefect task: name, retries, caching, measurement."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE

from storage.errors import RefitError

F = TypeVar("F", bound=Callable)


def transient_only(task, task_run, state) -> bool:
    """Retry condition: only transient errors, and never once the checkpoint was touched."""
    try:
        state.result()
    except RefitError as exc:
        return exc.transient and not exc.mutation_started
    except Exception:
        return False
    return False


def stage_task(name: str, fn: F, *, read_only: bool) -> F:
    """Wrap ``fn(rx, ...)`` as the Prefect task named like its stage in SPEC section 8.

    Read-only stages retry transient errors (object-storage requests already
    retry with backoff underneath; this covers a stage-wide hiccup). Mutating
    stages are never retried or cached: a second attempt could act on a
    half-written checkpoint.
    """

    @functools.wraps(fn)
    def measured(rx, *args, **kwargs):
        with rx.stage(name) as record:
            result = fn(rx, *args, **kwargs)
            record.bytes = int(getattr(result, "bytes", 0) or 0)
            record.detail = str(getattr(result, "summary", "") or "")
            return result

    return task(
        name=name,
        task_run_name=name,
        cache_policy=NO_CACHE,
        persist_result=False,
        retries=2 if read_only else 0,
        retry_delay_seconds=[1, 4] if read_only else 0,
        retry_condition_fn=transient_only if read_only else None,
    )(measured)
