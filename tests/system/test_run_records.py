"""What a run leaves in its result: each stage's row in the one status vocabulary, run once (no attempt count),
and a result written by an earlier release (lowercase statuses, an ``attempts`` of 1) still read."""

from __future__ import annotations

import json

from flows.report import RefitResult, failed_stage, print_result
from storage.format.status import COMPLETED, FAILED, Status


def test_every_stage_row_says_its_status_in_the_one_vocabulary_and_no_attempt_count(lab, capsys):
    lab.publish("initial")
    lab.publish("delta")
    _, result = lab.refit()
    assert result.status == "READY" and failed_stage(result) is None
    rows = json.loads(json.dumps(result.to_json()))["stages"]  # as --json prints them
    assert rows and all(r["status"] == "COMPLETED" and "attempts" not in r for r in rows), rows
    assert all(s["status"] is COMPLETED for s in result.stages)

    lab.publish("delta")
    bucket = lab.root / "revisions" / "r2" / "bucket-00000.safetensors"
    good = bucket.read_bytes()
    bucket.write_bytes(good[:-64] + bytes(b ^ 0xFF for b in good[-64:]))  # r2's payload is corrupt
    _, failed = lab.refit()
    assert failed.status == "FAILED"
    statuses = {s["name"]: s["status"] for s in failed.stages}
    assert statuses["apply deltas"] == FAILED and failed_stage(failed) == "apply deltas", statuses
    assert set(statuses.values()) <= set(Status) and all(isinstance(v, Status) for v in statuses.values())
    capsys.readouterr()
    print_result(failed)
    table = capsys.readouterr().out
    assert "apply deltas    FAILED" in table and "resolve catalog COMPLETED" in table, table


def test_a_result_an_earlier_release_wrote_still_names_its_failed_stage():
    old = {"status": "FAILED", "version": None, "target_digest": None, "format_digest": None,
           "checkpoint_path": None, "error": "boom",
           "stages": [{"name": "resolve catalog", "status": "ok", "attempts": 1, "seconds": 0.1, "bytes": 0,
                       "requests": 2, "retries": 0, "backoff_s": 0.0},
                      {"name": "fetch buckets", "status": "cancelled", "attempts": 1, "seconds": 0.1, "bytes": 0,
                       "requests": 2, "retries": 0, "backoff_s": 0.0},
                      {"name": "apply deltas", "status": "failed", "attempts": 1, "seconds": 0.2, "bytes": 9,
                       "requests": 0, "retries": 0, "backoff_s": 0.0}]}
    result = RefitResult(**old)
    assert failed_stage(result) == "apply deltas"  # not the one cancelled because it failed
