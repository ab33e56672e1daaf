"""The one status vocabulary of the program: a run's outcome, the store's ``state.json``, a node's record.

``Status`` is a ``StrEnum``: each member is the very string the records, the
command lines' output and the Python API have always carried (``"READY"``,
...), so a member compares, hashes, formats and serializes to JSON as that
string. Which statuses each record may hold (docs/format.md, sections 6.3
and 7):

- a run (``flows.report.RefitResult``): ``RUN_STATUSES``;
- the store's ``state.json``: ``StoreStatus`` (``READY`` or ``UPDATING``);
- a node's record: ``NodeStatus`` (a run's status, ``DRIFTED`` when the
  engines disagree with the store, ``STARTED`` when a heartbeat wrote it
  before any run ended); a reader derives ``STALE`` (``NodeRecord.condition``),
  which is never written;
- a stage of a run (its row in the result's ``stages``, the stage table):
  ``StageStatus`` (``PENDING`` before it ends, ``COMPLETED``, ``FAILED``,
  ``INTERRUPTED`` by a signal or a cancellation, ``CANCELLED`` because
  another stage failed; Prefect's words for a task run's states). Earlier
  releases wrote these in lowercase (``"ok"`` for ``COMPLETED``):
  ``stage_status_of`` reads both.

Imports nothing of the program: every room may use it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class Status(StrEnum):
    READY = "READY"
    SKIPPED = "SKIPPED"
    FAILED = "FAILED"
    POISONED = "POISONED"
    INTERRUPTED = "INTERRUPTED"
    UPDATING = "UPDATING"
    DRIFTED = "DRIFTED"
    STARTED = "STARTED"
    STALE = "STALE"
    PENDING = "PENDING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"


READY, SKIPPED, FAILED, POISONED, INTERRUPTED = (Status.READY, Status.SKIPPED, Status.FAILED, Status.POISONED,
                                                 Status.INTERRUPTED)
UPDATING, DRIFTED, STARTED, STALE = Status.UPDATING, Status.DRIFTED, Status.STARTED, Status.STALE
PENDING, COMPLETED, CANCELLED = Status.PENDING, Status.COMPLETED, Status.CANCELLED

RUN_STATUSES = frozenset({READY, SKIPPED, FAILED, POISONED, INTERRUPTED})
SUCCEEDED = frozenset({READY, SKIPPED})  # a run that ended well (exit code 0)
STAGE_STATUSES = frozenset({PENDING, COMPLETED, FAILED, INTERRUPTED, CANCELLED})
STAGE_ENDED_BADLY = frozenset({FAILED, INTERRUPTED})  # the stage a failed run names (not one cancelled after it)

# the values a record may hold, as types its strict model validates (a JSON string matches its member)
StoreStatus = Literal[Status.READY, Status.UPDATING]
NodeStatus = Literal[Status.READY, Status.SKIPPED, Status.FAILED, Status.POISONED, Status.INTERRUPTED,
                     Status.DRIFTED, Status.STARTED]
StageStatus = Literal[Status.PENDING, Status.COMPLETED, Status.FAILED, Status.INTERRUPTED, Status.CANCELLED]

_STAGE_LEGACY = {"pending": PENDING, "ok": COMPLETED, "failed": FAILED, "interrupted": INTERRUPTED,
                 "cancelled": CANCELLED}  # what earlier releases wrote


def stage_status_of(value: object) -> Status | None:
    """A stage's status as a result, an artifact or a pickled outcome carries it, in either spelling
    (``"COMPLETED"``, or the lowercase ``"ok"`` of older releases); None for anything else."""
    if isinstance(value, Status):
        return value if value in STAGE_STATUSES else None
    if not isinstance(value, str):
        return None
    if value in _STAGE_LEGACY:
        return _STAGE_LEGACY[value]
    try:
        status = Status(value)
    except ValueError:
        return None
    return status if status in STAGE_STATUSES else None
