"""Bounded downloads (docs/format.md, 5.7): each bucket's and shard's size limit is known before it is fetched.

A bucket over its bound (its header allowance plus each mapped tensor's worst-case frame) is refused
from its size alone, before a byte of it is downloaded, on file:// and on a real S3 server; bytes after
the last tensor of a bucket under its bound are refused once it is downloaded, and its local copy is
dropped. Each rejection names the revision and the file, leaves the installed version as it was, and
the good revision installs its exact bytes afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tests.support.adversarial_support as av
from tests.support.s3_support import s3, s3_lab  # noqa: F401  (s3 is a fixture)
from storage.durable import tree_size
from storage.errors import PermanentStorageError, SafetensorsError
from storage.objects.store import ObjectStore
from storage.urls import join_url, parent_url

MiB = 2**20


def documented_bound(encoding: str, sizes: dict[str, int]) -> int:
    """The bound as docs/format.md states it, computed here independently of the product."""
    header = 8 + min(100 * MiB, MiB + sum(512 + 12 * len(n.encode()) for n in sizes))
    per, fixed = {"xor": (1, 0), "xor_sparse": (9, 8), "overwrite": (5, 4), "xor_gaps": (10, 8)}[encoding]
    decoded = {n: fixed + per * size for n, size in sizes.items()}
    return header + sum(d + d // 128 + 65536 for d in decoded.values())


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    return av.hostile_world(tmp_path_factory)


def bucket_sizes(world, template: str, bucket: str) -> dict[str, int]:
    mapped = [t for t, f in world.index(template)["weight_map"].items() if f == bucket]
    return {t: av.tensor_nbytes(world, t) for t in mapped}


def padded(extra: int):
    return lambda path: path.read_bytes() + b"\0" * extra


def test_a_bucket_over_its_bound_is_refused_before_it_is_downloaded(world):
    bucket = world.bucket_names("d2")[0]
    bound = documented_bound("xor", bucket_sizes(world, "d2", bucket))
    original = (world.revisions / "d2" / bucket).stat().st_size
    version = world.new("d2", files={bucket: padded(bound - original + 1)})  # one byte over
    out = world.refit(version)
    av.assert_rejected(out, SafetensorsError, file=bucket)
    assert f"{bound:,} bytes" in out.error.reason and "not downloaded" in out.error.reason, out.error
    folder = out.store / "deltas" / version
    assert not folder.exists() or [p.name for p in folder.iterdir()] == ["index.json"], "a byte was downloaded"
    exact = world.new("d2", files={bucket: padded(bound - original)})  # at the bound: downloaded, then refused
    out = world.refit(exact)
    av.assert_rejected(out, SafetensorsError, file=bucket)
    assert "follow the last tensor" in out.error.reason, out.error


@pytest.mark.parametrize("template", ["s2", "o2"])
def test_a_sparse_bucket_is_bounded_by_its_encodings_worst_case_record(world, template):
    bucket = world.bucket_names(template)[0]
    encoding = world.index(template)["metadata"]["delta_encoding"]
    bound = documented_bound(encoding, bucket_sizes(world, template, bucket))
    original = (world.revisions / template / bucket).stat().st_size
    out = world.refit(world.new(template, files={bucket: padded(bound - original + 1)}))
    av.assert_rejected(out, SafetensorsError, file=bucket)
    assert f"{bound:,} bytes" in out.error.reason, out.error


def test_bytes_after_the_last_tensor_are_refused_and_the_copy_dropped(world):
    bucket = world.bucket_names("d2")[0]
    version = world.new("d2", files={bucket: padded(4096)})
    out = world.refit(version)
    av.assert_rejected(out, SafetensorsError, file=bucket)
    assert out.error.revision == version and "4096 byte(s) follow the last tensor" in out.error.reason, out.error
    assert not (out.store / "deltas" / version / bucket).exists(), "the refused bucket was kept"
    good = world.refit("d2", name="d2-after-padding")
    assert av.accepted_or_rejected(good, world.lab.expected("d2")) == "accepted", good.error


def test_a_local_object_over_max_size_is_not_copied(tmp_path):
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(3 * MiB))
    dest = tmp_path / "cache" / "big.bin"
    dest.parent.mkdir()
    store = ObjectStore()
    with pytest.raises(PermanentStorageError) as caught:
        store.download(f"file://{source}", dest, max_size=MiB)
    assert caught.value.file == f"file://{source}" and f"{MiB} allowed" in caught.value.reason
    assert list(dest.parent.iterdir()) == [] and store.stats.bytes_read == 0


def test_on_s3_a_bucket_over_its_bound_is_refused_from_its_size_and_the_good_bytes_install(prefect_api, s3,
                                                                                           tmp_path):
    lab = s3_lab(tmp_path / "lab", s3, "bounded")
    settings = s3.settings()
    lab.publish("initial", storage=settings)
    lab.publish("delta", storage=settings)
    cache = tmp_path / "cache"
    state, result = lab.refit(target="r1", cache_dir=cache, storage=settings)
    assert state.name == "Ready", result.error
    lab.publish("delta", storage=settings)
    objects = ObjectStore(settings)
    url = join_url(parent_url(lab.catalog), "revisions", "r2", "bucket-00000.safetensors")
    good = objects.read_bytes(url, max_size=64 * MiB)
    index = json.loads(objects.read_bytes(join_url(parent_url(lab.catalog), "revisions", "r2",
                                                   "delta.safetensors.index.json"), max_size=MiB))
    sizes = {t: lab.expected("r2")[t].nbytes for t in index["weight_map"]}
    bound = documented_bound("xor", sizes)
    fs, path = objects.locate(url)
    fs.pipe_file(path, good + b"\0" * (bound - len(good) + 4 * MiB))  # replaced behind the catalog's back
    size_before = tree_size(cache)
    state, result = lab.refit(target="r2", cache_dir=cache, storage=settings)
    assert state.name == "Failed" and result.status == "FAILED", result.error
    error = result.exception
    assert isinstance(error, SafetensorsError), repr(error)
    assert error.revision == "r2" and error.file == url and f"{bound:,} bytes" in error.reason, error
    fetch = {s["name"]: s for s in result.stages}["fetch buckets"]
    assert fetch.get("bytes", 0) == 0, fetch
    assert tree_size(cache) - size_before < MiB, "the refused bucket (or part of it) landed in the cache"
    active = json.loads((cache / lab.model.replace("/", "--") / "active.json").read_text())
    assert active["version"] == "r1"
    fs.pipe_file(path, good)
    state, result = lab.refit(target="r2", cache_dir=cache, storage=settings)
    assert state.name == "Ready", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")


def _bucket_folder(lab, version: str) -> Path:
    record = json.loads((lab.catalog_dir / f"{version}.json").read_text())
    return Path(record["uri"].removeprefix("file://")).parent


def test_a_node_without_a_checkpoint_bounds_buckets_by_the_full_revisions_shard_headers(tmp_path):
    from tests.support.lab import Lab, tiny_shape

    lab = Lab(tmp_path / "lab", shape=tiny_shape())
    for kind in ("initial", "delta", "full", "delta"):
        lab.publish(kind)
    bucket = _bucket_folder(lab, "r3") / "bucket-00000.safetensors"
    good = bucket.read_bytes()
    index = json.loads((_bucket_folder(lab, "r3") / "delta.safetensors.index.json").read_text())
    bound = documented_bound("xor", {t: lab.expected("r3")[t].nbytes for t in index["weight_map"]})
    bucket.write_bytes(good + b"\0" * (bound - len(good) + 1))
    state, result = lab.refit(target="r3", seed_checkpoint=None)  # no launch snapshot: from the full r2
    assert state.name == "Failed" and result.status == "FAILED", result.error
    error = result.exception
    assert isinstance(error, SafetensorsError) and error.revision == "r3", repr(error)
    assert error.file.endswith("r3/bucket-00000.safetensors") and f"{bound:,} bytes" in error.reason, error
    assert not (lab.store_root / "deltas" / "r3" / "bucket-00000.safetensors").exists()
    bucket.write_bytes(good)
    state, result = lab.refit(target="r3", seed_checkpoint=None)
    assert state.name == "Ready", result.error
    assert result.lineage == ["r2", "r3"]
    lab.assert_checkpoint(Path(result.checkpoint_path), "r3")


def test_a_full_shard_with_bytes_after_its_last_tensor_is_refused_before_it_is_downloaded(tmp_path):
    from tests.support.lab import Lab, tiny_shape

    lab = Lab(tmp_path / "lab", shape=tiny_shape())
    lab.publish("initial")
    lab.publish("delta")
    assert lab.run(target="r1").status == "READY"
    lab.publish("full")
    shard = sorted(_bucket_folder(lab, "r2").glob("*.safetensors"))[0]
    good = shard.read_bytes()
    shard.write_bytes(good + b"\0" * 100)
    state, result = lab.refit(target="r2")
    assert state.name == "Failed" and result.status == "FAILED", result.error
    error = result.exception
    assert isinstance(error, SafetensorsError) and error.revision == "r2", repr(error)
    assert error.file.endswith(f"r2/{shard.name}") and "100 byte(s) follow the last tensor" in error.reason, error
    assert not (lab.store_root / "full" / "r2" / shard.name).exists(), "the refused shard was downloaded"
    assert json.loads((lab.store_root / "active.json").read_text())["version"] == "r1"
    shard.write_bytes(good)
    result = lab.run(target="r2")
    assert result.status == "READY", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")
