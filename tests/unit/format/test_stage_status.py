"""A stage's status is in the program's one status vocabulary (``storage.format.status.Status``), and the
lowercase statuses earlier releases wrote still read as the same members."""

from __future__ import annotations

import json

import pytest

from storage.format.status import (
    CANCELLED, COMPLETED, FAILED, INTERRUPTED, PENDING, READY, STAGE_STATUSES, Status, stage_status_of,
)


@pytest.mark.parametrize("written, member", [
    ("ok", COMPLETED), ("failed", FAILED), ("interrupted", INTERRUPTED), ("cancelled", CANCELLED),
    ("pending", PENDING),  # what earlier releases wrote
    ("COMPLETED", COMPLETED), ("FAILED", FAILED), ("INTERRUPTED", INTERRUPTED), ("CANCELLED", CANCELLED),
    ("PENDING", PENDING),  # what this one writes
])
def test_a_stage_status_reads_in_either_spelling_as_one_member(written, member):
    status = stage_status_of(written)
    assert status is member and isinstance(status, Status)


@pytest.mark.parametrize("other", ["READY", "SKIPPED", "POISONED", "ok ", "OK", "done", "", None, 3, ["ok"]])
def test_anything_else_is_not_a_stage_status(other):
    assert stage_status_of(other) is None


def test_stage_statuses_are_members_of_the_one_vocabulary_and_serialize_as_their_names():
    assert STAGE_STATUSES <= set(Status) and READY not in STAGE_STATUSES
    row = {"name": "fetch buckets", "status": COMPLETED}
    assert json.loads(json.dumps(row)) == {"name": "fetch buckets", "status": "COMPLETED"}
    assert stage_status_of(json.loads(json.dumps(row))["status"]) is COMPLETED
