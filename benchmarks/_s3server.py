"""The transfer benchmark's minimal S3 server: ``python -m benchmarks.transfer --serve DIR`` runs it.

The S3 subset the benchmark needs (HEAD, ranged GET sent with ``sendfile``,
listing, create-only PUT, multipart upload with a create-only completion) over
a scratch folder: ``/bucket/key`` is the file ``root/bucket/key``. It answers
concurrent ranged GETs at once, from the page cache, with next to no CPU, as
real S3 answers requests for a large object; it checks no signatures.
"""

from __future__ import annotations

import email.utils
import os
import re
import shutil
import signal
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

MIB = 2**20
_XMLNS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


class S3Handler(BaseHTTPRequestHandler):
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
    handler = type("Handler", (S3Handler,), {"root": Path(root)})
    server = _Server(("127.0.0.1", 0), handler)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever(poll_interval=0.2)
