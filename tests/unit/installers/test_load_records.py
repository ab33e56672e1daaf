"""The loader's request and report files are strict records read by the one record parser: the request (the
receiver's, for the loader) refuses a wrong type, a missing field and an unknown key, each a FormatError
naming the file and the field; a report ignores keys it does not know (a newer loader's) and a refused one
reads as a rank that may have changed the engine's weights."""

from __future__ import annotations

import json

import pytest

from storage.errors import FormatError
from storage.store.local_store import LocalStore
from tasks.installers.sglang_loader import (LOADING, OK, REQUEST_SCHEMA, LoadRequest, read_reports, read_request,
                                            reports_dir, request_path, write_request)


def request(**over) -> LoadRequest:
    fields = dict(request_id="req1", model="org/name", version="r3", digest="sha256:" + "a" * 64,
                  format_digest="sha256:" + "b" * 64, path="checkpoints/r3", files={"model.safetensors": [12, 34]},
                  installer="sglang", created_at_unix_ms=1, deadline_unix_ms=2)
    return LoadRequest(**fields | over)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path, "org/name")


def test_the_request_round_trips_in_its_json_shape(store):
    assert read_request(store) is None  # none written yet
    write_request(store, request())
    on_disk = json.loads(request_path(store).read_text())
    assert on_disk == {"request_id": "req1", "model": "org/name", "version": "r3", "digest": "sha256:" + "a" * 64,
                       "format_digest": "sha256:" + "b" * 64, "path": "checkpoints/r3",
                       "files": {"model.safetensors": [12, 34]}, "installer": "sglang", "created_at_unix_ms": 1,
                       "deadline_unix_ms": 2, "schema": REQUEST_SCHEMA}
    assert read_request(store) == request()


@pytest.mark.parametrize("change, field", [
    ({"deadline_unix_ms": "2"}, "deadline_unix_ms"),
    ({"deadline_unix_ms": True}, "deadline_unix_ms"),
    ({"files": {"model.safetensors": "12"}}, "files.model.safetensors"),
    ({"schema": "canonical-refit.install-request.v9"}, "schema"),
    ({"surprise": 1}, "surprise"),
    ({"schema": None}, "schema"),  # removed below: a request without its schema
    ({"digest": None}, "digest"),  # removed below: a missing field
])
def test_a_refused_request_names_the_file_and_the_field(store, change, field):
    write_request(store, request())
    path = request_path(store)
    raw = json.loads(path.read_text()) | change
    raw = {k: v for k, v in raw.items() if v is not None}
    path.write_text(json.dumps(raw))
    with pytest.raises(FormatError) as info:
        read_request(store)
    assert (info.value.field, info.value.file) == (field, str(path))


def test_a_request_that_is_not_json_names_the_file(store):
    request_path(store).parent.mkdir(parents=True)
    request_path(store).write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON") as info:
        read_request(store)
    assert info.value.file == str(request_path(store))


def test_a_report_with_a_key_it_does_not_know_is_read(store):
    folder = reports_dir(store, "req1")
    folder.mkdir(parents=True)
    (folder / "a.json").write_text(json.dumps({"request_id": "req1", "version": "r3", "status": OK, "tp_rank": 0,
                                               "tensors": 5, "seconds": 1, "from_a_newer_loader": [1]}))
    [report] = read_reports(store, "req1")
    assert (report.status, report.tp_rank, report.tensors, report.seconds) == (OK, 0, 5, 1.0)


@pytest.mark.parametrize("bad", [{"mutation_started": "no"}, {"tp_rank": "0"}, {"status": None}])
def test_a_report_of_the_wrong_type_reads_as_a_rank_that_may_have_mutated(store, bad, caplog):
    folder = reports_dir(store, "req1")
    folder.mkdir(parents=True)
    (folder / "a.json").write_text(json.dumps({"request_id": "req1", "version": "r3", "status": LOADING} | bad))
    [report] = read_reports(store, "req1")
    assert report.status == "unreadable" and report.may_have_mutated
    assert str(folder / "a.json") in report.message and "a.json" in caplog.text
