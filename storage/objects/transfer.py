"""Ranged, resumable downloads under one connection budget shared with the uploads.

``download`` fetches an object longer than ``range_size`` as byte ranges in
parallel on the store's ``ConnectionBudget`` (``storage.objects.budget``),
sized to the object (``range_plan``: at most ``range_size``, and as many
ranges as whole waves of the connection budget, so the last wave never runs
alone), each streamed in chunks of ``STREAM_CHUNK`` bytes and written in place
into a partial file whose durable record lets a download killed at any
instant resume from the last recorded byte of every range
(``storage.objects.partial``). When a connection finishes with no range left
waiting, the range still going with the most bytes to come is split onto it
(``_Download._split``), so ranges answered late do not leave the other
connections idle at the end. A range retried in the same process resumes
where its bytes stopped. Remote requests go through ``ObjectStore.call`` one
range at a time (retried and counted); local file errors become
``StoreError`` naming the local path. So an object of any size (a GB-scale
fused expert block) is fetched over every connection of the budget at once,
with memory bounded by the connections times ``STREAM_CHUNK``, never by the
object.

The sources (``storage.objects.sources``) are chosen by
``storage.objects.store``, the only module that knows about protocols; local
and in-memory objects are plain copies (``storage.objects.localcopy``);
uploads are in ``storage.objects.multipart``. The names this module held
before it was split (the budget, the sources, ``partial_paths``) are
importable from here as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from storage.errors import Cancelled, PermanentStorageError, TransientStorageError
from storage.objects.budget import ConnectionBudget, Requester, Stopped
from storage.objects.localcopy import copy_object
from storage.objects.partial import CHECKPOINT_INTERVAL_S, PartialFile, partial_paths
from storage.objects.sources import (
    STREAM_CHUNK, FsspecSource, LocalSource, S3Source, open_regular, read_regular,
)

__all__ = [
    "CHECKPOINT_INTERVAL_S", "MIN_PLANNED_RANGE", "RANGE_ALIGN", "SPLIT_MIN", "STREAM_CHUNK", "ConnectionBudget",
    "FsspecSource", "LocalSource", "S3Source", "download", "open_regular", "partial_paths", "range_plan",
    "read_regular",
]

log = logging.getLogger("canonical_refit.transfer")
RANGE_ALIGN = 2**18  # range sizes are multiples of this
MIN_PLANNED_RANGE = 8 * 2**20  # ranges are not split below this for the sake of whole waves
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



def download(store: Requester, source, url: str, dest: Path, *, expected_size: int | None = None,
             max_size: int | None = None, cancel: threading.Event | None = None,
             progress: Callable[[int], None] | None = None) -> int:
    """Fetch ``url`` into ``dest`` (see the module); returns the object's size in bytes."""
    job = _Download(store, source, url, Path(dest), cancel, progress)
    job.check()
    if not source.ranged:
        return copy_object(store, source, url, Path(dest), check=job.check, report=job._report,
                           expected_size=expected_size, max_size=max_size)
    return job.fetch(expected_size, max_size)


class _Download(PartialFile):
    def __init__(self, store: Requester, source, url: str, dest: Path, cancel, progress):
        self.store, self.source, self.url, self.dest = store, source, url, dest
        self.cancel, self.progress = cancel, progress
        self.range_size = store.settings.range_size
        self.failed = threading.Event()
        self.size, self.identity = 0, None
        self._init_partial(dest)
        # the ranges' geometry, under _split_lock: planned ranges keep their index; a split adds a new one
        self._claimed: dict[int, int] = {}  # index -> the offset up to which its request writes (or wrote)
        self._waiting: set[int] = set()  # submitted, not yet started
        self._flowing: dict[int, tuple[float, int]] = {}  # index -> (monotonic time, offset) of its first byte
        self._latency: float | None = None  # the shortest wait of this download's requests for their answer, s

    def check(self) -> None:
        """Raise if the caller cancelled, or another range of this download failed."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("download cancelled", file=self.url)
        if self.failed.is_set():
            raise Stopped("stopped: another range of this download failed", file=self.url)

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
