"""Every record a process reads back is strict: a field of the wrong type is refused where the file is read.

The store's state files (``state.json``, ``active.json``, ``poisoned.json``,
``installing.json``, ``verified/{v}.json``, ``chains/{v}.json``) and the
nodes' status records are strict pydantic records parsed by one helper
(``storage.jsonio.bounded_json.parse_record``). A hostile record (``{"version": 3}``,
a status nobody writes, a string where a number belongs) fails at once, with
the program's typed error naming the file and the field: ``StoreError``
through the store's status (the Python API and ``python -m flows.refit
status``), a problem naming the object through the fleet's node listing.
Records written by older versions (fewer fields) and newer ones (more
fields) are still read.
"""

from __future__ import annotations

import json

import pytest

from flows import api
from flows.cli import main as refit_cli
from flows.fleet import fleet_status
from storage.catalog.nodes import NodeRecord, nodes_url, scan_node_records, write_node_record
from storage.durable import folder_identity
from storage.errors import FormatError, StoreError
from storage.format.status import DRIFTED, READY, STARTED, Status
from storage.objects.store import ObjectStore
from storage.store.local_store import LocalStore

MODEL = "org/m"
ACTIVE = {"version": "r1", "digest": "sha256:00", "format_digest": "sha256:01", "files": {}, "path": "full/r1",
          "installer": "none", "installed_at_unix_ms": 1}
VERIFIED = {"version": "r1", "path": "full/r1", "sequence": 1, "checksum_format": "xxh3-64",
            "format_digest": "sha256:01", "target_digest": "sha256:00", "checksums": {}, "files": {}}
MARK = {"reason": "install failed", "version": "r1", "installer": "none"}

# (state file, its contents, the field the error names)
HOSTILE_STORE_FILES = [
    ("state.json", {"status": "READY", "version": 3}, "version"),
    ("state.json", {"status": "SHINY", "version": "r1"}, "status"),
    ("state.json", {"status": "READY", "version": "r1", "files": {"model.safetensors": "big"}},
     "files.model.safetensors"),
    ("state.json", ["READY", "r1"], None),
    ("active.json", ACTIVE | {"installed_at_unix_ms": "yesterday"}, "installed_at_unix_ms"),
    ("active.json", ACTIVE | {"path": None}, "path"),
    ("poisoned.json", MARK | {"engine_urls": "http://engine:30000"}, "engine_urls"),
    ("poisoned.json", MARK | {"since_unix_ms": 1.5}, "since_unix_ms"),
    ("installing.json", MARK | {"version": 3}, "version"),
    ("verified/r1.json", VERIFIED | {"flushed": "no"}, "flushed"),
    ("verified/r1.json", VERIFIED | {"checksums": ["aa", "bb"]}, "checksums"),
    ("verified/r1.json", VERIFIED | {"sequence": True}, "sequence"),
]


def _store(tmp_path, name: str, record) -> tuple[LocalStore, str]:
    store = LocalStore(tmp_path / "cache", MODEL)
    path = store.root / name
    path.write_text(json.dumps(record))
    return store, str(path)


@pytest.mark.parametrize("name, record, field", HOSTILE_STORE_FILES)
def test_a_hostile_state_file_fails_the_store_status_naming_the_file_and_field(tmp_path, capsys, name, record,
                                                                              field):
    store, path = _store(tmp_path, name, record)
    with pytest.raises(StoreError) as caught:
        api.status(model=MODEL, cache_dir=tmp_path / "cache")
    error = caught.value
    assert error.local_file == path and error.field == field
    assert f"local file {path!r}" in str(error) and "run `recover`" in str(error)
    if field is not None:
        assert f"field {field!r}" in str(error) and f"{field}: " in str(error)
    code = refit_cli(["status", "--model", MODEL, "--cache-dir", str(tmp_path / "cache")])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.startswith("error: ") and path in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["state.json", "active.json", "poisoned.json", "installing.json",
                                  "verified/r1.json"])
def test_a_bare_version_3_is_refused_where_it_is_read(tmp_path, name):
    """``{"version": 3}`` in any state file: a typed error naming the file and ``version`` (never a TypeError
    later)."""
    _, path = _store(tmp_path, name, {"version": 3})
    with pytest.raises(StoreError) as caught:
        api.status(model=MODEL, cache_dir=tmp_path / "cache")
    assert caught.value.local_file == path and "version: Input should be a valid string" in str(caught.value)


def test_a_hostile_chain_record_is_refused_naming_its_field(tmp_path):
    store, path = _store(tmp_path, "chains/r2.json", {"version": "r2", "full_version": "r0", "deltas": "r1"})
    with pytest.raises(StoreError) as caught:
        store.chain("r2")
    assert caught.value.local_file == path and caught.value.field == "deltas"
    (store.root / "chains" / "r2.json").write_text(json.dumps({"version": "r2", "full_version": "r0",
                                                               "deltas": ["r1", 2]}))
    with pytest.raises(StoreError) as caught:
        store.chain("r2")
    assert caught.value.field == "deltas.1"
    (store.root / "chains" / "r2.json").write_text(json.dumps({"version": "r2", "full_version": "r0",
                                                               "deltas": ["r1"]}))
    assert store.chain("r2").deltas == ("r1",)


def test_records_of_older_and_newer_writers_are_still_read(tmp_path):
    """A verified record without the fields later versions added, and with one this version does not know, is
    read (defaults filled in, the unknown key ignored); the statuses read back as members of ``Status``."""
    store = LocalStore(tmp_path / "cache", MODEL)
    folder = store.root / "full" / "r1"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 16)
    files = folder_identity(folder)
    old = {k: v for k, v in VERIFIED.items() if k != "files"} | {"files": files, "written_by": "a later version"}
    (store.root / "verified" / "r1.json").write_text(json.dumps(old))
    (store.root / "state.json").write_text(json.dumps({"status": "READY", "version": "r1", "files": files,
                                                       "source": "full/r1"}))
    described = api.status(model=MODEL, cache_dir=tmp_path / "cache")
    assert described["verified"] == ["r1"] and described["state"]["status"] == "READY"
    assert described["state"]["status"] is Status.READY
    record = store.verified("r1")
    assert record.flushed is True and record.boot_id is None and record.launch_files is None
    assert store.current() == record


def _write(tmp_path, node: str, record) -> str:
    folder = tmp_path / "nodes" / MODEL.replace("/", "--")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{node}.json").write_text(json.dumps(record))
    return f"{nodes_url(f'file://{tmp_path}/catalog', MODEL)}/{node}.json"


NODE = {"node": "n", "model": MODEL, "version": "r1", "digest": "sha256:00", "status": "READY"}
HOSTILE_NODES = {  # node name -> (its record, the field its error names)
    "bare": ({"version": 3}, "node"),
    "typed": (NODE | {"node": "typed", "version": 3}, "version"),
    "shiny": (NODE | {"node": "shiny", "status": "SHINY"}, "status"),
    "stale": (NODE | {"node": "stale", "status": "STALE"}, "status"),  # a reader's condition, never written
    "slow": (NODE | {"node": "slow", "stages": {"fetch buckets": "slow"}}, "stages.fetch buckets"),
    "maybe": (NODE | {"node": "maybe", "transient": "yes"}, "transient"),
    "twice": (NODE | {"node": "twice", "attempts": "2"}, "attempts"),
    "listed": ([NODE | {"node": "listed"}], None),
}


def test_hostile_node_records_are_named_in_the_fleet_listing_and_the_rest_is_read(tmp_path):
    catalog = f"file://{tmp_path}/catalog"
    objects = ObjectStore.shared(None)
    write_node_record(objects, catalog, NodeRecord(node="good", model=MODEL, version="r1", digest="sha256:00",
                                                   status=READY))
    urls = {node: _write(tmp_path, node, record) for node, (record, _) in HOSTILE_NODES.items()}
    # an older writer's record (none of the later fields) with a key a newer one added, and a heartbeat's first
    _write(tmp_path, "old", {"node": "old", "model": MODEL, "version": None, "digest": None, "status": "STARTED",
                             "updated_at_unix_ms": 5, "written_by": "a later version"})
    view = fleet_status(catalog, MODEL)
    assert [n.node for n in view.nodes] == ["good", "old"]
    assert view.nodes[1].status is STARTED and view.nodes[1].engines == {} and view.nodes[1].transient is False
    assert view.nodes[0].status is READY and view.nodes[0].condition() == "READY"
    assert len(view.problems) == len(HOSTILE_NODES)
    for node, url in urls.items():
        assert sum(problem.startswith(f"{url}: ") for problem in view.problems) == 1, (node, view.problems)
    scan = scan_node_records(objects, catalog, MODEL)
    assert scan.unreadable == sorted(HOSTILE_NODES)
    for node, (_, field) in HOSTILE_NODES.items():
        error = scan.errors[node]
        assert isinstance(error, FormatError) and error.file == urls[node] and error.field == field, (node, error)
        assert "NodeRecord record" in str(error)
    assert "version: Input should be a valid string" in str(scan.errors["typed"])


def test_a_node_record_keeps_the_strings_it_always_had(tmp_path):
    """The status vocabulary is one ``StrEnum`` whose members are the strings the records always held: a record
    written now is byte-for-byte what an older version wrote for the same values."""
    catalog = f"file://{tmp_path}/catalog"
    record = NodeRecord(node="n", model=MODEL, version=None, digest=None, status=DRIFTED, updated_at_unix_ms=7)
    write_node_record(ObjectStore.shared(None), catalog, record)
    raw = json.loads((tmp_path / "nodes" / "org--m" / "n.json").read_text())
    assert raw["status"] == "DRIFTED" and type(raw["status"]) is str
    assert json.dumps(record.to_json(), sort_keys=True) == json.dumps(raw, sort_keys=True)
    with pytest.raises(ValueError, match="version"):  # constructing one in code is as strict as reading one
        NodeRecord(node="n", model=MODEL, version=3, digest=None, status=READY)
