"""A rate-limited object store: ``throttled:///abs/path`` over the local disk (the refit benchmark's slow link).

Reads through ``throttled://`` go to the local filesystem but are paced by one
process-wide link of ``bytes_per_s`` (a token schedule shared by every
thread, so eight concurrent downloads share the bandwidth as they would share
a NIC). Writes are not throttled. ``mirror_catalog`` makes a second catalog
whose records point their payload URIs at ``throttled://``, so the very same
published files can be fetched at a realistic bandwidth. Importing the module
registers the protocol with fsspec in this process.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from storage.jsonio.canonical import canonical_json

PROTOCOL = "throttled"
CHUNK = 1 * 2**20


class Link:
    """A shared link of fixed bandwidth: ``take(n)`` returns once ``n`` bytes would have arrived."""

    def __init__(self) -> None:
        self.bytes_per_s = 0.0
        self.bytes = 0
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            self.bytes += n
            if self.bytes_per_s <= 0:
                return
            now = time.monotonic()
            start = max(now, self._free_at)  # an idle link does not bank bandwidth
            self._free_at = start + n / self.bytes_per_s
            done = self._free_at
        wait = done - time.monotonic()
        if wait > 0:
            time.sleep(wait)


LINK = Link()


def configure(bytes_per_s: float) -> None:
    """Set the bandwidth of ``throttled://`` reads in this process (0: unlimited)."""
    LINK.bytes_per_s = float(bytes_per_s)


class ThrottledFileSystem(LocalFileSystem):
    """The local filesystem under ``throttled://``, with ``get_file``/``cat_file`` paced by ``LINK``."""

    protocol = (PROTOCOL,)

    def get_file(self, path1, path2, callback=None, **kwargs):
        path1 = self._strip_protocol(path1)
        with open(path1, "rb") as src, open(path2, "wb") as dst:
            while block := src.read(CHUNK):
                LINK.take(len(block))
                dst.write(block)

    def cat_file(self, path, start=None, end=None, **kwargs):
        path = self._strip_protocol(path)
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            start = 0 if start is None else (start if start >= 0 else max(0, size + start))
            end = size if end is None else (end if end >= 0 else size + end)
            fh.seek(start)
            parts = []
            left = max(0, end - start)
            while left:
                block = fh.read(min(CHUNK, left))
                if not block:
                    break
                LINK.take(len(block))
                parts.append(block)
                left -= len(block)
        return b"".join(parts)


def register() -> None:
    """Make ``throttled://`` known to fsspec in this process."""
    fsspec.register_implementation(PROTOCOL, ThrottledFileSystem, clobber=True)


def throttled_url(path: Path) -> str:
    return f"{PROTOCOL}://{Path(path).resolve()}"


def mirror_catalog(catalog_dir: Path, mirror_dir: Path) -> str:
    """Copy the catalog's records into ``mirror_dir`` with ``file://`` payload URIs made ``throttled://``.

    Only the small record files are rewritten; the payload files are shared.
    Returns the mirror's URL.
    """
    if mirror_dir.exists():
        shutil.rmtree(mirror_dir)
    mirror_dir.mkdir(parents=True)
    for path in sorted(Path(catalog_dir).glob("*.json")):
        record = json.loads(path.read_bytes())
        if isinstance(record.get("uri"), str) and record["uri"].startswith("file://"):
            record["uri"] = PROTOCOL + "://" + record["uri"][len("file://"):]
        (mirror_dir / path.name).write_bytes(canonical_json(record))
    return throttled_url(mirror_dir)


register()


# -- a per-TCP-connection bandwidth cap ----------------------------------------------------------


class ConnectionThrottle:
    """A TCP relay on 127.0.0.1 that caps every accepted connection at ``bytes_per_s`` toward the client.

    Unlike ``testbed.s3proxy`` (which paces each HTTP response body from its own start), the cap belongs to
    the TCP connection, as a network path or a server's per-connection limit applies it: a keep-alive
    connection carries its requests one after another at the one rate, headers included, with a burst of
    at most ``burst`` bytes after an idle moment. Bytes toward the server are relayed unpaced. Every
    accepted connection is counted (``accepted``), so a caller sees how many connections a client opened.
    """

    def __init__(self, upstream: str, bytes_per_s: float, burst: int = 64 * 2**10):
        from urllib.parse import urlsplit

        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.bytes_per_s, self.burst = float(bytes_per_s), burst
        self.accepted = 0
        self._sock = None

    def start(self) -> "ConnectionThrottle":
        import socket

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(server, client, self.bytes_per_s), daemon=True).start()
            threading.Thread(target=self._pipe, args=(client, server, 0.0), daemon=True).start()

    def _pipe(self, src, dst, bps: float) -> None:
        """Relay ``src`` to ``dst``; with ``bps``, a token bucket of ``burst`` bytes refilled at ``bps``."""
        import socket

        tokens, at = float(self.burst), time.monotonic()
        chunk = max(4096, min(self.burst, int(bps / 200) or self.burst)) if bps else 2**16
        try:
            while data := src.recv(chunk):
                if bps:
                    now = time.monotonic()
                    tokens = min(float(self.burst), tokens + (now - at) * bps) - len(data)
                    at = now
                    if tokens < 0:
                        time.sleep(-tokens / bps)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()


def _serve_tcp(argv: list[str]) -> int:
    """``python -m testbed.throttle UPSTREAM MB_PER_S``: a ``ConnectionThrottle`` printing its URL; runs until
    killed (a line ``accepted N`` on SIGTERM)."""
    import signal
    import sys

    throttle = ConnectionThrottle(argv[0], float(argv[1]) * 1e6).start()
    print(throttle.url, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    print(f"accepted {throttle.accepted}", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_serve_tcp(sys.argv[1:]))
