"""How a refit ended: its status, its final Prefect state, whether it is retried, and what to run next.

Every command a result prints as ``next:`` is built here and works as printed.
"""

from __future__ import annotations

from prefect.states import Cancelled, Completed, Failed, State

from flows.report import FAILED, INTERRUPTED, POISONED, READY, SKIPPED, RefitResult
from storage.errors import Interrupted, RefitError
from storage.retry import transient
from storage.settings import RefitParams
from tasks.install import recover_command
from tasks.receiver import Receiver


def retryable_run(result: RefitResult) -> bool:
    """A failed run is retried only for a transient error (never poisoned, interrupted or bad input)."""
    return result.status == FAILED and transient(result.exception, rolled_back=True)


def outcome_of(rx: Receiver, error: BaseException) -> str:
    """The status a failed run ends in."""
    try:
        poisoned = rx.store.exists and rx.store.poisoned() is not None
    except RefitError:  # a malformed poisoned.json: the receiver must be treated as poisoned
        poisoned = True
    if poisoned and not isinstance(error, Interrupted):
        return POISONED
    if isinstance(error, (Interrupted, KeyboardInterrupt)) or rx.stop.interrupted:
        return INTERRUPTED
    return FAILED


def next_step(rx: Receiver, status: str, error: BaseException | None) -> str | None:
    """What the operator does next, as a command that works as printed."""
    params = rx.params
    if status == POISONED:
        return f"{recover_command(params)}  (re-installs through the installer the node was poisoned with)"
    if status == INTERRUPTED:
        return next_step_after_interrupt(params)
    if status == READY and not rx.params.activate:
        current = rx.store.current()
        return (f"python -m flows.refit activate --model {params.model} --cache-dir {params.cache_dir} "
                f"--version {current.version if current else params.target}")
    if status == FAILED and error is not None:
        local = getattr(error, "local_file", None)
        if isinstance(error, RefitError) and getattr(error, "discarded", False):
            return (f"the local copy {local} was discarded and is downloaded again by the next run; if the "
                    "published object itself is wrong, restore it (or publish a corrected revision), then run "
                    f"the refit again: {refit_command(params)}")
        return f"fix the cause above, then run the refit again: {refit_command(params)}"
    return None


def next_step_after_interrupt(params: RefitParams) -> str:
    return f"run the refit again; the store recovers by itself: {refit_command(params)}"


def refit_command(params: RefitParams) -> str:
    """The CLI command that repeats this refit."""
    parts = ["python -m flows.refit", f"--catalog {params.catalog}", f"--model {params.model}",
             f"--cache-dir {params.cache_dir}", f"--target {params.target}"]
    if params.seed_checkpoint:
        parts.append(f"--seed-checkpoint {params.seed_checkpoint}")
    return " ".join(parts)


def final_state(result: RefitResult) -> State:
    """The flow run's final state: Ready, Skipped, Failed, Poisoned or Interrupted, carrying the result."""
    if result.status == READY:
        return Completed(name="Ready", message=f"{result.version} {result.target_digest}", data=result)
    if result.status == SKIPPED:
        return Completed(name="Skipped", message=result.notes[-1] if result.notes else "", data=result)
    if result.status == INTERRUPTED:
        return Cancelled(name="Interrupted", message=result.error or "interrupted", data=_carrier(result))
    return Failed(name="Poisoned" if result.status == POISONED else "Failed", message=result.error or "",
                  data=_carrier(result))


def _carrier(result: RefitResult) -> RefitError:
    """Failed states carry an exception (a plain call of the flow raises it), with the result attached."""
    error = RefitError(result.error or result.status)
    error.result = result
    return error


def last_refit_outcome(reset: bool = False) -> State | None:
    """The final state this process's last refit reached, or None; ``reset`` forgets it (before a run). What a
    node agent gives a run that the server kept ``Cancelling`` because it ended before its cancellation
    reached it."""
    from flows.report import forget_last, last_result

    if reset:
        forget_last()
        return None
    result = last_result()
    return final_state(result) if result is not None else None
