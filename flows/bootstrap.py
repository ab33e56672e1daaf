"""The process set-up of a command that runs a flow: one call, by the entry points, never at import.

``bootstrap()`` does, in order:

1. Prefect's environment defaults (``ENVIRONMENT``; a value already set
   wins). Prefect reads its logging settings when it is imported, so this
   runs before anything imports Prefect.
2. Which Prefect API (``prefer_local_server``): the running local server of
   ``PREFECT_HOME`` when nothing else is configured
   (``flows.prefect_api.preselect_local_server``), also before Prefect is
   imported, so its settings are built once.
3. Logging: the product's logger at INFO; with ``log_to_stderr`` (a
   long-running process: the node agent) the root logger writes to stderr.
4. Prefect itself (``flows.prefect_adapter.start``): the capability check
   (an unsupported Prefect fails here, loudly), the heartbeat sender and the
   product logger's Prefect handlers.

The entry points: ``python -m flows.refit`` (a refit or the demo; ``status``,
``recover``, ``activate`` and ``--help`` run no flow and never call it),
``python -m flows.publish``, ``python -m deployments.serve`` (the node
agent). Importing a flow module sets nothing up: a program that imports
``flows.refit`` or ``flows.api`` keeps its environment and its logging, and
a flow of ours still calls step 4 when it runs (``flow_run_reporting``).
This module imports Prefect only in step 4.
"""

from __future__ import annotations

import logging
import os
import sys

ENVIRONMENT = {
    # the product's own log lines go to the flow run's logs too
    "PREFECT_LOGGING_EXTRA_LOGGERS": "canonical_refit",
    # stage helpers log from worker threads, outside any run context: keep those lines local
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def environment() -> None:
    """Step 1 alone: Prefect's environment defaults (a value already set wins)."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def bootstrap(*, prefer_local_server: bool = False, log_to_stderr: bool = False, prefect: bool = True) -> None:
    """Set this process up to run flows (see the module); idempotent. ``prefect=False`` stops before Prefect is
    imported (a command that may still end without running a flow)."""
    environment()
    if prefer_local_server:
        from flows.prefect_api import preselect_local_server

        preselect_local_server()
    if log_to_stderr:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API request otherwise
    logging.getLogger("canonical_refit").setLevel(logging.INFO)  # Prefect leaves extra loggers at WARNING
    if prefect:
        from flows.prefect_adapter import start

        start()


def bootstrap_command(**options) -> int | None:
    """``bootstrap`` for a command line: None once set up; 1 after one line on stderr saying why not (a Prefect
    this product does not support: ``UnsupportedPrefect`` names its version and what it lacks)."""
    from flows.prefect_adapter import UnsupportedPrefect

    try:
        bootstrap(**options)
    except UnsupportedPrefect as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return None
