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
  which is never written.

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


READY, SKIPPED, FAILED, POISONED, INTERRUPTED = (Status.READY, Status.SKIPPED, Status.FAILED, Status.POISONED,
                                                 Status.INTERRUPTED)
UPDATING, DRIFTED, STARTED, STALE = Status.UPDATING, Status.DRIFTED, Status.STARTED, Status.STALE

RUN_STATUSES = frozenset({READY, SKIPPED, FAILED, POISONED, INTERRUPTED})
SUCCEEDED = frozenset({READY, SKIPPED})  # a run that ended well (exit code 0)

# the values a record may hold, as types its strict model validates (a JSON string matches its member)
StoreStatus = Literal[Status.READY, Status.UPDATING]
NodeStatus = Literal[Status.READY, Status.SKIPPED, Status.FAILED, Status.POISONED, Status.INTERRUPTED,
                     Status.DRIFTED, Status.STARTED]
