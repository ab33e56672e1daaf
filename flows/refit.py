"""The receiver flow: move the local checkpoint to a target revision and install it.

``runbook`` is the one composition of the eight stages (``docs/format.md``,
"Stages of a refit"); the Prefect flow ``refit``, the CLI, the deployments,
the Python API, the tests, the crash harness and the benchmarks all run it.
Inside a flow run each stage is a Prefect task; outside one, the same
functions run plain. Run ``python -m flows.refit --help`` for the CLI; with
no arguments at all it runs the embedded demo (``flows.demo``).
"""

from __future__ import annotations

if __name__ == "__main__":  # the CLI (flows.cli); Prefect is imported only by the commands that run a flow
    from flows.cli import exit_with, main

    exit_with(main())

import logging
import time
from contextlib import contextmanager
from typing import Iterator

from prefect import flow
from prefect.states import State

from flows.report import READY, SKIPPED, Attempt, PrefectReporter, RefitResult, current_watch
from storage.runtime.cancel import StopToken, current_stop, signals_stop_the_run
from storage.errors import Interrupted
from storage.store.flush import flush_in_background
from storage.store.local_store import UPDATING
from storage.runtime.killpoints import killpoint
from storage.patch.pipeline import Arrivals
from storage.patch.reconstruct import roll_back
from storage.settings import RefitParams
from tasks.activate import ACTIVATE
from tasks.apply_deltas import APPLY_DELTAS
from tasks.fetch_buckets import FETCH_BUCKETS, discard_rejected_artifact
from tasks.fetch_index import FETCH_INDEX
from tasks.install import INSTALL, heal_interrupted_install
from tasks.installers import make_installer
from tasks.receiver import Receiver
from tasks.resolve_catalog import RESOLVE_CATALOG
from tasks.seed_checkpoint import SEED_CHECKPOINT
from tasks.verify_digest import VERIFY_DIGEST
from flows.prefect_adapter import flow_run_reporting, unpersisted_results
from flows.node_report import report_node
from flows.outcome import final_state, outcome_of, recover_command, retryable_run, settle
from flows.run_labels import log_outcome, refit_run_name

log = logging.getLogger("canonical_refit.refit")


def runbook(rx: Receiver) -> str:
    """The eight stages in order; returns READY or SKIPPED, raises with the store consistent.

    The exclusive lock covers stages 1-6 and becomes the shared installation
    fence for 7-8. Fetch runs beside apply; it is cancelled and joined before
    anything else touches the store, on every path; only then is a failed
    update rolled back, and only then is the lock released.
    """
    recover = recover_command(rx.params)  # what a refused install names, as the run's next: line does
    with rx.preparation(first=lambda run: heal_interrupted_install(run, recover)) as lock:
        plan = RESOLVE_CATALOG(rx)
        if plan.skip:
            return SKIPPED
        baseline = SEED_CHECKPOINT(rx, plan)
        indexes = FETCH_INDEX(rx, plan, baseline)
        with rolled_back_on_failure(rx, indexes):
            with fetching_beside(rx, plan, baseline, indexes) as arrivals:
                prepared = APPLY_DELTAS(rx, plan, baseline, indexes, arrivals)
            verified = VERIFY_DIGEST(rx, plan, prepared)
        lock.downgrade()
        try:
            receipt = INSTALL(rx, verified, recover)
            if rx.params.activate:
                ACTIVATE(rx, receipt)
        finally:
            # READY without waiting for the disk: the pages are written back in the background, once the engine
            # has the weights (a write-back started earlier makes the install and active.json's fsync queue
            # behind a whole checkpoint of dirty pages)
            flush_in_background(rx.store, verified.checkpoint)
    return READY


@contextmanager
def fetching_beside(rx: Receiver, plan, baseline, indexes) -> Iterator[Arrivals]:
    """Fetch buckets in the background while the body applies what arrives.

    On any way out of the body the fetch is cancelled (unless the body
    finished) and joined: no download outlives this block. A fetch error
    surfaces only if the body succeeded without it.
    """
    arrivals = Arrivals(rx.stop.child())
    running = FETCH_BUCKETS.start(rx, plan, baseline, indexes, arrivals)
    finished = False
    try:
        yield arrivals
        finished = True
    finally:
        if not finished:
            arrivals.cancel()
        running.join()
        arrivals.detach()
        arrivals.stop.close()
    running.result()


@contextmanager
def rolled_back_on_failure(rx: Receiver, indexes) -> Iterator[None]:
    """If the body fails after the store went UPDATING, put the last verified checkpoint back.

    Runs after ``fetching_beside`` has joined the fetch (it is the outer
    block). A cached artifact that failed validation is discarded first, so
    the next run downloads it again. An interrupted run only discards the
    half-written folder (fast); a failed one also rebuilds a lost base from
    the cache when it can.
    """
    try:
        yield
    except BaseException as exc:
        killpoint("rollback.start")
        discard_rejected_artifact(rx, indexes, exc)
        state = rx.store.state()
        if state is not None and state.status == UPDATING:
            interrupted = isinstance(exc, (Interrupted, KeyboardInterrupt)) or rx.stop.interrupted
            outcome = roll_back(rx.store, exc, state.previous, workers=rx.params.apply_workers,
                                rebuild=not interrupted)
            rx.ledger.note(f"{'interrupted' if interrupted else 'failed'} after the store changed; {outcome}")
        raise


def run_refit(params: RefitParams, *, installer=None, reporter: PrefectReporter | None = None,
              stop: StopToken | None = None) -> RefitResult:
    """Run the runbook, retried as a whole after transient failures, into a ``RefitResult`` (never raises for a
    run's failure).

    An attempt that failed for a transient reason (the object store down or
    throttling longer than its request retries) is retried after
    ``retry_delay_s`` (doubled each time), up to ``retries`` times; each
    attempt starts only after the previous one released everything, and
    recovers the store as any run does. Poison, an interrupt and permanent
    errors (bad input, wrong base, a missing object) are never retried.
    ``installer`` defaults to the one ``params.installer`` names. A
    ``KeyboardInterrupt`` (a second Ctrl-C) reaches the caller's watch, then is re-raised.
    The outcome is built once, after the last attempt (``flows.outcome.settle``), and handed to its sinks
    (``deliver``).
    """
    installer = installer or make_installer(params.installer)
    stop = stop or current_stop.get()
    waiting = stop.child()
    attempts: list[Attempt] = []
    policy = params.run_retry_policy()
    interrupted = False

    def attempt(number: int) -> Attempt:
        attempts.append(last := run_attempt(params, installer, reporter, stop, number))
        return last

    def told(number: int, delay: float, last: Attempt) -> None:
        log.warning("refit of %s to %s failed on a transient error (attempt %d of %d); retrying the whole run "
                    "in %.0fs: %s", params.model, params.target, number, policy.attempts, delay, last.exception)

    def pause(delay: float) -> bool:
        nonlocal interrupted
        interrupted = waiting.wait(delay)
        return interrupted

    try:
        policy.repeat(attempt, again=lambda last: not isinstance(last.exception, KeyboardInterrupt)
                      and retryable_run(last), on_retry=told, wait=pause)
    finally:
        waiting.close()
    result = settle(params, attempts, interrupted=interrupted)
    deliver(params, result, attempts[-1].rx, installer, reporter)
    if isinstance(result.exception, KeyboardInterrupt):
        raise result.exception
    return result


def deliver(params: RefitParams, result: RefitResult, rx: Receiver, installer,
            reporter: PrefectReporter | None) -> None:
    """The outcome's sinks, in one place: the node's record and event, the caller's watch (``flows.report``),
    the run's artifacts; the flow returns it as its final state (``final_state``). After a second Ctrl-C only
    the watch hears of it: the process is stopping."""
    stopping = isinstance(result.exception, KeyboardInterrupt)
    if not stopping:
        report_node(params, result, installer)
    watch = current_watch()
    if watch is not None:
        watch.deliver(result)
    if reporter is not None and not stopping:
        reporter.publish_result(result, rx)


def run_attempt(params: RefitParams, installer, reporter: PrefectReporter | None, stop: StopToken | None,
                number: int) -> Attempt:
    """One attempt of the runbook, start to end, with everything it held released."""
    started = time.monotonic()
    rx = Receiver(params, installer=installer, progress=reporter.progress if reporter else None, stop=stop)
    rx.attempt = number
    error: BaseException | None = None
    try:
        status = runbook(rx)
    except BaseException as exc:  # every way a run ends gets a typed, reported result
        error = exc
        status = outcome_of(rx, exc)
    finally:
        rx.close()
    return Attempt(rx, status, error, number, round(time.monotonic() - started, 3))


@flow(name="refit", flow_run_name=refit_run_name, validate_parameters=True,  # "refit NODE: MODEL FROM -> TO"
      persist_result=False, result_storage=unpersisted_results())
def refit(params: RefitParams) -> State:
    """Resolve, seed, fetch, apply, verify, install and activate one target revision."""
    with signals_stop_the_run(), flow_run_reporting():  # Ctrl-C, SIGTERM and Prefect's cancellation stop the
        result = run_refit(params, reporter=PrefectReporter(params.model))  # run; its stages are its task runs
    log_outcome(params.node, params.model, params.target, result)  # a failure at ERROR in the run's logs
    return final_state(result)


