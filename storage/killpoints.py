"""Named points where the crash harness may kill the process (``SIGKILL``, no cleanup).

Production runs pay one dictionary lookup per point. The harness sets
``CANONICAL_REFIT_KILLPOINT=name[:n]`` to die the n-th time (default first)
execution reaches ``name``, after appending ``name`` to the file named by
``CANONICAL_REFIT_KILLPOINT_LOG`` (so the parent knows where it died).
``CANONICAL_REFIT_KILLPOINT_PAUSE=seconds`` sleeps at every point instead,
which gives a parent time to kill at a random moment between points.
"""

from __future__ import annotations

import os
import signal
import threading
import time

_SPEC = os.environ.get("CANONICAL_REFIT_KILLPOINT", "")
_NAME, _, _NTH = _SPEC.partition(":")
_PAUSE = float(os.environ.get("CANONICAL_REFIT_KILLPOINT_PAUSE", "0") or 0)
_LOG = os.environ.get("CANONICAL_REFIT_KILLPOINT_LOG", "")
_counts: dict[str, int] = {}
_lock = threading.Lock()

POINTS = (
    "seed.copied",        # launch snapshot copied, not yet verified
    "fetch.file",         # one artifact file downloaded and recorded
    "state.updating",     # UPDATING written, nothing changed yet
    "apply.base_released",  # base's verified record forgotten, folder not yet renamed
    "apply.materialized", # base taken over or copied, before patching
    "apply.block",        # in the middle of patching tensors
    "verify.before_ready",  # digest verified, READY not yet written
    "verify.recorded",    # verified record and chain written, READY not yet written
    "install.before",     # inside the fence, engine not yet called
    "install.after",      # engine loaded, active.json not yet written
    "activate.written",   # active.json written
    "recover.discarded",  # recovery removed a half-written checkpoint, state not yet repointed
)


def killpoint(name: str) -> None:
    """Die here if the harness asked for it; otherwise do nothing."""
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
