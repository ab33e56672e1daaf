"""Index manifests of full checkpoints and deltas: every rule of docs/format.md, section 5 has its error."""

from __future__ import annotations

import json

import pytest

from storage.catalog.records import Revision
from storage.errors import ManifestError
from storage.catalog.manifests import parse_delta_manifest, parse_full_manifest, require_known_tensors

D = {k: "sha256:" + k * 64 for k in "abc"}


def delta_rev(**over) -> Revision:
    raw = {"schema": "canonical-refit.revision.v1", "model": "m/x", "version": "r2", "sequence": 2,
           "payload_format": "xor_delta", "base_version": "r1", "base_digest": D["a"], "target_digest": D["b"],
           "format_digest": D["c"], "checksum_format": "adler32",
           "uri": "s3://bucket/revisions/r2/delta.safetensors.index.json", "created_at_unix_ms": 5}
    return Revision.model_validate(raw | over)


def full_rev() -> Revision:
    return delta_rev(payload_format="full_hf_checkpoint", base_version=None, base_digest=None,
                     uri="s3://bucket/revisions/r2/model.safetensors.index.json")


def delta_index(metadata_over=None, weight_map=None, drop=()) -> bytes:
    metadata = {"version": "r2", "base_version": "r1", "delta_encoding": "xor", "compression_format": "zstd",
                "checksum_format": "adler32"} | (metadata_over or {})
    for key in drop:
        metadata.pop(key)
    return json.dumps({"metadata": metadata,
                       "weight_map": {"w": "bucket-00000.safetensors"} if weight_map is None else weight_map}).encode()


def test_valid_delta_manifest_and_shard_urls():
    m = parse_delta_manifest(delta_index(), delta_rev())
    assert m.delta_encoding == "xor" and m.files == ["bucket-00000.safetensors"]
    assert m.file_url("bucket-00000.safetensors") == "s3://bucket/revisions/r2/bucket-00000.safetensors"


def test_empty_weight_map_is_a_valid_no_change_delta():
    assert parse_delta_manifest(delta_index(weight_map={}), delta_rev()).files == []


@pytest.mark.parametrize("over, drop, field", [
    ({"version": "r3"}, (), "version"),
    ({"base_version": "r0"}, (), "base_version"),
    ({"compression_format": "lz4"}, (), "compression_format"),
    ({"delta_encoding": "bsdiff"}, (), "delta_encoding"),
    ({"checksum_format": "md5"}, (), "checksum_format"),
    ({"checksum_format": "blake3"}, (), "checksum_format"),
    ({}, ("version",), "version"),
    ({}, ("base_version",), "base_version"),
    ({}, ("compression_format",), "compression_format"),
    ({}, ("delta_encoding",), "delta_encoding"),
    ({}, ("checksum_format",), "checksum_format"),
])
def test_missing_or_mismatched_metadata_names_the_field(over, drop, field):
    with pytest.raises(ManifestError) as info:
        parse_delta_manifest(delta_index(over, drop=drop), delta_rev())
    assert info.value.field == field and info.value.revision == "r2"
    assert "delta.safetensors.index.json" in str(info.value)


@pytest.mark.parametrize("encoding", ["xor", "xor_sparse", "overwrite"])
def test_all_three_encodings_are_accepted(encoding):
    assert parse_delta_manifest(delta_index({"delta_encoding": encoding}), delta_rev()).delta_encoding == encoding


@pytest.mark.parametrize("raw, message", [
    (b"{oops", "not valid JSON"),
    (b"[]", "not an object"),
    (b'{"metadata": {}, "metadata": {}}', "duplicate key"),
    (json.dumps({"weight_map": {}}).encode(), "metadata: Field required"),
    (json.dumps({"metadata": {}, "weight_map": []}).encode().replace(b'"metadata": {}', b'"metadata": '
     + json.dumps({"version": "r2", "base_version": "r1", "delta_encoding": "xor", "compression_format": "zstd",
                   "checksum_format": "adler32"}).encode()), "weight_map: Input should be a valid dictionary"),
])
def test_malformed_delta_json_is_rejected(raw, message):
    with pytest.raises(ManifestError, match=message):
        parse_delta_manifest(raw, delta_rev())


@pytest.mark.parametrize("name", ["/tmp/x.safetensors", "../x.safetensors", "a/b.safetensors", ".", ".."])
def test_unsafe_bucket_names_name_the_tensor(name):
    with pytest.raises(ManifestError, match="unsafe") as info:
        parse_delta_manifest(delta_index(weight_map={"layer.w": name}), delta_rev())
    assert info.value.tensor == "layer.w"


def test_delta_naming_an_unknown_tensor_is_rejected():
    m = parse_delta_manifest(delta_index(weight_map={"ghost": "bucket-00000.safetensors"}), delta_rev())
    with pytest.raises(ManifestError, match="does not have") as info:
        require_known_tensors(m, {"w": ("BF16", (2,), 4)})
    assert info.value.tensor == "ghost"


def test_full_manifest_checksum_format_is_optional_but_must_be_supported():
    raw = json.dumps({"metadata": {"total_size": 4}, "weight_map": {"w": "model.safetensors"}}).encode()
    assert parse_full_manifest(raw, full_rev()).checksum_format is None
    raw = json.dumps({"metadata": {"checksum_format": "xxh3-128"}, "weight_map": {"w": "model.safetensors"}}).encode()
    assert parse_full_manifest(raw, full_rev()).checksum_format == "xxh3-128"
    raw = json.dumps({"metadata": {"checksum_format": "sha1"}, "weight_map": {"w": "model.safetensors"}}).encode()
    with pytest.raises(ManifestError, match="'sha1'") as info:
        parse_full_manifest(raw, full_rev())
    assert info.value.field == "checksum_format"


def test_full_manifest_needs_a_weight_map():
    with pytest.raises(ManifestError, match="empty"):
        parse_full_manifest(json.dumps({"metadata": {}, "weight_map": {}}).encode(), full_rev())
