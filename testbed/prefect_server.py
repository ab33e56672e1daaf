"""A local Prefect server for the lab, and the small helpers that read runs and events back from it.

``PrefectServer`` runs ``prefect server start`` on 127.0.0.1 at a free port,
UI off, with a ``PREFECT_HOME`` of its own (``ROOT/server-home``; log
``ROOT/server.log``), in its own session: on SQLite in that home
(``database_url=None``: the refit benchmark, the deployment tests) or on a
PostgreSQL database (``Postgres.url``: the fleet lab and the fleet test).
``start`` waits (bounded) for ``/api/health``; ``stop`` ends its process group
(SIGTERM, a bounded wait, SIGKILL). It is also a context manager.
``cpu_seconds`` reads its CPU time, for the per-request costs in docs/fleet.md.
With ``auth_string`` ("user:password") the server runs with Prefect's basic
authentication (``PREFECT_SERVER_API_AUTH_STRING``); ``client_env`` and
``client`` then carry the credentials (``PREFECT_API_AUTH_STRING``), and a
request without them is answered 401 (``/api/health`` excepted).

``prefect_env`` gives a client process its own ``PREFECT_HOME`` (so nothing
touches a developer's database) with analytics off.

The tests start a server on a database Prefect has migrated already (a few
seconds less per start; the benchmarks keep measuring a start from empty):
``migrated_postgres()`` is a fresh PostgreSQL database copied from a template
(``CREATE DATABASE ... TEMPLATE``), and ``PrefectServer(migrated=True)`` on
SQLite starts on a copy of a migrated database file. Each template is made
once per machine and Prefect version (``prefect server database upgrade``),
under a file lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from testbed.processes import free_port, process_cpu_seconds, quiet_env, stop_group, tail, wait_until

PREFECT = str(Path(sys.executable).with_name("prefect"))
FINAL_STATE_TYPES = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
TEMPLATES = Path(tempfile.gettempdir()) / "canonical-refit-prefect-templates"


@contextmanager
def _templates_locked():
    TEMPLATES.mkdir(parents=True, exist_ok=True)
    with open(TEMPLATES / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _prefect_version() -> str:
    from importlib.metadata import version

    return version("prefect")


def _migrate(home: Path, database_url: str | None) -> None:
    """``prefect server database upgrade`` of the database at ``database_url`` (None: SQLite in ``home``)."""
    home.mkdir(parents=True, exist_ok=True)
    database = {"PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url} if database_url else {}
    done = subprocess.run([PREFECT, "server", "database", "upgrade", "-y"], cwd=home, capture_output=True,
                          text=True, timeout=300, env=quiet_env(PREFECT_HOME=str(home), **database))
    if done.returncode != 0:
        raise RuntimeError(f"prefect server database upgrade exited {done.returncode}:\n{done.stdout[-2000:]}"
                           f"\n{done.stderr[-2000:]}")


def sqlite_template() -> Path:
    """A SQLite database file Prefect (this version) has migrated; made once per machine."""
    path = TEMPLATES / f"prefect-{_prefect_version()}.db"
    with _templates_locked():
        if not path.exists():
            build = TEMPLATES / f"build-{uuid.uuid4().hex[:8]}"
            try:
                _migrate(build, None)
                os.replace(build / "prefect.db", path)
            finally:
                shutil.rmtree(build, ignore_errors=True)
    return path


def migrated_postgres():
    """A fresh PostgreSQL database of its own (``testbed.postgres.Postgres``, created: drop it after), a copy of
    a template Prefect (this version) has migrated; the template is made once per machine."""
    import re

    from testbed.postgres import Postgres

    template = Postgres("refit_template_" + re.sub(r"[^a-z0-9]", "_", _prefect_version().lower())[:40])
    with _templates_locked():
        if not template.exists():
            build, home = Postgres().create(), TEMPLATES / f"build-{uuid.uuid4().hex[:8]}"
            try:
                _migrate(home, build.url)
                build.rename(template.name)
                build.seal()
            except BaseException:
                build.drop()
                raise
            finally:
                shutil.rmtree(home, ignore_errors=True)
        return Postgres().create(template=template.name)


def prefect_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """Environment overrides for a process that runs Prefect flows in isolation."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


class PrefectServer:
    """``prefect server start`` on 127.0.0.1, its own PREFECT_HOME, UI off: on PostgreSQL (``database_url``) or, with
    None, on SQLite in its home. ``start``/``stop``, or a ``with`` block."""

    def __init__(self, root: Path, database_url: str | None = None, *, extra_env: dict[str, str] | None = None,
                 args: tuple[str, ...] = (), auth_string: str | None = None, migrated: bool = False):
        self.root = Path(root)
        self.auth_string = auth_string  # "user:password": Prefect's basic authentication on, for every client
        self.args = tuple(args)  # more `prefect server start` flags (e.g. --no-services)
        self.home = self.root / "server-home"
        self.log = self.root / "server.log"
        self.database_url = database_url
        self.extra_env = dict(extra_env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.migrated = migrated  # on SQLite: start on a copy of a migrated database (sqlite_template)

    def start(self, timeout_s: float = 180.0) -> "PrefectServer":
        import httpx

        self.home.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        if self.migrated and not self.database_url and not (self.home / "prefect.db").exists():
            shutil.copyfile(sqlite_template(), self.home / "prefect.db")
        database = {"PREFECT_SERVER_DATABASE_CONNECTION_URL": self.database_url} if self.database_url else {}
        auth = {"PREFECT_SERVER_API_AUTH_STRING": self.auth_string} if self.auth_string else {}
        env = quiet_env(**{"PREFECT_HOME": str(self.home), "PREFECT_UI_ENABLED": "false", **database, **auth,
                           **self.extra_env})
        started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port),
                                          *self.args],
                                         env=env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.proc.returncode}\n{tail(self.log)}")
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until("the Prefect server to be healthy", healthy, timeout_s, every_s=0.25,
                       diagnostics=lambda: tail(self.log))
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def stop(self) -> None:
        stop_group(self.proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid)

    def client_env(self, home: Path, api_url: str | None = None, **extra: str) -> dict[str, str]:
        """Environment of a client process of this server (own PREFECT_HOME; ``api_url`` e.g. a tap's; the
        credentials when the server has authentication on)."""
        Path(home).mkdir(parents=True, exist_ok=True)
        auth = {"PREFECT_API_AUTH_STRING": self.auth_string} if self.auth_string else {}
        return quiet_env(PREFECT_API_URL=api_url or self.url, PREFECT_HOME=str(home), **auth, **extra)

    def headers(self) -> dict[str, str]:
        """HTTP headers of a request to this server's API (its basic authentication, if on)."""
        return auth_headers(self.auth_string)

    def __enter__(self) -> "PrefectServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.url, auth_string=self.auth_string)


def auth_headers(auth_string: str | None) -> dict[str, str]:
    """The ``Authorization`` header of Prefect's basic authentication for ``auth_string``; none for None."""
    import base64

    if not auth_string:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(auth_string.encode()).decode()}


# -- reading runs back ---------------------------------------------------------------------------------------


def deployment_ids(client, names: list[str]) -> dict[str, object] | None:
    """Deployment ids by name, or None while one is missing."""
    from prefect.exceptions import ObjectNotFound

    try:
        return {name: client.read_deployment_by_name(name).id for name in names}
    except ObjectNotFound:
        return None


def runs_of(client, deployment_ids_: list) -> list:
    """Flow runs of the deployments, oldest first."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=list(deployment_ids_))),
                                 limit=200)
    return sorted(runs, key=lambda r: r.created)


def target_of(run) -> str | None:
    return ((run.parameters or {}).get("params") or {}).get("target")


def is_final(run) -> bool:
    return run.state_type is not None and run.state_type.value in FINAL_STATE_TYPES


def published_events(client_url: str, since_iso: str, auth_string: str | None = None) -> list[dict]:
    """``canonical-refit.revision.published`` events the server has stored since ``since_iso`` (oldest first)."""
    import httpx

    body = {"filter": {"event": {"name": ["canonical-refit.revision.published"]},
                       "occurred": {"since": since_iso}, "order": "ASC"}, "limit": 50}
    response = httpx.post(f"{client_url}/events/filter", json=body, timeout=10, headers=auth_headers(auth_string))
    response.raise_for_status()
    return response.json().get("events", [])


def parse_time(value) -> float:
    """An API timestamp (datetime or ISO string) as Unix seconds."""
    from datetime import datetime

    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return value.timestamp()
