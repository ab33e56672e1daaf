"""The receiver flow: move the local checkpoint to a target revision and install it (SPEC section 8).

Run ``python -m flows.refit --help`` for the CLI; with no arguments at all it
runs the embedded demo (``flows.demo``).
"""

from __future__ import annotations

import os

os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "canonical_refit")
# stage helpers log from worker threads, outside any run context: keep those lines local
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")

import logging  # noqa: E402

from prefect import flow  # noqa: E402
from prefect.states import Completed, Failed, State  # noqa: E402

from flows.report import FAILED, POISONED, READY, SKIPPED, PrefectReporter, build_result  # noqa: E402
from storage.errors import RefitError  # noqa: E402
from storage.settings import RefitParams  # noqa: E402
from tasks.activate import activate_task  # noqa: E402
from tasks.apply_deltas import apply_deltas_task  # noqa: E402
from tasks.fetch_buckets import fetch_buckets_task  # noqa: E402
from tasks.fetch_index import fetch_index_task  # noqa: E402
from tasks.install import install_task  # noqa: E402
from tasks.installers import make_installer  # noqa: E402
from tasks.receiver import Receiver  # noqa: E402
from tasks.resolve_catalog import resolve_catalog_task  # noqa: E402
from tasks.seed_checkpoint import seed_checkpoint_task  # noqa: E402
from tasks.verify_digest import verify_digest_task  # noqa: E402

logging.getLogger("canonical_refit").setLevel(logging.INFO)  # Prefect leaves extra loggers at WARNING


@flow(name="refit", flow_run_name="refit {params.model} to {params.target}", validate_parameters=True)
def refit(params: RefitParams) -> State:
    """Resolve, seed, fetch, apply, verify, install and activate one target revision."""
    reporter = PrefectReporter(params.model)
    rx = Receiver(params, installer=make_installer(params.installer), progress=reporter.progress)
    try:
        with rx.preparation() as lock:
            plan = resolve_catalog_task(rx)
            if plan.superseded_by:
                return finish(rx, reporter, SKIPPED)
            baseline = seed_checkpoint_task(rx, plan)
            indexes = fetch_index_task(rx, plan, baseline)
            arrivals = rx.arrivals()  # fetch and apply overlap: a bucket is applied once it has arrived
            fetching = fetch_buckets_task.submit(rx, plan, baseline, indexes, arrivals)
            prepared = apply_deltas_task(rx, plan, baseline, indexes, arrivals)
            fetching.result()
            verified = verify_digest_task(rx, plan, prepared)
            lock.downgrade()  # the installation fence: shared from validation to activation
            receipt = install_task(rx, verified)
            if params.activate:
                activate_task(rx, receipt)
        return finish(rx, reporter, READY)
    except Exception as exc:  # every failure ends in a typed, reported final state
        return finish(rx, reporter, POISONED if rx.store.poisoned() else FAILED, exc)


def finish(rx: Receiver, reporter: PrefectReporter, status: str, error: BaseException | None = None) -> State:
    """Publish the run's artifacts and turn its outcome into the flow's final state."""
    rx.release()
    result = build_result(rx, status, error, activated=rx.params.activate and status == READY)
    reporter.publish(rx, result)
    if status == READY:
        return Completed(name="Ready", message=f"{result.version} {result.target_digest}", data=result)
    if status == SKIPPED:
        return Completed(name="Skipped", message=rx.ledger.notes[-1] if rx.ledger.notes else "", data=result)
    if not isinstance(error, RefitError):
        wrapped = RefitError(f"unexpected {type(error).__name__}: {error}")
        wrapped.__cause__, error = error, wrapped
    error.result = result
    return Failed(name="Poisoned" if status == POISONED else "Failed", message=str(error), data=error)


if __name__ == "__main__":
    from flows.cli import main

    raise SystemExit(main(refit_flow=refit))
