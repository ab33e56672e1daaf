"""The partial file of a ranged download and its durable record: what a download killed at any instant
resumes from.

Ranges are written in place (``pwrite``) into ``.{name}.part`` next to
``dest``. Bytes count only once they are fsynced and listed in the record
``.{name}.part.json`` (url, size, ETag, range size, ``done``: completed
ranges, ``partial``: the first bytes of ranges still going, by range, and
``split``: the bounds of ranges split or added, if any): a range is recorded
when it completes, and the ranges in flight every ``checkpoint_bytes`` landed
(at most every ``CHECKPOINT_INTERVAL_S``). A resume trusts a record only if it
matches the object and its ranges cover the object exactly once; ``dest``
only ever appears whole (a rename). Local file errors become ``StoreError``
naming the local path.

``PartialFile`` is the base class of the download (``storage.objects.transfer``)
holding these steps; the download owns the ranges' geometry (``pieces``,
``_plan``, under ``_split_lock``) that the record lists.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import field
from pathlib import Path
from typing import Annotated, Callable

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from storage.durable import atomic_write_json, fsync_dir
from storage.errors import StoreError
from storage.jsonio.bounded_json import STORE_RECORD, read_record
from storage.objects.classify import local_call, local_error

log = logging.getLogger("canonical_refit.transfer")
CHECKPOINT_INTERVAL_S = 0.025  # the ranges in flight are recorded at most this often


@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class PartialRecord:
    """Contents of ``.{name}.part.json``. Strict, and no key it does not know: a record this version cannot
    read whole is not resumed from (the download starts again), never half-understood."""

    url: str
    size: int
    identity: str
    range_size: int
    done: list[int]  # indices of the completed ranges
    partial: dict[str, int] = field(default_factory=dict)  # range index -> its first bytes recorded
    split: dict[str, Annotated[tuple[int, int], Field(strict=False)]] = field(default_factory=dict)


def read_partial_record(path: Path, url: str) -> PartialRecord | None:
    """The record at ``path`` of a download of ``url``; None if missing; ``StoreError`` naming both if it is
    not bounded JSON or not such a record."""
    return read_record(path, PartialRecord, STORE_RECORD, error=StoreError, missing_ok=True,
                       hint="; the download starts again", file=url, local_file=str(path))


def partial_paths(dest: Path) -> tuple[Path, Path]:
    """The partial file and its durable record for a download into ``dest``."""
    return dest.parent / f".{dest.name}.part", dest.parent / f".{dest.name}.part.json"


class PartialFile:
    """The partial file's steps: open and lock it, adopt a matching record, write, checkpoint, commit
    completed ranges, and finish (rename onto ``dest``) or keep what is recorded for a resume."""

    url: str
    dest: Path
    size: int
    identity: str | None
    range_size: int
    check: Callable[[], None]

    def _init_partial(self, dest: Path) -> None:
        self.part, self.record = partial_paths(dest)
        self.fd = -1
        self.done: set[int] = set()
        self._landed: dict[int, int] = {}  # bytes of each range in the partial file (recorded or not), reported
        self._recorded: dict[int, int] = {}  # bytes of each unfinished range listed in the record
        self._record_lock = threading.Lock()
        self._unrecorded, self._recorded_at = 0, 0.0
        self.checkpoint_bytes = 0
        self._split_lock = threading.Lock()  # the ranges' geometry (the download's) and what landed in them
        self._plan: dict[int, tuple[int, int]] = {}
        self.pieces: dict[int, tuple[int, int]] = {}  # index -> [start, end) now
        self._going: set[int] = set()  # started, not yet recorded as done

    def _local(self, doing: str, path: Path, fn: Callable, *args):
        return local_call(doing, path, self.url, fn, *args)

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
            record = read_partial_record(self.record, self.url)
        except StoreError as exc:
            log.info("not resuming %s: %s", self.url, exc)
            record = None
        ranges = with_splits(plan, record.split, self.size) if record is not None else None
        if (self.identity is not None and ranges is not None
                and (record.url, record.size, record.identity, record.range_size)
                == (self.url, self.size, self.identity, self.range_size)
                and all(i in ranges for i in record.done)
                and all(k.isdigit() and int(k) in ranges and int(k) not in record.done
                        and 0 < n <= ranges[int(k)][1] - ranges[int(k)][0] for k, n in record.partial.items())
                and self._local("reading the partial download", self.part, os.fstat, self.fd).st_size >= self.size):
            partial = {int(k): n for k, n in record.partial.items()}
            whole = {i for i, n in partial.items() if n == ranges[i][1] - ranges[i][0]}  # written, not yet listed
            return ranges, set(record.done) | whole, {i: n for i, n in partial.items() if i not in whole}
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



def with_splits(plan: dict[int, tuple[int, int]], split, size: int) -> dict[int, tuple[int, int]] | None:
    """The planned ranges with a record's ``split`` ({index: [start, end]}: shortened planned ranges and new
    ones) applied, or None unless they cover ``[0, size)`` exactly, each once."""
    if not isinstance(split, dict):
        return None
    ranges = dict(plan)
    for key, bounds in split.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(bounds, (list, tuple)) and len(bounds) == 2
                and all(type(b) is int for b in bounds) and 0 <= bounds[0] < bounds[1] <= size):
            return None
        ranges[int(key)] = (bounds[0], bounds[1])
    offset = 0
    for start, end in sorted(ranges.values()):
        if start != offset:
            return None
        offset = end
    return ranges if offset == size else None

