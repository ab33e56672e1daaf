"""The Prefect API a command-line run talks to: the configured server, the local one, or a private one.

With ``PREFECT_API_URL`` set, runs report to that server. Without it
(``CANONICAL_REFIT_API_MODE``):

* ``local`` (the default): the local Prefect server of this ``PREFECT_HOME``
  (``flows.local_server``), started by the first command that needs it and
  reused by the next ones, which then pay no server start-up. A line on
  stderr says which server a command uses and how to stop it; it stops by
  itself after ``CANONICAL_REFIT_API_IDLE_S`` seconds unused (default 1800).
* ``private``: a private API server for this command only (SQLite in
  ``PREFECT_HOME``, a free loopback port, telemetry off), in its own session
  so a Ctrl-C meant for the command does not kill the server the command
  still reports its final state to, and stopped when the command ends. The
  kernel stops it too if the command is killed (``kill -9`` included): it is
  started with a parent-death signal.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator, Literal

from pydantic import Field

from storage.settings import Settings, settings_config

log = logging.getLogger("canonical_refit.api")


def notice(message: str) -> None:
    """One line on stderr that a user must see whatever logging is set up (a command's first lines run
    before Prefect configures its handlers)."""
    print(f"canonical-refit: {message}", file=sys.stderr, flush=True)
STARTUP_TIMEOUT_S = 120


class ApiSettings(Settings):
    """Which Prefect API a command uses when ``PREFECT_API_URL`` is not set (env prefix ``CANONICAL_REFIT_API_``)."""

    model_config = settings_config("CANONICAL_REFIT_API_")

    mode: Literal["local", "private"] = Field(
        "local", description="local: start (or reuse) the local Prefect server of PREFECT_HOME, kept for later "
                             "commands; private: a server for this command only, stopped when it ends")
    idle_s: float = Field(1800.0, gt=0, description="local: seconds unused after which the local server stops")


_preselected: list = []  # the local server found before Prefect was imported (preselect_local_server)


def preselect_local_server() -> None:
    """Before Prefect is imported: point ``PREFECT_API_URL`` at the running local server, if one runs and
    nothing else is configured, so Prefect's settings are built once, already right.

    Saves a command re-reading its settings twice (half a second). Anything
    configured wins: ``PREFECT_API_URL`` in the environment, a profile that
    mentions it, ``CANONICAL_REFIT_API_MODE=private``; then nothing is done
    here and ``prefect_api`` decides as usual.
    """
    from pathlib import Path

    from flows import local_server

    if "prefect" in sys.modules or os.environ.get("PREFECT_API_URL") or ApiSettings().mode != "local":
        return
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        if "PREFECT_API_URL" in profiles.read_text():
            return
    except OSError:
        pass
    record = local_server.running_server(home)
    if record is not None:
        os.environ["PREFECT_API_URL"] = record.url
        _preselected[:] = [record]


def configured_api_url() -> str | None:
    """The API URL of the current Prefect settings (None: no server configured)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else None


def _die_with_parent(parent: int) -> None:
    """In the child before exec: receive SIGTERM when the parent dies (Linux), and exit if it already did."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the command's own exit path still stops the server
        return
    if os.getppid() != parent:
        os._exit(1)


def _server_class():
    import prefect
    from prefect.server.api.server import SubprocessASGIServer

    from flows.local_server import server_environment

    class PrivateServer(SubprocessASGIServer):
        """Prefect's subprocess API server: its own session, telemetry off, dying with the command."""

        def _run_uvicorn_command(self) -> subprocess.Popen:
            env = {**server_environment(), "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                   "PREFECT__SERVER_FINAL": "1"}
            parent = os.getpid()
            return subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                 "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "error", "--lifespan", "on"],
                env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=lambda: _die_with_parent(parent))

    return PrivateServer


class Api:
    """The API a command reports to; lower ``drain_timeout_s`` to stop waiting for a dead one sooner."""

    def __init__(self, url: str, kind: str):
        self.url, self.kind, self.drain_timeout_s = url, kind, 10.0

    @property
    def private(self) -> bool:
        return self.kind == "private"


@contextmanager
def prefect_api(settings: ApiSettings | None = None) -> Iterator[Api]:
    """Inside, Prefect talks to the configured server, the local one, or a private one (see the module)."""
    url = configured_api_url()
    if _preselected and url == _preselected[0].url:  # the local server, found before Prefect was imported
        record = _preselected[0]
        notice(f"no PREFECT_API_URL: using the local Prefect server at {record.url} (pid {record.pid}, UI "
               f"{record.ui_url}; stop it with: python -m flows.local_server stop)")
        from flows import local_server

        with local_server.lease():
            api = Api(url, "local")
            try:
                yield api
            finally:
                drain_workers(api.drain_timeout_s)
        return
    if url:
        api = Api(url, "configured")
        try:
            yield api
        finally:  # the command exits without Prefect's exit handlers (flows.cli.exit_with): send what is queued
            drain_workers(api.drain_timeout_s)
        return
    settings = settings or ApiSettings()
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if settings.mode == "local":
        from flows import local_server

        record, started = local_server.ensure_running(idle_s=settings.idle_s, timeout_s=STARTUP_TIMEOUT_S)
        if started:
            notice(f"no PREFECT_API_URL: started a local Prefect server for this and later commands at "
                   f"{record.url} (pid {record.pid}, UI {record.ui_url}); it stops after "
                   f"{settings.idle_s / 60:.0f} min unused, or now with: {local_server.STOP_COMMAND}")
        else:
            notice(f"no PREFECT_API_URL: using the local Prefect server at {record.url} (pid {record.pid}, UI "
                   f"{record.ui_url}; stop it with: {local_server.STOP_COMMAND})")
        with local_server.lease(), reporting_to(record.url) as api:
            api.kind = "local"
            yield api
        return
    server = _server_class()(port=_free_port())
    notice("no PREFECT_API_URL: starting a private Prefect API for this command (CANONICAL_REFIT_API_MODE="
           "private; set PREFECT_API_URL to report to a running server instead)")
    server.start(timeout=STARTUP_TIMEOUT_S)
    try:
        with reporting_to(server.api_url) as api:
            api.kind = "private"
            yield api
    finally:
        server.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def reporting_to(url: str) -> Iterator[Api]:
    """Point this process's Prefect settings at ``url`` (every thread's, not only this context's); drain the
    logs and events at the end."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api = Api(url, "")
    # the process-wide settings too: threads that do not carry this context (stage workers reporting
    # progress) fall back to them, and would otherwise start a temporary server of their own
    os.environ["PREFECT_API_URL"] = url
    refresh_global_settings_context()
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            try:
                yield api
            finally:
                drain_workers(api.drain_timeout_s)
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        refresh_global_settings_context()


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
