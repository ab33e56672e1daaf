"""How a refit ended: its outcome (built once, ``settle``), its final Prefect state, whether it is retried, and
what to run next.

Every command a result prints as ``next:`` is built here and works as
printed: the command first, then why in parentheses. A refit command names
the node (``--node``) and every option the run had that differs from its
default (catalog, model, store, seed, installer and engines, S3 endpoint,
...), so pasting it on that host changes that node and no other: nothing is
taken from the host name or the environment of the shell it is pasted in.
Secrets (the engines' API key, storage credentials) are never printed; they
come from the environment as they did for the run.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from flows.report import (
    FAILED, INTERRUPTED, POISONED, READY, SKIPPED, Attempt, RefitResult, Status, build_result, current_watch,
    watch_next_run,
)
from storage.errors import Interrupted, RefitError, StageDeadlineExceeded
from storage.retry import transient
from storage.settings import RefitParams
from tasks.receiver import Receiver

if TYPE_CHECKING:  # Prefect is imported by final_state only: the outcome is built without it
    from prefect.states import State


def retryable_run(result: RefitResult | Attempt) -> bool:
    """A failed run (or attempt) is retried only for a transient error (never poisoned, interrupted or bad
    input)."""
    return result.status == FAILED and transient(result.exception, rolled_back=True)


def settle(params: RefitParams, attempts: list[Attempt], *, interrupted: bool = False) -> RefitResult:
    """The run's outcome, built once after its last attempt from that attempt's receiver and the store's records.

    ``interrupted``: the run was stopped while it waited to try again (the
    last attempt's error is kept, the status is ``INTERRUPTED``). Earlier
    attempts are listed, and each failed one noted, before the last one's notes.
    """
    last = attempts[-1]
    status = INTERRUPTED if interrupted else last.status
    return build_result(
        last.rx, status, last.exception, activated=params.activate and status == READY, target=params.target,
        next_step=next_step(last.rx, status, last.exception), attempts=[a.row() for a in attempts],
        notes_before=[f"attempt {a.number} failed ({a.row()['error']}); retried the whole run" for a in attempts[:-1]])


def outcome_of(rx: Receiver, error: BaseException) -> Status:
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


def next_step(rx: Receiver, status: Status, error: BaseException | None) -> str | None:
    """What the operator does next, as a command that works as printed (then why, in parentheses)."""
    params = rx.params
    if status == POISONED:
        return f"{recover_command(params)}  (re-installs through the installer the node was poisoned with)"
    if status == INTERRUPTED:
        return next_step_after_interrupt(params)
    if status == READY and not rx.params.activate:
        current = rx.store.current()
        installer = f" --installer {_quoted(params.installer.kind)}" if params.installer.kind != "none" else ""
        return (f"python -m flows.refit activate --model {_quoted(params.model)} --cache-dir "
                f"{_quoted(params.cache_dir)} --version {_quoted(current.version if current else params.target)}"
                + installer)
    if status == FAILED and error is not None:
        local = getattr(error, "local_file", None)
        if isinstance(error, RefitError) and getattr(error, "discarded", False):
            return (f"{refit_command(params)}  (the local copy {local} was discarded and is downloaded again by "
                    "this run; if the published object itself is wrong, restore it or publish a corrected "
                    "revision first)")
        if isinstance(error, StageDeadlineExceeded):
            return (f"{refit_command(params)}  (the store is back at its last verified version; run the refit "
                    "again, with a longer --stage-deadline-seconds if the stage was only slow)")
        return f"{refit_command(params)}  (fix the cause above first, then run the refit again)"
    return None


def next_step_after_interrupt(params: RefitParams) -> str:
    return f"{refit_command(params)}  (run the refit again; the store recovers by itself)"


# the options a repeated refit carries when the run had them: (field path, its flag, as the field defines it:
# flows/options.py); a boolean's flag is given when the run had the value the flag sets. The node, catalog,
# model, store and target are always given.
def _flagged(*paths: str, model=RefitParams) -> tuple[tuple[str, str], ...]:
    from flows.options import flag_of

    return tuple((path, flag_of(model, path).option()) for path in paths)


_ALWAYS = _flagged("catalog", "model", "node", "cache_dir", "target")
_WHEN_SET = _flagged("seed_checkpoint", "seed_links", "initial_version", "installer.kind", "installer.engine_urls",
                     "storage.endpoint_url", "cache_max_gb", "verify", "only_if_newer", "activate", "lock_timeout_s",
                     "apply_workers", "storage.concurrency", "retries", "retry_delay_s", "stage_deadline_s",
                     "trusted_keys")
REPEATED_OPTIONS = _ALWAYS + _WHEN_SET  # every flag of python -m flows.refit (tests/system/test_next_lines.py checks)
# deprecated flags that do nothing (a stage runs once: storage/retry.py): still parsed, never printed
NOT_REPEATED = ("stage_retries", "stage_retry_delay_s")


def refit_command(params: RefitParams) -> str:
    """The CLI command that repeats this refit on this node: its identity and every option it had that is not
    the default (see the module)."""
    return _command("python -m flows.refit", params, _ALWAYS, _WHEN_SET)


def _recover_flagged(*paths: str) -> tuple[tuple[str, str], ...]:
    from storage.settings import RecoverParams

    return _flagged(*paths, model=RecoverParams)


def recover_command(params: RefitParams) -> str:
    """The command that recovers this node as printed after a poisoned run: the node's store, and its identity
    in the fleet (``--catalog``, ``--node``, the S3 endpoint) so the recovery rewrites that node's status
    record at once. The installer is the one recorded in the poisoned mark: not repeated."""
    return _command("python -m flows.refit recover", params,
                    _recover_flagged("model", "cache_dir", "catalog", "node"),
                    _recover_flagged("storage.endpoint_url", "lock_timeout_s"))


def _command(head: str, params, always, when_set) -> str:
    parts = [head]
    for path, flag in always:
        parts.append(f"{flag} {_quoted(_value(params, path))}")
    for path, flag in when_set:
        if not _has(params, path):  # a setting this version does not have
            continue
        value, default = _value(params, path), _default(params, path)
        if value == default or value is None:
            continue
        if isinstance(value, bool):
            parts.append(flag)
        elif isinstance(value, (list, tuple)):
            parts.extend(f"{flag} {_quoted(item)}" for item in value)
        else:
            parts.append(f"{flag} {_quoted(value)}")
    return " ".join(parts)


def _quoted(value) -> str:
    return shlex.quote(str(value))


def _has(params, path: str) -> bool:
    *parents, name = path.split(".")
    owner = _value(params, ".".join(parents)) if parents else params
    return name in type(owner).model_fields


def _value(params, path: str):
    for name in path.split("."):
        params = getattr(params, name)
    return params


def _default(params, path: str):
    """The value the field takes when nothing sets it (a default factory's own value: the node's host name,
    the number of cores)."""
    *parents, name = path.split(".")
    owner = _value(params, ".".join(parents)) if parents else params
    return type(owner).model_fields[name].get_default(call_default_factory=True)


def final_state(result: RefitResult) -> State:
    """The flow run's final state: Ready or Skipped carrying the outcome; Failed, Poisoned or Interrupted
    carrying the run's own typed error (a plain call of the flow raises it; the outcome itself reaches the
    caller through its watch, ``flows.report.watching``)."""
    from prefect.states import Cancelled, Completed, Failed

    if result.status == READY:
        return Completed(name="Ready", message=f"{result.version} {result.target_digest}", data=result)
    if result.status == SKIPPED:
        return Completed(name="Skipped", message=result.notes[-1] if result.notes else "", data=result)
    error = result.exception
    if result.status == INTERRUPTED:
        error = error if isinstance(error, Interrupted) else Interrupted(result.error or "interrupted")
        return Cancelled(name="Interrupted", message=result.error or "interrupted", data=error)
    if not isinstance(error, Exception):
        error = RefitError(result.error or result.status)
    return Failed(name="Poisoned" if result.status == POISONED else "Failed", message=result.error or "",
                  data=error)


def last_refit_outcome(reset: bool = False) -> State | None:
    """The final state the last refit started in this context reached, or None; ``reset`` (before each run)
    opens a watch for the next one. What a node agent gives a run that the server kept ``Cancelling`` because
    it ended before its cancellation reached it."""
    if reset:
        watch_next_run()
        return None
    watch = current_watch()
    return final_state(watch.outcome) if watch is not None and watch.outcome is not None else None
