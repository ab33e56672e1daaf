"""What every receiver stage works with: parameters, stores, catalog, ledger, progress."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from storage.store.artifacts import ArtifactCache
from storage.runtime.cancel import StopToken, current_stop
from storage.catalog.records import Catalog
from storage.catalog.signing import RecordVerifier
from storage.durable import remove_tree
from storage.runtime.gc_pause import gc_paused
from storage.runtime.killpoints import killpoint
from storage.store.local_store import LocalStore
from storage.objects.store import ObjectStore, TransferStats
from storage.settings import RefitParams
from tasks.stage import Ledger, StageRecord, measuring

log = logging.getLogger("canonical_refit.receiver")


STAGE_ORDER = ("resolve catalog", "seed checkpoint", "fetch index", "fetch buckets", "apply deltas",
               "verify digest", "install", "activate")


class Progress:
    """Thread-safe byte counter that reports at most every ``interval_s``."""

    def __init__(self, label: str, total: int, report: Callable[[str, int, int], None] | None, interval_s=1.0):
        self.label, self.total, self.done = label, total, 0
        self._report, self._interval = report, interval_s
        self._lock = threading.Lock()
        self._last = 0.0

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            due = now - self._last >= self._interval or self.done >= self.total
            if due:
                self._last = now
        if due and self._report:
            self._report(self.label, self.done, self.total)


class _StageObjects:
    """Object storage as the catalog sees it, resolved at each use: counting into the stage that runs in the
    calling thread, or (a thread of no stage: the catalog's own read pool) into the one stage running, if only
    one is. Nothing is swapped while two stages run on two threads (fetch beside apply)."""

    def __init__(self, rx: "Receiver"):
        self._rx = rx

    def __getattr__(self, name: str):
        return getattr(self._rx.stage_objects(), name)


class Receiver:
    """The stores, settings and stop token one refit run works with (no Prefect here)."""

    def __init__(self, params: RefitParams, *, installer=None,
                 progress: Callable[[str, int, int], None] | None = None, stop: StopToken | None = None):
        self.params = params
        self.stop = (stop or current_stop.get()).child()  # stops when its run is interrupted, or on its own
        self.store = LocalStore(params.cache_dir, params.model, quota_bytes=params.quota_bytes, create=False)
        self.artifacts = ArtifactCache(self.store)
        self._objects = ObjectStore.shared(params.storage)
        self._stage_view = threading.local()  # fetch and apply run at once: each stage counts its own requests
        self._running: list[ObjectStore] = []  # the views of the stages running now
        self.catalog = Catalog(_StageObjects(self), params.catalog, params.model, cache_dir=self.store.catalog_dir,
                               verify=RecordVerifier.from_settings(params.trusted_keys))
        self.ledger = Ledger(STAGE_ORDER, log=log)
        self.report_progress = progress
        self.installer = installer
        self.lock = None
        self.recovery: tuple[str, ...] = ()  # what the recovery at the start of preparation did
        self.attempt = 1  # of the whole run, when it is retried after a transient failure

    @property
    def objects(self) -> ObjectStore:
        """Object storage, counting into the stage that runs in this thread."""
        return getattr(self._stage_view, "objects", None) or self._objects

    def stage_objects(self) -> ObjectStore:
        """``objects``; from a thread of no stage, the one stage's view while only one stage runs."""
        own = getattr(self._stage_view, "objects", None)
        if own is not None:
            return own
        running = self._running
        return running[0] if len(running) == 1 else self._objects

    @property
    def deadline_s(self) -> float | None:
        """Each interruptible stage's deadline, in seconds (``tasks.stage.Deadline``); None: none."""
        return self.params.stage_deadline_s

    @property
    def revision(self) -> str:
        """The revision this run installs: the resolved target once ``resolve catalog`` ran, else as asked."""
        return self.ledger.lineage[-1] if self.ledger.lineage else self.params.target

    def progress(self, label: str, total: int) -> Progress:
        return Progress(label, total, self.report_progress)

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRecord]:
        """Measure one stage: wall time, and the requests, retries and backoff it caused."""
        stats = TransferStats()
        view = self._stage_view.objects = self._objects.with_stats(stats)
        self._running.append(view)
        try:
            with measuring(self.ledger.record(name), self.stop) as record:
                yield record
        finally:
            snap = stats.snapshot()
            record.requests += snap["attempts"]
            record.retries += snap["retries"]
            record.backoff_s += snap["backoff_s"]
            self._stage_view.objects = None
            self._running.remove(view)

    @contextmanager
    def preparation(self, first: Callable[["Receiver"], None] | None = None) -> Iterator:
        """Hold the store lock exclusively for stages 1-6 (``downgrade`` it for the installation fence).

        The store's folders are created under the lock, on first use. While the
        lock is held the cyclic garbage collector is paused (``gc_paused``):
        every stage makes objects per tensor (headers, plans, checksums, records)
        and none of them forms a cycle, but each automatic collection in between
        walks the whole index again (at 92k tensors about 1 s of a 6 s refit,
        in full collections and in the first young collection after each
        shorter pause). What the run leaves is collected once it ends.
        """
        existed = self.store.exists
        self.store.root.parent.mkdir(parents=True, exist_ok=True)
        lock = self.lock = self.store.exclusive(self.params.lock_timeout_s, stop=self.stop).acquire()
        with gc_paused():  # after the lock: a run waiting for it allocates nothing per tensor
            yield from self._prepared(lock, existed, first)

    def _prepared(self, lock, existed: bool, first: Callable[["Receiver"], None] | None) -> Iterator:
        try:
            killpoint("lock.exclusive", self.params.target)
            self.store.create()
            if first is not None and existed:
                first(self)  # before recovery: an install a killed process left half done
            # then bring the store back to a trustworthy state (what the lineage may start from)
            self.recovery = tuple(self.store.recover(workers=self.params.apply_workers, stop=self.stop,
                                                     progress=self.progress)) if existed else ()
            for action in self.recovery:  # in every run's notes, a skipped one's too
                self.ledger.note(f"recovery: {action}")
            yield lock
        finally:
            if not existed and lock.exclusive and self.store.pristine():
                remove_tree(self.store.root)  # a first run that stored nothing (a wrong --model) leaves nothing
            lock.release()  # idempotent
            self.lock = None

    def close(self) -> None:
        """Release what the run still holds (idempotent)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        self.stop.close()
