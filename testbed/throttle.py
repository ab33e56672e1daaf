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

from storage.canonical import canonical_json

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
