"""The store's other files are strict records too: launch files, artifact sources, flushed marks.

``launch-files.json`` (``LaunchFiles``), ``{full,deltas}/{v}.source.json``
(``SourceRecord``) and ``flushed/{v}.json`` (``FlushedMark``), and the local
Prefect server's ``local-server.json`` (``flows.local_server``, a state file
of ``$PREFECT_HOME``), are strict pydantic dataclasses read through
``storage.jsonio.bounded_json.read_record``: a value of the wrong JSON type,
a missing key or a key the program does not know is refused with the typed
error (``StoreError``; ``FormatError`` for the server's record) naming the
file and the field. Files as today's code writes them parse. Each is a cache
or a mark, so a refused one is logged and rebuilt, as a torn one always was:
the launch files are captured again, an artifact is downloaded again, an
unflushed checkpoint stays unflushed, no local server is known.
"""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from tests.support.logs import emitted

from flows import local_server
from storage.errors import FormatError, StoreError
from storage.jsonio.bounded_json import STORE_RECORD, read_record
from storage.store import launch_files
from storage.store.artifacts import DELTA, ArtifactCache, SourceRecord, read_source
from storage.store.local_store import LocalStore
from storage.store.records import FlushedMark

MODEL = "org/m"
CONFIG = b'{"model_type": "llama"}\n'


def test_the_launch_files_record_as_written_today_parses_and_a_refused_one_is_captured_again(lab):
    lab.publish("initial")
    (lab.launch / "config.json").write_bytes(CONFIG)
    assert lab.run(target="r0").status == "READY"
    root = LocalStore(lab.cache, lab.model).root
    today = {"files": {"config.json": [len(CONFIG), hashlib.sha256(CONFIG).hexdigest()]}, "version": "r0"}
    path = root / launch_files.RECORD
    assert json.loads(path.read_text()) == today
    assert launch_files.read_launch_record(root) == launch_files.LaunchFiles(
        "r0", {"config.json": (len(CONFIG), hashlib.sha256(CONFIG).hexdigest())})
    path.write_text(json.dumps(today | {"version": 3}))
    with pytest.raises(StoreError) as caught:
        read_record(path, launch_files.LaunchFiles, STORE_RECORD, error=StoreError)
    assert caught.value.local_file == str(path) and caught.value.field == "version"
    with emitted("canonical_refit.store", logging.WARNING) as logged:
        assert launch_files.kept(root) is None
    assert str(path) in _text(logged) and "captured again at the next seed" in _text(logged)
    assert lab.run(target="r0").status == "READY"
    assert json.loads(path.read_text()) == today  # captured again from the launch snapshot


@pytest.mark.parametrize("contents, field", [
    ({"version": "r0", "files": {"config.json": [23, 7]}}, "files.config.json.1"),
    ({"version": "r0", "files": {"config.json": ["23", "ab"]}}, "files.config.json.0"),
    ({"version": "r0", "files": ["config.json"]}, "files"),
    ({"files": {}}, "version"),
    ({"version": "r0", "files": {}, "captured_at": 1}, "captured_at"),
])
def test_a_malformed_launch_files_record_is_refused_naming_it(tmp_path, contents, field):
    store = LocalStore(tmp_path / "cache", MODEL)
    path = store.root / launch_files.RECORD
    path.write_text(json.dumps(contents))
    with pytest.raises(StoreError) as caught:
        read_record(path, launch_files.LaunchFiles, STORE_RECORD, error=StoreError)
    assert (caught.value.local_file, caught.value.field) == (str(path), field)
    assert launch_files.read_launch_record(store.root) is None and launch_files.describe(store.root) is None


SOURCE = {"files": {"bucket-00000.safetensors": [1234, 1700000000000000000]},
          "index_sha256": "ab" * 32, "uri": "s3://bucket/revisions/r1/index.json"}


def test_a_source_record_as_written_today_parses(tmp_path):
    store = LocalStore(tmp_path / "cache", MODEL)
    cache = ArtifactCache(store)
    index = b'{"metadata": {}}'
    cache.open(DELTA, "r1", SOURCE["uri"], index)
    path = store.root / DELTA / "r1.source.json"
    assert json.loads(path.read_text()) == {"files": {}, "index_sha256": hashlib.sha256(index).hexdigest(),
                                            "uri": SOURCE["uri"]}
    path.write_text(json.dumps(SOURCE))
    assert read_source(path) == SourceRecord(SOURCE["uri"], "ab" * 32,
                                             {"bucket-00000.safetensors": [1234, 17 * 10**17]})
    seeded = {"files": {}, "index_sha256": None, "uri": "seed:/models/launch"}  # a seeded launch snapshot's
    path.write_text(json.dumps(seeded))
    assert read_source(path).index_sha256 is None


@pytest.mark.parametrize("contents, field", [
    (SOURCE | {"uri": None}, "uri"),
    (SOURCE | {"index_sha256": 5}, "index_sha256"),
    (SOURCE | {"files": {"bucket-00000.safetensors": [1234]}}, "files.bucket-00000.safetensors"),
    ({k: v for k, v in SOURCE.items() if k != "index_sha256"}, "index_sha256"),
    (SOURCE | {"etag": "x"}, "etag"),
])
def test_a_malformed_source_record_is_refused_and_its_folder_is_wiped(tmp_path, contents, field):
    store = LocalStore(tmp_path / "cache", MODEL)
    cache = ArtifactCache(store)
    folder = cache.open(DELTA, "r1", SOURCE["uri"], None)
    (folder / "bucket-00000.safetensors").write_bytes(b"stale")
    path = store.root / DELTA / "r1.source.json"
    path.write_text(json.dumps(contents))
    with pytest.raises(StoreError) as caught:
        read_source(path)
    assert (caught.value.local_file, caught.value.field) == (str(path), field)
    with emitted("canonical_refit.store", logging.WARNING) as logged:
        assert not cache.matches(DELTA, "r1", SOURCE["uri"], None)
        cache.open(DELTA, "r1", SOURCE["uri"], None)
    assert str(path) in _text(logged) and "downloaded again" in _text(logged)
    assert not (folder / "bucket-00000.safetensors").exists()  # wiped, to be downloaded again
    assert read_source(path) == SourceRecord(SOURCE["uri"], None, {})


VERIFIED = {"version": "r1", "path": "full/r1", "sequence": 1, "checksum_format": "xxh3-64",
            "format_digest": "sha256:01", "target_digest": "sha256:00", "checksums": {},
            "files": {"model.safetensors": [10, 20]}, "verified_at_unix_ms": 1, "boot_id": "a boot before this one",
            "flushed": False}


@pytest.mark.parametrize("mark, flushed", [
    ({"files": {"model.safetensors": [10, 20]}}, True),  # as written today: it vouches for the record
    ({"files": {"model.safetensors": [10, 21]}}, False),  # for other bytes
    ({"files": {"model.safetensors": ["10", 20]}}, False),  # refused: wrong type
    ({}, False),  # refused: no files
    ({"files": {"model.safetensors": [10, 20]}, "fsynced_at": 5}, False),  # refused: unknown key
])
def test_a_flushed_mark_vouches_only_when_it_is_a_valid_mark(tmp_path, mark, flushed):
    store = LocalStore(tmp_path / "cache", MODEL)
    (store.root / "verified" / "r1.json").write_text(json.dumps(VERIFIED))
    path = store.root / "flushed" / "r1.json"
    path.write_text(json.dumps(mark))
    with emitted("canonical_refit.store", logging.WARNING) as logged:
        assert store.verified("r1", check_files=False).flushed is flushed
    refused = "files" not in mark or len(mark) > 1 or not isinstance(mark["files"]["model.safetensors"][0], int)
    if refused:
        with pytest.raises(StoreError) as caught:
            read_record(path, FlushedMark, STORE_RECORD, error=StoreError)
        assert caught.value.local_file == str(path) and str(path) in _text(logged)
    else:
        assert read_record(path, FlushedMark, STORE_RECORD) == FlushedMark(mark["files"])


SERVER = {"pid": 1, "start": None, "url": "http://127.0.0.1:4200/api", "started_at_unix_ms": 1700000000000,
          "idle_s": 1800.0, "log": "/home/u/.prefect/canonical-refit/local-server.log"}


def test_the_local_servers_record_as_written_today_parses(tmp_path):
    record = local_server.ServerRecord(**SERVER)
    folder = tmp_path / "canonical-refit"
    folder.mkdir()
    local_server._write_record(folder, record)
    assert json.loads((folder / local_server.RECORD).read_text()) == SERVER
    assert local_server.load_record(folder) == record and local_server.read_record(folder) == record
    (folder / local_server.RECORD).write_text(json.dumps(SERVER | {"idle_s": 60}))  # an integer idle time
    assert local_server.load_record(folder).idle_s == 60


@pytest.mark.parametrize("contents, field", [
    (SERVER | {"pid": "1"}, "pid"),
    (SERVER | {"idle_s": "1800"}, "idle_s"),
    ({k: v for k, v in SERVER.items() if k != "url"}, "url"),
    (SERVER | {"port": 4200}, "port"),
])
def test_a_malformed_local_server_record_is_refused_and_no_server_is_known(tmp_path, contents, field):
    folder = tmp_path / "canonical-refit"
    folder.mkdir()
    path = folder / local_server.RECORD
    path.write_text(json.dumps(contents))
    with pytest.raises(FormatError) as caught:
        local_server.load_record(folder)
    assert (caught.value.local_file, caught.value.field) == (str(path), field)
    with emitted("canonical_refit.api", logging.WARNING) as logged:
        assert local_server.read_record(folder) is None and local_server.running_server(tmp_path) is None
    assert str(path) in _text(logged)


def _text(records: list[logging.LogRecord]) -> str:
    return "\n".join(record.getMessage() for record in records)
