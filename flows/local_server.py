"""The local Prefect server: started by the first command that needs one, reused by the commands after it.

    python -m flows.local_server status     # is one running, where, since when, idle for how long
    python -m flows.local_server stop       # stop it now (runs stay in $PREFECT_HOME's database)
    python -m flows.local_server start      # start one ahead of time (the UI shows the runs)

Prefect 3 needs an API for every flow run. With no ``PREFECT_API_URL``, a
command would start a private API server and stop it at its end, paying its
start-up (4 to 17 s on 2 cores) every time. Instead, the first command starts
this one: Prefect's own API app and UI, SQLite in ``PREFECT_HOME``, on a free
loopback port, in a session of its own (the terminal's Ctrl-C does not reach
it). It says so on one line. Later commands find it through its record,
``$PREFECT_HOME/canonical-refit/local-server.json``, and talk to it at once.

It stops by itself once ``idle_s`` (default 30 minutes) have passed with no
request and no live command holding a lease on it (every command using it
leaves a lease file named after its process while it runs, so a long refit
that sends nothing for a while keeps it up). A killed command leaves its
lease behind; the server ignores leases of processes that are gone. Its
runs, their states, stage tables and artifacts stay in the database: start
it again and open the UI to read them.

``CANONICAL_REFIT_API_MODE=private`` keeps the older behaviour: a private
server per command that dies with the command, however it ends.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger("canonical_refit.api")
RECORD = "local-server.json"
DEFAULT_IDLE_S = 1800.0
STARTUP_TIMEOUT_S = 120.0
STOP_COMMAND = "python -m flows.local_server stop"


def state_dir(home: Path | None = None) -> Path:
    """``$PREFECT_HOME/canonical-refit``: the server's record, log, lock and leases."""
    if home is None:
        if "prefect" in sys.modules or not os.environ.get("PREFECT_HOME"):
            from prefect.settings import get_current_settings

            home = Path(get_current_settings().home)
        else:  # PREFECT_HOME is what Prefect would use: no need to import it (seconds) to read a record
            home = Path(os.environ["PREFECT_HOME"])
    return Path(home).expanduser() / "canonical-refit"


def process_start(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), or None if there is no such process.

    With the pid it names one process: a later process reusing the pid has another start time.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # a zombie has exited: only its parent has not reaped it
        return None
    return int(fields[19])


@dataclass(frozen=True)
class ServerRecord:
    """What a running local server wrote about itself."""

    pid: int
    start: int | None
    url: str  # the API URL (…/api)
    started_at_unix_ms: int
    idle_s: float
    log: str

    @property
    def ui_url(self) -> str:
        return self.url.removesuffix("/api")

    def alive(self) -> bool:
        return process_start(self.pid) == self.start and self.start is not None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """True if the API answers its health check (plain ``http.client``: commands ask before importing)."""
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(self.url)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
        try:
            connection.request("GET", f"{url.path}/health")
            return connection.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()


@functools.cache
def strict_record() -> type[ServerRecord]:
    """``ServerRecord`` as the strict record of ``local-server.json`` (a pydantic dataclass built on first use:
    a command asks for its server before it imports pydantic). No unknown key: the file is this program's
    own, and a record it refuses only means no server is known (a new one is started)."""
    from pydantic import ConfigDict
    from pydantic.dataclasses import dataclass as strict_dataclass

    return strict_dataclass(ServerRecord, frozen=True, config=ConfigDict(strict=True, extra="forbid"))


def load_record(folder: Path) -> ServerRecord | None:
    """The server record in ``folder``, or None if there is none; ``FormatError`` naming the file if refused."""
    from storage.jsonio import bounded_json  # here, not at the top: a command asks for its server before importing
    from storage.errors import FormatError

    path = folder / RECORD
    record = bounded_json.read_record(path, strict_record(), bounded_json.RECORD, error=FormatError,
                                      missing_ok=True, hint="; a new server is started in its place")
    return None if record is None else ServerRecord(**asdict(record))  # the plain record: it compares equal


def read_record(folder: Path) -> ServerRecord | None:
    """The server record in ``folder``, or None if there is none or it is refused (logged)."""
    from storage.errors import FormatError

    try:
        return load_record(folder)
    except FormatError as exc:
        log.warning("ignoring the local server's record: %s", exc)
        return None


def _write_record(folder: Path, record: ServerRecord) -> None:
    tmp = folder / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, folder / RECORD)


def running_server(home: Path | None = None) -> ServerRecord | None:
    """The local server of this ``PREFECT_HOME`` if one runs and answers, else None."""
    record = read_record(state_dir(home))
    return record if record is not None and record.alive() and record.healthy() else None


@contextmanager
def _start_lock(folder: Path) -> Iterator[None]:
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "local-server.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # two commands starting at once start one server
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def server_environment() -> dict[str, str]:
    """The environment of a Prefect server this project starts: no API URL of its own, telemetry off."""
    from prefect.settings import get_current_settings

    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    env.pop("PREFECT_API_URL", None)
    return env


def ensure_running(*, idle_s: float = DEFAULT_IDLE_S, timeout_s: float = STARTUP_TIMEOUT_S) -> tuple[ServerRecord, bool]:
    """The running local server, started now if there is none; and whether this call started it."""
    folder = state_dir()
    found = running_server()
    if found is not None:
        return found, False
    with _start_lock(folder):
        found = running_server()  # another command may have started it while this one waited
        if found is not None:
            return found, False
        log_path = folder / "local-server.log"
        with open(log_path, "ab") as out:
            child = subprocess.Popen(
                [sys.executable, "-m", "flows.local_server", "run", "--idle", str(idle_s)],
                env=server_environment(), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = read_record(folder)
            if record is not None and record.pid == child.pid and record.healthy():
                return record, True
            if child.poll() is not None:
                break
            time.sleep(0.05)
        if child.poll() is None:
            child.kill()
        child.wait()
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        raise RuntimeError(f"the local Prefect server did not start within {timeout_s:.0f}s (exit code "
                           f"{child.returncode}); its log, {log_path}, ends with:\n{tail}")


@contextmanager
def lease(folder: Path | None = None) -> Iterator[None]:
    """While inside, this process counts as a user of the local server (it does not stop as idle)."""
    leases = (folder or state_dir()) / "leases"
    leases.mkdir(parents=True, exist_ok=True)
    path = leases / f"{os.getpid()}-{process_start(os.getpid())}"
    path.touch()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def live_leases(folder: Path) -> int:
    """How many processes hold a lease now (the leases of processes that are gone are removed)."""
    count = 0
    for path in (folder / "leases").glob("*-*"):
        pid, _, start = path.name.partition("-")
        if pid.isdigit() and str(process_start(int(pid))) == start:
            count += 1
        else:
            path.unlink(missing_ok=True)
    return count


def stop(home: Path | None = None, *, timeout_s: float = 30.0) -> ServerRecord | None:
    """Stop the local server of this ``PREFECT_HOME``; the record of the one stopped (None: none ran)."""
    folder = state_dir(home)
    record = read_record(folder)
    if record is None or not record.alive():
        (folder / RECORD).unlink(missing_ok=True)
        return None
    os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while record.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if record.alive():
        os.kill(record.pid, signal.SIGKILL)
    try:
        os.waitpid(record.pid, os.WNOHANG)  # reap it if this process started it
    except ChildProcessError:
        pass
    (folder / RECORD).unlink(missing_ok=True)
    return record


# -- the server process ---------------------------------------------------------------------------


class _Activity:
    """An ASGI wrapper that remembers when the last request ended (and how many are open)."""

    def __init__(self, app):
        self.app, self.open, self.last = app, 0, time.monotonic()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        self.open += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.open -= 1
            self.last = time.monotonic()


def _with_ui(app):
    """Prefect's ephemeral app (its in-process services: task-run recorder, triggers) with the UI mounted.

    Prefect serves the UI only from a non-ephemeral app, whose lifespan runs
    every background service; a person reading a local run needs the UI, not
    the scheduler. Best effort: without it the API still serves.
    """
    try:
        from starlette.routing import Mount

        from prefect.server.api.server import create_ui_app

        for index, route in enumerate(app.router.routes):
            if isinstance(route, Mount) and route.name == "ui":
                app.router.routes[index] = Mount("/", app=create_ui_app(False), name="ui")
    except Exception as exc:  # an older or newer Prefect: no UI, the API is what counts
        log.warning("the local server runs without its UI: %s", exc)
    return app


def serve(idle_s: float) -> int:
    """The server process: Prefect's API on a free loopback port until idle for ``idle_s`` or SIGTERM."""
    import uvicorn

    from prefect.server.api.server import create_app

    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    activity = _Activity(_with_ui(create_app(ephemeral=True, final=True)))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(activity, log_level="error", lifespan="on",
                                            timeout_graceful_shutdown=5))
    record = ServerRecord(pid=os.getpid(), start=process_start(os.getpid()), url=f"http://127.0.0.1:{port}/api",
                          started_at_unix_ms=int(time.time() * 1000), idle_s=idle_s,
                          log=str(folder / "local-server.log"))

    def watch() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        _write_record(folder, record)  # only now: a command that reads it can use the server at once
        while not server.should_exit:
            time.sleep(1.0)
            if activity.open or live_leases(folder):
                activity.last = time.monotonic()
            elif time.monotonic() - activity.last > idle_s:
                print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} unused for {idle_s:.0f}s: stopping", flush=True)
                server.should_exit = True

    threading.Thread(target=watch, name="idle-watch", daemon=True).start()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} local Prefect server pid {os.getpid()} on {record.url}",
          flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        if read_record(folder) == record:
            (folder / RECORD).unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.local_server", description=(
        "The local Prefect server that commands start when no PREFECT_API_URL is set, and reuse."))
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status", help="print the running server's URL, pid and age (exit 1: none runs)")
    commands.add_parser("stop", help="stop the running server (its runs stay in PREFECT_HOME's database)")
    start = commands.add_parser("start", help="start the server now, if none runs")
    run = commands.add_parser("run", help="be the server (what `start` runs in the background)")
    for sub in (start, run):
        sub.add_argument("--idle", type=float, default=DEFAULT_IDLE_S,
                         help=f"stop after this many seconds unused (default {DEFAULT_IDLE_S:.0f})")
    args = parser.parse_args(argv)
    if args.command == "run":
        return serve(args.idle)
    if args.command == "start":
        record, started = ensure_running(idle_s=args.idle)
        print(f"{'started' if started else 'already running'}: {record.url} (pid {record.pid}; UI "
              f"{record.ui_url}); stop it with: {STOP_COMMAND}")
        return 0
    if args.command == "stop":
        record = stop()
        print(f"stopped the local Prefect server {record.url} (pid {record.pid})" if record else
              "no local Prefect server runs for this PREFECT_HOME")
        return 0
    record = running_server()
    if record is None:
        print("no local Prefect server runs for this PREFECT_HOME")
        return 1
    age = time.time() - record.started_at_unix_ms / 1000
    print(f"running: {record.url} (pid {record.pid}; UI {record.ui_url}; up {age:.0f}s; stops after "
          f"{record.idle_s:.0f}s unused; log {record.log})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
