"""A counting tap in front of the Prefect API: what each node sends, request by request.

``ApiTap`` is a TCP proxy on 127.0.0.1, one per node. It forwards bytes
untouched and parses a copy of what the node sends: every HTTP/1.1 request
(method and path, ids folded by ``path_template``), and after a websocket
upgrade every message (an event sent to ``/events/in``), each a ``Hit``. It
sees exactly what the server sees from that node, without changing the agent.
``TapHub`` serves any number of taps from one event-loop thread.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit

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
    event: str | None = None  # the name of the event a websocket message carries ("prefect.task-run.Running")


def _event_name(payload: bytes, mask: bytes | None, inflate=None) -> str | None:
    """The ``event`` field of a (client-masked, maybe deflated) websocket message carrying one event."""
    if mask is not None:
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    try:
        if inflate is not None:
            payload = inflate.decompress(payload + b"\x00\x00\xff\xff")
    except zlib.error:
        return None
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return value.get("event") if isinstance(value, dict) else None


class _RequestParser:
    """Splits the client-to-server byte stream of one connection into HTTP/1.1 requests and websocket frames."""

    def __init__(self, tap: "ApiTap"):
        self.tap = tap
        self.buf = bytearray()
        self.mode = "head"
        self.remaining = 0
        self.ws_path = ""
        self._inflate = zlib.decompressobj(-zlib.MAX_WBITS)  # one per connection: deflate keeps its context

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
            mask = bytes(buf[offset:offset + 4]) if buf[1] & 0x80 else None
            if mask is not None:
                offset += 4
            if len(buf) < offset + length:
                return False
            payload = bytes(buf[offset:offset + length])
            compressed = bool(buf[0] & 0x40)  # RSV1: permessage-deflate (context kept across messages)
            del buf[:offset + length]
            if opcode in (1, 2):  # a text or binary message (pings, pongs and close frames are not counted)
                self.tap.hit(f"WS {self.ws_path}", offset + length,
                             event=_event_name(payload, mask, self._inflate if compressed else None))
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

    def hit(self, what: str, size: int, event: str | None = None) -> None:
        with self._lock:
            self.hits.append(Hit(time.time(), what, size, event))

    def events(self, start: float = 0.0, end: float | None = None) -> Counter:
        """Websocket event messages by event name (a task run's state changes fold to ``...task-run.<state>``)."""
        return Counter(h.event or "?" for h in self.between(start, end) if h.what == EVENT_MESSAGE)

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
