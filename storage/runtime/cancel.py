"""Cooperative stopping: Ctrl-C, SIGTERM and Prefect cancellation become a flag every loop checks.

A signal handler only sets a flag (the run's token); the code doing the work
sees it at its next check point (between blocks, chunks, ranges, tensors and
stages) and raises ``Interrupted``. Stopping therefore never lands in the
middle of a durable write or a rename, worker threads are told and joined,
and the run ends through its normal failure path: fetch cancelled and
joined, a half-written checkpoint undone or discarded, the lock released.

A stop from inside the run may name its cause: a stage past its deadline
(``tasks/stage.py``) stops the run's token with ``cause``, and every check
then raises that typed error (``StageDeadlineExceeded``) instead of
``Cancelled``; the run stops at the same safe points as on a cancellation,
and fails (it was not interrupted from outside).

Tokens form a tree: a run's work stops when its run's token does; a run may
stop its own background fetch (another stage failed) without stopping itself.
A stop belongs to the run it interrupted: each ``signals_stop_the_run`` block
(one command, one refit of a notebook or a trainer) has a token of its own,
so a Ctrl-C in one run never interrupts the next.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

from storage.errors import Cancelled, Interrupted, RefitError

log = logging.getLogger("canonical_refit.cancel")


class StopToken:
    """A flag that stops work cooperatively; ``check`` raises once it (or a parent) is set."""

    def __init__(self, parent: "StopToken | None" = None, *, interrupt: bool = False):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self.parent = parent
        self.reason: str | None = None
        self._cause: Callable[[], RefitError] | None = None  # builds the error a check raises (a deadline's)
        self._interrupt = interrupt  # stopping from outside the run (signals), as opposed to the run cancelling work
        if parent is not None:
            parent.add_listener(self._notify)

    def child(self) -> "StopToken":
        """A token that stops with this one, and can also be stopped on its own."""
        return StopToken(self)

    def stop(self, reason: str, *, interrupt: bool = False, cause: Callable[[], RefitError] | None = None) -> None:
        """Stop this token; ``interrupt``: the stop comes from outside the run (a cancellation), so the run
        ends INTERRUPTED through the fast path, not as a failure; ``cause``: builds the typed error each
        ``check`` then raises instead of ``Cancelled`` (a stage's deadline)."""
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._cause = cause
            self._interrupt = self._interrupt or interrupt
            self._event.set()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (from the stopping thread) when this token or a parent stops."""
        with self._lock:
            self._listeners.append(listener)
            stopped = self._event.is_set()
        if stopped:
            listener()

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def close(self) -> None:
        """Detach from the parent (a finished run's token must not accumulate on the process token)."""
        if self.parent is not None:
            self.parent.remove_listener(self._notify)

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    @property
    def stopped(self) -> bool:
        return self._event.is_set() or (self.parent is not None and self.parent.stopped)

    @property
    def interrupted(self) -> bool:
        """True if the stop came from outside the run (a signal or a cancellation)."""
        if self._event.is_set() and self._interrupt:
            return True
        return self.parent is not None and self.parent.interrupted

    def why(self) -> str:
        node: StopToken | None = self
        while node is not None:
            if node._event.is_set():
                return node.reason or "stopped"
            node = node.parent
        return "stopped"

    def cause(self) -> RefitError | None:
        """The typed error the stop that holds this token names (a new one each call), or None."""
        node: StopToken | None = self
        while node is not None:
            if node._event.is_set():
                return node._cause() if node._cause is not None else None
            node = node.parent
        return None

    def check(self, **context) -> None:
        """Raise ``Interrupted`` (from outside), the stop's ``cause`` or ``Cancelled`` (by the run) if this token
        is stopped."""
        if not self.stopped:
            return
        if self.interrupted:
            raise Interrupted(f"interrupted ({self.why()})", **context)
        cause = self.cause()
        if cause is not None:
            raise cause.with_context(**context)
        raise Cancelled(f"stopped: {self.why()}", **context)

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, waking early when stopped; returns ``stopped``."""
        if self.stopped:
            return True
        woken = threading.Event()
        self.add_listener(woken.set)
        try:
            woken.wait(timeout)
        finally:
            self.remove_listener(woken.set)
        return self.stopped


ROOT = StopToken(interrupt=True)  # the parent of runs started outside any signals block: never stopped itself
# the token a run started in this context stops with: its signals block's, or one an agent gives each run
current_stop: ContextVar[StopToken] = ContextVar("canonical_refit_stop", default=ROOT)
_handling: list[StopToken] = []  # the token of the signals block the main thread is in, if any


@contextmanager
def signals_stop_the_run() -> Iterator[StopToken]:
    """While inside, SIGINT and SIGTERM stop this block's own token instead of raising; a second signal raises.

    The token is new for each block (and ``current_stop`` inside it), so an
    interrupt ends the run in progress only. Only the main thread can install
    handlers: elsewhere, or inside another such block, this yields the token
    in force (a flow run in the CLI's worker thread, a run of an agent).
    """
    if threading.current_thread() is not threading.main_thread() or _handling:
        yield current_stop.get()
        return
    token = StopToken(interrupt=True)
    received: list[int] = []

    def handler(signum, _frame) -> None:
        name = signal.Signals(signum).name
        received.append(signum)
        if len(received) == 1:
            log.warning("%s received: stopping at the next safe point (again to stop at once)", name)
            token.stop(name)
            return
        raise KeyboardInterrupt(f"second {name}: stopping at once; the next run recovers the store")

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, handler)
    _handling.append(token)
    scoped = current_stop.set(token)
    try:
        yield token
    finally:
        current_stop.reset(scoped)
        _handling.pop()
        for sig, old in previous.items():
            signal.signal(sig, old)
