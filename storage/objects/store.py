"""Object storage through fsspec: the one place that knows about protocols.

``ObjectStore`` turns a URL (``s3://``, ``file://``, ``memory://``, any other
fsspec protocol, or a plain local path) into a filesystem and a path, and
offers the handful of operations the pipeline needs: bounded reads, ranged
resumable downloads into local files, create-only writes (concurrent multipart
uploads on S3) and listings. Every request is classified into transient errors
(retried with bounded exponential backoff and counted in ``TransferStats``)
and permanent ones (raised at once, URI in the message). Data requests share
one connection budget per store (``storage.objects.budget``). Nothing outside this
module branches on the protocol, except the choice of a source's kind of copy
(``storage.objects.sources``) it makes here.

The ranged downloads (``transfer``), multipart uploads (``multipart``), the
conditional-write probe (``conditional``) and the stats (``stats``) it drives
live in modules of their own; ``TransferStats`` stays importable from here.
Those that only moving bytes needs (``transfer``, ``multipart``,
``conditional``), fsspec and the S3 client are imported where a transfer or
a remote filesystem needs them: a ``file://`` URL resolves to
``storage.objects.localfiles``, so listing and reading local objects (``flows.fleet
status`` on a ``file://`` catalog) imports none of them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from storage.durable import atomic_write_bytes, copy_bytes, create_only_write
from storage.errors import (
    RefitError, ImmutableConflict, InvalidURI, PermanentStorageError, TransientStorageError,
)
from storage.objects.budget import ConnectionBudget
from storage.objects.classify import classify, local_error
from storage.objects.localfiles import LocalFiles
from storage.objects.s3client import s3_filesystem
from storage.objects.sources import FsspecSource, LocalSource, S3Source, open_regular, protocols_of, read_regular
from storage.objects.stats import TransferStats
from storage.settings import ObjectStoreSettings
from storage.urls import normalize_url

if TYPE_CHECKING:
    import fsspec

__all__ = ["ObjectStore", "TransferStats"]

log = logging.getLogger("canonical_refit.objects")
T = TypeVar("T")


_SHARED: dict[str, "ObjectStore"] = {}
_SHARED_LOCK = threading.Lock()
_SHARED_MAX = 16  # distinct settings kept (oldest dropped first)
# what else decides which credentials and endpoint a new S3 client picks up
_CLIENT_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION",
               "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE",
               "AWS_SHARED_CREDENTIALS_FILE")


class ObjectStore:
    """fsspec-backed object storage with retries, stats and create-only writes."""

    @classmethod
    def shared(cls, settings: ObjectStoreSettings | None = None, stats: TransferStats | None = None
               ) -> "ObjectStore":
        """This process's store for ``settings``, counting into ``stats``.

        Its S3 clients, their connections and the connection budget are kept
        between calls: a warm node agent or trainer pays for a client (about
        0.3 s: a session, credentials, a connection) once, not at every run.
        The AWS variables of the environment are part of the key, so changed
        credentials get a new client.
        """
        settings = settings or ObjectStoreSettings()
        key = settings.model_dump_json() + "".join(f"|{os.environ.get(k, '')}" for k in _CLIENT_ENV)
        with _SHARED_LOCK:
            store = _SHARED.pop(key, None) or cls(settings)
            _SHARED[key] = store  # most recently used last
            while len(_SHARED) > _SHARED_MAX:
                _SHARED.pop(next(iter(_SHARED)))
        return store.with_stats(stats or TransferStats())

    def __init__(self, settings: ObjectStoreSettings | None = None, stats: TransferStats | None = None):
        self.settings = settings or ObjectStoreSettings()
        self.stats = stats or TransferStats()
        self._filesystems: dict[str, fsspec.AbstractFileSystem] = {}
        self._fs_lock = threading.Lock()
        self.budget = ConnectionBudget(self.settings.concurrency)  # every GET body and upload part

    def with_stats(self, stats: TransferStats) -> "ObjectStore":
        """A view of this store that shares its filesystems and budget but counts into ``stats``."""
        view = ObjectStore.__new__(ObjectStore)
        view.settings, view.stats = self.settings, stats
        view._filesystems, view._fs_lock, view.budget = self._filesystems, self._fs_lock, self.budget
        return view

    # -- resolution ------------------------------------------------------------

    def locate(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        """Filesystem and path for ``url``; the only protocol switch in the project."""
        url = normalize_url(url)
        protocol = url.split("://", 1)[0]
        with self._fs_lock:
            fs = self._filesystems.get(protocol)
            if fs is None:
                fs = self._build_filesystem(protocol, url)
                self._filesystems[protocol] = fs
        return fs, fs._strip_protocol(url)

    def _build_filesystem(self, protocol: str, url: str) -> fsspec.AbstractFileSystem:
        if protocol in ("s3", "s3a"):
            return s3_filesystem(self.settings)
        if protocol == "file":  # fsspec's LocalFileSystem, without importing fsspec to list and read
            return LocalFiles()
        import fsspec

        try:
            return fsspec.url_to_fs(url)[0]
        except (ImportError, ValueError) as exc:
            raise InvalidURI(f"unsupported object storage protocol {protocol!r} ({exc})", file=url) from exc

    @staticmethod
    def is_local(fs: fsspec.AbstractFileSystem) -> bool:
        """Whether ``fs`` is the local filesystem (``file://``, or another protocol built on fsspec's)."""
        if isinstance(fs, LocalFiles):
            return True
        from fsspec.implementations.local import LocalFileSystem  # fs is fsspec's: fsspec is imported already

        return isinstance(fs, LocalFileSystem)

    def _source(self, fs: fsspec.AbstractFileSystem, path: str):
        """How to read an object: ranged S3 GETs, ranged reads of another remote filesystem, or a plain copy."""
        if self.is_local(fs) or "memory" in protocols_of(fs):
            return LocalSource(fs, path)
        if "s3" in protocols_of(fs):
            return S3Source(fs, path)
        return FsspecSource(fs, path)

    # -- retries -----------------------------------------------------------------

    def call(self, what: str, url: str, fn: Callable[[], T], *, check: Callable[[], None] | None = None) -> T:
        """Run ``fn`` under the request retry policy (``ObjectStoreSettings.retry_policy``).

        ``check`` (raising ``Cancelled``) is called while waiting between attempts.
        """
        attempts = 0

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            self.stats.add(attempts=1)
            try:
                return fn()
            except Exception as exc:  # classified here; nothing is swallowed
                err = classify(exc, url)
                if err is exc:
                    raise
                raise err from exc

        def on_retry(n: int, delay: float, err: BaseException) -> None:
            self.stats.add(retries=1, backoff_s=delay)
            log.warning("%s of %s failed (attempt %d/%d), retrying in %.2f s: %s", what, url, n,
                        self.settings.retry_attempts, delay, getattr(err, "reason", err))

        try:
            return self.settings.retry_policy().call(
                what, attempt, retryable=lambda e: isinstance(e, RefitError) and e.transient,
                wait=lambda delay: _sleep(delay, check), on_retry=on_retry)
        except RefitError as err:
            if not err.transient:
                raise
            raise TransientStorageError(f"{what} failed after {attempts} attempts: {err.reason}", file=url) from err

    # -- reads ---------------------------------------------------------------------

    def size(self, url: str) -> int:
        fs, path = self.locate(url)
        return int(self.call("stat", url, lambda: fs.size(path)))

    def exists(self, url: str) -> bool:
        fs, path = self.locate(url)
        return bool(self.call("exists", url, lambda: fs.exists(path)))

    def read_bytes(self, url: str, *, max_size: int) -> bytes:
        """Whole object, refusing objects larger than ``max_size`` before reading them."""
        fs, path = self.locate(url)
        if self.is_local(fs):  # a regular file only (a FIFO would block), never read past max_size
            data = self.call("read", url, lambda: read_regular(path, url, max_size))
            self.stats.add(bytes_read=len(data))
            return data

        def read() -> bytes:
            size = int(fs.size(path))
            if size > max_size:
                raise PermanentStorageError(f"object is {size} bytes, more than the {max_size} allowed", file=url)
            data = fs.cat_file(path)
            if len(data) != size:
                raise TransientStorageError(f"short read: {len(data)} of {size} bytes", file=url)
            return data

        data = self.call("read", url, read)
        self.stats.add(bytes_read=len(data))
        return data

    def read_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object; a short answer is a transient error."""
        fs, path = self.locate(url)

        def read() -> bytes:
            if self.is_local(fs):  # a regular file only: a FIFO would block
                fd = open_regular(path, url)
                try:
                    data = os.pread(fd, max(0, end - start), start)
                finally:
                    os.close(fd)
            else:
                data = fs.cat_file(path, start=start, end=end)
            if len(data) != end - start:
                raise TransientStorageError(f"short ranged read: {len(data)} of {end - start} bytes", file=url)
            return data

        data = self.call("ranged read", url, read)
        self.stats.add(bytes_read=len(data))
        return data

    def download(self, url: str, dest: Path, *, expected_size: int | None = None, max_size: int | None = None,
                 cancel: threading.Event | None = None, progress: Callable[[int], None] | None = None) -> int:
        """Fetch an object into ``dest`` (it appears whole or not at all); returns its size in bytes.

        ``expected_size`` (from an earlier ``size``) saves a HEAD for objects of
        at most one ``range_size``; a body shorter than it is a transient error,
        so the request is retried. A larger remote object is fetched as ranges
        in parallel, and a download interrupted in any way (even SIGKILL)
        resumes from its recorded ranges (``storage.objects.transfer``). ``cancel`` set
        stops it within one chunk (``Cancelled``); ``progress(n)`` is told of
        bytes as they land. Local file errors raise ``StoreError`` naming the file.
        """
        import storage.objects.transfer as transfer

        fs, path = self.locate(url)
        return transfer.download(self, self._source(fs, path), url, Path(dest), expected_size=expected_size,
                                 max_size=max_size, cancel=cancel, progress=progress)

    def list_names(self, url: str, suffix: str = "") -> list[str]:
        """Base names of the objects directly under ``url`` that end with ``suffix``."""
        fs, path = self.locate(url)

        def listing() -> list[str]:
            try:
                entries = fs.ls(path, detail=True)
            except FileNotFoundError:
                return []
            return [
                e["name"].rstrip("/").rsplit("/", 1)[-1]
                for e in entries
                if e.get("type") != "directory"
            ]

        names = self.call("list", url, listing)
        return sorted(n for n in names if n.endswith(suffix))

    def walk(self, url: str) -> list[tuple[str, int, float]]:
        """Every object under ``url`` (recursively): (path relative to ``url``, size, modification time in
        Unix seconds)."""
        fs, path = self.locate(url)
        root = path.rstrip("/") + "/"

        def listing() -> list[tuple[str, int, float]]:
            try:
                found = fs.find(path, detail=True)
            except FileNotFoundError:
                return []
            out = []
            for name, info in found.items():
                if info.get("type") == "directory" or not name.startswith(root):
                    continue
                when = info.get("LastModified") or info.get("mtime") or 0
                out.append((name[len(root):], int(info.get("size") or 0),
                            when.timestamp() if hasattr(when, "timestamp") else float(when)))
            return sorted(out)

        return self.call("list", url, listing)

    # -- writes ------------------------------------------------------------------------

    def delete_tree(self, url: str) -> None:
        """Remove every object under ``url`` (reclaiming an orphaned payload; nothing else is ever deleted)."""
        fs, path = self.locate(url)
        self.call("delete", url, lambda: fs.rm(path, recursive=True))

    def delete(self, url: str) -> bool:
        """Remove the object at ``url`` (for the few objects that are not immutable: node records); False if
        there was none."""
        fs, path = self.locate(url)

        def remove() -> bool:
            try:
                fs.rm_file(path)
                return True
            except FileNotFoundError:
                return False

        if not self.exists(url):
            return False
        return bool(self.call("delete", url, remove))

    def put_replace(self, url: str, data: bytes) -> None:
        """Write ``url`` whole, replacing what is there (for mutable objects such as a node's own record).

        Atomic for readers: a local file is replaced by rename, an S3 object by one PUT.
        """
        fs, path = self.locate(url)
        data = bytes(data)

        def put() -> None:
            if self.is_local(fs):
                atomic_write_bytes(Path(path), data)
            else:
                fs.pipe_file(path, data)

        self.call("write", url, put)
        self.stats.add(bytes_written=len(data))


    def put_immutable(self, url: str, data: bytes) -> bool:
        """Create ``url`` with ``data``; True if written, False if identical bytes were there.

        Different bytes already at ``url`` raise ``ImmutableConflict``.
        """
        fs, path = self.locate(url)
        data = bytes(data)

        def put() -> bool:
            try:
                if self.is_local(fs):
                    if not create_only_write(Path(path), lambda fh: fh.write(data)):
                        raise FileExistsError(path)
                else:
                    fs.pipe_file(path, data, mode="create")
                return True
            except FileExistsError:
                return False

        created = self.call("create-only write", url, put)
        if created:
            self.stats.add(bytes_written=len(data))
            return True
        # a different size is a conflict too, and must not be read (it may be large)
        if self.size(url) != len(data) or self.read_bytes(url, max_size=len(data)) != data:
            raise ImmutableConflict("a different object is already published here", file=url)
        return False

    def put_immutable_file(self, url: str, local: Path) -> bool:
        """Create ``url`` from a local file; same semantics as ``put_immutable``.

        On S3 a file under two parts is one conditional PUT, a larger one a
        multipart upload of ``block_size`` parts sent in parallel on the
        connection budget, whose completion is conditional; a failed one is
        aborted. A large file whose key already exists (a republish after a
        crash) is compared, not uploaded again.
        """
        fs, path = self.locate(url)
        local = Path(local)
        try:
            size = local.stat().st_size
        except OSError as exc:
            raise local_error(exc, local, url, "reading the file to upload") from exc
        part = self.settings.block_size
        multipart = size >= 2 * part and "s3" in protocols_of(fs)

        def put() -> bool:
            try:
                if self.is_local(fs):
                    if not create_only_write(Path(path), lambda fh: _copy_into(local, fh, size)):
                        raise FileExistsError(path)
                elif "s3" in protocols_of(fs):
                    fs.put_file(str(local), path, mode="create", chunksize=part)  # under 2 parts: one PUT
                else:
                    fs.put_file(str(local), path, mode="create")
                return True
            except FileExistsError:
                return False

        exists = size >= 2 * part and not self.is_local(fs) and self.exists(url)
        if not exists:
            if multipart:
                from storage.objects.multipart import S3Multipart, upload_parts

                created = upload_parts(self, S3Multipart(fs, path), url, local, part)
            else:
                created = self.call("create-only upload", url, put)
            if created:
                self.stats.add(bytes_written=size)
                return True
        if self.size(url) != size or not self._same_content(url, local):
            raise ImmutableConflict("a different object is already published here", file=url)
        return False

    def _same_content(self, url: str, local: Path) -> bool:
        size, chunk = local.stat().st_size, self.settings.block_size
        with open(local, "rb") as fh:
            for start in range(0, size, chunk):
                end = min(size, start + chunk)
                if self.read_range(url, start, end) != fh.read(end - start):
                    return False
        return True

    def ensure_conditional_writes(self, prefix_url: str, *, allow_unconditional: bool = False) -> None:
        """Check once per server and bucket that create-only writes are enforced (``storage.objects.conditional``:
        a server that ignores ``If-None-Match: *`` could let a publication replace an immutable revision)."""
        import storage.objects.conditional as conditional

        conditional.ensure_conditional_writes(self, prefix_url, allow_unconditional=allow_unconditional)


def _sleep(seconds: float, check: Callable[[], None] | None) -> None:
    """Sleep, calling ``check`` (which may raise) every 50 ms."""
    if check is None:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        check()
        time.sleep(min(left, 0.05))
    check()


def _copy_into(src: Path, dst_fh, size: int) -> None:
    with open(src, "rb") as fh:
        copy_bytes(fh, dst_fh, size)
