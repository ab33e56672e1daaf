"""The process set-up of a command that runs a flow, done once before Prefect is imported.

Prefect reads its logging settings when it is imported, so these defaults
must be in the environment first. The entry points that run a flow call
``bootstrap()`` before anything imports Prefect (``python -m flows.refit``
for a refit or the demo, ``python -m flows.publish`` for a publication,
``python -m deployments.serve``), and so do the flow modules themselves
(``flows.refit``, ``flows.publish``) for a program that imports a flow
directly. A command that runs no flow (``status``, ``recover``, ``--help``,
``flows.fleet``) never calls it and never imports Prefect. Prefect-free:
nothing here imports it.
"""

from __future__ import annotations

import logging
import os

ENVIRONMENT = {
    # the product's own log lines go to the flow run's logs too
    "PREFECT_LOGGING_EXTRA_LOGGERS": "canonical_refit",
    # stage helpers log from worker threads, outside any run context: keep those lines local
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}


def bootstrap() -> None:
    """Set Prefect's environment defaults (a value already set wins) and the product's log level; idempotent."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    logging.getLogger("canonical_refit").setLevel(logging.INFO)  # Prefect leaves extra loggers at WARNING
