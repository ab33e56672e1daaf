"""Fetch and apply together: buckets are applied as soon as they have arrived and been checked.

``Arrivals`` is the hand-off between the fetch stage (which announces each
file once it is downloaded, size-checked and recorded in the artifact cache)
and the apply stage (which waits for exactly the files each tensor needs).
``ArrivingPlans`` is the apply side: a ``PlanSource`` that checks each
bucket once, on arrival, and hands out a tensor's plan when all its buckets
(one per delta that changed it) are in.
"""

from __future__ import annotations

import heapq
import threading
from collections import Counter
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Mapping, Sequence

from storage.runtime.cancel import StopToken
from storage.format.checkpoint import TensorLocation
from storage.errors import Cancelled, RefitError, StoreError
from storage.catalog.manifests import Manifest
from storage.runtime.gc_pause import gc_paused_call
from storage.patch.patcher import PatchStep, TensorPlan, bucket_steps, tensor_plan


class Arrivals:
    """Which artifact files are in the cache, and whether fetching may still bring the others."""

    def __init__(self, stop: StopToken | None = None) -> None:
        self.stop = stop
        self._cond = threading.Condition()
        self._ready: set[tuple[str, str]] = set()
        self._log: list[tuple[str, str]] = []  # the arrived files in arrival order (readers keep a cursor)
        self._errors: dict[tuple[str, str], RefitError] = {}
        self._fatal: BaseException | None = None
        self._admitted = False
        self._closed = False
        self._cancelled = False
        if stop is not None:
            stop.add_listener(self._wake)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _check_stop(self, **context) -> None:
        if self.stop is not None:
            self.stop.check(**context)

    # -- fetch side --------------------------------------------------------------------------

    def admit(self) -> None:
        """Room is made and downloads begin: the apply stage may now change the store."""
        with self._cond:
            self._admitted = True
            self._cond.notify_all()

    def arrived(self, version: str, name: str) -> None:
        key = (version, name)
        with self._cond:
            if key not in self._ready:
                self._ready.add(key)
                self._log.append(key)
            self._cond.notify_all()

    def failed(self, version: str, name: str, error: RefitError) -> None:
        with self._cond:
            self._errors[(version, name)] = error
            self._cond.notify_all()

    def abort(self, error: BaseException) -> None:
        """Fetching failed as a whole (before or while downloading)."""
        with self._cond:
            self._fatal = self._fatal or error
            self._cond.notify_all()

    def close(self) -> None:
        """Fetching is over: a file not in by now is not coming."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- apply side ---------------------------------------------------------------------------

    def has(self, version: str, name: str) -> bool:
        with self._cond:
            return (version, name) in self._ready

    def arrived_since(self, cursor: int, needed, missing) -> tuple[list[tuple[str, str]], int]:
        """Block until files arrived after the first ``cursor``; return them (in arrival order) and the new cursor.

        O(new arrivals + failed files) per call. ``needed(key)`` says whether a
        failed file is still wanted (its error is then raised); ``missing()``
        names a wanted file that is not in, for the error once fetching closed.
        Raises as soon as a needed file failed, fetching stopped, or waiting
        was cancelled.
        """
        with self._cond:
            while True:
                if len(self._log) > cursor:
                    return self._log[cursor:], len(self._log)
                for key, error in self._errors.items():
                    if needed(key):
                        raise error
                if self._fatal is not None:
                    raise self._fatal
                self._check_stop()
                if self._cancelled:
                    raise Cancelled("stopped waiting for downloads after another tensor failed")
                if self._closed:
                    key = missing()
                    raise StoreError("the file was not fetched", revision=key[0], file=key[1])
                self._cond.wait()

    def cancel(self) -> None:
        """The apply side gave up: waiters stop waiting, fetching starts no new download, downloads stop."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
        if self.stop is not None:
            self.stop.stop("the apply stage stopped")

    def detach(self) -> None:
        """Stop listening to the run's token (the fetch is over)."""
        if self.stop is not None:
            self.stop.remove_listener(self._wake)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_admitted(self) -> None:
        """Block until downloads may start; raises what stopped fetching before that."""
        with self._cond:
            self._cond.wait_for(lambda: self._admitted or self._fatal is not None or self._closed
                                or (self.stop is not None and self.stop.stopped))
            if not self._admitted:
                self._check_stop()
                raise self._fatal or StoreError("fetching ended before any download started")

    def wait(self, version: str, name: str) -> None:
        """Block until ``name`` of ``version`` is in the cache; raises why it will not be."""
        key = (version, name)
        with self._cond:
            self._cond.wait_for(lambda: key in self._ready or key in self._errors or self._fatal is not None
                                or self._closed or self._cancelled or (self.stop is not None and self.stop.stopped))
            if key in self._ready:
                return
            if key in self._errors:
                raise self._errors[key]
            if self._fatal is not None:
                raise self._fatal
            self._check_stop(revision=version, file=name)
            if self._cancelled:
                raise Cancelled("stopped waiting for a download after another tensor failed", revision=version,
                                file=name)
            raise StoreError("the file was not fetched", revision=version, file=name)


class ArrivingPlans:
    """Tensor plans of a replay chain, each ready when its buckets have arrived (a ``PlanSource``).

    ``take`` hands out whichever tensor has all its buckets in, largest first,
    so appliers never wait behind a large download while smaller ones are ready.
    """

    @gc_paused_call  # a few objects a tensor, no cycles
    def __init__(self, deltas: Sequence[Manifest], folders: Mapping[str, Path],
                 checkpoint: Mapping[str, TensorLocation], arrivals: Arrivals, *, workers: int = 1):
        self._deltas, self._folders, self._checkpoint = list(deltas), folders, checkpoint
        self._workers = workers  # threads checking a bucket's frames
        self._arrivals = arrivals
        # one delta (a steady refit): each tensor needs one file, ready as soon as it is in; its plan is made
        # with the others of its bucket once that is checked (``_bucket``), in one pass
        self._one = len(self._deltas) == 1
        rank: dict[tuple[int, str], int] = {}
        for i, manifest in enumerate(self._deltas):
            for name in manifest.files:
                rank[(i, name)] = len(rank)
        self._rank = rank
        file_key = {key: (self._deltas[key[0]].version, key[1]) for key in rank}  # (delta, bucket) -> file
        self._file_key = file_key
        needs = self._needs = self._needed(rank)
        self._order: list[str] | None = None  # ``names()``, sorted when first asked for
        # Bookkeeping of ``take``, O(1) amortized per tensor and file (a heap push/pop per tensor):
        # which tensors wait for each file, how many of its files each tensor still misses, the ready ones
        # in a heap by priority (largest first, then the greatest name: as ``max((nbytes, name))``).
        sizes = list(map(_NBYTES, map(checkpoint.__getitem__, needs)))
        priority = list(map(_SECOND, sorted(zip(sizes, needs), reverse=True)))
        self._priority = dict(zip(priority, range(len(priority))))
        self._by_priority = priority
        waiting: dict[tuple[str, str], list[str]] = {}
        missing: dict[str, int] = {}
        if self._one:  # each tensor waits for its bucket alone: the manifest's own grouping
            manifest = self._deltas[0]
            for key in rank:
                waiting[file_key[key]] = manifest.tensors_of(key[1])
            total = sum(sizes)  # bytes the apply pass folds: each tensor's size times the deltas that change it
        else:
            total = 0
            for t, ks in needs.items():
                files = {file_key[k] for k in ks}
                total += checkpoint[t].nbytes * len(ks)
                missing[t] = len(files)
                for key in files:
                    have = waiting.get(key)
                    if have is None:
                        waiting[key] = [t]
                    else:
                        have.append(t)
        self._waiting, self._missing, self._total = waiting, missing, total
        self._wanted = {key: len(ts) for key, ts in self._waiting.items()}  # untaken tensors needing each file
        self._ready_heap: list[int] = []
        self._cursor = 0  # files of ``arrivals`` already counted
        self._left = len(self._needs)  # tensors not taken yet
        self._take_lock = threading.Lock()
        self._steps: dict[tuple[int, str], dict[str, PatchStep]] = {}
        self._plans: dict[str, TensorPlan] = {}  # one delta: each checked bucket's tensors' plans
        self._locks: dict[tuple[int, str], threading.Lock] = {k: threading.Lock() for k in rank}

    def _needed(self, rank: dict[tuple[int, str], int]) -> dict[str, list[tuple[int, str]]]:
        """Each tensor's ``(delta, bucket)`` keys, oldest delta first (one delta: one shared list a bucket)."""
        if self._one:
            weight_map = self._deltas[0].weight_map
            shared = {name: [key] for key in rank for name in (key[1],)}
            return dict(zip(weight_map, map(shared.__getitem__, weight_map.values())))
        needs: dict[str, list[tuple[int, str]]] = {}
        for i, manifest in enumerate(self._deltas):
            keys = {name: (i, name) for name in manifest.files}
            for tensor, bucket in manifest.weight_map.items():
                have = needs.get(tensor)
                if have is None:
                    needs[tensor] = [keys[bucket]]
                else:
                    have.append(keys[bucket])
        return needs

    def names(self) -> list[str]:
        if self._order is None:
            rank, checkpoint = self._rank, self._checkpoint
            last = {t: max(map(rank.__getitem__, ks)) for t, ks in self._needs.items()}
            self._order = sorted(self._needs, key=lambda t: (last[t], -checkpoint[t].nbytes, t))
        return list(self._order)

    def _absorb(self) -> None:
        """Wait (under the take lock) until at least one untaken tensor has all its files in."""
        heap, priority = self._ready_heap, self._priority
        while not heap:
            keys, self._cursor = self._arrivals.arrived_since(
                self._cursor, lambda key: self._wanted.get(key, 0) > 0, self._first_missing)
            for key in keys:
                waited = self._waiting.pop(key, ())
                if self._one:  # its one file is in: every tensor waiting for it is ready
                    ready = list(map(priority.__getitem__, waited))
                else:
                    ready = []
                    for t in waited:
                        self._missing[t] -= 1
                        if self._missing[t] == 0:
                            ready.append(priority[t])
                if len(ready) > len(heap):  # many at once (a bucket's worth): one heapify, not a push each
                    heap += ready
                    heapq.heapify(heap)
                else:
                    for r in ready:
                        heapq.heappush(heap, r)

    def _first_missing(self) -> tuple[str, str]:
        """A file some untaken tensor still waits for (only when fetching ended without it: the error path)."""
        return next(key for key, ts in self._waiting.items() if self._wanted.get(key, 0) > 0)

    def take(self) -> str | None:
        with self._take_lock:  # one taker waits at a time; the others queue here
            if not self._left:
                return None
            self._absorb()
            name = self._by_priority[heapq.heappop(self._ready_heap)]
            self._left -= 1
            for key in self._needs[name]:
                self._wanted[self._file_key[key]] -= 1
            return name

    def take_many(self, limit: int, small: int) -> list[str]:
        """``take`` for a batch: the first ready tensor (waiting for one), then, if it is under ``small`` bytes,
        the ready ones after it while they are too, up to ``limit``; never waits for a second."""
        with self._take_lock:
            if not self._left:
                return []
            self._absorb()
            heap, by_priority, pop = self._ready_heap, self._by_priority, heapq.heappop
            first = by_priority[pop(heap)]
            taken = [first]
            # the heap hands tensors out in priority order (no push happens here): after a first one under
            # ``small`` every other one is no larger, hence under ``small`` too
            if self._checkpoint[first].nbytes < small:
                taken += map(by_priority.__getitem__, [pop(heap) for _ in range(min(limit - 1, len(heap)))])
            self._taken(taken)
            self._left -= len(taken)
            return taken

    def _taken(self, taken: list[str]) -> None:
        """Count ``taken`` out of the tensors each file is still wanted for (under the take lock)."""
        wanted, needs, file_key = self._wanted, self._needs, self._file_key
        if self._one:  # one file a tensor: counted per bucket
            for key, n in Counter(map(_FIRST, map(needs.__getitem__, taken))).items():
                wanted[file_key[key]] -= n
            return
        for name in taken:
            for key in needs[name]:
                wanted[file_key[key]] -= 1

    def count(self) -> int:
        """How many tensors (``len(names())`` without sorting them)."""
        return len(self._needs)

    def total_bytes(self) -> int:
        """Bytes the apply pass folds: each tensor's size times the deltas that change it."""
        return self._total

    def plan(self, name: str) -> TensorPlan:
        plan = self._plans.get(name)  # one delta: made with its bucket's others (set once, read without a lock)
        if plan is not None:
            return plan
        if self._one:
            self._bucket(self._needs[name][0])
            return self._plans[name]
        done = self._steps  # a checked bucket's steps are read without its lock (set once, never changed)
        keys = self._needs[name]
        if len(keys) == 1:  # one delta changes it (a steady refit)
            bucket = done.get(keys[0])
            step = (bucket if bucket is not None else self._bucket(keys[0]))[name]
            return tensor_plan(self._checkpoint[name], (step,))
        steps = []
        for key in keys:
            bucket = done.get(key)
            steps.append((bucket if bucket is not None else self._bucket(key))[name])
        return tensor_plan(self._checkpoint[name], tuple(steps))

    def cancel(self) -> None:
        self._arrivals.cancel()

    def prepare(self) -> None:
        """Before the store changes: wait for the first tensor's buckets and check every bucket already in.

        What a bucket's check can reject without waiting for later downloads
        (``bucket_steps``: headers, metadata, checksums, frame structure) is
        thus rejected with the store untouched; buckets still downloading are
        checked after patching has begun, and every record is validated as it
        is decoded to be applied (a rejection then undoes what was patched).
        """
        if self._needs:
            with self._take_lock:
                self._absorb()
        for key in self._locks:
            if self._arrivals.has(self._deltas[key[0]].version, key[1]):
                self._bucket(key)

    def _bucket(self, key: tuple[int, str]) -> dict[str, PatchStep]:
        with self._locks[key]:
            if key not in self._steps:
                manifest = self._deltas[key[0]]
                self._arrivals.wait(manifest.version, key[1])
                path = self._folders[manifest.version] / key[1]
                steps = bucket_steps(manifest, key[1], path, self._checkpoint, workers=self._workers)
                if self._one:
                    self._plans.update(_plans(steps, self._checkpoint))
                self._steps[key] = steps
            return self._steps[key]


def _plans(steps: dict[str, PatchStep], checkpoint: Mapping[str, TensorLocation]) -> dict[str, TensorPlan]:
    """The one-step plan of each tensor of a checked bucket, each made as one dictionary (not the frozen
    dataclass's ``object.__setattr__`` per field): ``TensorPlan(checkpoint[name], (step,))``."""
    new, put = object.__new__, object.__setattr__
    out = {}
    for name, step in steps.items():
        plan = out[name] = new(TensorPlan)
        put(plan, "__dict__", {"location": checkpoint[name], "steps": (step,)})
    return out


_NBYTES, _FIRST, _SECOND = attrgetter("nbytes"), itemgetter(0), itemgetter(1)
