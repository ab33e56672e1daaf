"""Pausing Python's cyclic garbage collector around work that allocates an object (or a few) per tensor.

A refit or a publication holds an index of every tensor (100k tensors: about a million live objects). Each
full collection walks all of them, and allocating a few objects per tensor (parsing a header, one plan and
its bookkeeping per tensor) triggers collections in proportion: at 92k tensors a third of a refit's CPU time
went to the collector, and a tensor cost more the more tensors there were. The objects made there are freed
by reference counting (they form no cycles), so nothing is lost by not collecting while the work runs;
whatever cyclic garbage appears meanwhile is collected by the first collection once the pause ends.

``gc_paused()`` nests and may be entered from several threads: the collector is disabled by the first to
enter (if it was enabled) and enabled again when the last one leaves.
"""

from __future__ import annotations

import functools
import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_resume = False  # the collector was enabled when the first pause began


@contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()


def gc_paused_call(fn):
    """``fn`` run inside ``gc_paused()`` (a decorator)."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        with gc_paused():
            return fn(*args, **kwargs)

    return paused
