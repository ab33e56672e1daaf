"""One retry policy for every level: a request, a stage, a whole refit, a publication.

A ``RetryPolicy`` says how many attempts there are in all, how long to wait
before each next one (exponential backoff, capped, optionally jittered), and
``transient`` says what is worth another attempt: a ``RefitError`` marked
transient (timeouts, throttling, 5xx, resets, short bodies) raised before the
local checkpoint was touched. Bad input, a missing object, denied access,
poison and an interrupt never are. Each level builds its policy from its own
settings (``ObjectStoreSettings``, ``RefitParams``, ``PublishParams``), so
tests and operators tune the waits without touching code.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from storage.errors import RefitError

log = logging.getLogger("canonical_refit.retry")
T = TypeVar("T")


def transient(exc: BaseException, *, rolled_back: bool = False) -> bool:
    """Worth another attempt: a transient error, raised before the checkpoint was touched (or, with
    ``rolled_back``, by a whole run whose changes were undone before it ended)."""
    return isinstance(exc, RefitError) and exc.transient and (rolled_back or not exc.mutation_started)


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` in all (the first included); the wait before retry n is ``initial_s * factor**(n-1)``,
    at most ``max_s``, times a random share in ``[1 - jitter, 1]``."""

    attempts: int
    initial_s: float
    factor: float = 2.0
    max_s: float = float("inf")
    jitter: float = 0.0

    @property
    def retries(self) -> int:
        return max(0, self.attempts - 1)

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1: after the first attempt failed)."""
        base = min(self.max_s, self.initial_s * self.factor ** (retry - 1))
        return base * (1.0 - self.jitter * random.random()) if self.jitter else base

    def call(self, what: str, fn: Callable[[], T], *, retryable: Callable[[BaseException], bool] = transient,
             wait: Callable[[float], object] = time.sleep,
             on_retry: Callable[[int, float, BaseException], None] | None = None) -> T:
        """``fn()``, called again after each error ``retryable`` accepts, until the attempts are used up.

        ``wait(seconds)`` sleeps between attempts (a stop token's ``wait`` wakes
        early; the next attempt then sees the stop); ``on_retry(attempt, delay,
        error)`` is told of each retry, else a warning is logged.
        """
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except BaseException as exc:
                if attempt >= self.attempts or not retryable(exc):
                    raise
                delay = self.delay(attempt)
                if on_retry is not None:
                    on_retry(attempt, delay, exc)
                else:
                    log.warning("%s failed (attempt %d of %d), retrying in %.1fs: %s", what, attempt,
                                self.attempts, delay, exc)
                wait(delay)
        raise AssertionError("unreachable")
