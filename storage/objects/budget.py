"""The connection budget: at most ``slots`` data requests in flight per store, whoever asks.

``ConnectionBudget`` is the pool of ``concurrency`` request slots that an
``ObjectStore`` and its ``with_stats`` views share: every GET body and every
upload part runs on one of its threads. Callers submit requests and wait
without holding a slot, so a large download never keeps slots idle and no
caller waits for a slot held by another waiting caller.

``Requester`` is what the transfers (``transfer``, ``multipart``) need of a
store: its settings, stats, budget and retried ``call``. They depend on it,
not on ``ObjectStore``, so no module below the store imports the store.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Protocol, TypeVar

from storage.errors import Cancelled, StoreError

T = TypeVar("T")


class Requester(Protocol):
    """The part of ``ObjectStore`` a transfer drives: settings, stats, the budget and the retried call."""

    settings: Any
    stats: Any
    budget: "ConnectionBudget"

    def call(self, what: str, url: str, fn: Callable[[], T], *, check: Callable[[], None] | None = None) -> T:
        ...


class Stopped(Cancelled):
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
                    elif error is None or isinstance(error, Stopped):
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
