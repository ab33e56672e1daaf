"""Named points where the crash harness may kill the process (``SIGKILL``, no cleanup).

Production runs pay one dictionary lookup per point. The harness sets
``CANONICAL_REFIT_KILLPOINT=name[:n]`` to die the n-th time (default first)
execution reaches ``name``, after appending ``name`` to the file named by
``CANONICAL_REFIT_KILLPOINT_LOG`` (so the parent knows where it died).
``CANONICAL_REFIT_KILLPOINT_PAUSE=seconds`` sleeps at every point instead,
which gives a parent time to kill at a random moment between points.
``CANONICAL_REFIT_KILLPOINT_GATE=name:path`` holds the process at the first
``name`` until ``path`` exists (a test then signals it, kills a server, ...).
``CANONICAL_REFIT_KILLPOINT_TRACE=path`` appends one JSON line per point
reached (pid, point, monotonic time, version where known), so concurrency
tests can order what several processes did.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

_SPEC = os.environ.get("CANONICAL_REFIT_KILLPOINT", "")
_NAME, _, _NTH = _SPEC.partition(":")
_PAUSE = float(os.environ.get("CANONICAL_REFIT_KILLPOINT_PAUSE", "0") or 0)
_LOG = os.environ.get("CANONICAL_REFIT_KILLPOINT_LOG", "")
_TRACE = os.environ.get("CANONICAL_REFIT_KILLPOINT_TRACE", "")
_GATE_NAME, _, _GATE_PATH = os.environ.get("CANONICAL_REFIT_KILLPOINT_GATE", "").partition(":")
_gated: set[str] = set()
_counts: dict[str, int] = {}
_lock = threading.Lock()

POINTS = (
    "lock.exclusive",     # the preparation lock was taken
    "seed.copied",        # launch snapshot copied, not yet verified
    "fetch.file",         # one artifact file downloaded and recorded
    "fetch.stopped",      # the fetch stage ended (every download finished, failed or was cancelled)
    "state.updating",     # UPDATING written, nothing changed yet
    "apply.base_released",  # base's verified record forgotten, folder not yet renamed
    "apply.materialized", # base taken over or copied, before patching
    "apply.block",        # in the middle of patching tensors
    "verify.before_ready",  # digest verified, READY not yet written
    "verify.recorded",    # verified record and chain written, READY not yet written
    "install.before",     # inside the shared lock, the install fence not yet written
    "install.fenced",     # the install fence written, engine not yet called
    "install.after",      # engine loaded, active.json not yet written
    "activate.written",   # active.json written
    "recover.discarded",  # recovery removed a half-written checkpoint, state not yet repointed
)


# reached only when a run fails: traced and gated like the others, not part of the happy-path harness
FAILURE_POINTS = (
    "rollback.start",     # a failed update is about to be rolled back (after the fetch was joined)
    "undo.tensor",        # a rejected apply is being undone in place: one more tensor reverted, the rest not yet
)
PUBLISH_POINTS = (        # the publisher's (tests/support/crash_publish.py)
    "publish.claimed",    # the sequence claimed, nothing uploaded
    "publish.file",       # one payload object uploaded (the others, the index and the record not yet)
    "publish.uploaded",   # every payload object and the index uploaded, the record not yet written
    "publish.recorded",   # the record written, the publisher's kept copy not yet replaced
    "publish.kept_staged",  # the new kept copy complete in its folder, last.json not yet switched to it
)


def killpoint(name: str, version: str | None = None) -> None:
    """Die here if the harness asked for it; otherwise do nothing."""
    if _TRACE:
        _trace(name, version)
    if _GATE_NAME and name == _GATE_NAME and name not in _gated:
        _gated.add(name)
        while not os.path.exists(_GATE_PATH):
            time.sleep(0.02)
    if _PAUSE:
        _log(name)
        time.sleep(_PAUSE)
    if not _NAME or name != _NAME:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        hit = _counts[name] == int(_NTH or 1)
    if hit:
        _log(name)
        os.kill(os.getpid(), signal.SIGKILL)


def _log(name: str) -> None:
    if _LOG:
        with open(_LOG, "a") as fh:
            fh.write(f"{name}\n")
            fh.flush()
            os.fsync(fh.fileno())


def _trace(name: str, version: str | None) -> None:
    line = json.dumps({"pid": os.getpid(), "what": name, "version": version, "t": time.monotonic_ns()})
    fd = os.open(_TRACE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
