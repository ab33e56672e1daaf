"""The one attempt loop (``RetryPolicy.repeat``) that a request's retries and the refit's whole-run retries share."""

from __future__ import annotations

import pytest

from storage.errors import RefitError
from storage.retry import RetryPolicy


def flaky(failures: int, calls: list):
    """A call that fails transiently ``failures`` times, then returns how many calls it took."""
    def fn():
        calls.append(len(calls) + 1)
        if len(calls) <= failures:
            error = RefitError(f"timeout {len(calls)}")
            error.transient = True
            raise error
        return len(calls)
    return fn


def test_call_retries_a_transient_error_with_the_policy_delays():
    calls, waits, told = [], [], []
    policy = RetryPolicy(4, 0.5, 2.0, max_s=1.5)
    value = policy.call("read", flaky(3, calls), wait=waits.append,
                        on_retry=lambda n, delay, exc: told.append((n, delay, str(exc))))
    assert value == 4
    assert waits == [0.5, 1.0, 1.5]
    assert [(n, d) for n, d, _ in told] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert told[0][2].startswith("timeout 1")


def test_call_raises_the_last_error_once_the_attempts_are_used_up_and_never_retries_a_permanent_one():
    calls = []
    with pytest.raises(RefitError, match="timeout 2"):
        RetryPolicy(2, 0.0).call("read", flaky(5, calls), wait=lambda s: None)
    assert calls == [1, 2]
    calls = []
    with pytest.raises(ZeroDivisionError):
        RetryPolicy(5, 0.0).call("read", lambda: calls.append(1) or 1 / 0, wait=lambda s: None)
    assert calls == [1]


def test_repeat_returns_the_last_result_and_a_wait_that_says_stopped_ends_the_attempts():
    seen, told = [], []
    last = RetryPolicy(5, 1.0).repeat(lambda n: seen.append(n) or n, again=lambda n: True,
                                      on_retry=lambda n, d, r: told.append((n, d, r)), wait=lambda d: len(seen) == 2)
    assert (last, seen) == (2, [1, 2])
    assert told == [(1, 1.0, 1), (2, 2.0, 2)]
    assert RetryPolicy(5, 1.0).repeat(lambda n: n, again=lambda n: n < 3, on_retry=lambda *a: None,
                                      wait=lambda d: False) == 3
    assert RetryPolicy(3, 1.0).repeat(lambda n: n, again=lambda n: True, on_retry=lambda *a: None,
                                      wait=lambda d: False) == 3
