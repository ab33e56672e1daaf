"""Durability off the critical path: a verified checkpoint's pages reach the disk after it is READY.

Patching a checkpoint leaves its pages dirty in the page cache; waiting for
them to be written back (``msync``/``fsync`` of the whole checkpoint) would
make every refit pay for the disk. Instead the checkpoint is recorded
``flushed=False`` with the boot it was verified in: within that boot the page
cache *is* the checkpoint, and after a restart an unflushed record is
re-hashed before it is trusted again (``LocalStore.recover``). This module
writes the pages back in the background and then records ``flushed=True``.

At most one flush runs per store: a newer checkpoint supersedes the one
being flushed (a sequential refit takes the same files over, so their dirty
pages are never more than one checkpoint's worth).
"""

from __future__ import annotations

import logging
import threading
import time

from storage.runtime.cancel import StopToken
from storage.durable import fsync_files
from storage.store.local_store import LocalStore, VerifiedCheckpoint

log = logging.getLogger("canonical_refit.flush")
_lock = threading.Lock()
_running: dict[str, tuple[threading.Thread, StopToken]] = {}


def flush_in_background(store: LocalStore, record: VerifiedCheckpoint) -> threading.Thread | None:
    """Start writing ``record``'s files back to disk, then mark it flushed; returns the thread."""
    if record.flushed:
        return None
    key = str(store.root)
    stop = StopToken()
    # not a daemon: a process that ends right after a refit still finishes writing its checkpoint back
    thread = threading.Thread(target=_flush, args=(store, record, stop), name=f"flush-{record.version}")
    with _lock:
        previous = _running.get(key)
        if previous is not None:
            previous[1].stop(f"superseded by {record.version}")
        _running[key] = (thread, stop)
    thread.start()
    return thread


def _flush(store: LocalStore, record: VerifiedCheckpoint, stop: StopToken) -> None:
    started = time.perf_counter()
    folder = store.absolute(record.path)
    try:
        fsync_files(folder, sorted(record.files), stop=stop)
        if stop.stopped:
            return
        if store.mark_flushed(record):  # lock-free: recorded even while another run holds the store
            log.info("%s is on disk (%.1fs after it was READY)", record.version, time.perf_counter() - started)
    except OSError as exc:  # the files moved on (a newer refit took them over): nothing to record
        log.debug("flush of %s stopped: %s", record.version, exc)
    finally:
        with _lock:
            current = _running.get(str(store.root))
            if current is not None and current[0] is threading.current_thread():
                del _running[str(store.root)]


def wait_for_flushes(timeout_s: float | None = None) -> bool:
    """Wait for the background flushes of this process; True if none is left."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        with _lock:
            threads = [t for t, _ in _running.values()]
        if not threads:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        threads[0].join(left)
        if deadline is not None and time.monotonic() >= deadline:
            with _lock:
                return not _running
