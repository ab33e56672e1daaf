"""Real checkpoint layouts, in their small mode, published and refitted end to end through flows.api.

Each shape of ``flows.synthetic.SHAPES`` (DeepSeek-V3's FP8 E4M3 weights with F32 block scales, DeepSeek-R1-NVFP4's
U8-packed FP4 weights with F8_E4M3 scales and scalar F32 global scales, a Kimi-K3-like layout with F8_E5M2
experts, gpt-oss's fused MXFP4 expert blocks, a dense bf16 stack) is written with real tensor names and dtypes
at tiny sizes, published as r0 and two RL-like steps (every tensor changes), and refitted by a fresh node to r1
(seeded, then the delta) and then to r2 in place. The installed checkpoint is read back with an independent
safetensors reader (no project code) and compared tensor by tensor: names, dtypes, shapes and bytes.
"""

from __future__ import annotations

import pytest

from tests.support.crash_support import raw_tensors
from flows import api
from flows.synthetic import SHAPES, SMALL_SCALES, ShapedCheckpoint, shape_layout
from storage.catalog.records import Catalog
from storage.objects.store import ObjectStore
from storage.store.local_store import LocalStore


@pytest.mark.parametrize("shape", SHAPES)
def test_a_real_shape_is_published_and_refitted_byte_exact(shape, tmp_path):
    specs = shape_layout(shape, SMALL_SCALES[shape])
    model, catalog = f"lab/{shape}", f"file://{tmp_path}/catalog"
    common = dict(catalog=catalog, model=model)
    publish = dict(state_dir=tmp_path / "publisher", emit_event=False, **common)
    r0 = ShapedCheckpoint.random(specs, seed=3)
    launch = r0.write(tmp_path / "launch", shard_tensors=200)
    assert api.publish(launch, kind="initial", **publish).version == "r0"
    revisions = [r0]
    for k in (1, 2):
        revisions.append(revisions[-1].step(seed=10 + k))
        published = api.publish(revisions[-1].write(tmp_path / f"r{k}", shard_tensors=200), **publish)
        assert (published.version, published.changed_tensors) == (f"r{k}", len(specs))

    cache = tmp_path / "cache"
    for k in (1, 2):  # a fresh node: the launch folder seeded, then r1; then r2 patched in place
        result = api.refit(target=f"r{k}", cache_dir=cache, seed_checkpoint=launch, installer={"kind": "none"},
                           **common)
        assert (result.status, result.version) == ("READY", f"r{k}")

    store = LocalStore(cache, model, create=False)
    active = store.active()
    record = Catalog(ObjectStore(), catalog, model).read("r2")
    assert (active.version, active.digest) == ("r2", record.target_digest)  # the digest of every tensor, verified
    installed = raw_tensors(store.root / active.path)
    assert sorted(installed) == sorted(s.name for s in specs)
    expected = revisions[2]
    for i, spec in enumerate(specs):
        dtype, dims, data = installed[spec.name]
        assert (dtype, tuple(dims)) == (spec.dtype, spec.shape), spec.name
        assert data == expected.tensor_bytes(i), spec.name
    dtypes = {spec.dtype for spec in specs}
    if shape in ("deepseek-v3", "deepseek-r1-nvfp4", "kimi-k3"):
        assert "F8_E4M3" in dtypes
    if shape == "kimi-k3":
        assert "F8_E5M2" in dtypes
    if shape in ("deepseek-r1-nvfp4", "gpt-oss"):
        assert "U8" in dtypes


@pytest.mark.parametrize("module", ["benchmarks.refit", "benchmarks.publish"])
def test_the_shape_benchmarks_run_as_commands_and_report_every_stage(module, tmp_path):
    """``python -m benchmarks.refit|publish --shape ... --small``, as documented: every tensor changed, published
    (and refitted byte-exact), and a figure per tensor for every stage; the figures' values are not asserted."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "result.json"
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-m", module, "--shape", "deepseek-r1-nvfp4", "--small", "--json",
                           str(out)], cwd=root, env=os.environ | {"PYTHONPATH": path}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    [point] = result["points"]
    assert point["tensors"] == len(shape_layout("deepseek-r1-nvfp4", SMALL_SCALES["deepseek-r1-nvfp4"]))
    assert point["dtypes"] == ["BF16", "F32", "F8_E4M3", "U8"]
    assert set(point["publish_us_per_tensor"]) >= {"plan revision", "encode payload", "upload payload",
                                                   "write record", "wall", "cpu"}
    assert "publish" in result["goals"] and "goal <= 40" in done.stdout
    if module == "benchmarks.refit":
        assert point["byte_exact"] is True and point["tensors_compared"] == point["tensors"]
        assert set(point["refit_us_per_tensor"]) >= {"fetch index", "fetch buckets", "apply deltas",
                                                     "verify digest", "stages_sum", "cpu"}
        assert point["memory"]["anon_over_baseline_per_tensor"] > 0
        assert "refit" in result["goals"] and "goal <= 20" in done.stdout
    else:
        assert "refit_us_per_tensor" not in point


def test_a_checkpoint_reopened_is_parsed_again_when_its_bytes_changed(tmp_path):
    """``CheckpointIndex.open`` remembers layouts by their bytes: the same bytes elsewhere give the same tensors
    at the new place; a shard whose header changed is parsed again, and a broken one is still refused."""
    import shutil

    from storage.errors import SafetensorsError
    from storage.format.checkpoint import CheckpointIndex
    from storage.format.safetensors import encode_header

    specs = shape_layout("dense", SMALL_SCALES["dense"])
    folder = ShapedCheckpoint.random(specs, seed=5).write(tmp_path / "a", shard_tensors=40)
    first = CheckpointIndex.open(folder)
    copy = tmp_path / "b"
    shutil.copytree(folder, copy)
    again = CheckpointIndex.open(copy)
    assert again.folder == copy and again.tensors == first.tensors
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    header = first.headers[shard.name]
    infos = sorted(header.tensors.values(), key=lambda t: t.start)
    changed, _ = encode_header(((t.name, "F16" if i == 0 else t.dtype, t.shape, t.nbytes) for i, t in enumerate(infos)),
                               header.metadata)
    assert len(changed) == header.data_offset  # the same data section, one dtype different
    shard.write_bytes(changed + data[header.data_offset:])
    assert CheckpointIndex.open(folder).tensors[infos[0].name].dtype == "F16"
    shard.write_bytes(changed[:8] + b"x" + changed[9:] + data[header.data_offset:])  # no longer JSON
    with pytest.raises(SafetensorsError):
        CheckpointIndex.open(folder)


def test_no_collection_runs_while_a_refit_holds_the_store_and_a_verified_record_is_parsed_once(
        tmp_path, monkeypatch):
    """The cyclic collector does not run between taking the store lock and releasing it (each collection walks
    the whole index), and runs again afterwards; a store object parses a verified record (a checksum per tensor)
    once however often it is asked for, and again once the file was rewritten."""
    import gc
    import json
    import sys

    import storage.store.local_store as local_store
    import tasks.receiver as receiver
    from storage.durable import atomic_write_json
    from storage.store.records import VerifiedCheckpoint

    specs = shape_layout("deepseek-v3", SMALL_SCALES["deepseek-v3"])
    model, catalog = "lab/memo", f"file://{tmp_path}/catalog"
    publish = dict(state_dir=tmp_path / "publisher", emit_event=False, catalog=catalog, model=model)
    r0 = ShapedCheckpoint.random(specs, seed=4)
    launch = r0.write(tmp_path / "launch", shard_tensors=200)
    api.publish(launch, kind="initial", **publish)
    api.publish(r0.step(seed=21).write(tmp_path / "r1", shard_tensors=200), **publish)
    refit = dict(catalog=catalog, model=model, cache_dir=tmp_path / "cache", seed_checkpoint=launch,
                 installer={"kind": "none"})
    assert api.refit(target="r0", **refit).status == "READY"

    collections: list[bool] = []  # one per collection: was the store held?
    held: list[bool] = []
    preparation = receiver.Receiver.preparation

    class Watched:
        def __init__(self, rx, *args, **kwargs):
            self.cm = preparation(rx, *args, **kwargs)

        def __enter__(self):
            value = self.cm.__enter__()
            held.append(True)
            return value

        def __exit__(self, *exc):
            held.clear()
            return self.cm.__exit__(*exc)

    def collected(phase, info):
        if phase == "start":
            collections.append(bool(held))

    monkeypatch.setattr(receiver.Receiver, "preparation", lambda rx, *a, **k: Watched(rx, *a, **k))
    gc.callbacks.append(collected)
    try:
        result = api.refit(target="r1", **refit)
        assert (result.status, result.version) == ("READY", "r1")
        assert gc.isenabled()
        gc.collect()
    finally:
        gc.callbacks.remove(collected)
    inside = [c for c in collections if c]  # collections that started while the refit held the store lock
    assert inside == [], f"{len(inside)} of {len(collections)} collections ran while the store lock was held"
    assert len(collections) > len(inside)  # the collector runs outside (the explicit gc.collect() above at least)

    parsed: list[str] = []
    memo_module = sys.modules[local_store._VerifiedMemo.__module__]  # where the store's record reads happen
    read = memo_module.read_record
    monkeypatch.setattr(memo_module, "read_record", lambda cls, path: (
        parsed.append(path.name) if cls is VerifiedCheckpoint else None) or read(cls, path))
    store = LocalStore(tmp_path / "cache", model, create=False)
    records = [store.verified("r1") for _ in range(5)] + [store.inventory()["r1"], store.current()]
    assert parsed.count("r1.json") == 1 and len(parsed) == len(set(parsed)), parsed  # each record parsed once
    assert all((r.target_digest, r.checksums) == (records[0].target_digest, records[0].checksums) for r in records)
    path = store.root / "verified" / "r1.json"
    raw = json.loads(path.read_text())
    raw["verified_at_unix_ms"] += 1
    atomic_write_json(path, raw)  # rewritten (a new file): parsed again by the same store object
    again = store.verified("r1")
    assert parsed.count("r1.json") == 2, parsed
    assert again.verified_at_unix_ms == records[0].verified_at_unix_ms + 1
