"""An HTTP proxy for S3 servers that injects faults and models real S3's per-connection limits.

``FaultProxy`` listens on 127.0.0.1 and forwards to an upstream S3 server.
For a configurable share of requests it answers ``503 SlowDown`` or ``500
InternalError``, resets the connection, stalls past the client's read
timeout, or truncates the response body. Faults are bounded: a request (same
method, path, query and range) is faulted at most ``max_per_key`` times, so a
client that retries enough always gets through. It can also deny paths with
``403 AccessDenied`` or ``404 NoSuchKey`` and strip conditional-write headers
(the behaviour of servers that overwrite silently).

To model S3 it can cap each connection's bandwidth (``bandwidth_bps``, bytes/s,
paced on response bodies as they stream to the client and on request bodies
as they are read) and delay every response by ``latency_s``. Every request is
logged (method, path, query, Range header, fault, status, body bytes sent and
received, start and end times); ``peak_open`` and ``max_in_flight_gets`` tell
how many requests overlapped. The proxy stops itself after ``lifetime_s``.

``python -m testbed.s3proxy UPSTREAM [--bandwidth-mb-s N] [--latency-ms N]``
serves one in its own process (so it does not share the client's GIL) and
prints its URL (the transfer benchmark runs it so). The tests put one in front
of their moto server (``tests/support/s3_support.py``); the fleet lab one in front of
each node's S3.

It stays one module of about 500 lines: the proxy, its request handler and
the pacing are one mechanism (the handler reads and updates the proxy's state
on every request), so a split would only spread it over files.
"""

from __future__ import annotations

import argparse
import http.client
import random
import signal
import logging
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

FAULT_KINDS = ("slowdown", "error500", "reset", "stall", "truncate")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
               "upgrade", "expect", "host"}
_CHUNK = 256 * 2**10
log = logging.getLogger("canonical_refit.testbed.s3proxy")


@dataclass
class Faults:
    """What the proxy does to requests. ``rate`` is the share of requests that get a fault."""

    rate: float = 0.0
    kinds: tuple[str, ...] = FAULT_KINDS
    max_per_key: int = 2          # a given request is faulted at most this many times
    max_total: int = 200
    stall_s: float = 2.0          # longer than the client's read timeout
    seed: int = 0
    deny: tuple[str, ...] = ()    # substrings of the path (and query) answered 403 AccessDenied ...
    deny_methods: tuple[str, ...] = ()  # ... only for these methods, if given (e.g. a write refused, reads not)
    missing: tuple[str, ...] = ()  # substrings of the path (and query) answered 404 NoSuchKey
    ranges: tuple[str, ...] = ()  # if given, only requests with one of these Range headers get faults
    strip_conditional: bool = False  # drop If-None-Match/If-Match: a server that overwrites silently
    get_latency_s: float = 0.0    # hold object GETs this long (makes concurrent fetches overlap) ...
    latency_suffix: str = ""      # ... those whose path ends with this; counted in max_in_flight_gets
    corrupt_puts: tuple[str, ...] = ()  # the first PUT whose path contains one of these has a byte flipped
    verify_checksums: bool = False  # as S3 does: a PUT whose body does not match its checksum header -> BadDigest


@dataclass
class Request:
    """One logged request; ``sent``/``received`` count body bytes, times are ``time.monotonic()``."""

    method: str
    path: str
    query: str
    range: str | None
    fault: str | None
    status: int | None
    sent: int = 0
    received: int = 0
    started: float = 0.0
    ended: float | None = None
    checksum: str | None = None  # the integrity header a write carried (x-amz-checksum-*, Content-MD5)


def peak_open(requests: list[Request]) -> int:
    """The most of ``requests`` that were open (received, response not yet finished) at one instant."""
    events = sorted([(r.started, 1) for r in requests]
                    + [(r.ended if r.ended is not None else float("inf"), -1) for r in requests])
    peak = open_now = 0
    for _, delta in events:  # at equal times an end (-1) sorts before a start
        open_now += delta
        peak = max(peak, open_now)
    return peak


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # many connections open at once; the default backlog of 5 drops SYNs

    def handle_error(self, request, client_address) -> None:
        """A client that hung up (a reset or a broken pipe: the faults this proxy injects, a killed agent) is
        logged at debug; anything else as socketserver does (its traceback on stderr)."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            log.debug("client %s hung up: %s", client_address, error)
            return
        super().handle_error(request, client_address)


@dataclass
class FaultProxy:
    """A bounded fault-injecting, optionally throttling HTTP proxy on 127.0.0.1 in front of ``upstream``."""

    upstream: str
    faults: Faults = field(default_factory=Faults)
    lifetime_s: float = 300.0
    log: list[Request] = field(default_factory=list)
    bandwidth_bps: float = 0.0   # per connection, each direction; 0: unlimited
    latency_s: float = 0.0       # before every response starts

    def __post_init__(self):
        parts = urlsplit(self.upstream)
        self._upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._rng = random.Random(self.faults.seed)
        self._per_key: dict[tuple, int] = {}
        self._injected = 0
        self._open_gets = 0
        self._corrupted: set[str] = set()
        self.max_in_flight_gets = 0
        self._stopping = threading.Event()
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._server = _Server(("127.0.0.1", 0), Handler)
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

    def outage(self, kind: str | None) -> None:
        """From now on answer every request with ``kind`` (e.g. "slowdown", "deny"); None ends the outage."""
        if kind is not None and kind not in _ERRORS:
            raise ValueError(f"unknown outage kind {kind!r}")
        self._outage = kind

    def choose(self, method: str, path: str, query: str, byte_range: str | None) -> str | None:
        """The fault for this request, or None (bounded per request and in total, except during an outage)."""
        if getattr(self, "_outage", None):
            return self._outage
        f = self.faults
        target = f"{path}?{query}" if query else path
        if any(d in target for d in f.deny) and (not f.deny_methods or method in f.deny_methods):
            return "deny"
        if any(m in target for m in f.missing):
            return "missing"
        if f.ranges and byte_range not in f.ranges:
            return None
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
            self._open_gets += 1
            self.max_in_flight_gets = max(self.max_in_flight_gets, self._open_gets)

    def get_finished(self) -> None:
        with self._lock:
            self._open_gets -= 1

    def injected(self) -> dict[str, int]:
        """How many of each fault were injected."""
        out: dict[str, int] = {}
        for r in self.requests():
            if r.fault:
                out[r.fault] = out.get(r.fault, 0) + 1
        return out

    def bytes_sent(self, path_contains: str = "", since: int = 0) -> int:
        """Response body bytes sent for requests (from log index ``since``) whose path contains this."""
        with self._lock:
            return sum(r.sent for r in self.log[since:] if path_contains in r.path)

    def wait(self, seconds: float) -> None:
        self._stopping.wait(seconds)


_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "error500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "deny": (403, "AccessDenied", "Access Denied"),
    "missing": (404, "NoSuchKey", "The specified key does not exist."),
}


class _Pace:
    """Paces one body to ``bps`` bytes/s (no-op when 0)."""

    def __init__(self, bps: float):
        self.bps, self.start, self.done = bps, time.monotonic(), 0
        self.chunk = _CHUNK if not bps else int(min(_CHUNK, max(16 * 2**10, bps / 100)))

    def took(self, n: int) -> None:
        self.done += n
        if self.bps:
            delay = self.start + self.done / self.bps - time.monotonic()
            if delay > 0:
                time.sleep(delay)


class _Body:
    """A request body of ``length`` bytes read from the client once, paced, as it is iterated."""

    def __init__(self, handler: "_ProxyHandler", length: int):
        self.handler, self.length = handler, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[bytes]:
        pace, left = _Pace(self.handler.owner.bandwidth_bps), self.length
        self.length = 0  # read once
        while left > 0:
            data = self.handler.rfile.read(min(left, pace.chunk))
            if not data:
                raise ConnectionError("the request body ended early")
            left -= len(data)
            self.handler._entry.received += len(data)
            pace.took(len(data))
            yield data


class _Refused(Exception):
    """An answer the proxy gives instead of forwarding: (status, S3 error code, message)."""


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # idle keep-alive connections end by themselves
    owner: FaultProxy

    def log_message(self, *args) -> None:  # keep test output clean; requests are in owner.log
        pass

    def do_GET(self):
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _body(self) -> "bytes | _Body":
        """The request body: streamed on as it is read (paced), or read whole if chunked."""
        if "chunked" not in (self.headers.get("Transfer-Encoding") or "").lower():
            return _Body(self, int(self.headers.get("Content-Length") or 0))
        chunks = []
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            chunks.append(b"".join(_Body(self, size)))
            self.rfile.readline()

    def _proxy(self) -> None:
        owner = self.owner
        if owner._stopping.is_set():  # kept-alive connections do not outlive the proxy
            self._reset()
            return
        started = time.monotonic()
        path, _, query = self.path.partition("?")
        byte_range = self.headers.get("Range")
        fault = owner.choose(self.command, path, query, byte_range)
        entry = Request(self.command, path, query, byte_range, fault, None, started=started)
        self._entry = entry
        self._counted = False
        body = self._body()
        if self.command == "PUT":
            entry.checksum = next((k.lower() for k in self.headers if k.lower().startswith("x-amz-checksum-")
                                   and k.lower() != "x-amz-checksum-algorithm" or k.lower() == "content-md5"), None)
            if owner.faults.corrupt_puts or owner.faults.verify_checksums:
                try:
                    body = self._checked(entry, b"".join(body) if isinstance(body, _Body) else body)
                except _Refused as refused:
                    owner.record(entry)
                    entry.status = self._send_error_xml(*refused.args)
                    return
        owner.record(entry)
        self._counted = self.command == "GET" and not query and path.endswith(owner.faults.latency_suffix)
        if self._counted:
            owner.get_started()
        try:
            self._respond(entry, body, fault)
        finally:
            self._close_entry()

    def _checked(self, entry: Request, body: bytes) -> bytes:
        """A PUT body, a byte flipped if ``corrupt_puts`` says so (once per matching path: in transit); with
        ``verify_checksums`` a body that does not match its CRC32 or MD5 header is refused, as S3 refuses it."""
        import base64
        import hashlib
        import zlib

        owner = self.owner
        with owner._lock:
            corrupt = body and any(c in entry.path for c in owner.faults.corrupt_puts) \
                and entry.path not in owner._corrupted
            if corrupt:
                owner._corrupted.add(entry.path)
        if corrupt:
            body = body[:len(body) // 2] + bytes([body[len(body) // 2] ^ 0x01]) + body[len(body) // 2 + 1:]
            entry.fault = "corrupt"
        if owner.faults.verify_checksums:
            crc, md5 = self.headers.get("x-amz-checksum-crc32"), self.headers.get("Content-MD5")
            if (crc is not None and base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode() != crc) or \
                    (md5 is not None and base64.b64encode(hashlib.md5(body).digest()).decode() != md5):
                entry.fault = "bad-digest"
                raise _Refused(400, "BadDigest", "The Content-MD5 or checksum value that you specified did not "
                                                 "match what the server received.")
        return body

    def _close_entry(self) -> None:
        """The request ends as its last bytes are about to be sent (before the client can see them),
        so a request the client makes after this answer always starts later (idempotent)."""
        if self._entry.ended is None:
            self._entry.ended = time.monotonic()
            if self._counted:
                self.owner.get_finished()

    def _respond(self, entry: Request, body: "bytes | _Body", fault: str | None) -> None:
        owner = self.owner
        if owner.latency_s:
            owner.wait(owner.latency_s)
        writes = self.command in ("PUT", "POST", "DELETE")
        if isinstance(body, _Body) and (fault in _ERRORS or fault == "stall" or (fault == "reset" and not writes)):
            b"".join(body)  # not forwarded: read it all, as a server would before answering
        if fault in _ERRORS:
            entry.status = self._send_error_xml(*_ERRORS[fault])
            return
        if fault == "stall":
            owner.wait(owner.faults.stall_s)
            self.close_connection = True
            return
        if fault == "reset" and not writes:
            self._reset()
            return
        if self.command == "GET" and not entry.query and owner.faults.get_latency_s \
                and entry.path.endswith(owner.faults.latency_suffix):
            owner.wait(owner.faults.get_latency_s)
        conn = http.client.HTTPConnection(*owner._upstream, timeout=60)
        try:
            response = self._forward(conn, body)
            entry.status = response.status
            if fault == "reset":  # the write landed, but the client never hears so
                response.read()
                self._reset()
                return
            self._relay(entry, response, truncate=fault == "truncate")
        finally:
            conn.close()

    def _forward(self, conn: http.client.HTTPConnection, body: "bytes | _Body") -> http.client.HTTPResponse:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if self.owner.faults.strip_conditional:
            headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
        if isinstance(body, bytes):
            self._entry.received = len(body)
        length = len(body)
        if length or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(length)
        conn.request(self.command, self.path, body=(iter(body) if isinstance(body, _Body) else body) if length
                     else None, headers=headers)
        return conn.getresponse()

    def _relay(self, entry: Request, response: http.client.HTTPResponse, truncate: bool) -> None:
        """Send the upstream response on, its body paced; ``truncate`` sends half of it and closes."""
        upstream = [(k, v) for k, v in response.getheaders()]
        length = response.getheader("Content-Length")
        data = None
        if length is None and self.command != "HEAD":  # a chunked answer: buffer it to know its length
            data = response.read()
            length = str(len(data))
        self.send_response(response.status)
        for name, value in upstream:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", length or "0")
        total = 0 if self.command == "HEAD" else int(length or 0)
        limit = total // 2 if truncate and total > 1 else total
        if not limit:
            self._close_entry()
        self.end_headers()
        pace = _Pace(self.owner.bandwidth_bps)
        offset = 0
        while offset < limit:
            if data is not None:
                chunk = data[offset:offset + min(pace.chunk, limit - offset)]
            else:
                chunk = response.read(min(pace.chunk, limit - offset))
            if not chunk:
                break
            if offset + len(chunk) >= limit:
                self._close_entry()
            self.wfile.write(chunk)
            offset += len(chunk)
            entry.sent = offset
            pace.took(len(chunk))
        if limit < total:
            self.wfile.flush()
            self.close_connection = True

    def _send_error_xml(self, status: int, code: str, message: str) -> int:
        data = b"" if self.command == "HEAD" else (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{escape(self.path)}</Resource><RequestId>fault-proxy</RequestId></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        self._close_entry()
        self.end_headers()
        self.wfile.write(data)
        return status

    def _reset(self) -> None:
        """Close with RST (SO_LINGER 0) instead of a response."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.s3proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("upstream", help="URL of the S3 server, e.g. http://127.0.0.1:9000")
    p.add_argument("--bandwidth-mb-s", type=float, default=0.0, help="per-connection cap, MB/s (0: none)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="delay before every response, ms")
    p.add_argument("--lifetime-s", type=float, default=3600.0, help="stop after this many seconds")
    args = p.parse_args(argv)
    proxy = FaultProxy(args.upstream, lifetime_s=args.lifetime_s, bandwidth_bps=args.bandwidth_mb_s * 1e6,
                       latency_s=args.latency_ms / 1e3)
    proxy.log = _NoLog()
    proxy.start()
    print(proxy.url, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: proxy.stop())
    while not proxy._stopping.wait(0.5):
        pass
    return 0


class _NoLog(list):
    """A log that keeps nothing (a long benchmark sends many requests)."""

    def append(self, item) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
