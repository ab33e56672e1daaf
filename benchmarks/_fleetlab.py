"""A fleet on one machine, for the fleet benchmarks and the fleet test: Prefect on PostgreSQL, node agents, S3, taps.

- ``Postgres``: one fresh database per run (``CREATE DATABASE`` through ``psql``), dropped after.
- ``PrefectServer``: ``prefect server start`` on that database (no SQLite), on a free loopback port, in its
  own session; stopped by its process group. ``cpu_seconds`` reads its CPU time (and ``Postgres.cpu_seconds``
  the database backends'), for the per-request costs in docs/fleet.md.
- ``MotoS3``: moto's S3 server as a subprocess (the benchmarks' own; the tests use ``tests/s3_support.py``).
- ``ApiTap``: a counting TCP proxy in front of the Prefect API, one per node. It forwards bytes untouched
  and parses a copy of what the node sends: every HTTP/1.1 request (method and path, ids folded), and after
  a websocket upgrade every message (an event sent to ``/events/in``). It sees exactly what the server sees
  from that node, without changing the agent.
- ``NodeProcess``: ``python -m deployments.serve --node NAME --name-suffix -NAME ...`` as a process with its
  own cache, Prefect home and log; started, stopped (SIGTERM), killed (SIGKILL) and restarted by PID.
  ``agent_module`` may name a wrapper (``benchmarks._fleetlab agent``) that records stage spans.

Nothing here imports ``tests/``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
PREFECT = str(Path(sys.executable).with_name("prefect"))
FINAL_STATE_TYPES = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_until(what: str, check: Callable[[], object], timeout_s: float, *, every_s: float = 0.2,
               diagnostics: Callable[[], str] = lambda: ""):
    """Poll ``check`` until it returns something truthy; ``TimeoutError`` with ``diagnostics`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{diagnostics()}")
        time.sleep(every_s)


def quiet_env(**extra: str) -> dict[str, str]:
    """This process's environment without receiver, AWS or Prefect settings, analytics off, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CANONICAL_REFIT_", "AWS_", "PREFECT_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1",
               PREFECT_LOGGING_EXTRA_LOGGERS="canonical_refit")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def _stop_group(proc: subprocess.Popen | None, timeout_s: float = 15.0) -> None:
    """SIGTERM, a bounded wait, then SIGKILL to the process group ``proc`` leads (started in its own session)."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def process_rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- PostgreSQL -----------------------------------------------------------------------------------------


class Postgres:
    """One database of its own on the local PostgreSQL server (trust auth), created and dropped through ``psql``."""

    def __init__(self, name: str | None = None, *, host: str = "127.0.0.1", port: int = 5432,
                 user: str = "postgres"):
        self.name = name or f"refit_fleet_{uuid.uuid4().hex[:10]}"
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", self.name):
            raise ValueError(f"database name {self.name!r} is not a plain identifier")
        self.host, self.port, self.user = host, port, user
        self.created = False

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://{self.user}@{self.host}:{self.port}/{self.name}"

    def _psql(self, sql: str) -> str:
        done = subprocess.run(["psql", "-h", self.host, "-p", str(self.port), "-U", self.user, "-d", "postgres",
                               "-v", "ON_ERROR_STOP=1", "-Atqc", sql], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"psql {sql!r}: {done.stderr.strip()}")
        return done.stdout

    def create(self) -> "Postgres":
        self._psql(f"CREATE DATABASE {self.name}")
        self.created = True
        return self

    def drop(self) -> None:
        if self.created:
            self._psql(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")
            self.created = False

    def stats(self) -> dict[str, float]:
        """This database's cumulative counters (``pg_stat_database``): seconds spent executing statements,
        transactions committed, rows inserted and updated."""
        out = self._psql("SELECT active_time, xact_commit, tup_inserted, tup_updated FROM pg_stat_database "
                         f"WHERE datname = '{self.name}'").strip()
        active, commits, inserted, updated = (float(x or 0) for x in out.split("|"))
        return {"active_s": active / 1000, "commits": commits, "rows_inserted": inserted, "rows_updated": updated}

    def cpu_seconds(self) -> float:
        """Seconds the database spent executing this database's statements (``active_time``: its CPU and I/O
        together, whichever connection ran them)."""
        return self.stats()["active_s"]

    def __enter__(self) -> "Postgres":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.drop()


# -- the Prefect server ----------------------------------------------------------------------------------


class PrefectServer:
    """``prefect server start`` on PostgreSQL (``database_url``; None: SQLite in its home), 127.0.0.1, its own
    PREFECT_HOME, UI off."""

    def __init__(self, root: Path, database_url: str | None, *, extra_env: dict[str, str] | None = None):
        self.root = Path(root)
        self.home = self.root / "server-home"
        self.log = self.root / "server.log"
        self.database_url = database_url
        self.extra_env = dict(extra_env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self, timeout_s: float = 180.0) -> "PrefectServer":
        import httpx

        self.home.mkdir(parents=True, exist_ok=True)
        database = {"PREFECT_SERVER_DATABASE_CONNECTION_URL": self.database_url} if self.database_url else {}
        env = quiet_env(PREFECT_HOME=str(self.home), PREFECT_UI_ENABLED="false", **database, **self.extra_env)
        started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
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
        _stop_group(self.proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid)

    def client_env(self, home: Path, api_url: str | None = None, **extra: str) -> dict[str, str]:
        """Environment of a client process of this server (own PREFECT_HOME; ``api_url`` e.g. a tap's)."""
        Path(home).mkdir(parents=True, exist_ok=True)
        return quiet_env(PREFECT_API_URL=api_url or self.url, PREFECT_HOME=str(home), **extra)

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.url)


# -- S3 (moto) ----------------------------------------------------------------------------------------------

BUCKET = "refit-fleet"
AWS = {"AWS_ACCESS_KEY_ID": "canonical-refit-bench", "AWS_SECRET_ACCESS_KEY": "canonical-refit-bench-secret",
       "AWS_DEFAULT_REGION": "us-east-1"}


class MotoS3:
    """moto's S3 server on 127.0.0.1 in a subprocess, with one bucket."""

    def __init__(self, log_path: Path, bucket: str = BUCKET):
        self.log_path, self.bucket = Path(log_path), bucket
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "MotoS3":
        import http.client

        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

        def create_bucket() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto exited: {tail(self.log_path)}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("PUT", f"/{self.bucket}", body=b"")
                status = conn.getresponse().status
                conn.close()
                return status in (200, 409)
            except OSError:
                return False

        wait_until("moto to answer", create_bucket, timeout_s, every_s=0.1, diagnostics=lambda: tail(self.log_path))
        return self

    def stop(self) -> None:
        _stop_group(self.proc, timeout_s=10)


# -- a counting tap in front of the Prefect API -----------------------------------------------------------

_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
EVENT_MESSAGE = "WS /events/in"


def path_template(target: str, prefix: str = "/api") -> str:
    path = target.split("?", 1)[0]
    if path.startswith(prefix):
        path = path[len(prefix):]
    return _ID.sub(":id", path)


@dataclass
class Hit:
    """One request (or websocket message) a node sent to the API."""

    at: float  # time.time()
    what: str  # "POST /deployments/get_scheduled_flow_runs", or EVENT_MESSAGE for a websocket message
    up_bytes: int = 0


class _RequestParser:
    """Splits the client-to-server byte stream of one connection into HTTP/1.1 requests and websocket frames."""

    def __init__(self, tap: "ApiTap"):
        self.tap = tap
        self.buf = bytearray()
        self.mode = "head"
        self.remaining = 0
        self.ws_path = ""

    def feed(self, data: bytes) -> None:
        self.buf += data
        try:
            while self._step():
                pass
        except (ValueError, IndexError):  # not HTTP we understand: stop parsing this connection
            self.mode, self.buf = "opaque", bytearray()

    def _step(self) -> bool:
        buf = self.buf
        if self.mode == "opaque":
            buf.clear()
            return False
        if self.mode == "head":
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            del buf[:end + 4]
            method, target, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            self.tap.hit(f"{method} {path_template(target, self.tap.prefix)}", end + 4)
            if "websocket" in headers.get("upgrade", "").lower():
                self.mode, self.ws_path = "ws", path_template(target, self.tap.prefix)
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                self.mode = "chunk-size"
            else:
                self.remaining = int(headers.get("content-length") or 0)
                self.mode = "body" if self.remaining else "head"
            return True
        if self.mode in ("body", "chunk-data"):
            n = min(self.remaining, len(buf))
            del buf[:n]
            self.remaining -= n
            if self.remaining:
                return False
            self.mode = "head" if self.mode == "body" else "chunk-size"
            return True
        if self.mode == "chunk-size":
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            size = int(bytes(buf[:end]).split(b";")[0].strip() or b"0", 16)
            del buf[:end + 2]
            self.mode, self.remaining = ("trailer", 0) if size == 0 else ("chunk-data", size + 2)
            return True
        if self.mode == "trailer":
            end = buf.find(b"\r\n")
            if end < 0:
                return False
            empty = end == 0
            del buf[:end + 2]
            if empty:
                self.mode = "head"
            return True
        if self.mode == "ws":
            if len(buf) < 2:
                return False
            opcode, length, offset = buf[0] & 0x0F, buf[1] & 0x7F, 2
            if length == 126:
                if len(buf) < 4:
                    return False
                length, offset = int.from_bytes(buf[2:4], "big"), 4
            elif length == 127:
                if len(buf) < 10:
                    return False
                length, offset = int.from_bytes(buf[2:10], "big"), 10
            if buf[1] & 0x80:
                offset += 4
            if len(buf) < offset + length:
                return False
            del buf[:offset + length]
            if opcode in (1, 2):  # a text or binary message (pings, pongs and close frames are not counted)
                self.tap.hit(f"WS {self.ws_path}", offset + length)
            return True
        return False


class ApiTap:
    """A counting TCP proxy for one node's Prefect API traffic (see the module); runs on a ``TapHub``'s loop."""

    def __init__(self, hub: "TapHub", upstream: str, name: str):
        parts = urlsplit(upstream)
        self.hub, self.name = hub, name
        self.upstream = (parts.hostname, parts.port)
        self.prefix = parts.path.rstrip("/") or ""
        self.hits: list[Hit] = []
        self.down_bytes = 0
        self.connections = 0
        self._lock = threading.Lock()
        self.port: int | None = None
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.prefix}"

    def hit(self, what: str, size: int) -> None:
        with self._lock:
            self.hits.append(Hit(time.time(), what, size))

    def between(self, start: float, end: float | None = None) -> list[Hit]:
        with self._lock:
            return [h for h in self.hits if h.at >= start and (end is None or h.at <= end)]

    def counts(self, start: float = 0.0, end: float | None = None) -> Counter:
        return Counter(h.what for h in self.between(start, end))

    async def _open(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=256)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self.connections += 1
        parser = _RequestParser(self)

        def downstream(data: bytes) -> None:
            self.down_bytes += len(data)

        await asyncio.gather(self._pump(reader, up_writer, parser.feed), self._pump(up_reader, writer, downstream))

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, seen) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                seen(data)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            try:
                dst.close()
            except Exception:  # noqa: BLE001 - already closed
                pass


class TapHub:
    """One event-loop thread serving any number of ``ApiTap``s."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="api-taps", daemon=True)
        self.thread.start()
        self.taps: list[ApiTap] = []

    def tap(self, upstream: str, name: str) -> ApiTap:
        tap = ApiTap(self, upstream, name)
        asyncio.run_coroutine_threadsafe(tap._open(), self.loop).result(10)
        self.taps.append(tap)
        return tap

    def stop(self) -> None:
        async def close() -> None:
            for tap in self.taps:
                if tap._server is not None:
                    tap._server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# -- node agents -------------------------------------------------------------------------------------------


@dataclass
class NodeProcess:
    """One node: ``python -m deployments.serve`` for ``name``, with its own cache, Prefect home and log."""

    name: str
    root: Path
    catalog: str
    model: str
    seed: Path
    env: dict[str, str]  # PREFECT_API_URL, PREFECT_HOME, AWS credentials, ...
    s3_endpoint: str | None = None
    poll_s: float | None = None
    installer: tuple[str, ...] = ("--installer", "none")
    extra: tuple[str, ...] = ()
    agent_module: tuple[str, ...] = ("-m", "deployments.serve")
    proc: subprocess.Popen | None = None
    starts: int = 0
    logs: list[Path] = field(default_factory=list)

    def __post_init__(self):
        self.root = Path(self.root) / self.name
        self.root.mkdir(parents=True, exist_ok=True)
        self.cache = self.root / "cache"

    @property
    def suffix(self) -> str:
        return f"-{self.name}"

    @property
    def deployments(self) -> dict[str, str]:
        """Short name -> full deployment name on the server."""
        return {"latest": f"refit/refit-latest{self.suffix}", "on_publish": f"refit/refit-on-publish{self.suffix}",
                "publish": f"publish/publish{self.suffix}"}

    def argv(self) -> list[str]:
        cmd = [PYTHON, *self.agent_module, "--node", self.name, f"--name-suffix={self.suffix}",
               "--catalog", self.catalog, "--model", self.model, "--seed-checkpoint", str(self.seed),
               "--cache-dir", str(self.cache), "--apply-workers", "2", *self.installer]
        if self.s3_endpoint:
            cmd += ["--s3-endpoint-url", self.s3_endpoint]
        if self.poll_s is not None:
            cmd += ["--poll-seconds", str(self.poll_s)]
        return cmd + list(self.extra)

    @property
    def log(self) -> Path:
        return self.logs[-1] if self.logs else self.root / "agent-1.log"

    def start(self) -> "NodeProcess":
        assert not self.alive, f"{self.name} is already running"
        self.starts += 1
        log = self.root / f"agent-{self.starts}.log"
        self.logs.append(log)
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(self.argv(), env=self.env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the agent stops at a safe point and exits); SIGKILL after ``timeout_s``."""
        _stop_group(self.proc, timeout_s)
        return self.proc.returncode if self.proc else None

    def kill(self) -> None:
        """SIGKILL, no warning: a crashed host."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def store(self):
        from storage.store.local_store import LocalStore

        return LocalStore(self.cache, self.model, create=False)

    def active_version(self) -> str | None:
        """The installed version, from the node's own ``active.json``."""
        from storage.errors import RefitError

        try:
            store = self.store()
            active = store.active() if store.exists else None
        except RefitError:
            return None
        return active.version if active else None

    def rss_bytes(self) -> int:
        return process_rss_bytes(self.proc.pid) if self.alive else 0

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid) if self.alive else 0.0

    def diagnostics(self) -> str:
        return f"--- {self.name} ({self.log.name}) ---\n{tail(self.log)}"


# -- the trainer ---------------------------------------------------------------------------------------------


class Trainer:
    """A synthetic model's launch snapshot and its training steps, published with ``flows.publish.run_publish``
    in this (warm) process; the event reaches whatever ``PREFECT_API_URL`` names."""

    def __init__(self, root: Path, catalog: str, model: str, *, shape=None, share: float | None = None,
                 endpoint: str | None = None, seed: int = 7):
        from flows.synthetic import ModelShape, RLTrainer, random_model, write_checkpoint

        self.root, self.catalog, self.model, self.endpoint = Path(root), catalog, model, endpoint
        self.shape = shape or ModelShape(vocab=512, hidden=64, intermediate=160, layers=2, shards=2)
        self.share = share
        self.launch = self.root / "launch"
        self.state_dir = self.root / "publisher"
        self.steps = 0
        tensors = random_model(self.shape, seed=seed)
        write_checkpoint(self.launch, tensors, shards=self.shape.shards)
        self.current = tensors
        self.rl = RLTrainer(tensors, seed=seed)
        self._write = write_checkpoint

    def checkpoint(self) -> Path:
        """The next training step's checkpoint folder (the launch snapshot for step 0)."""
        from flows.synthetic import train_step

        if self.steps == 0:
            folder = self.launch
        else:
            if self.share:  # RL-like: a share of the bf16 elements flips by one ulp
                self.current = self.rl.step(self.share)
            else:  # dense: every element moves
                self.current = train_step(self.current, seed=100 + self.steps)
            folder = self._write(self.root / f"step-{self.steps}", self.current, shards=self.shape.shards)
        self.steps += 1
        return folder

    def params(self, folder: Path, kind: str, **extra):
        from storage.settings import ObjectStoreSettings, PublishParams

        storage = ObjectStoreSettings(endpoint_url=self.endpoint, region="us-east-1") if self.endpoint else None
        values = dict(catalog=self.catalog, model=self.model, checkpoint=folder, kind=kind, state_dir=self.state_dir,
                      **extra)
        if storage is not None:
            values["storage"] = storage
        return PublishParams(**values)

    def publish(self, kind: str = "delta", **extra):
        """Publish the next step (``initial`` first); returns (PublishResult, seconds the call took)."""
        from flows.publish import run_publish

        params = self.params(self.checkpoint(), kind, **extra)
        started = time.time()
        result = run_publish(params)
        return result, started


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


def published_events(client_url: str, since_iso: str) -> list[dict]:
    """``canonical-refit.revision.published`` events the server has stored since ``since_iso`` (oldest first)."""
    import httpx

    body = {"filter": {"event": {"name": ["canonical-refit.revision.published"]},
                       "occurred": {"since": since_iso}, "order": "ASC"}, "limit": 50}
    response = httpx.post(f"{client_url}/events/filter", json=body, timeout=10)
    response.raise_for_status()
    return response.json().get("events", [])


def parse_time(value) -> float:
    """An API timestamp (datetime or ISO string) as Unix seconds."""
    from datetime import datetime

    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return value.timestamp()


# -- an agent that also records its stages' spans (the warm benchmark) -----------------------------------------


def _install_span_recorder(path: Path) -> None:
    """Every Receiver the refit code builds records each stage's [start, end] (Unix time) into ``path``."""
    import tasks.receiver
    from contextlib import contextmanager

    base = tasks.receiver.Receiver

    class SpanReceiver(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._spans: list[dict] = []

        @contextmanager
        def stage(self, name):
            start = time.time()
            try:
                with super().stage(name) as record:
                    yield record
            finally:
                self._spans.append({"stage": name, "start": start, "end": time.time()})

        def close(self):
            from prefect.context import FlowRunContext

            context = FlowRunContext.get()
            run_id = str(context.flow_run.id) if context and context.flow_run else None
            with open(path, "a") as fh:
                fh.write(json.dumps({"flow_run": run_id, "target": self.params.target, "spans": self._spans}) + "\n")
            super().close()

    tasks.receiver.Receiver = SpanReceiver
    import flows.refit
    import flows.report

    flows.refit.Receiver = SpanReceiver

    def timed(name: str, fn):
        """``fn``, also recording its span as a step of the run outside its stages (``extra``)."""
        def wrapper(*args, **kwargs):
            from prefect.context import FlowRunContext

            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                context = FlowRunContext.get()
                run_id = str(context.flow_run.id) if context and context.flow_run else None
                with open(path, "a") as fh:
                    fh.write(json.dumps({"flow_run": run_id, "extra": name, "start": start, "end": time.time()})
                             + "\n")
        return wrapper

    flows.refit.report_node = timed("node record and event", flows.refit.report_node)
    reporter = flows.report.PrefectReporter
    reporter.__init__ = timed("progress artifact", reporter.__init__)
    reporter.publish_result = timed("result artifacts", reporter.publish_result)


def agent_main(argv: list[str]) -> int:
    """``python -m benchmarks._fleetlab agent SPANS.jsonl SERVE-ARGS...``: deployments.serve, stage spans recorded."""
    _install_span_recorder(Path(argv[0]))
    from deployments.serve import main

    return main(argv[1:])


if __name__ == "__main__":
    if sys.argv[1:2] == ["agent"]:
        raise SystemExit(agent_main(sys.argv[2:]))
    raise SystemExit("usage: python -m benchmarks._fleetlab agent SPANS.jsonl SERVE-ARGS...")


# -- a fleet lab for the benchmarks: server, S3, taps and nodes, and one measured publication wave ---------------


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def machine() -> dict:
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    import prefect

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "prefect": prefect.__version__,
            "postgres": _postgres_version()}


def _postgres_version() -> str | None:
    try:
        return subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-Atc", "SHOW server_version"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def classify_s3(request) -> str:
    """What an S3 request (a ``FaultProxy`` log entry) was for."""
    if request.method == "GET" and "list-type" in request.query:
        return "list"
    if "/revisions/" in request.path:
        return f"payload {request.method}"
    if "/nodes/" in request.path:
        return f"node record {request.method}"
    if "/catalog/" in request.path:
        return f"catalog {request.method}"
    return f"other {request.method}"


class FleetLab:
    """PostgreSQL, a Prefect server on it (or an existing one), moto, and nodes each behind an API tap and an S3
    proxy of their own; the trainer publishes from this process. Use as a context manager."""

    def __init__(self, root: Path, *, poll_s: float | None, shape=None, share: float | None = None,
                 api_url: str | None = None, spans: Path | None = None, log: Callable[[str], None] = print):
        self.root = Path(root)
        self.poll_s, self.shape, self.share, self.log = poll_s, shape, share, log
        self.external_api = api_url
        self.spans = spans
        self.database: Postgres | None = None
        self.server: PrefectServer | None = None
        self.nodes: dict[str, NodeProcess] = {}
        self.taps: dict[str, ApiTap] = {}
        self.proxies: dict = {}
        self.ids: dict[str, dict[str, object]] = {}
        self.catalog = f"s3://{BUCKET}/fleet-{uuid.uuid4().hex[:8]}/catalog"
        self.model = "lab/fleet"

    # -- set-up and tear-down ----------------------------------------------------------------------------

    def __enter__(self) -> "FleetLab":
        self.hub = TapHub()
        self.moto = MotoS3(self.root / "moto.log").start()
        if self.external_api:
            self.api_url = self.external_api
        else:
            self.database = Postgres().create()
            self.server = PrefectServer(self.root, self.database.url).start()
            self.api_url = self.server.url
            self.log(f"Prefect server on PostgreSQL database {self.database.name}: healthy after "
                     f"{self.server.startup_s:.1f}s")
        os.environ.update(AWS)
        os.environ.update(PREFECT_API_URL=self.api_url, PREFECT_HOME=str(self.root / "trainer-home"),
                          DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
        self.trainer = Trainer(self.root / "trainer", self.catalog, self.model, shape=self.shape, share=self.share,
                               endpoint=self.moto.url)
        return self

    def __exit__(self, *exc) -> None:
        for node in self.nodes.values():
            node.stop(timeout_s=20)
        if self.server is not None:
            self.server.stop()
        for proxy in self.proxies.values():
            proxy.stop()
        self.moto.stop()
        self.hub.stop()
        if self.database is not None:
            self.database.drop()

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api_url)

    def server_cpu(self) -> float:
        return self.server.cpu_seconds() if self.server else 0.0

    def database_cpu(self) -> float:
        return self.database.cpu_seconds() if self.database else 0.0

    # -- nodes ----------------------------------------------------------------------------------------------

    def add_node(self, name: str) -> NodeProcess:
        from benchmarks._s3proxy import FaultProxy, Faults

        tap = self.hub.tap(self.api_url, name)
        proxy = FaultProxy(self.moto.url, Faults(), lifetime_s=24 * 3600).start()
        module = ("-m", "benchmarks._fleetlab", "agent", str(self.spans)) if self.spans else ("-m", "deployments.serve")
        env = quiet_env(PREFECT_API_URL=tap.url, PREFECT_HOME=str(self.root / "homes" / name), **AWS)
        node = NodeProcess(name, self.root / "nodes", self.catalog, self.model, self.trainer.launch, env,
                           s3_endpoint=proxy.url, poll_s=self.poll_s, agent_module=module)
        self.nodes[name], self.taps[name], self.proxies[name] = node, tap, proxy
        return node

    def start(self, names: list[str], timeout_s: float = 300) -> float:
        """Start the nodes' agents; wait until each registered and its start-up run ended. Seconds it took."""
        started = time.monotonic()
        for name in names:
            self.nodes[name].start()
        with self.client() as client:
            for name in names:
                node = self.nodes[name]

                def registered():
                    if not node.alive:
                        raise RuntimeError(f"{name}'s agent exited\n{node.diagnostics()}")
                    return deployment_ids(client, list(node.deployments.values()))

                ids = wait_until(f"{name} to register", registered, timeout_s, every_s=0.5,
                                 diagnostics=node.diagnostics)
                self.ids[name] = {short: ids[full] for short, full in node.deployments.items()}
            for name in names:
                wait_until(f"{name}'s start-up run", lambda: [r for r in runs_of(client, [self.ids[name]["latest"]])
                                                             if is_final(r) and not r.auto_scheduled], timeout_s,
                           every_s=0.5, diagnostics=self.nodes[name].diagnostics)
        return time.monotonic() - started

    # -- measurements ---------------------------------------------------------------------------------------

    def idle(self, seconds: float) -> dict:
        """What the idle agents cost over ``seconds``: API requests per node per minute, server and database CPU,
        agent RSS."""
        start, cpu0, db0 = time.time(), self.server_cpu(), self.database_cpu()
        agents0 = {name: node.cpu_seconds() for name, node in self.nodes.items()}
        time.sleep(seconds)
        end = time.time()
        elapsed = end - start
        per_node = {}
        for name, node in self.nodes.items():
            counts = self.taps[name].counts(start, end)
            per_node[name] = {"requests_per_min": round(sum(counts.values()) * 60 / elapsed, 1),
                              "requests": dict(counts), "rss_mb": round(node.rss_bytes() / 1e6, 1),
                              "agent_cpu_pct": round((node.cpu_seconds() - agents0[name]) / elapsed * 100, 2)}
        requests = sum(sum(self.taps[n].counts(start, end).values()) for n in self.nodes)
        return {"seconds": round(elapsed, 1), "nodes": len(self.nodes), "per_node": per_node,
                "api_requests_per_s": round(requests / elapsed, 2),
                "server_cpu_pct": round((self.server_cpu() - cpu0) / elapsed * 100, 2),
                "database_cpu_pct": round((self.database_cpu() - db0) / elapsed * 100, 2),
                "load_average": load_average()}

    def wave(self, kind: str = "delta", timeout_s: float = 300, settle_s: float = 3.0, **publish: str) -> dict:
        """Publish the trainer's next step from this process and measure it reaching every node."""
        names = list(self.nodes)
        marks = {name: len(self.proxies[name].log) for name in names}
        cpu0, db0 = self.server_cpu(), self.database_cpu()
        rows0 = self.database.stats() if self.database else {}
        result, published_at = self.trainer.publish(kind, **publish)
        publish_s = time.time() - published_at
        version = result.version
        with self.client() as client:
            def finished():
                runs = {}
                for name in names:
                    found = [r for r in runs_of(client, [self.ids[name]["on_publish"]])
                             if target_of(r) == version and is_final(r)]
                    if not found:
                        return None
                    runs[name] = found[0]
                return runs

            runs = wait_until(f"every node to finish its refit to {version}", finished, timeout_s, every_s=0.1,
                              diagnostics=lambda: "\n".join(n.diagnostics() for n in self.nodes.values()))
            done_at = time.time()
            event = wait_until(f"the published event of {version}", lambda: next(
                (e for e in published_events(self.api_url, "2000-01-01T00:00:00Z")
                 if e["resource"]["prefect.resource.id"].endswith(f".{version}")), None), 60, every_s=0.5)
            event_at = parse_time(event["occurred"])
            states = {name: {s.name: parse_time(s.timestamp) for s in client.read_flow_run_states(run.id)}
                      for name, run in runs.items()}
        time.sleep(settle_s)  # the runs' last log batches and the agents' next polls land
        cpu, db = self.server_cpu() - cpu0, self.database_cpu() - db0
        rows = {k: v - rows0[k] for k, v in self.database.stats().items() if k != "active_s"} if rows0 else {}
        nodes = {}
        for name in names:
            run, st = runs[name], states[name]
            claimed, running, final = st.get("Pending"), st.get("Running"), parse_time(run.end_time or run.updated)
            counts = self.taps[name].counts((claimed or event_at) - 0.05, final + settle_s)
            polls = counts.pop("POST /deployments/get_scheduled_flow_runs", 0)
            events = sum(v for k, v in counts.items() if k.startswith("WS /events/in"))
            http = {k: v for k, v in counts.items() if not k.startswith("WS ")}
            s3 = self._s3(name, marks[name], version)
            nodes[name] = {
                "state": run.state_name, "created_after_event_s": round(parse_time(run.created) - event_at, 3),
                "claimed_after_event_s": round(claimed - event_at, 3) if claimed else None,
                "run_start_after_event_s": round(running - event_at, 3) if running else None,
                "ready_after_event_s": round(final - event_at, 3),
                "ready_after_publish_start_s": round(final - published_at, 3),
                "run_wall_s": round(final - running, 3) if running else None,
                "run_start_at": running, "ready_at": final,
                "api_requests": sum(http.values()), "api_events_sent": events, "api_polls_in_window": polls,
                "api_by_kind": dict(sorted(http.items(), key=lambda kv: -kv[1])), "s3": s3}
        ready = [n["ready_after_publish_start_s"] for n in nodes.values()]
        return {"version": version, "kind": kind, "payload_bytes": result.bytes_written, "files": result.files,
                "publish_s": round(publish_s, 3), "event_after_publish_start_s": round(event_at - published_at, 3),
                "all_ready_after_publish_start_s": round(max(ready), 3),
                "all_ready_after_event_s": round(max(n["ready_after_event_s"] for n in nodes.values()), 3),
                "observed_all_done_after_publish_start_s": round(done_at - published_at, 3),
                "server_cpu_s": round(cpu, 3), "database_cpu_s": round(db, 3), "database": rows, "nodes": nodes,
                "load_average": load_average()}

    def _s3(self, name: str, mark: int, version: str) -> dict:
        """The node's S3 requests since ``mark``: counts by kind, GET bytes, and whether each payload object of
        ``version`` was fetched exactly once."""
        log = self.proxies[name].log[mark:]
        kinds = Counter(classify_s3(r) for r in log)
        objects: dict[str, list] = {}
        for r in log:
            if r.method == "GET" and not r.query and f"/revisions/{version}/" in r.path:
                objects.setdefault(r.path, []).append(r)
        gets = [r for r in log if r.method == "GET"]
        return {"requests": len(log), "by_kind": dict(kinds), "get_requests": len(gets),
                "get_bytes": sum(r.sent for r in gets),
                "payload_objects": len(objects), "payload_gets": sum(len(v) for v in objects.values()),
                "payload_bytes": sum(r.sent for v in objects.values() for r in v),
                "payload_ranged_gets": sum(1 for v in objects.values() for r in v if r.range),
                "each_payload_object_once": all(len(v) == 1 or (all(r.range for r in v) and
                                                                len({r.range for r in v}) == len(v))
                                                for v in objects.values())}


def saturate(api_url: str, deployment_ids_: list, *, threads: int = 4, seconds: float = 10.0,
             cpu: Callable[[], float] = lambda: 0.0, db_cpu: Callable[[], float] = lambda: 0.0) -> dict:
    """Poll as fast as ``threads`` clients can (the agents' own request) for ``seconds``: what one server process
    sustains, its latency, and its CPU."""
    import httpx

    body = {"deployment_ids": [str(i) for i in deployment_ids_], "scheduled_before": "2000-01-01T00:00:00Z"}
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker() -> None:
        with httpx.Client(base_url=api_url, timeout=30) as client:
            while time.monotonic() < stop:
                t = time.perf_counter()
                client.post("/deployments/get_scheduled_flow_runs", json=body).raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - t)

    cpu0, db0, started = cpu(), db_cpu(), time.monotonic()
    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(seconds + 60)
    elapsed = time.monotonic() - started
    return {"threads": threads, "seconds": round(elapsed, 1), "requests": len(latencies),
            "requests_per_s": round(len(latencies) / elapsed, 1),
            "latency_ms": {"p50": _r(percentile(latencies, .5) * 1000, 1), "p99": _r(percentile(latencies, .99) * 1000, 1)},
            "server_cpu_pct": round((cpu() - cpu0) / elapsed * 100, 1),
            "database_cpu_pct": round((db_cpu() - db0) / elapsed * 100, 1), "load_average": load_average()}


def summarize_waves(waves: list[dict]) -> dict:
    """Latencies and per-node costs over several waves."""
    nodes = [n for w in waves for n in w["nodes"].values()]
    starts = [n["run_start_after_event_s"] for n in nodes]
    return {
        "waves": len(waves), "nodes": len(waves[0]["nodes"]) if waves else 0,
        "payload_bytes": [w["payload_bytes"] for w in waves],
        "publish_to_all_ready_s": {"p50": _r(percentile([w["all_ready_after_publish_start_s"] for w in waves], .5)),
                                   "max": _r(max(w["all_ready_after_publish_start_s"] for w in waves))},
        "event_to_all_ready_s": {"p50": _r(percentile([w["all_ready_after_event_s"] for w in waves], .5)),
                                 "max": _r(max(w["all_ready_after_event_s"] for w in waves))},
        "publish_s": {"p50": _r(percentile([w["publish_s"] for w in waves], .5))},
        "event_to_run_created_s": _dist([n["created_after_event_s"] for n in nodes]),
        "event_to_run_start_s": _dist(starts),
        "run_wall_s": _dist([n["run_wall_s"] for n in nodes]),
        "api_requests_per_refit": _dist([n["api_requests"] for n in nodes]),
        "api_events_per_refit": _dist([n["api_events_sent"] for n in nodes]),
        "s3_get_requests_per_refit": _dist([n["s3"]["get_requests"] for n in nodes]),
        "s3_requests_per_refit": _dist([n["s3"]["requests"] for n in nodes]),
        "s3_get_bytes_per_refit": _dist([n["s3"]["get_bytes"] for n in nodes]),
        "payload_fetched_once_everywhere": all(n["s3"]["each_payload_object_once"] for n in nodes),
        "server_cpu_s_per_refit": _r(sum(w["server_cpu_s"] for w in waves) / max(1, len(nodes))),
        "database_cpu_s_per_refit": _r(sum(w["database_cpu_s"] for w in waves) / max(1, len(nodes))),
        "database_per_refit": {k: _r(sum(w["database"].get(k, 0) for w in waves) / max(1, len(nodes)), 1)
                               for k in ("commits", "rows_inserted", "rows_updated")},
    }


def _r(x, digits: int = 3):
    return None if x is None else round(x, digits)


def _dist(values: list) -> dict:
    xs = [v for v in values if v is not None]
    return {"p50": _r(percentile(xs, .5)), "max": _r(max(xs)) if xs else None, "min": _r(min(xs)) if xs else None}


def bench_main(name: str, argv: list[str] | None, parse_args, run, table, log) -> int:
    """The command line of a fleet-lab benchmark: a scratch folder, ``run``, its JSON under benchmarks/results/,
    then ``table`` printed."""
    import shlex
    import shutil
    import tempfile
    from datetime import datetime, timezone

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.json or ROOT / "benchmarks" / "results" / f"{name}-{stamp}.json"
    root = Path(tempfile.mkdtemp(prefix=f"canonical-refit-{name}-"))
    log(f"working in {root}; load average {load_average()}")
    started = time.perf_counter()
    try:
        result = run(args, root)
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result["command"] = f"python -m benchmarks.{name} " + shlex.join(argv)
    result["started_at"] = stamp
    result["seconds"] = round(time.perf_counter() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    print(f"\nJSON: {out}")
    return 0
