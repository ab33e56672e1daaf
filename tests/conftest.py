"""Shared fixtures: isolated Prefect state, tiny models, a lab that publishes and refits.

Prefect is isolated before it is imported: a temporary ``PREFECT_HOME``,
analytics off, and (for tests that run flows) a session-scoped
``prefect_test_harness``, so no test touches a developer's Prefect database.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_PREFECT_HOME = tempfile.mkdtemp(prefix="canonical-refit-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.5")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "canonical_refit")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # stage helpers log from threads
for key in [k for k in os.environ if k.startswith("CANONICAL_REFIT_") or k.startswith("AWS_")]:
    del os.environ[key]  # the tests build every setting themselves

ROOT = Path(__file__).resolve().parents[1]  # tests is a package: pytest puts the repository root on the path

import pytest  # noqa: E402

from tests.support.lab import Lab, tiny_shape  # noqa: E402


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: two workers per test run, more on a bigger machine (at most four: each has its own
    Prefect server, S3 server and stores, and most tests wait on processes rather than compute)."""
    return max(1, min(4, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def prefect_api():
    """The session's Prefect API for tests that run flows: the local server of the session's PREFECT_HOME.

    It is the server a command without ``PREFECT_API_URL`` starts and reuses
    (``flows.local_server``), started once here: CLI commands the tests run
    with this PREFECT_HOME find it too. Stopped at the end of the session.
    """
    from flows import local_server
    from flows.prefect_api import reporting_to

    record, _ = local_server.ensure_running(idle_s=7200, timeout_s=180)
    try:
        # every thread's settings, as a command's: a stage's worker thread must not start a server of its own
        with local_server.lease(), reporting_to(record.url):
            yield record.url
    finally:
        local_server.stop()


@pytest.fixture
def lab(tmp_path) -> Lab:
    """A catalog, a trainer and a receiver cache under ``tmp_path`` (file:// storage)."""
    return Lab(tmp_path, shape=tiny_shape())


@pytest.fixture
def flow_lab(prefect_api, tmp_path) -> Lab:
    """Like ``lab``, for tests that run the Prefect flows."""
    return Lab(tmp_path, shape=tiny_shape())
