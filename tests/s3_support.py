"""A real S3 server for the tests, and a fault-injecting proxy to put in front of it.

``MotoServer`` runs moto's standalone S3 server (``python -m moto.server``, the
``moto_server`` entry point of ``moto[server]``) as a subprocess bound to
127.0.0.1 at a free port, and stops it by PID. moto enforces
``If-None-Match: *`` (412), which is what publication semantics need.

``FaultProxy`` is a small HTTP/1.1 proxy on 127.0.0.1 that forwards to the
server and, for a configurable share of requests, answers ``503 SlowDown`` or
``500 InternalError``, resets the connection, stalls past the client's read
timeout, or truncates the response body. Faults are bounded: a request (same
method, path, query and range) is faulted at most ``max_per_key`` times, so a
client that retries enough always gets through. It can also deny paths with
``403 AccessDenied`` or ``404 NoSuchKey`` and strip conditional-write headers (the behaviour of
servers that overwrite silently). Every request is logged for assertions.
The proxy stops itself after ``lifetime_s``.

Run ``python tests/s3_support.py crash-publish ...`` to publish in a process that
is SIGKILLed right before it would write the catalog record.
"""

from __future__ import annotations

import http.client
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import pytest

from storage.settings import ObjectStoreSettings

BUCKET = "refit-e2e"
ACCESS_KEY_ID = "canonical-refit-test"
SECRET_ACCESS_KEY = "canonical-refit-test-secret"
REGION = "us-east-1"
FAULT_KINDS = ("slowdown", "error500", "reset", "stall", "truncate")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
               "upgrade", "expect", "host"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aws_environment(endpoint_url: str | None = None) -> dict[str, str]:
    """The standard AWS variables a client of the test server needs (and nothing else)."""
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
           "AWS_DEFAULT_REGION": REGION}
    if endpoint_url:
        env["AWS_ENDPOINT_URL_S3"] = endpoint_url
    return env


class MotoServer:
    """moto's S3 server in a subprocess on 127.0.0.1; ``stop`` ends it by PID."""

    def __init__(self, log_path: Path):
        self.log_path = Path(log_path)
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "MotoServer":
        """Start the server and wait (bounded) until it answers HTTP."""
        for _ in range(3):  # the port may be taken between free_port() and the bind
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
                )
            if self._wait_ready(timeout_s):
                return self
            self.stop()
        raise RuntimeError(f"moto server did not start; log: {self._log_tail()}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/")
                conn.getresponse().read()
                conn.close()
                return True
            except OSError:
                time.sleep(0.1)
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server's PID, SIGKILL it if it has not exited within ``timeout_s``."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def create_bucket(self, name: str) -> None:
        """CreateBucket with a plain path-style PUT (moto checks no signature)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("PUT", f"/{name}", body=b"")
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status not in (200, 409):
            raise RuntimeError(f"CreateBucket {name}: {response.status} {body[:300]!r}")


# -- the fault-injecting proxy ------------------------------------------------------------------


@dataclass
class Faults:
    """What the proxy does to requests. ``rate`` is the share of requests that get a fault."""

    rate: float = 0.0
    kinds: tuple[str, ...] = FAULT_KINDS
    max_per_key: int = 2          # a given request is faulted at most this many times
    max_total: int = 200
    stall_s: float = 2.0          # longer than the client's read timeout
    seed: int = 0
    deny: tuple[str, ...] = ()    # path substrings answered 403 AccessDenied
    missing: tuple[str, ...] = ()  # path substrings answered 404 NoSuchKey
    strip_conditional: bool = False  # drop If-None-Match/If-Match: a server that overwrites silently
    get_latency_s: float = 0.0    # hold object GETs this long (makes concurrent fetches overlap) ...
    latency_suffix: str = ""      # ... those whose path ends with this; counted in max_in_flight_gets


@dataclass
class Request:
    method: str
    path: str
    query: str
    range: str | None
    fault: str | None
    status: int | None


@dataclass
class FaultProxy:
    """A bounded fault-injecting HTTP proxy on 127.0.0.1 in front of ``upstream``."""

    upstream: str
    faults: Faults = field(default_factory=Faults)
    lifetime_s: float = 300.0
    log: list[Request] = field(default_factory=list)

    def __post_init__(self):
        parts = urlsplit(self.upstream)
        self._upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._rng = random.Random(self.faults.seed)
        self._per_key: dict[tuple, int] = {}
        self._injected = 0
        self._in_flight = 0
        self.max_in_flight_gets = 0
        self._stopping = threading.Event()
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="fault-proxy", daemon=True)
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        self._timer.start()
        return self

    def stop(self) -> None:
        """Stop serving (idempotent); stalled handlers wake up and close their connections."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- bookkeeping -------------------------------------------------------------------------------

    def choose(self, method: str, path: str, query: str, byte_range: str | None) -> str | None:
        """The fault for this request, or None (bounded per request and in total)."""
        f = self.faults
        if any(d in path for d in f.deny):
            return "deny"
        if any(m in path for m in f.missing):
            return "missing"
        with self._lock:
            key = (method, path, query, byte_range)
            if (f.rate <= 0 or self._injected >= f.max_total or self._per_key.get(key, 0) >= f.max_per_key
                    or self._rng.random() >= f.rate):
                return None
            kinds = [k for k in f.kinds if not (k == "truncate" and method != "GET")]
            if not kinds:
                return None
            self._per_key[key] = self._per_key.get(key, 0) + 1
            self._injected += 1
            return self._rng.choice(kinds)

    def record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)

    def requests(self, path_contains: str = "", method: str | None = None) -> list[Request]:
        """Logged requests whose path contains ``path_contains`` (and of ``method``)."""
        with self._lock:
            return [r for r in self.log if path_contains in r.path and (method is None or r.method == method)]

    def get_started(self) -> None:
        with self._lock:
            self._in_flight += 1
            self.max_in_flight_gets = max(self.max_in_flight_gets, self._in_flight)

    def get_finished(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def injected(self) -> dict[str, int]:
        """How many of each fault were injected."""
        out: dict[str, int] = {}
        for r in self.requests():
            if r.fault:
                out[r.fault] = out.get(r.fault, 0) + 1
        return out

    def wait(self, seconds: float) -> None:
        self._stopping.wait(seconds)


_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "error500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "deny": (403, "AccessDenied", "Access Denied"),
    "missing": (404, "NoSuchKey", "The specified key does not exist."),
}


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # idle keep-alive connections end by themselves
    owner: FaultProxy

    def log_message(self, *args) -> None:  # keep test output clean; requests are in owner.log
        pass

    def do_GET(self):
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _proxy(self) -> None:
        owner = self.owner
        if owner._stopping.is_set():  # kept-alive connections do not outlive the proxy
            self._reset()
            return
        path, _, query = self.path.partition("?")
        body = self._read_body()
        byte_range = self.headers.get("Range")
        fault = owner.choose(self.command, path, query, byte_range)
        entry = Request(self.command, path, query, byte_range, fault, None)
        owner.record(entry)
        if fault in _ERRORS:
            entry.status = self._send_error_xml(*_ERRORS[fault])
            return
        if fault == "stall":
            owner.wait(owner.faults.stall_s)
            self.close_connection = True
            return
        writes = self.command in ("PUT", "POST", "DELETE")
        if fault == "reset" and not writes:
            self._reset()
            return
        if self.command == "GET" and not query and owner.faults.get_latency_s \
                and path.endswith(owner.faults.latency_suffix):
            owner.get_started()
            try:
                owner.wait(owner.faults.get_latency_s)
                status, headers, data = self._forward(body)
            finally:
                owner.get_finished()
        else:
            status, headers, data = self._forward(body)
        entry.status = status
        if fault == "reset":  # the write landed, but the client never hears so
            self._reset()
            return
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        length = dict((k.lower(), v) for k, v in headers).get("content-length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length if length is not None else str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "truncate" and len(data) > 1:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if self.owner.faults.strip_conditional:
            headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        host, port = self.owner._upstream
        conn = http.client.HTTPConnection(host, port, timeout=60)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            response = conn.getresponse()
            data = response.read()
            return response.status, response.getheaders(), data
        finally:
            conn.close()

    def _send_error_xml(self, status: int, code: str, message: str) -> int:
        data = b"" if self.command == "HEAD" else (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{self.path}</Resource><RequestId>fault-proxy</RequestId></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return status

    def _reset(self) -> None:
        """Close with RST (SO_LINGER 0) instead of a response."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True


# -- the session fixture ---------------------------------------------------------------------------


@dataclass
class S3:
    """The test S3 server: its endpoint, the bucket, and settings the project's clients use."""

    server: MotoServer
    bucket: str = BUCKET

    @property
    def endpoint(self) -> str:
        return self.server.url

    def prefix(self, name: str) -> str:
        """A fresh ``s3://bucket/name-xxxxxxxx`` prefix, so tests never see each other's objects."""
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:8]}"

    def settings(self, endpoint: str | None = None, **overrides) -> ObjectStoreSettings:
        """Object-store settings for ``endpoint`` (default: the server) with quick backoff."""
        values = dict(endpoint_url=endpoint or self.endpoint, region=REGION, backoff_initial_s=0.05,
                      backoff_max_s=0.5, read_timeout_s=1.5, connect_timeout_s=2.0)
        values.update(overrides)
        return ObjectStoreSettings(**values)

    def proxy(self, faults: Faults | None = None, lifetime_s: float = 120.0) -> FaultProxy:
        """A fault proxy in front of the server; use it as a context manager."""
        return FaultProxy(self.endpoint, faults or Faults(), lifetime_s=lifetime_s)


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 with the test bucket, and AWS credentials in the environment.

    Only the standard credential variables are set; every client gets the
    endpoint from ``ObjectStoreSettings`` (or, in the receiver-process test,
    from the environment it is started with).
    """
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    saved = {k: os.environ.get(k) for k in aws_environment()}
    try:
        server.create_bucket(BUCKET)
        os.environ.update(aws_environment())
        yield S3(server)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def s3_lab(root: Path, s3: S3, name: str):
    """A ``Lab`` whose catalog is ``s3://bucket/name-xxxx/catalog`` (payloads go next to it)."""
    from lab import Lab, tiny_shape

    lab = Lab(root, shape=tiny_shape())
    lab.catalog = f"{s3.prefix(name)}/catalog"
    return lab


def process_env(**extra: str) -> dict[str, str]:
    """Environment for a child process: ours without AWS or project settings, the harness's
    Prefect API, and ``extra``."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "CANONICAL_REFIT_", "FSSPEC_"))}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# -- a publisher that dies before its catalog record ---------------------------------------------


def crash_publish(argv: list[str]) -> None:
    """Run ``flows.publish`` with ``argv``, SIGKILLing this process as the catalog record is written."""
    from storage.catalog import Catalog

    def die(self, record):
        sys.stdout.write(f"killed before writing {self.record_url(record.version)}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    Catalog.write = die
    from flows.publish import main

    raise SystemExit(main(argv))


# -- read paths compared on the test server ------------------------------------------------------


def bench_reads(mib: int = 16, files: int = 8, concurrency: int = 4) -> None:
    """Print MB/s and peak traced memory of each way to read objects from moto (median of 3)."""
    import tempfile
    import tracemalloc
    from concurrent.futures import ThreadPoolExecutor

    from storage.objects import ObjectStore

    with tempfile.TemporaryDirectory(prefix="s3-bench-") as tmp:
        server = MotoServer(Path(tmp) / "moto.log").start()
        try:
            server.create_bucket(BUCKET)
            os.environ.update(aws_environment())
            store = ObjectStore(S3(server).settings(read_timeout_s=60))
            size = mib * 2**20
            urls = [f"s3://{BUCKET}/bench/{i:02d}.bin" for i in range(files)]
            for url in urls:
                store.put_immutable(url, os.urandom(size))
            fs, _ = store.locate(urls[0])
            paths = [store.locate(u)[1] for u in urls]
            ways = {
                "ObjectStore.download (s3fs get_file, streamed)":
                    lambda i: store.download(urls[i], Path(tmp) / f"{i}.bin", expected_size=size),
                "ObjectStore.read_bytes (HEAD + cat_file)": lambda i: store.read_bytes(urls[i], max_size=size),
                "s3fs cat_file": lambda i: fs.cat_file(paths[i]),
                "s3fs open(block_size=64 MiB).read()": lambda i: fs.open(paths[i], "rb", block_size=64 * 2**20).read(),
            }
            print(f"{files} objects of {mib} MiB on moto; MB = 10^6 bytes")
            for name, read in ways.items():
                tracemalloc.start()
                read(0)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                rates = []
                for _ in range(3):
                    start = time.perf_counter()
                    for i in range(files):
                        read(i)
                    rates.append(files * size / (time.perf_counter() - start) / 1e6)
                start = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    list(pool.map(read, range(files)))
                parallel = files * size / (time.perf_counter() - start) / 1e6
                print(f"{name:<50} sequential {sorted(rates)[1]:7.0f} MB/s   {concurrency} at a time "
                      f"{parallel:7.0f} MB/s   peak {peak / 2**20:6.1f} MiB per object")
        finally:
            server.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["crash-publish"]:
        crash_publish(sys.argv[2:])
    elif sys.argv[1:2] == ["bench"]:
        bench_reads(*(int(a) for a in sys.argv[2:5]))
    else:
        raise SystemExit("usage: python tests/s3_support.py crash-publish PUBLISH-ARGS... | bench [MIB FILES WORKERS]")
