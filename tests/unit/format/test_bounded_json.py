"""The one bounded JSON parser (storage/jsonio/bounded_json.py), and the hostile documents of issue 35 that are about parsing.

Deep nesting in a catalog record, an index or a bucket header must give the reader's typed error naming the
document, never a RecursionError; ``[],``-style documents of a legal size must be refused before
``json.loads`` turns every three bytes into a Python list; UTF-16 and BOM-prefixed records, repeated keys and
NaN are refused. Peak memory is measured with tracemalloc.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

import tests.support.adversarial_support as av
import tests.support.crash_trials as ct
from storage.jsonio import bounded_json
from storage.jsonio.bounded_json import (
    ELEMENT_COST, HEADER, INDEX, MEMORY_RATIO, RECORD, STORE_RECORD, JsonLimits, load_json, read_bounded,
)
from storage.catalog.manifests import parse_manifest
from storage.catalog.records import parse_revision
from storage.durable import read_json_file
from storage.errors import (
    CatalogError, FormatError, ManifestError, RefitError, SafetensorsError, StoreError, StoreRecordError,
)
from storage.format.safetensors import encode_header, parse_bytes

MiB = 2**20
ROOT = Path(__file__).resolve().parents[3]
INDEX_FILE = "delta.safetensors.index.json"


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    return opener * depth + closer * depth


def jam(depth: int = 100_000) -> bytes:
    """The issue's catalog object: ``{"junk":`` and 100,000 ``[`` ... ``]}`` (about 200 KB)."""
    return b'{"junk":' + nested(depth) + b"}"


def measured(fn, *args, **kwargs):
    """(result or raised exception, tracemalloc peak in bytes) of ``fn(*args, **kwargs)``."""
    tracemalloc.start()
    try:
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the test inspects what came out
            out = exc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


def bucket(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


# --- the parser itself --------------------------------------------------------------------------------------------


def test_valid_documents_parse_as_json_loads_would():
    for doc in ({"a": [1, 2.5, None, True, False, "é😀", {"b": {}}], "c": -3}, [], {}, "x", 0, None,
                {"weight_map": {f"t{i}": "a.safetensors" for i in range(1000)}}):
        raw = json.dumps(doc, ensure_ascii=False).encode()
        assert load_json(raw, RECORD) == doc
    assert load_json('{"s": "\\ud83d\\ude00"}', RECORD) == {"s": "😀"}  # an escaped surrogate pair is one character
    assert load_json(b"[1e308]", RECORD) == [1e308]


@pytest.mark.parametrize("raw, words", [
    (b"\xef\xbb\xbf{}", "byte order mark"),
    ('{"schema": "x"}'.encode("utf-16"), "not UTF-8"),  # with its BOM
    ('{"schema": "x"}'.encode("utf-16-le"), "not valid JSON"),  # no BOM: NUL bytes, valid UTF-8, not JSON
    ('{"schema": "x"}'.encode("utf-32"), "not UTF-8"),
    (b'{"a": "\xed\xa0\x80"}', "not UTF-8"),  # an encoded surrogate
    (b'{"a": "\xc0\xaf"}', "not UTF-8"),  # an overlong encoding
    (b'{"a": "\\ud800"}', "not valid JSON"),  # an escaped lone surrogate
    (b'{"a": "\\udc00\\ud800"}', "not valid JSON"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'{"x": {"a": 1, "b": 2, "a": 1}}', "duplicate key 'a'"),
    (b'{"a": NaN}', "NaN"),
    (b'{"a": Infinity}', "Infinity"),
    (b'{"a": -Infinity}', "-Infinity"),
    (b'{"a": 1e999}', "infinity"),
    (b'{"a": ' + b"1" * 5000 + b"}", "not valid JSON"),  # past Python's digit limit
    (b"", "not valid JSON"),
    (b'{"a": 1} x', "not valid JSON"),
    (jam(), "nests deeper than 32"),
    (nested(33), "nests deeper than 32"),
    (nested(5000, b'{"a":', b"}"), "nests deeper than 32"),
])
def test_what_is_refused_gets_the_typed_error_naming_the_document(raw, words):
    with pytest.raises(CatalogError) as caught:
        load_json(raw, RECORD, error=CatalogError, revision="r7", file="s3://bucket/catalog/r7.json")
    assert words in str(caught.value)
    assert caught.value.revision == "r7" and caught.value.file == "s3://bucket/catalog/r7.json"


def test_nesting_up_to_the_limit_parses_and_strings_do_not_count():
    assert load_json(nested(32), RECORD) == json.loads(nested(32))
    brackets = json.dumps({"name": "[" * 10_000 + "{" * 10_000, "escaped": '\\"[[[[' * 100}).encode()
    assert load_json(brackets, RECORD)["name"].count("[") == 10_000


def test_a_size_over_the_limit_is_refused_before_anything_else():
    raw = b" " * (RECORD.max_bytes + 1)
    with pytest.raises(CatalogError, match="more than the 1048576-byte limit"):
        load_json(raw, RECORD, error=CatalogError, file="r1.json")


def test_the_top_level_type_is_checked_when_asked():
    with pytest.raises(ManifestError, match="is a JSON array, not an object"):
        load_json(b"[1]", INDEX, error=ManifestError, expect=dict, file="i.json")


def test_element_counts_follow_the_bytes():
    limits = JsonLimits("test", 64 * MiB, 16, 1 << 30, free_elements=10)
    # 3 bytes an element of "[]," is far denser than the (4 * n - n) / ELEMENT_COST the bytes pay for
    with pytest.raises(FormatError, match="elements"):
        load_json(b"[" + b"[]," * 100_000 + b"[]]", limits)
    # padded with whitespace to what it pays for, the same shape parses
    pad = b" " * ELEMENT_COST
    assert len(load_json(b"[" + (b"[]," + pad) * 10_000 + b"[]]", limits)) == 10_001


# --- real headers: their true depth, every repeated key, at any chunk size -----------------------------------------


def header_json(tensors: int, metadata: dict | None = None, name: str = "model.layers.{i}.mlp.experts.{i}.w1") -> bytes:
    """A safetensors header's JSON (the writer's own encoding): depth 3, no backslash, ``tensors`` entries."""
    raw, _ = encode_header(((name.format(i=i), "F8_E4M3", [4, 2], 8) for i in range(tensors)), metadata)
    return raw[8:]


def shape_of(value) -> tuple[int, int, int]:
    """(depth, elements, object members) of a parsed JSON value, from the value itself: a container is one
    element, each item after its first one more (its comma), each member one more (its colon)."""
    if isinstance(value, dict):
        inner = [shape_of(v) for v in value.values()]
        extra = 2 * len(value) - 1 if value else 0
    elif isinstance(value, list):
        inner = [shape_of(v) for v in value]
        extra = len(value) - 1 if value else 0
    else:
        return 0, 0, 0
    return (1 + max((d for d, _, _ in inner), default=0), 1 + extra + sum(e for _, e, _ in inner),
            (len(value) if isinstance(value, dict) else 0) + sum(m for _, _, m in inner))


STRUCTURED_STRINGS = {  # strings holding brackets, commas, colons and quotes' neighbours, across chunk edges
    "header": header_json(300, {"format": "pt"}),
    "checksums": header_json(200, {f"model.layers.{i}.mlp.experts.{i}.w1": "xxh3-128:" + "0f" * 16
                                   for i in range(200)}),
    "names": header_json(50, name="layer[{i}]{{x}}:a,b"),
    "empty strings": json.dumps({"": ["", "", {"": ""}], "a": ["x" * 40, "", "]" * 30]}).encode(),
    "record": json.dumps({"uri": "s3://bucket/r1/delta.safetensors.index.json", "n": [1, [2, [3]]]}).encode(),
    "scalar": b'"a:b,[c]"',
}


@pytest.mark.parametrize("chunk", [1, 2, 5, 64, 1 << 15])
@pytest.mark.parametrize("doc", sorted(STRUCTURED_STRINGS))
def test_the_scan_counts_depth_elements_and_members_as_the_parsed_value_has_them(doc, chunk, monkeypatch):
    raw = STRUCTURED_STRINGS[doc]
    assert b"\\" not in raw
    monkeypatch.setattr(bounded_json, "_CHUNK", chunk)
    depth, elements, members = shape_of(json.loads(raw))
    assert bounded_json._structure(raw, 1 << 30, 1 << 30) == (depth, elements + 1, members)  # + the top value


def test_a_header_is_read_at_its_true_depth():
    raw = header_json(20_000, {"format": "pt"})
    assert load_json(raw, JsonLimits("header", 64 * MiB, 3, 1 << 22, 1 << 22)) == json.loads(raw)
    with pytest.raises(SafetensorsError, match="header nests deeper than 2 levels") as caught:
        load_json(raw, JsonLimits("header", 64 * MiB, 2, 1 << 22, 1 << 22), error=SafetensorsError, file="b.safetensors")
    assert caught.value.file == "b.safetensors"


def _repeat_last(raw: bytes, key: bytes) -> bytes:
    """``raw`` (an object of objects) with ``key`` added again to its last object, before the final ``}}``."""
    assert raw.rstrip().endswith(b"}}")
    return raw.rstrip()[:-2] + b',"' + key + b'":0}}'


@pytest.mark.parametrize("raw, key", [
    (_repeat_last(header_json(20_000), b"dtype"), "dtype"),  # a header: members counted, no pairs hook
    (header_json(20_000).rstrip()[:-1] + b',"model.layers.7.mlp.experts.7.w1":{}}', "model.layers.7.mlp.experts.7.w1"),
    (header_json(3000, name="a:[{i}]").rstrip()[:-1] + b',"a:[1]":{}}', "a:[1]"),  # strings hold structure
    (b'{"a\\n": 1, "a\\n": 2}', "a\n"),  # a backslash: the pairs hook
    (b'[{"a": 1}, {"b": [{"c": 1, "c": 1}]}]', "c"),  # in a list, at depth 4
    (b'{"__metadata__": {"x": "1", "y": "2", "x": "3"}, "t": {}}', "x"),
    (b'{"a": {}, "b": {"a": 1, "b": 2}, "a": {}}', "a"),  # the objects' sizes add up, less one
])
def test_every_repeated_key_is_refused_naming_it_and_the_document(raw, key):
    with pytest.raises(SafetensorsError) as caught:
        load_json(raw, HEADER, error=SafetensorsError, file="s3://bucket/r2/bucket-00000.safetensors", revision="r2")
    assert f"header is not valid JSON (duplicate key {key!r})" in str(caught.value)
    assert caught.value.file == "s3://bucket/r2/bucket-00000.safetensors" and caught.value.revision == "r2"


# --- memory: peak within MEMORY_RATIO x the bytes, for the costliest shapes ------------------------------------


def _at_the_limit(element: bytes, n: int = 2 * MiB) -> bytes:
    """A ``[...]`` of ``element`` repeated, each padded with spaces to just the bytes its elements pay for."""
    per_item = bounded_json._scan(element, 99, 1 << 30)[1]  # the element's own, and its comma
    width = -(-per_item * ELEMENT_COST // (MEMORY_RATIO - 1)) + 1  # ASCII: the decoded text costs 1x the bytes
    item = element + b"," + b" " * (width - len(element) - 1)
    return b"[" + item * (n // width) + element + b"]"


SHAPES = {
    "empty arrays": b"[]",
    "empty objects": b"{}",
    "nested arrays": b"[[[[[[]]]]]]",
    "objects of one key": b'{"a":{}}',
    "small integers": b"7",
    "large integers": b"1000000",
    "floats": b"1.5",
    "short strings": b'"ab"',
    "escaped strings": b'"\\n\\t"',
    "null": b"null",
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_peak_memory_stays_within_four_times_the_bytes(shape):
    limits = JsonLimits("test", 64 * MiB, 16, 1 << 30, free_elements=0)
    raw = _at_the_limit(SHAPES[shape])
    value, peak = measured(load_json, raw, limits)
    assert isinstance(value, list), value  # accepted: it is what the bytes pay for
    assert peak <= MEMORY_RATIO * len(raw), f"{peak:,} bytes for {len(raw):,}"
    denser = raw.replace(b" " * 8, b"")  # the same elements in fewer bytes: refused, still within the bound
    value, peak = measured(load_json, denser, limits)
    assert isinstance(value, FormatError) and "elements" in str(value), value
    assert peak <= MEMORY_RATIO * len(denser) + MiB


def test_unique_keys_and_non_ascii_text_stay_within_the_bound():
    limits = JsonLimits("test", 64 * MiB, 16, 1 << 30, free_elements=0)
    keys = b"{" + b",".join(b'"k%07d":0%s' % (i, b" " * 64) for i in range(30_000)) + b"}"  # 2 elements each
    value, peak = measured(load_json, keys, limits)
    assert isinstance(value, dict) and len(value) == 30_000
    assert peak <= MEMORY_RATIO * len(keys)
    # a character past Latin-1 makes the decoded text 2 bytes a character: fewer elements are paid for
    wide = ("[" + ",".join(['"\u1234ab"' + " " * 120] * 30_000) + "]").encode()
    value, peak = measured(load_json, wide, limits)
    assert isinstance(value, list) and len(value) == 30_000
    assert peak <= MEMORY_RATIO * len(wide)
    # one past the BMP makes it 4 bytes a character: the text alone costs ~4x (and CPython's decoder holds its
    # 1-byte draft while it widens: 5x at that moment), so only the kind's floor of elements is allowed (here none)
    astral = ("[" + ",".join(['"\U0001F600ab"' + " " * 120] * 30_000) + "]").encode()
    value, peak = measured(load_json, astral, limits)
    assert isinstance(value, FormatError) and "elements" in str(value), value
    assert peak <= (MEMORY_RATIO + 1) * len(astral) + MiB


def test_a_63_mib_bracket_index_is_refused_without_building_it():
    raw = b'{"weight_map": [' + b"[]," * (21 * MiB) + b"[]]}"
    assert len(raw) < INDEX.max_bytes
    record = parse_revision(_delta_record(), version="r2", model="org/m", file="r2.json")
    out, peak = measured(parse_manifest, raw, record)
    assert isinstance(out, ManifestError) and "elements" in str(out), out
    assert out.revision == "r2" and out.file == record.uri
    assert peak < 2 * len(raw), f"peak {peak:,} bytes for a {len(raw):,}-byte index"  # the decoded text, no lists


def test_an_80_mib_bracket_bucket_header_is_refused_without_building_it():
    header = b'{"a": [' + b"[]," * (80 * MiB // 3 - 4) + b"[]]}"
    raw = bucket(header)
    out, peak = measured(parse_bytes, raw, file="s3://bucket/r2/bucket-00000.safetensors", revision="r2")
    assert isinstance(out, SafetensorsError) and "elements" in str(out), out
    assert out.file == "s3://bucket/r2/bucket-00000.safetensors" and out.revision == "r2"
    # the header's copy (parse_bytes) and its decoded text; no lists
    assert peak < 3 * len(header), f"peak {peak:,} bytes for an {len(header):,}-byte header"


def test_a_legal_large_index_parses():
    index = {"metadata": {"total_size": 1},
             "weight_map": {f"model.layers.{i // 64}.experts.{i % 64}.w": "model-00001-of-00009.safetensors"
                            for i in range(200_000)}}
    raw = json.dumps(index).encode()
    assert load_json(raw, INDEX, expect=dict) == index


# --- every reader: the deep document gets the reader's error ------------------------------------------------------


def _delta_record(version: str = "r2") -> dict:
    digest = "sha256:" + "0" * 64
    return {"schema": "canonical-refit.revision.v1", "model": "org/m", "version": version, "sequence": 2,
            "payload_format": "xor_delta", "base_version": "r1", "base_digest": digest, "target_digest": digest,
            "format_digest": digest, "checksum_format": "xxh3-128", "uri": f"s3://bucket/{version}/{INDEX_FILE}",
            "created_at_unix_ms": 1}


def test_a_deep_record_is_a_catalog_error_naming_revision_and_file():
    with pytest.raises(CatalogError, match="nests deeper") as caught:
        parse_revision(jam(), version="r5", model="org/m", file="s3://bucket/catalog/r5.json")
    assert (caught.value.revision, caught.value.file) == ("r5", "s3://bucket/catalog/r5.json")


def test_a_deep_index_is_a_manifest_error_naming_revision_and_file():
    record = parse_revision(_delta_record(), version="r2", model="org/m", file="r2.json")
    raw = b'{"metadata": {}, "weight_map": ' + nested(50_000, b'{"a":', b"}") + b"}"
    with pytest.raises(ManifestError, match="nests deeper") as caught:
        parse_manifest(raw, record)
    assert (caught.value.revision, caught.value.file) == ("r2", record.uri)


def test_a_deep_bucket_header_is_a_safetensors_error_naming_revision_and_file():
    raw = bucket(b'{"a": ' + nested(200_000) + b"}")
    with pytest.raises(SafetensorsError, match="nests deeper") as caught:
        parse_bytes(raw, file="s3://bucket/r2/bucket-00000.safetensors", revision="r2")
    assert (caught.value.revision, caught.value.file) == ("r2", "s3://bucket/r2/bucket-00000.safetensors")


def test_store_records_are_bounded_and_typed(tmp_path):
    state = tmp_path / "state.json"
    state.write_bytes(jam())
    with pytest.raises(StoreRecordError, match="nests deeper") as caught:
        read_json_file(state)
    assert caught.value.local_file == str(state)
    assert isinstance(caught.value, StoreError) and isinstance(caught.value, ValueError)  # torn-memo readers
    state.write_bytes('{"status": "READY"}'.encode("utf-16"))
    with pytest.raises(StoreRecordError, match="not UTF-8"):
        read_json_file(state)
    assert read_json_file(tmp_path / "missing.json") is None
    with open(state, "wb") as fh:
        fh.truncate(STORE_RECORD.max_bytes + 1)  # sparse: refused by its size, never read
    with pytest.raises(StoreRecordError, match="more than"):
        read_json_file(state)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "state.json"
    os.mkfifo(fifo)
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(measured(read_json_file, fifo)[0]), daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # unblock the reader before failing, so the test run does not hang
        with open(fifo, "wb"):
            pass
        reader.join(5)
    assert outcome and isinstance(outcome[0], StoreRecordError) and "not a regular file" in str(outcome[0])


def test_the_local_index_of_a_checkpoint_is_bounded(tmp_path):
    from storage.format.checkpoint import CheckpointIndex

    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(b'{"weight_map": ' + nested(10_000) + b"}")
    with pytest.raises(ManifestError, match="nests deeper") as caught:
        CheckpointIndex.open(tmp_path, revision="r0")
    assert caught.value.file == str(index) and caught.value.revision == "r0"
    assert read_bounded(tmp_path / "absent", RECORD, missing_ok=True) is None


# --- through the refit: the store untouched, the error naming revision and file --------------------------------


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    return av.hostile_world(tmp_path_factory)


def test_refit_to_a_deep_record_fails_typed_and_keeps_the_store(world):
    version = world.new("d2", raw_record=jam())
    out = world.refit(version)
    av.assert_rejected(out, CatalogError, file=f"{version}.json")
    assert "nests deeper" in str(out.error)


def test_refit_to_a_deep_index_fails_typed_and_keeps_the_store(world):
    version = world.new("d2", index=lambda i: b'{"metadata": {}, "weight_map": ' + nested(100_000) + b"}")
    out = world.refit(version)
    av.assert_rejected(out, ManifestError, file=INDEX_FILE)
    assert "nests deeper" in str(out.error)


def test_refit_to_a_deep_bucket_header_fails_typed_and_keeps_the_store(world):
    name = world.bucket_names("d2")[0]
    version = world.new("d2", files={name: bucket(b'{"a": ' + nested(100_000) + b"}")})
    out = world.refit(version)
    av.assert_rejected(out, SafetensorsError, file=name)
    assert "nests deeper" in str(out.error)


def test_refit_to_a_bracket_bomb_index_stays_small(world):
    bomb = b'{"metadata": {}, "weight_map": [' + b"[]," * (8 * MiB) + b"[]]}"  # 24 MiB, a legal size
    version = world.new("d2", index=lambda i: bomb)
    out = world.refit(version)
    av.assert_rejected(out, ManifestError, file=INDEX_FILE, bound=3 * len(bomb))
    assert "elements" in str(out.error)


def _cli(world, cache: Path, *args) -> tuple[int, dict, str]:
    env = ct.prefect_env() | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "flows.refit", "--catalog", world.lab.catalog, "--model", world.lab.model,
           "--seed-checkpoint", str(world.lab.launch), "--cache-dir", str(cache), "--apply-workers", "2",
           "--json", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else {}, proc.stderr[-3000:]


def test_the_cli_refuses_deep_records_and_indexes_and_still_installs_a_good_revision(world, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(world.golden, cache, symlinks=True)
    store = cache / world.model_folder
    before = av.protected(store)
    deep_record = world.new("d2", raw_record=jam())
    deep_index = world.new("d2", index=lambda i: b'{"metadata": {}, "weight_map": ' + nested(100_000) + b"}")
    for version, words, file in ((deep_record, "record nests deeper", f"{deep_record}.json"),
                                 (deep_index, "index nests deeper", INDEX_FILE)):
        rc, out, err = _cli(world, cache, "--target", version)
        assert rc == 1 and out["status"] == "FAILED", (out, err)
        assert words in out["error"] and repr(version) in out["error"] and file in out["error"], out["error"]
        assert "RecursionError" not in err
        assert out["installed_version"] == "r1"
        assert av.protected(store) == before
    # the deep record stays in the catalog: a refit that lists the catalog still installs a good revision
    rc, out, err = _cli(world, cache, "--target", "d2")
    assert rc == 0 and out["status"] == "READY" and out["version"] == "d2", (out, err)
    world.lab.assert_checkpoint(Path(out["checkpoint_path"]), "d2")


def test_a_validation_error_becomes_the_typed_error_naming_object_and_field():
    from pydantic import BaseModel, ValidationError

    class Claim(BaseModel):
        version: str
        sequence: int

    with pytest.raises(ValidationError) as caught:
        Claim.model_validate(load_json(b'{"version": "r1", "sequence": "x"}', RECORD))
    err = bounded_json.validation_error(caught.value, CatalogError, what="sequence claim", file="s/1.json",
                                        revision="r1")
    assert isinstance(err, CatalogError) and (err.field, err.file, err.revision) == ("sequence", "s/1.json", "r1")
    assert str(err).startswith("invalid sequence claim: ")
