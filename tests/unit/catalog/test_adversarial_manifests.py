"""Hostile index manifests, thrown at a store that runs r1, and fuzzed.

Manifests are fetched and validated before anything is downloaded or
mutated: every case must end in ``ManifestError`` naming the revision and
the index file, with the store bit-for-bit unchanged.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.support.adversarial_support as av
from storage.catalog.records import parse_revision
from storage.errors import ManifestError, StorageError
from storage.catalog.manifests import MAX_INDEX_BYTES, parse_manifest

MiB = 2**20
INDEX = "delta.safetensors.index.json"


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    return av.hostile_world(tmp_path_factory)


def with_map(mapping):
    return lambda index: index | {"weight_map": mapping}


def with_meta(**changes):
    def edit(index):
        meta = dict(index["metadata"])
        for key, value in changes.items():
            if value is None:
                meta.pop(key, None)
            else:
                meta[key] = value
        return index | {"metadata": meta}
    return edit


T = "model.embed_tokens.weight"
CASES = {
    "a JSON list": lambda i: b"[1, 2]",
    "a JSON string": lambda i: b'"weight_map"',
    "null": lambda i: b"null",
    "not JSON": lambda i: b"{weight_map:",
    "not UTF-8": lambda i: b'{"weight_map": "\xff"}',
    "duplicate weight_map": lambda i: b'{"metadata": {}, "weight_map": {}, "weight_map": {}}',
    "duplicate tensor": lambda i: json.dumps(i).replace('"weight_map": {', f'"weight_map": {{"{T}": "a.safetensors", ', 1).encode(),
    "weight_map a list": with_map([T]),
    "weight_map missing": lambda i: {"metadata": i["metadata"]},
    "metadata missing": lambda i: {"weight_map": i["weight_map"]},
    "shard name with ..": with_map({T: "../escape.safetensors"}),
    "absolute shard name": with_map({T: "/etc/passwd.safetensors"}),
    "shard name with a folder": with_map({T: "a/b.safetensors"}),
    "shard name with a backslash": with_map({T: "a\\b.safetensors"}),
    "hidden shard name": with_map({T: ".hidden.safetensors"}),
    "shard name not .safetensors": with_map({T: "bucket.bin"}),
    "shard name with NUL": with_map({T: "a\x00.safetensors"}),
    "shard name a number": with_map({T: 7}),
    "empty tensor name": with_map({"": "bucket-00000.safetensors"}),
    "tensor the checkpoint lacks": with_map({"model.nonexistent": "bucket-00000.safetensors"}),
    "version differs": with_meta(version="r9"),
    "base_version differs": with_meta(base_version="r0"),
    "version missing": with_meta(version=None),
    "compression gzip": with_meta(compression_format="gzip"),
    "compression missing": with_meta(compression_format=None),
    "unknown delta encoding": with_meta(delta_encoding="bsdiff"),
    "unknown checksum format": with_meta(checksum_format="md5"),
    "checksum format differs from the record": with_meta(checksum_format="xxh3-128"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_manifests_are_rejected_with_the_store_unchanged(world, case):
    version = world.new("d2", index=CASES[case])
    av.assert_rejected(world.refit(version), ManifestError, file=INDEX)


def test_a_huge_weight_map_is_rejected_in_memory_proportional_to_its_size(world):
    mapping = {f"model.layers.{k}.ghost": "bucket-00000.safetensors" for k in range(100_000)}
    version = world.new("d2", index=with_map(mapping))
    size = (world.revisions / version / INDEX).stat().st_size
    av.assert_rejected(world.refit(version), ManifestError, file=INDEX, bound=16 * size + 16 * MiB)


def test_an_index_over_the_size_limit_is_refused_before_it_is_read(world):
    version = world.new("d2")
    with open(world.revisions / version / INDEX, "r+b") as fh:
        fh.truncate(MAX_INDEX_BYTES + 1)  # sparse: no 64 MiB written
    out = world.refit(version)
    av.assert_rejected(out, StorageError, file=INDEX)
    assert "more than" in str(out.error)


# --- fuzzing ----------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=12)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
names = st.one_of(st.sampled_from(["bucket-00000.safetensors", "../x.safetensors", "a/b.safetensors", "",
                                   ".safetensors", "x.bin"]), st.text(max_size=20), json_values)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzzed_manifests_parse_or_give_a_manifest_error(world, data):
    record = parse_revision(world.record("d2"), version="d2", model=world.lab.model, file="d2.json")
    meta = dict(world.index("d2")["metadata"])
    for key in data.draw(st.lists(st.sampled_from(sorted(meta)), max_size=3)):
        meta[key] = data.draw(json_values)
    index = {"metadata": meta, "weight_map": data.draw(st.dictionaries(st.text(max_size=12), names, max_size=6))}
    if data.draw(st.booleans()):
        index = data.draw(json_values)
    raw = json.dumps(index).encode()
    tracemalloc.start()
    try:
        manifest = parse_manifest(raw, record)
    except ManifestError as exc:
        assert exc.revision == "d2" and exc.file == record.uri
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 4 * MiB
    assert all(isinstance(f, str) and "/" not in f and f.endswith(".safetensors") for f in manifest.files)
    assert manifest.delta_encoding in ("xor", "xor_sparse", "overwrite")
