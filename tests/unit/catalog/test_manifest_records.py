"""Index manifests are strict records read by the one record parser: today's files parse as before, keys a
publisher adds are ignored, and a known key of the wrong type or a missing one is a ManifestError naming the
file, the revision and the field: the index's (``metadata``, ``weight_map.<tensor>``), or its metadata's
(``delta_encoding``), the metadata being a record of its own (docs/format.md, sections 5 and 10.4)."""

from __future__ import annotations

import json

import pytest

from storage.catalog.manifests import parse_delta_manifest, parse_full_manifest, parse_manifest
from storage.catalog.records import Revision
from storage.errors import ManifestError

D = {k: "sha256:" + k * 64 for k in "abc"}
DELTA_URI = "s3://bucket/revisions/r2/delta.safetensors.index.json"
FULL_URI = "s3://bucket/revisions/r2/model.safetensors.index.json"


def revision(kind: str) -> Revision:
    raw = {"schema": "canonical-refit.revision.v1", "model": "m/x", "version": "r2", "sequence": 2,
           "payload_format": "xor_delta", "base_version": "r1", "base_digest": D["a"], "target_digest": D["b"],
           "format_digest": D["c"], "checksum_format": "adler32", "uri": DELTA_URI, "created_at_unix_ms": 5}
    if kind == "full":
        raw |= {"payload_format": "full_hf_checkpoint", "base_version": None, "base_digest": None, "uri": FULL_URI}
    return Revision.model_validate(raw)


def delta(**over) -> dict:
    return {"metadata": {"version": "r2", "base_version": "r1", "delta_encoding": "xor_sparse",
                         "compression_format": "zstd", "checksum_format": "adler32"},
            "weight_map": {"a.w": "bucket-00000.safetensors", "b.w": "bucket-00001.safetensors"}} | over


def full(**over) -> dict:
    # a standard Hugging Face index, as this program and other tools write it
    return {"metadata": {"total_size": 1234, "checksum_format": "xxh3-128"},
            "weight_map": {"a.w": "model-00001-of-00002.safetensors", "b.w": "model-00002-of-00002.safetensors"}} | over


def test_todays_indexes_parse_with_the_keys_other_publishers_add():
    m = parse_manifest(json.dumps(delta(generator="other-tool 1.0")).encode(), revision("delta"))
    assert (m.delta_encoding, m.checksum_format, m.files) == (
        "xor_sparse", "adler32", ["bucket-00000.safetensors", "bucket-00001.safetensors"])
    raw = json.dumps(full(metadata={"total_size": 1234, "checksum_format": "xxh3-128", "format": "pt"})).encode()
    m = parse_manifest(raw, revision("full"))
    assert (m.delta_encoding, m.checksum_format, m.tensors_of("model-00002-of-00002.safetensors")) == (
        None, "xxh3-128", ["b.w"])
    assert m.raw == raw  # the bytes are kept as read: the identity is over them


@pytest.mark.parametrize("document, record, field", [
    (delta(metadata={**delta()["metadata"], "version": 2}), "DeltaIndexMetadata", "version"),
    (delta(metadata={**delta()["metadata"], "delta_encoding": ["xor"]}), "DeltaIndexMetadata", "delta_encoding"),
    (delta(metadata={k: v for k, v in delta()["metadata"].items() if k != "compression_format"}),
     "DeltaIndexMetadata", "compression_format"),
    (delta(metadata="xor"), "DeltaIndex", "metadata"),
    (delta(weight_map={"a.w": 7}), "DeltaIndex", "weight_map.a.w"),
    (delta(weight_map=["bucket-00000.safetensors"]), "DeltaIndex", "weight_map"),
    ({"weight_map": {}}, "DeltaIndex", "metadata"),
])
def test_a_delta_index_of_the_wrong_shape_names_the_field(document, record, field):
    with pytest.raises(ManifestError, match=f"not a valid {record} record") as info:
        parse_delta_manifest(json.dumps(document).encode(), revision("delta"))
    assert (info.value.field, info.value.revision, info.value.file) == (field, "r2", DELTA_URI)


@pytest.mark.parametrize("document, record, field", [
    (full(metadata={"checksum_format": None}), "FullIndexMetadata", "checksum_format"),  # absent: none; null: refused
    (full(metadata={"checksum_format": 3}), "FullIndexMetadata", "checksum_format"),
    (full(metadata=[]), "FullIndex", "metadata"),
    (full(weight_map={"a.w": None}), "FullIndex", "weight_map.a.w"),
    ({"metadata": {}}, "FullIndex", "weight_map"),
])
def test_a_full_index_of_the_wrong_shape_names_the_field(document, record, field):
    with pytest.raises(ManifestError, match=f"not a valid {record} record") as info:
        parse_full_manifest(json.dumps(document).encode(), revision("full"))
    assert (info.value.field, info.value.revision, info.value.file) == (field, "r2", FULL_URI)


def test_a_full_index_without_metadata_has_no_checksum_format():
    m = parse_full_manifest(json.dumps({"weight_map": {"w": "model.safetensors"}}).encode(), revision("full"))
    assert (m.checksum_format, m.files) == (None, ["model.safetensors"])
