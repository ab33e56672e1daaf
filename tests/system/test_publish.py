"""The publisher writes exactly the records and payloads docs/format.md, sections 4-5 describe."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard
from safetensors import safe_open

from flows.synthetic import train_step
from tests.support.lab import ROOT_DIR, independent_digest, read_checkpoint
from storage.format.checkpoint import CheckpointIndex
from storage.errors import ImmutableConflict, LineageError
from storage.catalog.publisher import snapshot_of, stage_delta


def _record(lab, version) -> dict:
    return json.loads((lab.catalog_dir / f"{version}.json").read_text())


def _payload_dir(lab, version) -> Path:
    return lab.root / "revisions" / version


def test_launch_delta_and_full_revisions_match_the_spec(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    r0 = _record(lab, "r0")
    fmt, digest = independent_digest(lab.expected("r0"))
    assert r0 == {"schema": "canonical-refit.revision.v1", "model": lab.model, "version": "r0", "sequence": 0,
                  "payload_format": "metadata_only", "base_version": None, "base_digest": None,
                  "target_digest": digest, "format_digest": fmt, "checksum_format": "adler32", "uri": None,
                  "created_at_unix_ms": r0["created_at_unix_ms"]}
    assert (lab.catalog_dir / "r0.json").read_bytes() == json.dumps(r0, sort_keys=True, separators=(",", ":")).encode()

    base = lab.expected("r0")
    result = lab.publish("delta")
    r1 = _record(lab, "r1")
    assert r1["payload_format"] == "xor_delta" and r1["sequence"] == 1
    assert (r1["base_version"], r1["base_digest"]) == ("r0", digest)
    assert r1["target_digest"] == independent_digest(lab.expected("r1"))[1]
    assert r1["uri"] == f"file://{_payload_dir(lab, 'r1')}/delta.safetensors.index.json"
    index_bytes = (_payload_dir(lab, "r1") / "delta.safetensors.index.json").read_bytes()
    index = json.loads(index_bytes)
    assert index_bytes == json.dumps(index, sort_keys=True, separators=(",", ":")).encode()  # canonical JSON
    assert index["metadata"] == {"version": "r1", "base_version": "r0", "delta_encoding": "xor",
                                 "compression_format": "zstd", "checksum_format": "adler32"}
    target = lab.expected("r1")
    assert set(index["weight_map"]) == set(target)
    assert result.compression_ratio > 1.0 and result.changed_tensors == len(target)
    for bucket in sorted(set(index["weight_map"].values())):
        with safe_open(str(_payload_dir(lab, "r1") / bucket), framework="numpy") as f:
            metadata = f.metadata()
            for name in f.keys():
                frame = f.get_tensor(name)
                assert frame.dtype == np.uint8 and frame.ndim == 1
                xor = zstandard.ZstdDecompressor().decompress(frame.tobytes())
                got = np.bitwise_xor(np.frombuffer(xor, np.uint8), base[name].view(np.uint8).ravel())
                assert got.tobytes() == target[name].tobytes()
                assert metadata[name] == f"{zlib.adler32(target[name].tobytes(), 1) & 0xffffffff:08x}"

    lab.publish("full")
    r2 = _record(lab, "r2")
    assert r2["payload_format"] == "full_hf_checkpoint" and r2["base_version"] is None
    assert r2["target_digest"] == independent_digest(lab.expected("r2"))[1]
    folder = _payload_dir(lab, "r2")
    full_index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert full_index["metadata"]["checksum_format"] == "adler32"
    assert read_checkpoint(folder).keys() == lab.expected("r2").keys()
    for name, array in read_checkpoint(folder).items():
        assert array.tobytes() == lab.expected("r2")[name].tobytes()
    for shard in set(full_index["weight_map"].values()):
        with safe_open(str(folder / shard), framework="pt") as f:
            meta = f.metadata()
            for name in f.keys():
                assert meta[name] == f"{zlib.adler32(lab.expected('r2')[name].tobytes(), 1) & 0xffffffff:08x}"


def _snap(folder, workers=2):
    return snapshot_of(folder, "adler32", workers=workers)


def test_buckets_pack_by_decoded_size_and_unchanged_tensors_are_omitted(lab, tmp_path):
    base_dir = lab.write(lab.current, "base")
    target = train_step(lab.current, seed=7, skip=("layers.0.",))
    target_dir = lab.write(target, "target")
    limit = 40_000
    payload = stage_delta(_snap(base_dir), CheckpointIndex.open(target_dir), tmp_path / "out", version="r1",
                          base_version="r0", encoding="xor", level=3, bucket_max_bytes=limit, workers=2)
    index = json.loads((tmp_path / "out" / "delta.safetensors.index.json").read_text())
    assert not any("layers.0." in name for name in index["weight_map"])
    assert set(index["weight_map"]) == {n for n in target if "layers.0." not in n}
    sizes = {}
    for name, bucket in index["weight_map"].items():
        sizes.setdefault(bucket, []).append(target[name].nbytes)
    for bucket, members in sizes.items():
        assert sum(members) <= limit or len(members) == 1, bucket  # a larger tensor gets its own bucket
    assert len(sizes) == len(payload.files) > 2


@pytest.mark.parametrize("encoding", ["xor_sparse", "overwrite", "auto"])
def test_sparse_and_auto_encodings_reconstruct(flow_lab, encoding):
    lab = flow_lab
    lab.publish("initial")
    sparse = lab.next_step(fraction=0.002)
    result = lab.publish("delta", sparse, encoding=encoding)
    if encoding == "auto":  # the smallest on a sample; only canonical encodings are candidates
        assert result.encoding in ("xor", "xor_sparse", "overwrite")
    else:
        assert result.encoding == encoding
    state, refit = lab.refit()
    assert state.name == "Ready", refit.error
    lab.assert_checkpoint(refit.checkpoint_path, result.version)


def test_republishing_after_a_crash_before_the_record_succeeds(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    first = lab.publish("delta")
    (lab.catalog_dir / "r1.json").unlink()  # as if the publisher died before writing the record
    again = lab.publish("delta", lab.expected("r1"), version="r1", base_checkpoint=lab.launch)
    assert again.version == "r1" and not again.already_published
    assert _record(lab, "r1")["target_digest"] == first.target_digest
    same = lab.publish("delta", lab.expected("r1"), version="r1", base_checkpoint=lab.launch)
    assert same.already_published


def test_a_different_revision_under_a_published_version_is_a_conflict(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    with pytest.raises(ImmutableConflict, match="r1"):
        lab.publish("delta", lab.next_step(), version="r1", base_checkpoint=lab.launch)


def test_delta_against_a_base_checkpoint_that_is_not_the_exact_base_is_refused(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    wrong = lab.write(lab.next_step(), "not-the-base")
    with pytest.raises(LineageError, match="base_checkpoint= given hashes to"):  # the field (CLI: its flag)
        lab.publish("delta", base_checkpoint=wrong)


def test_publish_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "flows.publish", "--help"], capture_output=True, text=True,
                         cwd=ROOT_DIR, timeout=120)
    assert out.returncode == 0
    for flag in ("--catalog", "--model", "--checkpoint", "--kind", "--version", "--payload-url", "--base-version",
                 "--base-checkpoint", "--state-dir", "--no-keep-copy", "--encoding", "--checksum-format",
                 "--bucket-mib", "--zstd-level", "--workers", "--allow-unconditional-writes", "--no-event", "--json"):
        assert flag in out.stdout


def test_a_bucket_holds_at_most_max_bucket_tensors_whatever_their_bytes(lab, tmp_path, monkeypatch):
    """A step of many tiny tensors is cut into buckets by count too: one bucket of 500k tensors would pass every
    byte limit yet have a header a receiver refuses (storage.jsonio.bounded_json.HEADER's element bound)."""
    import storage.catalog.publisher as publisher

    monkeypatch.setattr(publisher, "MAX_BUCKET_TENSORS", 3)
    base_dir = lab.write(lab.current, "base")
    target = train_step(lab.current, seed=11)
    payload = stage_delta(_snap(base_dir), CheckpointIndex.open(lab.write(target, "target")), tmp_path / "out",
                          version="r1", base_version="r0", encoding="xor", level=3, bucket_max_bytes=1 << 30,
                          workers=2)
    index = json.loads((tmp_path / "out" / "delta.safetensors.index.json").read_text())
    members = {}
    for name, bucket in index["weight_map"].items():
        members.setdefault(bucket, []).append(name)
    assert len(index["weight_map"]) > 6 and max(len(names) for names in members.values()) == 3
    assert len(members) == len(payload.files) == -(-len(index["weight_map"]) // 3)
    for bucket, names in members.items():  # each bucket holds exactly the frames the index names
        with safe_open(str(tmp_path / "out" / bucket), framework="numpy") as f:
            assert sorted(f.keys()) == sorted(names)
