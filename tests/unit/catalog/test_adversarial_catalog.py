"""Hostile catalog records, thrown at a store that runs r1, and fuzzed.

A record is validated before anything else happens: every case must end in
``CatalogError`` (or ``LineageError`` for a record that breaks the chain)
naming the revision, the record file and the field, with the store
bit-for-bit unchanged. Unknown extra fields are ignored (docs/format.md, section 4).
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.support.adversarial_support as av
from storage.catalog.records import parse_revision
from storage.errors import CatalogError, LineageError, StorageError
from storage.settings import VERSION_PATTERN

MiB = 2**20
FIELDS = ("schema", "model", "version", "sequence", "payload_format", "base_version", "base_digest",
          "target_digest", "format_digest", "checksum_format", "uri", "created_at_unix_ms")


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    return av.hostile_world(tmp_path_factory)


def without(field):
    return lambda r: {k: v for k, v in r.items() if k != field}


def setting(**changes):
    return lambda r: r | changes


FIELD_CASES = {f"missing {f}": (without(f), f) for f in FIELDS if f not in ("base_version", "base_digest", "uri")}
FIELD_CASES |= {
    "sequence as a string": (setting(sequence="2"), "sequence"),
    "sequence as a float": (setting(sequence=2.0), "sequence"),
    "sequence as a bool": (setting(sequence=True), "sequence"),
    "negative sequence": (setting(sequence=-1), "sequence"),
    "created_at negative": (setting(created_at_unix_ms=-5), "created_at_unix_ms"),
    "schema v2": (setting(schema="canonical-refit.revision.v2"), "schema"),
    "unknown payload format": (setting(payload_format="lora"), "payload_format"),
    "unknown checksum format": (setting(checksum_format="md5"), "checksum_format"),
    "digest in uppercase": (setting(target_digest="sha256:" + "AB" * 32), "target_digest"),
    "digest too short": (setting(target_digest="sha256:abc"), "target_digest"),
    "digest of another hash": (setting(format_digest="md5:" + "0" * 32), "format_digest"),
    "base digest not a string": (setting(base_digest=12), "base_digest"),
    "base_version with a path separator": (setting(base_version="../r1"), "base_version"),
    "base_version absolute": (setting(base_version="/r1"), "base_version"),
    "delta without base_version": (setting(base_version=None), "base_version"),
    "delta without uri": (setting(uri=None), "uri"),
    "uri with a query": (setting(uri="s3://bucket/key?x=1"), "uri"),
    "uri with an empty segment": (setting(uri="s3://bucket//key"), "uri"),
    "model of another catalog": (setting(model="other/model"), "model"),
    "version differs from the file name": (setting(version="r7"), "version"),
    "version with a path separator": (setting(version="a/b"), "version"),
}
LINEAGE_CASES = {
    "sequence going backwards": (setting(sequence=0), "sequence"),
    "sequence not increasing": (setting(sequence=1), "sequence"),
    "base_digest of another revision": (setting(base_digest="sha256:" + "0" * 64), "base_digest"),
    "base not in the catalog": (setting(base_version="r404"), "base_version"),
    "base is itself": (setting(base_version="SELF"), "base_version"),
}


@pytest.mark.parametrize("case", sorted(FIELD_CASES))
def test_bad_records_are_rejected_naming_the_field(world, case):
    edit, field = FIELD_CASES[case]
    version = world.new("d2", record=edit)
    out = world.refit(version)
    av.assert_rejected(out, CatalogError, file=f"{version}.json")
    assert out.error.field == field, out.error


@pytest.mark.parametrize("case", sorted(LINEAGE_CASES))
def test_records_that_break_the_chain_are_rejected(world, case):
    edit, field = LINEAGE_CASES[case]

    def patched(record):
        out = edit(record)
        return out | {"base_version": out["version"]} if out.get("base_version") == "SELF" else out

    version = world.new("d2", record=patched)
    out = world.refit(version)
    assert isinstance(out.error, (CatalogError, LineageError)), out.error
    av.assert_rejected(out, type(out.error), file=f"{version}.json")
    assert out.error.field == field, out.error


@pytest.mark.parametrize("body", [b"", b"[]", b"null", b'"r2"', b"{", b"\xff\xfe", b'{"a": 1, "a": 2}'])
def test_records_that_are_not_json_objects_are_rejected(world, body):
    version = world.new("d2", raw_record=body)
    av.assert_rejected(world.refit(version), CatalogError, file=f"{version}.json")


def test_a_record_over_the_size_limit_is_refused_before_it_is_read(world):
    version = world.new("d2")
    with open(world.lab.catalog_dir / f"{version}.json", "r+b") as fh:
        fh.truncate(2 * MiB)
    av.assert_rejected(world.refit(version), StorageError, file=f"{version}.json")


def test_extra_fields_are_ignored(world):
    version = world.new("d2", record=setting(colour="blue", sequence=2, notes={"nested": [1, 2]}))
    out = world.refit(version)
    assert out.error is None, out.error
    assert av.cs.folder_digest(out.store / "materialized" / version) == world.world.expected_digest("d2")


# --- fuzzing ----------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
              st.text(max_size=80)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_fuzzed_records_parse_or_give_a_catalog_error(world, data):
    record = dict(world.record("d2"))
    for key in data.draw(st.lists(st.sampled_from(FIELDS), max_size=3)):
        if data.draw(st.booleans()):
            record.pop(key, None)
        else:
            record[key] = data.draw(json_values)
    for key, value in data.draw(st.dictionaries(st.text(max_size=10), json_values, max_size=2)).items():
        record.setdefault(key, value)
    raw = json.dumps(record).encode() if data.draw(st.booleans()) else data.draw(json_values)
    if not isinstance(raw, (bytes, dict)):
        raw = json.dumps(raw).encode()
    tracemalloc.start()
    try:
        rev = parse_revision(raw, version="d2", model=world.lab.model, file="d2.json")
    except CatalogError as exc:
        assert exc.file == "d2.json" and exc.revision is not None
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 4 * MiB
    import re

    assert rev.version == "d2" and rev.model == world.lab.model and re.match(VERSION_PATTERN, rev.version)
    assert type(rev.sequence) is int and rev.sequence >= 0
    assert (rev.base_version is None) == (rev.payload_format != "xor_delta")
