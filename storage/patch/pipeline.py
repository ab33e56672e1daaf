"""Fetch and apply together: buckets are applied as soon as they have arrived and been validated.

``Arrivals`` is the hand-off between the fetch stage (which announces each
file once it is downloaded, size-checked and recorded in the artifact cache)
and the apply stage (which waits for exactly the files each tensor needs).
``ArrivingPlans`` is the apply side: a ``PlanSource`` that validates each
bucket once, on arrival, and hands out a tensor's plan when all its buckets
(one per delta that changed it) are in.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Mapping, Sequence

from storage.cancel import StopToken
from storage.format.checkpoint import TensorLocation
from storage.errors import Cancelled, RefitError, StoreError
from storage.catalog.manifests import Manifest
from storage.patch.patcher import PatchStep, TensorPlan, bucket_steps


class Arrivals:
    """Which artifact files are in the cache, and whether fetching may still bring the others."""

    def __init__(self, stop: StopToken | None = None) -> None:
        self.stop = stop
        self._cond = threading.Condition()
        self._ready: set[tuple[str, str]] = set()
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
        with self._cond:
            self._ready.add((version, name))
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

    def first_ready(self, wants: dict[str, list[tuple[str, str]]], pick) -> str | None:
        """Block until one of ``wants`` (name -> files it needs) has all its files; return ``pick`` of those.

        Raises as soon as a needed file failed, fetching stopped, or waiting was cancelled.
        """
        with self._cond:
            while True:
                ready = [n for n, keys in wants.items() if all(k in self._ready for k in keys)]
                if ready:
                    return pick(ready)
                for keys in wants.values():
                    for key in keys:
                        if key in self._errors:
                            raise self._errors[key]
                if self._fatal is not None:
                    raise self._fatal
                self._check_stop()
                if self._cancelled:
                    raise Cancelled("stopped waiting for downloads after another tensor failed")
                if self._closed:
                    missing = next(k for keys in wants.values() for k in keys if k not in self._ready)
                    raise StoreError("the file was not fetched", revision=missing[0], file=missing[1])
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

    def __init__(self, deltas: Sequence[Manifest], folders: Mapping[str, Path],
                 checkpoint: Mapping[str, TensorLocation], arrivals: Arrivals, *, workers: int = 1):
        self._deltas, self._folders, self._checkpoint = list(deltas), folders, checkpoint
        self._workers = workers  # threads validating a bucket's frames
        self._arrivals = arrivals
        self._needs: dict[str, list[tuple[int, str]]] = {}
        rank: dict[tuple[int, str], int] = {}
        for i, manifest in enumerate(self._deltas):
            for name in manifest.files:
                rank[(i, name)] = len(rank)
            for tensor, bucket in manifest.weight_map.items():
                self._needs.setdefault(tensor, []).append((i, bucket))
        self._order = sorted(self._needs, key=lambda t: (max(rank[k] for k in self._needs[t]),
                                                         -checkpoint[t].nbytes, t))
        self._pending = {t: [(self._deltas[i].version, b) for i, b in needs] for t, needs in self._needs.items()}
        self._take_lock = threading.Lock()
        self._steps: dict[tuple[int, str], dict[str, PatchStep]] = {}
        self._locks: dict[tuple[int, str], threading.Lock] = {k: threading.Lock() for k in rank}

    def names(self) -> list[str]:
        return list(self._order)

    def take(self) -> str | None:
        with self._take_lock:  # one taker waits at a time; the others queue here
            if not self._pending:
                return None
            name = self._arrivals.first_ready(
                self._pending, lambda ready: max(ready, key=lambda t: (self._checkpoint[t].nbytes, t)))
            del self._pending[name]
            return name

    def total_bytes(self) -> int:
        """Bytes the apply pass folds: each tensor's size times the deltas that change it."""
        return sum(self._checkpoint[t].nbytes * len(needs) for t, needs in self._needs.items())

    def plan(self, name: str) -> TensorPlan:
        steps = tuple(self._bucket(key)[name] for key in self._needs[name])
        return TensorPlan(self._checkpoint[name], steps)

    def cancel(self) -> None:
        self._arrivals.cancel()

    def prepare(self) -> None:
        """Before the store changes: wait for the first tensor's buckets and validate every bucket already in.

        Whatever can be rejected without waiting for later downloads is thus
        rejected with the store untouched; only buckets still downloading are
        validated after patching has begun.
        """
        if self._order:
            self._arrivals.first_ready(self._pending, lambda ready: ready[0])
        for key in self._locks:
            if self._arrivals.has(self._deltas[key[0]].version, key[1]):
                self._bucket(key)

    def _bucket(self, key: tuple[int, str]) -> dict[str, PatchStep]:
        with self._locks[key]:
            if key not in self._steps:
                manifest = self._deltas[key[0]]
                self._arrivals.wait(manifest.version, key[1])
                path = self._folders[manifest.version] / key[1]
                self._steps[key] = bucket_steps(manifest, key[1], path, self._checkpoint, workers=self._workers)
            return self._steps[key]
