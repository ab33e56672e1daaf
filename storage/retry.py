"""One retry policy, and the one place that says which layer retries what.

A ``RetryPolicy`` says how many attempts there are in all, how long to wait
before each next one (exponential backoff, capped, optionally jittered), and
``transient`` says what is worth another attempt: a ``RefitError`` marked
transient (timeouts, throttling, 5xx, resets, short bodies) raised before the
local checkpoint was touched. Bad input, a missing object, denied access,
poison and an interrupt never are.

One retry layer per failure domain, so that retries never multiply:

=================  ====================================  ===============================================
layer              retries                               policy (settings)
=================  ====================================  ===============================================
a request          transient I/O of that one request:    ``ObjectStoreSettings.retry_policy``
                   a timeout, throttling, a 5xx, a       (``retry_attempts``, ``backoff_initial_s``,
                   reset, a short body                   ``backoff_max_s``); botocore's own retries are off
                                                         (``storage/objects/s3client.py``)
a stage            nothing: it runs once, under a        ``RefitParams.stage_deadline_s``
                   deadline. Past it the run stops at    (``--stage-deadline-seconds``, default none):
                   its next safe point as on a           ``tasks/stage.py`` ``Deadline`` stops the run's token
                   cancellation and fails with           (``storage/runtime/cancel.py``) with that cause. No
                   ``StageDeadlineExceeded`` (stage,     loop, no ``retried``, no attempt count. Without a
                   revision, seconds), not INTERRUPTED   deadline: bounded by its requests and the stop token
a refit            the whole run, after a transient      ``RefitParams.run_retry_policy`` (``retries``,
                   failure (a stage's deadline           ``retry_delay_s``): ``flows/refit.py``
                   included), once the attempt released  ``run_refit``; never after poison, an interrupt or
                   everything and rolled the store back  bad input
a publication      the upload and the record write       ``PublishParams.publication_retry_policy``
                   together (create-only writes: a       (``retries``, ``retry_delay_s``):
                   retry completes a partial upload)     ``flows/publish.py`` ``put_publication``
=================  ====================================  ===============================================

``RetryPolicy.repeat`` is the one attempt loop: a request's and a publication's
``RetryPolicy.call`` and the refit's ``run_refit`` both go through it.

During an outage a request is therefore tried ``retry_attempts`` times per
run attempt, and the run ``retries + 1`` times: at most their product (6 x 4
with the defaults), each run attempt starting over from a consistent store.
A stage that stalls (a hung link its request timeouts did not catch) costs at
most ``stage_deadline_s`` per run attempt: ``StageDeadlineExceeded`` is
transient, so the run-level retry applies to it as to an outage, and a run
whose last attempt still overruns fails (its ``next:`` says to run again,
with a longer deadline if the stage was only slow). A stage's deadline is not
an interrupt: a Ctrl-C, SIGTERM or cancellation ends the run INTERRUPTED and
is never retried; a deadline ends it FAILED.
The settings ``stage_retries`` and ``stage_retry_delay_s`` are still accepted
(command lines keep working), no longer do anything, and are never printed in
a ``next:`` command. Event delivery
(``flows/announce.py``) and the node agent's API polls have their own
backoffs: they are not on a run's path.
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

    def repeat(self, fn: Callable[[int], T], *, again: Callable[[T], bool], on_retry: Callable[[int, float, T], None],
               wait: Callable[[float], object] = time.sleep) -> T:
        """The one attempt loop: ``fn(attempt)`` (1 first), tried again while ``again(result)`` says so and
        attempts remain; returns the last result.

        Before each next attempt ``on_retry(attempt, delay, result)`` is told, then ``wait(delay)`` sleeps; a
        ``wait`` that returns true (a stop token's, stopped) ends the attempts there.
        """
        for attempt in range(1, self.attempts + 1):
            result = fn(attempt)
            if not again(result) or attempt >= self.attempts:
                return result
            delay = self.delay(attempt)
            on_retry(attempt, delay, result)
            if wait(delay):
                return result
        raise AssertionError("unreachable")

    def call(self, what: str, fn: Callable[[], T], *, retryable: Callable[[BaseException], bool] = transient,
             wait: Callable[[float], object] = time.sleep,
             on_retry: Callable[[int, float, BaseException], None] | None = None) -> T:
        """``fn()``, called again after each error ``retryable`` accepts, until the attempts are used up.

        ``wait(seconds)`` sleeps between attempts (a stop token's ``wait`` wakes
        early; the next attempt then sees the stop); ``on_retry(attempt, delay,
        error)`` is told of each retry, else a warning is logged.
        """
        def attempt(_number: int) -> tuple[T | None, BaseException | None]:
            try:
                return fn(), None
            except BaseException as exc:
                return None, exc

        def told(number: int, delay: float, outcome: tuple) -> None:
            if on_retry is not None:
                on_retry(number, delay, outcome[1])
            else:
                log.warning("%s failed (attempt %d of %d), retrying in %.1fs: %s", what, number, self.attempts,
                            delay, outcome[1])

        def sleep(delay: float) -> bool:
            wait(delay)
            return False  # the next attempt sees a stop itself

        value, error = self.repeat(attempt, again=lambda outcome: outcome[1] is not None and retryable(outcome[1]),
                                   on_retry=told, wait=sleep)
        if error is not None:
            try:
                raise error
            finally:
                del error  # no cycle through this frame
        return value
