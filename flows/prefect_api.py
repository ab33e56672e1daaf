"""The Prefect API a command-line run talks to: the configured server, or a private one it starts.

With ``PREFECT_API_URL`` set, runs report to that server. Without it, a
command starts Prefect's API server itself (SQLite in ``PREFECT_HOME``, on a
free loopback port) in its own session — so a Ctrl-C meant for the command
does not kill the server the command still has to report its final state to —
with telemetry off (this machine may have no route out), and stops it when
the command ends. This is what Prefect's "temporary server" does, minus the
two ways it hurt us: dying with the terminal's Ctrl-C (the command then
retried a dead server for minutes) and printing telemetry tracebacks.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger("canonical_refit.api")
STARTUP_TIMEOUT_S = 120


def configured_api_url() -> str | None:
    """The API URL of the current Prefect settings (None: no server configured)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_class():
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class PrivateServer(SubprocessASGIServer):
        """Prefect's subprocess API server, in a session of its own, telemetry off."""

        def _run_uvicorn_command(self) -> subprocess.Popen:
            env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
                   "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
            env.pop("PREFECT_API_URL", None)
            return subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                 "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "error", "--lifespan", "on"],
                env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    return PrivateServer


class Api:
    """The API a command reports to; lower ``drain_timeout_s`` to stop waiting for a dead one sooner."""

    def __init__(self, url: str, private: bool):
        self.url, self.private, self.drain_timeout_s = url, private, 10.0


@contextmanager
def prefect_api() -> Iterator[Api]:
    """Inside, Prefect talks to the configured server, or to a private one started for this command."""
    url = configured_api_url()
    if url:
        yield Api(url, private=False)
        return
    from prefect.context import refresh_global_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    server = _server_class()(port=_free_port())
    log.info("no PREFECT_API_URL: starting a private Prefect API for this command (set PREFECT_API_URL to "
             "report to a running server instead)")
    server.start(timeout=STARTUP_TIMEOUT_S)
    try:
        api = Api(server.api_url, private=True)
        # the process-wide settings too: threads that do not carry this context (stage workers reporting
        # progress) fall back to them, and would otherwise start a temporary server of their own
        os.environ["PREFECT_API_URL"] = server.api_url
        refresh_global_settings_context()
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            try:
                yield api
            finally:
                drain_workers(api.drain_timeout_s)
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        refresh_global_settings_context()
        server.stop()


def drain_workers(timeout_s: float = 10.0) -> bool:
    """Send the logs and events still queued to the API, waiting at most ``timeout_s``; True if all went."""
    import threading

    def drain() -> None:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        try:
            APILogWorker.drain_all(timeout=timeout_s)
        except Exception as exc:  # nothing to drain, or the API is gone: the run's outcome is already printed
            log.debug("log drain: %s", exc)
        try:
            EventsWorker.drain_all(timeout=timeout_s)
        except Exception as exc:
            log.debug("event drain: %s", exc)

    thread = threading.Thread(target=drain, name="prefect-drain", daemon=True)
    thread.start()
    thread.join(timeout_s + 1)
    return not thread.is_alive()
