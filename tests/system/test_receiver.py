"""What users rely on from the receiver."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard

from tests.support.lab import independent_digest, read_checkpoint, tree_hash
from storage.errors import (
    CapacityError, ChecksumMismatch, CheckpointMismatch, CodecError, InstallError, LineageError, ManifestError,
    ObjectNotFound,
)
from storage.store.artifacts import ArtifactCache
from storage.store.local_store import LocalStore
from storage.format.safetensors import read_header, write_safetensors
from tasks.installers import InstallOutcome, NoEngineInstaller


def store_of(lab) -> LocalStore:
    return LocalStore(lab.cache, lab.model)


def payload(lab, version: str) -> Path:
    return lab.root / "revisions" / version


def rewrite_bucket(path: Path, edit) -> None:
    """Rewrite a bucket: ``edit(frames: dict[name, bytes], metadata: dict) -> (frames, metadata)``."""
    header = read_header(path)
    blob = path.read_bytes()
    frames = {n: blob[header.data_offset + t.start: header.data_offset + t.end] for n, t in header.tensors.items()}
    frames, metadata = edit(dict(frames), dict(header.metadata))
    with open(path, "wb") as fh:
        write_safetensors(fh, [(n, "U8", [len(f)], np.frombuffer(f, np.uint8)) for n, f in frames.items()],
                          metadata)


def first_bucket(lab, version: str) -> Path:
    return sorted(payload(lab, version).glob("bucket-*.safetensors"))[0]


def edit_index(lab, version: str, edit) -> None:
    path = payload(lab, version) / "delta.safetensors.index.json"
    path.write_bytes(edit(path.read_bytes()))


def snapshot_state(lab) -> dict:
    """What a rejection must leave as it was: which checkpoint is READY, what is installed, what is verified.

    (Timestamps and file mtimes may move when an apply that already started is undone in place.)
    """
    store = store_of(lab)
    state, active = store.state(), store.active()
    return {"state": (state.status, state.version, state.source) if state else None,
            "active": (active.version, active.digest, active.path) if active else None,
            "verified": {v: r.target_digest for v, r in store.inventory().items()}}


def checkpoint_bytes(lab) -> dict:
    store = store_of(lab)
    return tree_hash(store.root / "materialized") | tree_hash(store.root / "full")


# -- 1. seeding ---------------------------------------------------------------------------------------


def test_first_start_seeds_and_verifies_the_launch_snapshot(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    state, result = lab.refit()
    assert state.name == "Ready" and result.version == "r0"
    store = store_of(lab)
    assert store.state().status == "READY" and store.state().source == "full/r0"
    assert read_checkpoint(store.root / "full" / "r0").keys() == lab.expected("r0").keys()
    assert store.verified("r0").target_digest == independent_digest(lab.expected("r0"))[1]
    assert json.loads((store.root / "full" / "r0.source.json").read_text())["uri"].startswith("seed:")


def test_a_launch_snapshot_that_is_not_revision_0_is_refused(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    tensors = dict(lab.expected("r0"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].copy()
    tensors[name].ravel()[0] ^= 1
    shutil.rmtree(lab.launch)
    lab.write(tensors, "../launch")
    state, result = lab.refit()
    assert state.name == "Failed" and result.status == "FAILED"
    assert result.error_detail["type"] == "ChecksumMismatch" and result.error_detail["revision"] == "r0"
    store = store_of(lab)
    assert store.inventory() == {} and store.active() is None
    assert not (store.root / "full" / "r0").exists()


# -- 2, 3, 14: deltas, chains, takeover ------------------------------------------------------------------


def test_delta_reconstructs_exactly_and_becomes_the_next_base(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    state, result = lab.refit(activate=False)
    store = store_of(lab)
    assert state.name == "Ready" and result.activated is False
    assert store.active() is None  # nothing activated yet
    assert store.state().version == "r1" and store.state().source == "materialized/r1"
    lab.assert_checkpoint(result.checkpoint_path, "r1")
    assert json.loads((store.root / "deltas" / "r1.source.json").read_text())["uri"].endswith(
        "revisions/r1/delta.safetensors.index.json")
    store.activate("r1", "none")
    assert store.active().version == "r1" and store.active().digest == independent_digest(lab.expected("r1"))[1]
    shard = sorted((store.root / "materialized" / "r1").glob("*.safetensors"))[0]
    inode = os.stat(shard).st_ino
    lab.publish("delta")
    state, result = lab.refit()
    assert state.name == "Ready" and result.lineage == ["r1", "r2"]
    lab.assert_checkpoint(result.checkpoint_path, "r2")
    assert os.stat(store.root / "materialized" / "r2" / shard.name).st_ino == inode  # taken over, not copied
    assert not (store.root / "materialized" / "r1").exists()


def test_replay_chain_with_a_full_revision_in_one_preparation(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    for kind in ("delta", "delta", "full", "delta", "delta"):
        lab.publish(kind)
    state, result = lab.refit()
    assert state.name == "Ready" and result.version == "r5"
    assert result.lineage == ["r3", "r4", "r5"]
    install = next(s for s in result.stages if s["name"] == "install")
    assert install["status"] == "COMPLETED" and "attempts" not in install  # a stage runs once
    lab.assert_checkpoint(result.checkpoint_path, "r5")
    store = store_of(lab)
    full_files = tree_hash(store.root / "full" / "r3")
    lab.assert_checkpoint(store.root / "full" / "r3", "r3")  # the full artifact never changes
    lab.publish("delta")
    state, result = lab.refit()
    assert state.name == "Ready" and result.lineage == ["r5", "r6"]
    assert tree_hash(store.root / "full" / "r3") == full_files


def test_chain_from_the_launch_snapshot(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    for _ in range(3):
        lab.publish("delta")
    state, result = lab.refit()
    assert state.name == "Ready" and result.lineage == ["r0", "r1", "r2", "r3"]
    lab.assert_checkpoint(result.checkpoint_path, "r3")
    store = store_of(lab)
    lab.assert_checkpoint(store.root / "full" / "r0", "r0")  # the first delta copied the seed once


# -- 4-8: bad manifests, wrong base, empty delta ---------------------------------------------------------


def _ready_at_r1(lab):
    lab.publish("initial")
    lab.publish("delta")
    state, _ = lab.refit()
    assert state.name == "Ready"


def test_a_bad_second_manifest_leaves_the_store_untouched(flow_lab):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("delta")
    lab.publish("delta")
    edit_index(lab, "r3", lambda raw: raw.replace(b'"zstd"', b'"lz4"'))
    before, files = snapshot_state(lab), checkpoint_bytes(lab)
    state, result = lab.refit()
    assert state.name == "Failed"
    assert result.error_detail["revision"] == "r3" and result.error_detail["field"] == "compression_format"
    assert snapshot_state(lab) == before and checkpoint_bytes(lab) == files
    assert not list((store_of(lab).root / "deltas").glob("r2/bucket-*"))  # nothing downloaded


@pytest.mark.parametrize("edit, field", [
    (lambda raw: b"{not json", None),
    (lambda raw: raw.replace(b'"version":"r2"', b'"version":"r9"'), "version"),
    (lambda raw: raw.replace(b'"base_version":"r1",', b""), "base_version"),
    (lambda raw: raw.replace(b'"zstd"', b'"gzip"'), "compression_format"),
    (lambda raw: raw.replace(b'"delta_encoding":"xor"', b'"delta_encoding":"rle"'), "delta_encoding"),
    (lambda raw: raw.replace(b'"checksum_format":"adler32"', b'"checksum_format":"crc32"'), "checksum_format"),
])
def test_bad_delta_index_fails_after_fetching_only_the_index(flow_lab, edit, field):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("delta")
    edit_index(lab, "r2", edit)
    before, files = snapshot_state(lab), checkpoint_bytes(lab)
    state, result = lab.refit()
    assert state.name == "Failed" and result.error_detail["revision"] == "r2"
    assert result.error_detail["field"] == field
    fetched = {s["name"]: s for s in result.stages}
    assert "fetch buckets" not in fetched or fetched["fetch buckets"]["bytes"] == 0
    assert snapshot_state(lab) == before and checkpoint_bytes(lab) == files


@pytest.mark.parametrize("name", ["/tmp/x.safetensors", "../x.safetensors", "a/b.safetensors", ".", ".."])
def test_unsafe_bucket_names_are_rejected_and_nothing_is_cached(flow_lab, name):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("delta")
    edit_index(lab, "r2", lambda raw: raw.replace(b'"bucket-00000.safetensors"', json.dumps(name).encode(), 1))
    outside = [Path("/tmp/x.safetensors"), store_of(lab).root / "deltas" / "x.safetensors",
               store_of(lab).root / "x.safetensors"]
    before = {p: p.stat().st_mtime_ns if p.exists() else None for p in outside}
    state, result = lab.refit()
    assert state.name == "Failed" and "unsafe shard file name" in result.error
    assert result.error_detail["revision"] == "r2" and result.error_detail["tensor"]
    assert not (store_of(lab).root / "deltas" / "r2").exists()
    assert {p: p.stat().st_mtime_ns if p.exists() else None for p in outside} == before  # nothing written there


def test_a_wrong_base_fails_before_any_download(flow_lab):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("delta")
    record = json.loads((lab.catalog_dir / "r2.json").read_text())
    record["base_digest"] = "sha256:" + "0" * 64
    (lab.catalog_dir / "r2.json").write_text(json.dumps(record))
    state, result = lab.refit()
    assert state.name == "Failed" and result.error_detail["type"] == "LineageError"
    assert result.error_detail["field"] == "base_digest" and result.error_detail["revision"] == "r2"
    assert [s["name"] for s in result.stages] == ["resolve catalog"]
    assert not (store_of(lab).root / "deltas" / "r2").exists()


def test_an_empty_delta_yields_the_base_bytes_and_fetches_only_the_index(flow_lab):
    lab = flow_lab
    _ready_at_r1(lab)
    result = lab.publish("delta", lab.expected("r1"))
    assert result.changed_tensors == 0
    index = json.loads((payload(lab, "r2") / "delta.safetensors.index.json").read_text())
    assert index["weight_map"] == {}
    state, refit = lab.refit()
    assert state.name == "Ready" and refit.version == "r2"
    assert {s["name"]: s["bytes"] for s in refit.stages}["fetch buckets"] == 0
    lab.assert_checkpoint(refit.checkpoint_path, "r1")


# -- 9-11: bad buckets, checksum mismatch, failed downloads --------------------------------------------------


@pytest.mark.parametrize("takeover", [True, False])
def test_checksum_mismatch_fails_and_the_last_verified_version_comes_back(flow_lab, takeover):
    lab = flow_lab
    lab.publish("initial")
    if takeover:
        lab.publish("delta")
        assert lab.refit()[0].name == "Ready"
    else:
        assert lab.refit()[0].name == "Ready"  # at r0, a full (seeded) checkpoint
    previous = "r1" if takeover else "r0"
    bad = lab.publish("delta").version
    victim = {}

    def corrupt(frames, metadata):
        name = sorted(frames)[0]
        victim["tensor"] = name
        metadata[name] = "0badc0de"
        return frames, metadata

    rewrite_bucket(first_bucket(lab, bad), corrupt)
    state, result = lab.refit()
    assert state.name == "Failed" and result.error_detail["type"] == "ChecksumMismatch"
    assert result.error_detail["revision"] == bad and result.error_detail["tensor"] == victim["tensor"]
    assert result.error_detail["file"].endswith("bucket-00000.safetensors")
    store = store_of(lab)
    assert store.state().status == "READY" and store.state().version == previous
    assert store.active().version == previous
    current = store.current()
    lab.assert_checkpoint(store.absolute(current.path), previous)
    state, result = lab.refit(target=previous)
    assert state.name == "Ready" and result.version == previous
    assert {s["name"]: s["bytes"] for s in result.stages}.get("fetch buckets", 0) == 0


def _frames_edit(kind):
    def edit(frames, metadata):
        name = sorted(frames)[0]
        if kind == "no metadata":
            metadata = {}
        elif kind == "missing tensor":
            frames.pop(name)
        elif kind == "missing checksum":
            metadata.pop(name)
        elif kind == "unknown tensor":
            frames["ghost.weight"] = frames[name]
        elif kind in ("frame too short", "frame too long"):
            raw = zstandard.ZstdDecompressor().decompress(frames[name])
            raw = raw[:-2] if kind == "frame too short" else raw + b"\0\0"
            frames[name] = zstandard.ZstdCompressor().compress(raw)
        return frames, metadata
    return edit


@pytest.mark.parametrize("kind, error", [
    ("no metadata", ManifestError), ("missing tensor", ManifestError), ("missing checksum", ManifestError),
    ("unknown tensor", ManifestError), ("frame too short", CodecError), ("frame too long", CodecError),
])
def test_malformed_buckets_fail_naming_the_bucket(flow_lab, kind, error):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("delta")
    bucket = first_bucket(lab, "r2")
    rewrite_bucket(bucket, _frames_edit(kind))
    before, files = snapshot_state(lab), checkpoint_bytes(lab)
    state, result = lab.refit()
    assert state.name == "Failed" and result.error_detail["type"] == error.__name__, result.error
    assert result.error_detail["file"].endswith(bucket.name) and result.error_detail["revision"] == "r2"
    assert snapshot_state(lab) == before and checkpoint_bytes(lab) == files


def test_a_failed_download_keeps_the_store_and_a_retry_reuses_complete_files(flow_lab):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("delta", bucket_max_mib=1)
    lab.publish("delta")
    lab.publish("delta")
    missing = first_bucket(lab, "r4")
    hidden = missing.with_suffix(".hidden")
    missing.rename(hidden)
    before, files = snapshot_state(lab), checkpoint_bytes(lab)
    state, result = lab.refit()
    assert state.name == "Failed" and result.error_detail["type"] == "ObjectNotFound"
    assert missing.name in result.error_detail["file"]
    assert snapshot_state(lab) == before and checkpoint_bytes(lab) == files
    # which other downloads completed before the failure stopped the rest is a race; what is guaranteed is
    # that each completed file is recorded, and that the retry downloads exactly the files that are not
    cache = ArtifactCache(store_of(lab))
    complete = {v: cache.complete_files("deltas", v) for v in ("r2", "r3", "r4")}
    assert missing.name not in complete["r4"]
    remaining = sum(p.stat().st_size for v in complete for p in (lab.root / "revisions" / v).glob("bucket-*")
                    if p.name not in complete[v] and p != hidden)
    hidden.rename(missing)
    state, result = lab.refit()
    assert state.name == "Ready" and result.version == "r4"
    fetched = next(s for s in result.stages if s["name"] == "fetch buckets")
    assert fetched["bytes"] == remaining + missing.stat().st_size
    lab.assert_checkpoint(result.checkpoint_path, "r4")


# -- 12, 13: cache identity, full revisions ------------------------------------------------------------------


def test_cached_artifacts_with_another_source_or_changed_files_are_not_reused(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    assert lab.refit(target="r1")[0].name == "Ready"
    assert lab.refit(target="r0")[0].name == "Ready"  # rollback keeps deltas/r1 cached
    store = store_of(lab)

    def evict_r1():  # as the quota would: r1 must be rebuilt from its cached delta
        store.evict("r1", store.materialized_dir("r1"))

    evict_r1()
    source = store.root / "deltas" / "r1.source.json"
    record = json.loads(source.read_text())
    record["uri"] = "file:///elsewhere/delta.safetensors.index.json"
    source.write_text(json.dumps(record))
    state, result = lab.refit(target="r1")
    assert state.name == "Ready"
    assert {s["name"]: s["bytes"] for s in result.stages}["fetch buckets"] > 0  # downloaded again
    assert json.loads(source.read_text())["uri"].endswith("revisions/r1/delta.safetensors.index.json")
    assert lab.refit(target="r0")[0].name == "Ready"
    evict_r1()
    bucket = sorted((store.root / "deltas" / "r1").glob("bucket-*"))[0]
    with open(bucket, "ab") as fh:
        fh.write(b"tampered")
    state, result = lab.refit(target="r1")
    assert state.name == "Ready"
    assert {s["name"]: s["bytes"] for s in result.stages}["fetch buckets"] == first_bucket(lab, "r1").stat().st_size
    lab.assert_checkpoint(result.checkpoint_path, "r1")


def _strip_full_checksums(lab, version):
    folder = payload(lab, version)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["metadata"].pop("checksum_format")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for shard in folder.glob("*.safetensors"):
        rewrite_full_shard(shard, lambda tensors, meta: (tensors, {"format": "pt"}))


def rewrite_full_shard(path: Path, edit) -> None:
    header = read_header(path)
    blob = path.read_bytes()
    tensors = {n: (t.dtype, list(t.shape), blob[header.data_offset + t.start: header.data_offset + t.end])
               for n, t in header.tensors.items()}
    tensors, meta = edit(tensors, dict(header.metadata))
    with open(path, "wb") as fh:
        write_safetensors(fh, [(n, d, s, np.frombuffer(b, np.uint8)) for n, (d, s, b) in sorted(tensors.items())],
                          meta)


def test_full_revision_checksums_are_checked_when_declared_and_ignored_when_absent(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("full")
    lab.publish("full")
    _strip_full_checksums(lab, "r2")
    state, result = lab.refit(target="r2")
    assert state.name == "Ready"
    lab.assert_checkpoint(result.checkpoint_path, "r2")
    shard = sorted(payload(lab, "r1").glob("*.safetensors"))[0]
    rewrite_full_shard(shard, lambda t, meta: (t, {**meta, sorted(t)[0]: "ffffffff"}))
    state, result = lab.refit(target="r1")
    assert state.name == "Failed" and result.error_detail["type"] == "ChecksumMismatch"
    assert result.error_detail["file"].endswith(shard.name) and result.error_detail["tensor"]
    assert store_of(lab).state().version == "r2"


@pytest.mark.parametrize("change, error", [
    ("checksum_format", ManifestError), ("null checksum_format", ManifestError), ("dtype", CheckpointMismatch),
    ("shape", CheckpointMismatch), ("extra tensor", ManifestError),
])
def test_full_revisions_that_do_not_fit_are_rejected_with_the_checkpoint_untouched(flow_lab, change, error):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("full")
    folder = payload(lab, "r2")
    if change in ("checksum_format", "null checksum_format"):
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["metadata"]["checksum_format"] = "sha512" if change == "checksum_format" else None
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        shard = sorted(folder.glob("*.safetensors"))[0]

        def edit(tensors, meta):
            name = sorted(tensors)[0]
            dtype, shape, data = tensors[name]
            if change == "dtype":
                tensors[name] = ("F16", shape, data)
            elif change == "shape":
                tensors[name] = (dtype, [int(np.prod(shape))], data)
            else:
                tensors["extra.weight"] = ("BF16", [2], b"\0\0\0\0")
                index = json.loads((folder / "model.safetensors.index.json").read_text())
                index["weight_map"]["extra.weight"] = shard.name
                (folder / "model.safetensors.index.json").write_text(json.dumps(index))
            return tensors, meta

        rewrite_full_shard(shard, edit)
    before, files = snapshot_state(lab), checkpoint_bytes(lab)
    materialized = tree_hash(store_of(lab).root / "materialized")
    state, result = lab.refit()
    assert state.name == "Failed" and result.error_detail["type"] == error.__name__, result.error
    assert result.error_detail["revision"] == "r2"
    assert snapshot_state(lab)["state"] == before["state"] and snapshot_state(lab)["active"] == before["active"]
    assert tree_hash(store_of(lab).root / "materialized") == materialized  # r1's checkpoint never touched
    lab.assert_checkpoint(store_of(lab).absolute(store_of(lab).current().path), "r1")
    # the index (and each shard's header, read by range) shows it: refused before any shard is downloaded
    assert "fetch buckets" not in {s["name"] for s in result.stages}


def test_a_full_artifact_is_reused_after_restart_with_only_its_index_refetched(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("full")
    lab.publish("delta")
    assert lab.refit()[0].name == "Ready"
    assert lab.refit(target="r0")[0].name == "Ready"
    state, result = lab.refit(target="r1")
    assert state.name == "Ready"
    stages = {s["name"]: s["bytes"] for s in result.stages}
    assert stages["fetch buckets"] == 0
    lab.assert_checkpoint(result.checkpoint_path, "r1")


# -- 15-17: installs and quota --------------------------------------------------------------------------------


class FlakyInstaller(NoEngineInstaller):
    name = "flaky"

    def __init__(self, fail: bool):
        self.fail = fail
        self.installed = []

    def install(self, request):
        if self.fail:
            raise InstallError("engine refused the request (connection refused)")
        self.installed.append(request.version)
        return InstallOutcome(f"loaded {request.version}")

    def is_current(self, identity):
        return False


def test_a_failed_install_keeps_the_previous_version_and_a_retry_reuses_the_prepared_target(flow_lab):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("delta")
    failed = lab.run(FlakyInstaller(fail=True))
    assert failed.status == "FAILED" and isinstance(failed.exception, InstallError)
    store = store_of(lab)
    assert store.active().version == "r1"  # a failed installation never activates
    assert store.state().status == "READY" and store.state().version == "r2"
    installer = FlakyInstaller(fail=False)
    result = lab.run(installer)
    assert result.status == "READY" and installer.installed == ["r2"] and store.active().version == "r2"
    stages = {s["name"]: s for s in result.stages}
    assert stages["fetch buckets"]["bytes"] == 0 and stages["apply deltas"]["bytes"] == 0
    lab.publish("full")
    lab.publish("delta")
    failed = lab.run(FlakyInstaller(fail=True), target="r3")
    assert failed.status == "FAILED" and isinstance(failed.exception, InstallError)
    assert lab.run(installer).status == "READY"  # recovery to another target: full + delta
    assert installer.installed == ["r2", "r4"] and store.active().version == "r4"
    lab.assert_checkpoint(store.absolute(store.current().path), "r4")


def test_deferred_activation(flow_lab):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("delta")
    state, result = lab.refit(activate=False)
    store = store_of(lab)
    assert state.name == "Ready" and store.active().version == "r1" and store.current().version == "r2"
    store.activate("r2", "none")
    assert store.active().version == "r2"


def test_quota_refuses_before_any_mutation_and_a_larger_quota_succeeds(flow_lab):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("full")
    before, files = snapshot_state(lab), checkpoint_bytes(lab)
    model = sum(f.stat().st_size for f in (store_of(lab).root / "materialized" / "r1").iterdir())
    state, result = lab.refit(cache_max_gb=1.5 * model / 1e9)  # active r1 + the full r2 cannot both fit
    assert state.name == "Failed" and result.error_detail["type"] == "CapacityError"
    assert snapshot_state(lab) == before and checkpoint_bytes(lab) == files
    state, result = lab.refit(cache_max_gb=1)
    assert state.name == "Ready" and result.version == "r2"


def test_eviction_makes_room_without_touching_the_active_version(flow_lab):
    lab = flow_lab
    _ready_at_r1(lab)
    lab.publish("delta")
    assert lab.refit()[0].name == "Ready"
    store = store_of(lab)
    assert (store.root / "deltas" / "r1").exists() and (store.root / "full" / "r0").exists()
    lab.publish("full")
    from storage.store.quota import held_size

    used = held_size(store.root)  # as the quota counts: full/r0's weights, linked from the launch folder, are not
    need = sum(f.stat().st_size for f in payload(lab, "r3").iterdir())
    state, result = lab.refit(cache_max_gb=0.8 * (used + need) / 1e9)
    assert state.name == "Ready", result.error
    assert not (store.root / "deltas" / "r1").exists()  # evicted first
    lab.assert_checkpoint(result.checkpoint_path, "r3")


def test_quota_must_be_positive(tmp_path):
    from storage.errors import StoreError

    with pytest.raises(StoreError, match="positive"):
        LocalStore(tmp_path, "m/x", quota_bytes=0)


# -- 18: tampering ---------------------------------------------------------------------------------------------


def test_a_ready_checkpoint_modified_outside_the_receiver_is_not_trusted(flow_lab):
    lab = flow_lab
    _ready_at_r1(lab)
    store = store_of(lab)
    shard = sorted((store.root / "materialized" / "r1").glob("*.safetensors"))[0]
    with open(shard, "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    lab.publish("delta")
    state, result = lab.refit()
    assert state.name == "Ready" and result.lineage == ["r0", "r1", "r2"]  # rebuilt from the seed
    assert any("changed outside the receiver" in note for note in result.notes)
    lab.assert_checkpoint(result.checkpoint_path, "r2")
