"""Where a download's bytes come from: an S3 object, an object of another remote fsspec filesystem, or a
local (or in-memory) file.

``S3Source`` and ``FsspecSource`` are ranged: ``open(start, end, identity, check)`` yields the announced
length and the body in chunks of ``STREAM_CHUNK`` bytes, so a cancel is seen within one chunk and no
body is ever held whole. ``LocalSource`` is a plain copy (``storage.objects.localcopy``). ``open_regular``
and ``read_regular`` read local files that must be regular files (a FIFO would block). Which source an
object gets is chosen by ``storage.objects.store``, the one place that knows about protocols.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import wait
from contextlib import contextmanager
from typing import Callable, Iterator

from storage.errors import NotRegularFile, PermanentStorageError, TransientStorageError
from storage.objects.classify import s3_error_code

STREAM_CHUNK = 2**19  # bytes per read of a streamed body: a cancel is seen within one chunk


def protocols_of(fs) -> tuple[str, ...]:
    """The protocol names of an fsspec filesystem."""
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


class S3Source:
    """An S3 object through s3fs's aiobotocore client; GET bodies are streamed chunk by chunk."""

    ranged = True

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self.bucket, self.key, self.version = fs.split_path(path)

    def stat(self) -> tuple[int, str | None]:
        """Size and ETag (one HEAD)."""
        info = self.fs.info(self.path)
        return int(info["size"]), info.get("ETag")

    @contextmanager
    def open(self, start: int, end: int | None, identity: str | None, check: Callable[[], None]):
        """(announced length, chunks) of bytes ``[start, end)``, or of the whole object if ``end`` is None.

        With ``identity`` the request is conditional (If-Match), so bytes of
        two versions of the object are never mixed. ``check`` is polled while
        waiting for the server; when it raises, the request is abandoned.
        """
        kw = {"Range": f"bytes={start}-{end - 1}"} if end is not None else {}
        if identity:
            kw["IfMatch"] = identity
        if self.version:
            kw["VersionId"] = self.version
        loop = self.fs.loop
        try:
            resp = _await(loop, self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key, **kw), check)
        except OSError as exc:
            if s3_error_code(exc) == "PreconditionFailed":
                raise PermanentStorageError(
                    f"the object changed during the download (its ETag is no longer {identity}); "
                    "download it again to start over") from exc
            raise
        from fsspec.asyn import sync  # an S3 source's filesystem is fsspec's: imported already

        body = resp["Body"]
        try:
            yield resp.get("ContentLength"), self._chunks(body, check)
        finally:
            try:
                sync(loop, body.aclose)
            except Exception:  # closing an abandoned body may fail; the connection is dropped anyway
                pass

    def _chunks(self, body, check: Callable[[], None]) -> Iterator[memoryview]:
        view = memoryview(bytearray(STREAM_CHUNK))
        while n := _await(self.fs.loop, _fill(body, view), check):
            yield view[:n]


def _await(loop, coro, check: Callable[[], None]):
    """Run ``coro`` on the filesystem's event loop; if ``check`` raises meanwhile, cancel it and re-raise."""
    import asyncio  # a remote filesystem's event loop runs: imported already

    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        while not wait([future], timeout=0.05).done:
            check()
    except BaseException:
        future.cancel()
        raise
    return future.result()


async def _fill(body, view: memoryview) -> int:
    """Fill ``view`` from ``body`` (short only at its end), in reads of 64 KiB so aiohttp buffers little."""
    got = 0
    while got < len(view):
        data = await body.read(min(len(view) - got, 2**16))
        if not data:
            break
        view[got:got + len(data)] = data
        got += len(data)
    return got


class FsspecSource:
    """An object of any other remote fsspec filesystem, read through ``fs.open``."""

    ranged = True

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def stat(self) -> tuple[int, str | None]:
        info = self.fs.info(self.path)
        keys = ("ETag", "etag", "md5Hash", "generation", "VersionId", "mtime")
        return int(info["size"]), next((str(info[k]) for k in keys if info.get(k)), None)

    @contextmanager
    def open(self, start: int, end: int | None, identity: str | None, check: Callable[[], None]):
        with self.fs.open(self.path, "rb") as fh:
            fh.seek(start)

            def chunks() -> Iterator[bytes]:
                left = None if end is None else end - start
                while left is None or left > 0:
                    data = fh.read(STREAM_CHUNK if left is None else min(STREAM_CHUNK, left))
                    if not data:
                        return
                    left = None if left is None else left - len(data)
                    yield data

            yield None, chunks()


class LocalSource:
    """An object on a local or in-memory filesystem: one plain copy, no ranges.

    A local file (``file://``) is opened without blocking and must be a regular file (a FIFO, socket or device
    is refused, never read); exactly the bytes its size announced are copied. In-memory objects (and other
    protocols built on the local filesystem) go through ``fs.get_file``.
    """

    ranged = False

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        protocols = protocols_of(fs)
        self.local = "file" in protocols or "local" in protocols  # plain local files (another protocol built
        # on the local filesystem keeps its own get_file)


def open_regular(path: str, url: str) -> int:
    """A read-only descriptor of the local regular file ``path`` (links followed), opened without blocking.

    A FIFO, socket, device or folder raises ``NotRegularFile`` naming ``url`` (a FIFO's ``open`` would block,
    and its size of 0 says nothing); other errors are the ``OSError`` of ``stat``/``open``.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(f"the object is not a regular file ({_kind(st.st_mode)}); refused without reading it",
                             file=url)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)  # what was opened, not what was there a moment before
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"the object is not a regular file ({_kind(st.st_mode)}); refused without "
                                 "reading it", file=url)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return f"mode {mode:o}"


def read_regular(path: str, url: str, max_size: int) -> bytes:
    """The whole local regular file ``path``, refused (unread) when it has more than ``max_size`` bytes and
    never read past ``max_size`` (a file growing meanwhile is a transient error)."""
    fd = open_regular(path, url)
    try:
        size = os.fstat(fd).st_size
        if size > max_size:
            raise PermanentStorageError(f"object is {size} bytes, more than the {max_size} allowed", file=url)
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(size + 1)
    finally:
        os.close(fd)
    if len(data) != size:
        raise TransientStorageError(f"the object changed while it was read ({len(data)} bytes where {size} were "
                                    "announced)", file=url)
    return data
