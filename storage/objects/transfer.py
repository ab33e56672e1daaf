"""Ranged, resumable downloads under one connection budget shared with the uploads.

``ConnectionBudget`` is the pool of ``concurrency`` request slots that an
``ObjectStore`` and its ``with_stats`` views share: every GET body and every
upload part runs on one of its threads. Callers submit requests and wait
without holding a slot, so a large download never keeps slots idle and no
caller waits for a slot held by another waiting caller.

``download`` fetches an object longer than ``range_size`` as byte ranges in
parallel, sized to the object (``range_plan``: at most ``range_size``, and as
many ranges as whole waves of the connection budget, so the last wave never
runs alone), each streamed in chunks of ``STREAM_CHUNK`` bytes and written in
place (``pwrite``) into ``.{name}.part`` next to ``dest``. When a connection
finishes with no range left waiting, the range still going with the most bytes
to come is split onto it (``_Download._split``), so ranges answered late do
not leave the other connections idle at the end. Bytes count only
once they are fsynced and listed in the durable record ``.{name}.part.json``
(url, size, ETag, range size, ``done``: completed ranges, ``partial``: the
first bytes of ranges still going, by range, and ``split``: the bounds of
ranges split or added, if any): a range is recorded when it
completes, and the ranges in flight every ``checkpoint_bytes`` landed (at
most every 25 ms). So a download killed at any instant resumes from the last
recorded byte of every range, never trusts unrecorded bytes, and ``dest``
only ever appears whole (a rename). A range retried in the same process
resumes where its bytes stopped. Remote
requests go through ``ObjectStore.call`` one range at a time (retried and
counted); local file errors become ``StoreError`` naming the local path.

The sources (``S3Source``, ``FsspecSource``, ``LocalSource``) are chosen by
``storage.objects.store``, the only module that knows about protocols; uploads
are in ``storage.objects.multipart``.

One module of about 820 lines: the connection budget, the sources and the resumable download
share one life cycle (a range is fetched on a budget slot, written, recorded), read best together.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import stat
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from fsspec.asyn import sync

from storage.objects.classify import local_error, s3_error_code
from storage.durable import atomic_write_json, copy_bytes, fsync_dir, read_json_file, temp_name
from storage.errors import (
    Cancelled, NotRegularFile, PermanentStorageError, StoreError, TransientStorageError,
)

if TYPE_CHECKING:
    from storage.objects.store import ObjectStore

log = logging.getLogger("canonical_refit.transfer")
STREAM_CHUNK = 2**19  # bytes per read of a streamed body: a cancel is seen within one chunk
RANGE_ALIGN = 2**18  # range sizes are multiples of this
MIN_PLANNED_RANGE = 8 * 2**20  # ranges are not split below this for the sake of whole waves
CHECKPOINT_INTERVAL_S = 0.025  # the ranges in flight are recorded at most this often
SPLIT_MIN = 2 * 2**20  # a range still going is split for an idle connection only if both halves get this much


def range_plan(size: int, range_size: int, connections: int) -> int:
    """The range size of a download of ``size`` bytes: at most ``range_size``, with the ranges in whole waves of
    ``connections`` (8 connections and 32 MiB: a 265 MiB object is 16 ranges of 16.75 MiB, not 8 of 32 MiB and
    a lone ninth); never below ``min(range_size, 8 MiB)``, each request's own cost."""
    if size <= range_size:
        return range_size
    waves = -(-size // (connections * range_size))
    planned = -(-size // (waves * connections))
    planned = -(-planned // RANGE_ALIGN) * RANGE_ALIGN
    return max(min(range_size, MIN_PLANNED_RANGE), min(range_size, planned))


class _Stopped(Cancelled):
    """A request not made because another request of the same transfer failed (never surfaces)."""


class ConnectionBudget:
    """At most ``slots`` data requests (GET bodies, upload parts) in flight, whoever asks."""

    def __init__(self, slots: int):
        self.slots = slots
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _BUDGETS.add(self)

    def _forget_pool(self) -> None:
        """In a forked child: the pool's threads did not survive the fork; start a new pool on demand."""
        self._pool, self._lock = None, threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.slots, thread_name_prefix="object-io")
        return self._pool.submit(fn, *args)

    def run(self, calls: dict, *, url: str, failed: threading.Event, cancel: threading.Event | None = None,
            on_success: Callable[[list], None] | None = None,
            more: Callable[[list], dict] | None = None) -> dict:
        """Run ``calls`` ({key: fn}) on the budget and return {key: result}.

        ``on_success(keys)`` runs in the calling thread after each batch of
        successes, failures or not; then, while nothing failed, ``more(keys)``
        may return further calls, submitted at once (a download splitting the
        rest of a slow range onto the connection just freed). The first failure
        sets ``failed`` (requests not yet started are dropped, as on ``cancel``)
        and is raised once every started request has ended, so no request
        outlives this call.
        """
        futures = {self.submit(fn): key for key, fn in calls.items()}
        pending, results, error, dropped = set(futures), {}, None, False
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                ok = []
                for f in finished:
                    if f.cancelled():
                        dropped = True
                    elif f.exception() is None:
                        results[futures[f]] = f.result()
                        ok.append(futures[f])
                    elif error is None or isinstance(error, _Stopped):
                        error = f.exception()
                if ok and on_success is not None:
                    try:
                        on_success(ok)
                    except StoreError as exc:
                        error, on_success = error or exc, None
                if error is not None:
                    failed.set()
                elif ok and more is not None and not failed.is_set():
                    for key, fn in more(ok).items():
                        future = self.submit(fn)
                        futures[future] = key
                        pending.add(future)
                if failed.is_set() or (cancel is not None and cancel.is_set()):
                    for f in pending:
                        f.cancel()
        finally:
            if pending:  # this thread is leaving early: stop the rest and wait for the running ones
                failed.set()
                for f in pending:
                    f.cancel()
                wait(pending)
        if error is not None:
            raise error
        if dropped:
            raise Cancelled("cancelled before all of its requests were made", file=url)
        return results


_BUDGETS: "weakref.WeakSet[ConnectionBudget]" = weakref.WeakSet()
os.register_at_fork(after_in_child=lambda: [b._forget_pool() for b in list(_BUDGETS)])


def partial_paths(dest: Path) -> tuple[Path, Path]:
    """The partial file and its durable record for a download into ``dest``."""
    return dest.parent / f".{dest.name}.part", dest.parent / f".{dest.name}.part.json"


# -- sources ------------------------------------------------------------------------------


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
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
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


# -- downloads ----------------------------------------------------------------------------------


def download(store: "ObjectStore", source, url: str, dest: Path, *, expected_size: int | None = None,
             max_size: int | None = None, cancel: threading.Event | None = None,
             progress: Callable[[int], None] | None = None) -> int:
    """Fetch ``url`` into ``dest`` (see the module); returns the object's size in bytes."""
    job = _Download(store, source, url, Path(dest), cancel, progress)
    job.check()
    if not source.ranged:
        return job.copy(expected_size, max_size)
    return job.fetch(expected_size, max_size)


class _Download:
    def __init__(self, store: "ObjectStore", source, url: str, dest: Path, cancel, progress):
        self.store, self.source, self.url, self.dest = store, source, url, dest
        self.cancel, self.progress = cancel, progress
        self.part, self.record = partial_paths(dest)
        self.range_size = store.settings.range_size
        self.failed = threading.Event()
        self.size, self.identity, self.fd = 0, None, -1
        self.done: set[int] = set()
        self._landed: dict[int, int] = {}  # bytes of each range in the partial file (recorded or not), reported
        self._recorded: dict[int, int] = {}  # bytes of each unfinished range listed in the record
        self._record_lock = threading.Lock()
        self._unrecorded, self._recorded_at = 0, 0.0
        self.checkpoint_bytes = 0
        # the ranges' geometry, under _split_lock: planned ranges keep their index; a split adds a new one
        self._split_lock = threading.Lock()
        self._plan: dict[int, tuple[int, int]] = {}
        self.pieces: dict[int, tuple[int, int]] = {}  # index -> [start, end) now
        self._claimed: dict[int, int] = {}  # index -> the offset up to which its request writes (or wrote)
        self._waiting: set[int] = set()  # submitted, not yet started
        self._going: set[int] = set()  # started, not yet recorded as done
        self._flowing: dict[int, tuple[float, int]] = {}  # index -> (monotonic time, offset) of its first byte
        self._latency: float | None = None  # the shortest wait of this download's requests for their answer, s

    def check(self) -> None:
        """Raise if the caller cancelled, or another range of this download failed."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("download cancelled", file=self.url)
        if self.failed.is_set():
            raise _Stopped("stopped: another range of this download failed", file=self.url)

    def fetch(self, expected_size: int | None, max_size: int | None) -> int:
        if expected_size is not None and expected_size <= self.range_size:
            self.size = expected_size  # one request and no HEAD, as for any small object
        else:
            self.size, self.identity = self.store.call("stat", self.url, lambda: self._stat(expected_size),
                                                       check=self.check)
        if max_size is not None and self.size > max_size:
            raise PermanentStorageError(f"object is {self.size} bytes, more than the {max_size} allowed",
                                        file=self.url)
        self._open_part()
        try:
            if self.size <= self.range_size:
                self._single()
            else:
                self._ranged()
        finally:
            os.close(self.fd)  # releases the lock
        return self.size

    def _stat(self, expected_size: int | None) -> tuple[int, str | None]:
        size, identity = self.source.stat()
        if expected_size is not None and size != expected_size:
            raise TransientStorageError(f"the object has {size} bytes, {expected_size} were expected", file=self.url)
        return size, identity

    # -- the two shapes of a remote download ----------------------------------------------------

    def _single(self) -> None:
        """One streamed GET; nothing to resume, so no record."""
        try:
            self._local("discarding an old partial download", self.part, self._truncate, 0)
            self._discard_record()
            self.store.budget.run({0: lambda: self.store.call("download", self.url, lambda: self._stream(None),
                                                              check=self.check)},
                                  url=self.url, failed=self.failed, cancel=self.cancel)
            self._finish()
        except BaseException:
            self._remove_partial()
            raise

    def _ranged(self) -> None:
        size = self.size
        self.range_size = rs = range_plan(size, self.range_size, self.store.budget.slots)
        self.checkpoint_bytes = max(2 * STREAM_CHUNK, size // 64)
        self._plan = {i: (start, min(start + rs, size)) for i, start in enumerate(range(0, size, rs))}
        self.pieces, self.done, partial = self._adopt(self._plan)
        ranges = self.pieces
        self._recorded, self._landed = dict(partial), dict(partial)
        self._next_index = max(ranges) + 1
        self._claimed = {i: start + partial.get(i, 0) for i, (start, _) in ranges.items()}
        have = sum(end - start for i, (start, end) in ranges.items() if i in self.done) + sum(partial.values())
        if have:
            log.info("resuming the download of %s: %d of %d bytes are already in %s", self.url, have, size, self.part)
            self._report(have)
        calls = {i: self._call(i) for i in sorted(ranges) if i not in self.done}
        self._waiting = set(calls)
        try:
            self.store.budget.run(calls, url=self.url, failed=self.failed, cancel=self.cancel,
                                  on_success=self._commit, more=self._split)
            self._finish()
        except BaseException:
            if (self.done or self._recorded) and self.identity is not None:
                kept = sum(end - start for i, (start, end) in ranges.items() if i in self.done)
                kept += sum(n for i, n in self._recorded.items() if i not in self.done)
                log.info("download of %s stopped with %d of %d bytes recorded in %s; the next download resumes",
                         self.url, kept, size, self.part)
            else:
                self._remove_partial()
            raise

    def _call(self, index: int) -> Callable[[], int]:
        return lambda: self._fetch(index)

    def _fetch(self, index: int) -> int:
        """One request (on a budget slot) for range ``index``, retried through ``ObjectStore.call``."""
        with self._split_lock:
            self._waiting.discard(index)
            self._going.add(index)
            start, end = self.pieces[index]
        self.check()
        return self.store.call(f"ranged read of bytes {start}-{end - 1}", self.url, lambda: self._stream(index),
                               check=self.check)

    def _split(self, finished: list[int]) -> dict[int, Callable[[], int]]:
        """Connections freed by ``finished`` ranges and no range of this download left waiting: split the range
        still going with the most bytes to come, so that the freed connection fetches its second part (the
        first request stops where that part begins). Without this, ranges whose answers came late (a server
        that serializes the start of requests, a slow connection) leave the other connections idle at the
        end of the download. The split point lets both parts end together, given the range's rate so far and
        the shortest wait for an answer seen in this download (what one more request costs; the first
        wave's later answers also waited for the others); no split leaves a part under ``SPLIT_MIN``
        bytes or saves less than that wait. The record lists the new geometry, so a resume trusts every
        recorded byte."""
        calls = {}
        with self._split_lock:
            for _ in finished:
                if self._waiting:
                    break
                now = time.monotonic()
                going = [(self.pieces[i][1] - self._claimed[i], i) for i in self._going
                         if i not in self.done and i in self._flowing]
                if not going:
                    break
                left, index = max(going)
                began, offset = self._flowing[index]
                latency = self._latency or 0.0
                rate = (self._claimed[index] - offset) / max(now - began, 1e-3)  # bytes/s of its connection
                # the new request's bytes start after one request's wait; the range keeps what it fetches
                # meanwhile plus half the rest, so both end together; no split where the wait eats the gain
                keep = (left + int(rate * latency)) // 2
                if left - keep < SPLIT_MIN or left < rate * 2 * latency:
                    break
                start, end = self.pieces[index]
                middle = self._claimed[index] + keep
                new = self._next_index
                self._next_index += 1
                self.pieces[index], self.pieces[new] = (start, middle), (middle, end)
                self._claimed[new] = middle
                self._waiting.add(new)
                calls[new] = self._call(new)
        if calls:
            log.debug("download of %s: ranges split for idle connections: %s", self.url,
                      {i: self.pieces[i] for i in calls})
        return calls

    def _stream(self, index: int | None) -> int:
        """Stream range ``index`` (None: the whole object, one request) into the partial file from its first byte
        not yet landed. The range may shrink meanwhile (``_split``): its request then stops at its new end."""
        self.check()
        if index is None:
            start, stop, origin = 0, self.size, 0
        else:
            with self._split_lock:
                start, stop = self.pieces[index]
            origin = self._landed.get(index, 0)  # the range's bytes already in the file
        first = start + origin
        if first >= stop:
            return stop - start
        length, got = stop - first, 0
        asked = time.monotonic()
        with self.source.open(first, None if index is None else stop, self.identity,
                              self.check) as (announced, chunks):
            if index is not None:
                with self._split_lock:
                    answered = time.monotonic()
                    wait_s = answered - asked  # the first wave's later answers also waited for the others
                    self._latency = wait_s if self._latency is None else min(self._latency, wait_s)
                    self._flowing[index] = (answered, first)
            if announced is not None and announced != length:
                raise TransientStorageError(f"the server answered {announced} bytes for a request of {length} "
                                            f"at offset {first}", file=self.url)
            for chunk in chunks:
                self.check()
                if got + len(chunk) > length:
                    raise TransientStorageError(f"the body is longer than the {length} bytes asked for "
                                                f"at offset {first}", file=self.url)
                n = len(chunk)
                if index is not None:
                    with self._split_lock:
                        stop = self.pieces[index][1]
                        n = max(0, min(n, stop - first - got))
                        self._claimed[index] = first + got + n
                self._write(chunk[:n], first + got)
                got += n
                self.store.stats.add(bytes_read=len(chunk))
                if index is None:
                    self._land(0, got)  # a retry starts over: only bytes beyond the last attempt's are reported
                    continue
                self._land(index, origin + got)
                self._checkpoint(n)
                if first + got >= stop:
                    break  # split: the rest is another request's; closing the body drops this connection
        if first + got != stop:
            raise TransientStorageError(f"short read: {got} of {stop - first} bytes at offset {first}",
                                        file=self.url)
        return stop - start

    # -- local files (never classified as remote errors) ----------------------------------------

    def _local(self, doing: str, path: Path, fn: Callable, *args):
        return _local(doing, path, self.url, fn, *args)

    def _open_part(self) -> None:
        """Open and lock the partial file (another download into the same ``dest`` waits)."""
        while True:
            if os.path.islink(self.part):  # a link planted in the cache is removed, never written through
                self._local("removing a link in the cache", self.part, os.unlink, self.part)
            fd = self._local("creating the partial download", self.part, os.open, self.part,
                             os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                waited = False
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if not waited:
                            log.info("waiting for another download into %s", self.dest)
                            waited = True
                        self.check()
                        time.sleep(0.05)
                try:
                    same = os.stat(self.part).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False  # the other download finished (renamed it) or discarded it
            except BaseException:
                os.close(fd)
                raise
            if same:
                self.fd = fd
                return
            os.close(fd)

    def _truncate(self, size: int) -> None:
        os.ftruncate(self.fd, 0)
        if size:
            os.ftruncate(self.fd, size)  # sparse: ranges land at their offsets

    def _write(self, data, offset: int) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            raise local_error(exc, self.part, self.url, "writing the partial download") from exc

    def _adopt(self, plan: dict[int, tuple[int, int]]
               ) -> tuple[dict[int, tuple[int, int]], set[int], dict[int, int]]:
        """The ranges (the plan with the record's splits), the completed ones and the recorded first bytes of the
        others, of a matching record; anything else starts from zero with the plan."""
        try:
            record = read_json_file(self.record)  # None if missing; bounded strict JSON
        except (OSError, ValueError):
            record = "unreadable"
        want = {"url": self.url, "size": self.size, "identity": self.identity, "range_size": self.range_size}
        done = record.get("done") if isinstance(record, dict) else None
        partial = record.get("partial", {}) if isinstance(record, dict) else None
        ranges = _with_splits(plan, record.get("split", {}), self.size) if isinstance(record, dict) else None
        if (self.identity is not None and ranges is not None and isinstance(done, list)
                and isinstance(partial, dict)
                and all(record.get(k) == v for k, v in want.items())
                and all(type(i) is int and i in ranges for i in done)
                and all(k.isdigit() and int(k) in ranges and int(k) not in done and type(n) is int
                        and 0 < n <= ranges[int(k)][1] - ranges[int(k)][0] for k, n in partial.items())
                and self._local("reading the partial download", self.part, os.fstat, self.fd).st_size >= self.size):
            partial = {int(k): n for k, n in partial.items()}
            whole = {i for i, n in partial.items() if n == ranges[i][1] - ranges[i][0]}  # written, not yet listed
            return ranges, set(done) | whole, {i: n for i, n in partial.items() if i not in whole}
        if record is not None:
            log.info("not resuming %s: the record %s is for another object, version or range size",
                     self.url, self.record)
        self._discard_record()
        self._local("preparing the partial download", self.part, self._truncate, self.size)
        return dict(plan), set(), {}

    def _commit(self, indices: list[int]) -> None:
        """Ranges whose bytes are written: fsync them, then record them (durably, atomically)."""
        with self._split_lock:
            self._going.difference_update(indices)
        with self._record_lock:
            self.done.update(indices)
            self._record()

    def _checkpoint(self, n: int) -> None:
        """After ``n`` more bytes landed: record the ranges in flight once ``checkpoint_bytes`` are unrecorded
        (a kill then costs at most that much again). Skipped while another thread records."""
        self._unrecorded += n
        if (self._unrecorded < self.checkpoint_bytes or time.monotonic() - self._recorded_at < CHECKPOINT_INTERVAL_S
                or not self._record_lock.acquire(blocking=False)):
            return
        try:
            self._record()
        finally:
            self._record_lock.release()

    def _record(self) -> None:
        """fsync the partial file, then write the record of what it held before the fsync (under the lock)."""
        with self._split_lock:  # what landed, and the geometry it landed in (a split never cuts landed bytes)
            written = {i: n for i, n in list(self._landed.items()) if i not in self.done and n > 0}
            split = {str(i): list(r) for i, r in sorted(self.pieces.items()) if self._plan.get(i) != r}
        self._unrecorded, self._recorded_at = 0, time.monotonic()
        self._local("syncing the partial download", self.part, os.fsync, self.fd)
        if self.identity is None:
            return  # nothing to check a later resume against: not resumable
        record = {"url": self.url, "size": self.size, "identity": self.identity, "range_size": self.range_size,
                  "done": sorted(self.done), "partial": {str(i): n for i, n in sorted(written.items())}}
        if split:
            record["split"] = split
        self._local("recording the completed ranges", self.record, atomic_write_json, self.record, record)
        self._recorded = written

    def _finish(self) -> None:
        """fsync, rename the partial file onto ``dest``, drop the record, fsync the folder."""
        got = self._local("checking the partial download", self.part, os.fstat, self.fd).st_size
        if got != self.size:
            raise StoreError(f"the partial download holds {got} bytes, the object has {self.size}",
                             file=self.url, local_file=str(self.part))
        self._local("syncing the download", self.part, os.fsync, self.fd)
        self._local("moving the download into place", self.dest, os.replace, self.part, self.dest)
        self._local("removing the download's record", self.record, self.record.unlink, True)
        self._local("syncing the download's folder", self.dest.parent, fsync_dir, self.dest.parent)

    def _discard_record(self) -> None:
        if self.record.exists():
            self._local("discarding the record of a partial download", self.record, self.record.unlink, True)
            self._local("discarding the record of a partial download", self.record, fsync_dir, self.record.parent)

    def _remove_partial(self) -> None:
        for path in (self.record, self.part):
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove %s after a failed download of %s: %s", path, self.url, exc)

    # -- progress -------------------------------------------------------------------------------

    def _land(self, index: int, got: int) -> None:
        """Report bytes of range ``index`` beyond what an earlier attempt of it already reported."""
        before = self._landed.get(index, 0)
        if got > before:
            self._landed[index] = got
            self._report(got - before)

    def _report(self, n: int) -> None:
        if self.progress is not None and n:
            self.progress(n)

    # -- local filesystems ----------------------------------------------------------------------

    def copy(self, expected_size: int | None, max_size: int | None) -> int:
        """A plain copy through ``fs.get_file`` into a temporary file, then a rename."""
        fs, path = self.source.fs, self.source.path
        tmp = self.dest.with_name(temp_name(self.dest.name))
        self._local("creating the download's temporary file", tmp, tmp.write_bytes, b"")

        def fetch() -> int:
            self.check()
            if self.source.local:
                return self._copy_regular(path, tmp, expected_size, max_size)
            expected = int(fs.size(path)) if expected_size is None else expected_size
            if max_size is not None and expected > max_size:
                raise PermanentStorageError(f"object is {expected} bytes, more than the {max_size} allowed",
                                            file=self.url)
            try:
                fs.get_file(path, str(tmp))
            except OSError as exc:
                if str(tmp) in (getattr(exc, "filename", None), getattr(exc, "filename2", None)):
                    raise local_error(exc, tmp, self.url, "copying the object") from exc
                raise
            got = self._local("checking the download", tmp, os.path.getsize, tmp)
            if got != expected:
                raise TransientStorageError(f"download returned {got} bytes, the object has {expected}", file=self.url)
            return expected

        try:
            size = self.store.call("download", self.url, fetch, check=self.check)
            self._local("syncing the download", tmp, _fsync_file, tmp)
            self._local("moving the download into place", self.dest, os.replace, tmp, self.dest)
            self._local("syncing the download's folder", self.dest.parent, fsync_dir, self.dest.parent)
        finally:
            tmp.unlink(missing_ok=True)
        self.store.stats.add(bytes_read=size)
        self._report(size)
        return size


    def _copy_regular(self, path: str, tmp: Path, expected_size: int | None, max_size: int | None) -> int:
        """Copy exactly the announced bytes of a local regular file into ``tmp`` (never more than ``max_size``)."""
        fd = open_regular(path, self.url)
        try:
            size = os.fstat(fd).st_size
            if max_size is not None and size > max_size:
                raise PermanentStorageError(f"object is {size} bytes, more than the {max_size} allowed; "
                                            "not downloaded", file=self.url)
            if expected_size is not None and size != expected_size:
                raise TransientStorageError(f"the object has {size} bytes, {expected_size} were expected",
                                            file=self.url)
            with os.fdopen(os.dup(fd), "rb") as fin:
                try:
                    out = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError as exc:
                    raise local_error(exc, tmp, self.url, "copying the object") from exc
                with os.fdopen(out, "wb") as fout:
                    try:
                        copy_bytes(fin, fout, size, stop=None)
                    except OSError as exc:
                        if exc.errno == errno.EIO and os.fstat(fd).st_size < size:  # shrank while copied
                            raise TransientStorageError(f"the object shrank while it was copied ({exc})",
                                                        file=self.url) from exc
                        raise local_error(exc, tmp, self.url, "copying the object") from exc
            if os.fstat(fd).st_size != size:  # grew (or shrank) while copied: what was copied is not the object
                raise TransientStorageError(f"the object changed size while it was copied (from {size} bytes)",
                                            file=self.url)
        finally:
            os.close(fd)
        return size


def _with_splits(plan: dict[int, tuple[int, int]], split, size: int) -> dict[int, tuple[int, int]] | None:
    """The planned ranges with a record's ``split`` ({index: [start, end]}: shortened planned ranges and new
    ones) applied, or None unless they cover ``[0, size)`` exactly, each once."""
    if not isinstance(split, dict):
        return None
    ranges = dict(plan)
    for key, bounds in split.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(bounds, list) and len(bounds) == 2
                and all(type(b) is int for b in bounds) and 0 <= bounds[0] < bounds[1] <= size):
            return None
        ranges[int(key)] = (bounds[0], bounds[1])
    offset = 0
    for start, end in sorted(ranges.values()):
        if start != offset:
            return None
        offset = end
    return ranges if offset == size else None


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def _local(doing: str, path: Path, url: str, fn: Callable, *args):
    """``fn(*args)``, a local file operation: its ``OSError`` becomes a ``StoreError`` naming ``path``."""
    try:
        return fn(*args)
    except OSError as exc:
        raise local_error(exc, path, url, doing) from exc
