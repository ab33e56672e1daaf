"""Applying while buckets arrive, and undoing a failed in-place apply (storage.patch.pipeline, storage.patch.patcher)."""

from __future__ import annotations

import shutil
import zlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

from flows.synthetic import train_step
from storage.catalog.records import Revision
from storage.format.checkpoint import CheckpointIndex
from storage.errors import ChecksumMismatch, CodecError, ObjectNotFound, StoreError
from storage.catalog.manifests import parse_delta_manifest
from storage.patch.patcher import apply_patches, plan_patches
from storage.patch.pipeline import Arrivals, ArrivingPlans
from storage.catalog.publisher import snapshot_of, stage_delta
from storage.format.safetensors import read_header, write_safetensors


def checksums_of(index: CheckpointIndex) -> dict[str, str]:
    """adler32 of every tensor, computed with zlib (independently of storage.format.digests)."""
    out = {}
    for name, loc in index.tensors.items():
        with open(index.folder / loc.file, "rb") as fh:
            fh.seek(loc.offset)
            out[name] = f"{zlib.adler32(fh.read(loc.nbytes), 1) & 0xffffffff:08x}"
    return out


def _revision(version: str, base: str) -> Revision:
    return Revision.model_validate({
        "schema": "canonical-refit.revision.v1", "model": "lab/tiny", "version": version, "sequence": int(version[1:]),
        "payload_format": "xor_delta", "base_version": base, "base_digest": "sha256:" + "a" * 64,
        "target_digest": "sha256:" + "b" * 64, "format_digest": "sha256:" + "c" * 64, "checksum_format": "adler32",
        "uri": f"file:///x/{version}/delta.safetensors.index.json", "created_at_unix_ms": 1})


class Chain:
    """A base checkpoint and K published deltas over it, for patcher-level tests."""

    def __init__(self, lab, tmp: Path, k: int, *, encodings=None, bucket_bytes=60_000):
        self.tmp = tmp
        tensors = lab.current
        self.base = lab.write(tensors, "c0")
        self.states = [tensors]
        self.manifests, self.folders = [], {}
        for i in range(1, k + 1):
            tensors = train_step(tensors, seed=50 + i, fraction=0.001 if (encodings or {}).get(i) else 1.0)
            self.states.append(tensors)
            folder = lab.write(tensors, f"c{i}")
            out = tmp / f"d{i}"
            stage_delta(snapshot_of(lab.trainer / f"c{i - 1}", "adler32", workers=2), CheckpointIndex.open(folder),
                        out, version=f"r{i}", base_version=f"r{i - 1}", encoding=(encodings or {}).get(i, "xor"),
                        level=3, bucket_max_bytes=bucket_bytes, workers=2)
            raw = (out / "delta.safetensors.index.json").read_bytes()
            self.manifests.append(parse_delta_manifest(raw, _revision(f"r{i}", f"r{i - 1}")))
            self.folders[f"r{i}"] = out
        self.index = CheckpointIndex.open(self.base)

    def work(self) -> CheckpointIndex:
        work = self.tmp / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(self.base, work)
        return CheckpointIndex(work, self.index.tensors, self.index.headers)

    def bytes_of(self, index: CheckpointIndex) -> dict[str, bytes]:
        out = {}
        for name, loc in index.tensors.items():
            with open(index.folder / loc.file, "rb") as fh:
                fh.seek(loc.offset)
                out[name] = fh.read(loc.nbytes)
        return out

    def expected(self, i: int) -> dict[str, bytes]:
        return {n: a.tobytes() for n, a in self.states[i].items()}


def rewrite_bucket(path: Path, edit) -> None:
    header = read_header(path)
    blob = path.read_bytes()
    frames = {n: blob[header.data_offset + t.start: header.data_offset + t.end] for n, t in header.tensors.items()}
    frames, metadata = edit(frames, dict(header.metadata))
    with open(path, "wb") as fh:
        write_safetensors(fh, [(n, "U8", [len(f)], np.frombuffer(f, np.uint8)) for n, f in frames.items()], metadata)


def test_folded_chain_reconstructs_the_last_revision(lab, tmp_path):
    chain = Chain(lab, tmp_path, 3)
    work = chain.work()
    plans = plan_patches(chain.manifests, chain.folders, chain.index.tensors)
    apply_patches(work, plans, target_checksum_format="adler32", workers=2)
    assert chain.bytes_of(work) == chain.expected(3)


@pytest.mark.parametrize("encodings", [{}, {2: "overwrite"}, {1: "xor_sparse", 2: "overwrite"}])
def test_a_checksum_failure_after_patching_is_undone_exactly(lab, tmp_path, encodings):
    chain = Chain(lab, tmp_path, 3, encodings=encodings)
    last = sorted(chain.folders["r3"].glob("bucket-*.safetensors"))[-1]
    rewrite_bucket(last, lambda f, m: (f, {**m, sorted(f)[0]: "00000000"}))
    work = chain.work()
    plans = plan_patches(chain.manifests, chain.folders, chain.index.tensors)
    base = checksums_of(chain.index)
    with pytest.raises(ChecksumMismatch) as info:
        apply_patches(work, plans, target_checksum_format="adler32", workers=2, undo_to=base, undo_format="adler32")
    assert info.value.undone is True and info.value.revision == "r3"
    assert chain.bytes_of(work) == chain.expected(0)  # every patched byte is back


def test_a_frame_that_ends_early_mid_tensor_is_undone(lab, tmp_path):
    chain = Chain(lab, tmp_path, 1)
    bucket = sorted(chain.folders["r1"].glob("bucket-*.safetensors"))[0]
    victim = {}

    def shorten(frames, metadata):
        name = max(frames, key=lambda n: chain.index.tensors[n].nbytes)
        victim["name"] = name
        raw = zstandard.ZstdDecompressor().decompress(frames[name])
        stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()  # no size hint: a wide window
        frames[name] = stream.compress(raw[: len(raw) // 2]) + stream.flush()
        return frames, metadata

    rewrite_bucket(bucket, shorten)
    work = chain.work()
    plans = plan_patches(chain.manifests, chain.folders, chain.index.tensors)
    with pytest.raises(CodecError, match="decodes to only") as info:
        apply_patches(work, plans, target_checksum_format="adler32", workers=1, block_size=4096,
                      undo_to=checksums_of(chain.index), undo_format="adler32")
    assert info.value.tensor == victim["name"] and info.value.undone is True
    assert chain.bytes_of(work) == chain.expected(0)


def test_tensors_are_applied_as_their_buckets_arrive(lab, tmp_path):
    chain = Chain(lab, tmp_path, 1, bucket_bytes=30_000)
    manifest = chain.manifests[0]
    assert len(manifest.files) >= 3
    arrivals = Arrivals()
    source = ArrivingPlans(chain.manifests, chain.folders, chain.index.tensors, arrivals)
    work = chain.work()
    first = manifest.files[0]
    done: list[str] = []
    result: dict = {}

    def apply():
        result["sums"] = apply_patches(work, source, target_checksum_format="adler32", workers=1,
                                       progress=lambda n: done.append(n))

    arrivals.admit()
    arrivals.arrived("r1", first)
    worker = threading.Thread(target=apply)
    worker.start()
    first_tensors = set(manifest.tensors_of(first))
    deadline = time.monotonic() + 60
    while sum(done) < sum(chain.index.tensors[n].nbytes for n in first_tensors) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.is_alive()  # still waiting for the buckets that have not arrived
    assert sum(done) == sum(chain.index.tensors[n].nbytes for n in first_tensors)
    for name in manifest.files[1:]:
        arrivals.arrived("r1", name)
    arrivals.close()
    worker.join(60)
    assert set(result["sums"]) == set(manifest.weight_map)
    assert chain.bytes_of(work) == chain.expected(1)


def test_waiting_for_admission_raises_why_fetching_stopped():
    arrivals = Arrivals()
    arrivals.abort(ObjectNotFound("gone", file="x"))
    with pytest.raises(ObjectNotFound):
        arrivals.wait_admitted()


def test_a_cancelled_fetch_starts_no_download_and_the_lock_waits_for_it(flow_lab):
    from storage.errors import Cancelled
    from tasks.fetch_buckets import fetch_buckets
    from tasks.fetch_index import fetch_index
    from tasks.receiver import Receiver
    from tasks.resolve_catalog import resolve_catalog
    from tasks.seed_checkpoint import seed_checkpoint

    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta", bucket_max_mib=1)
    rx = Receiver(lab.refit_params())
    with rx.preparation():
        plan = resolve_catalog(rx)
        baseline = seed_checkpoint(rx, plan)
        indexes = fetch_index(rx, plan, baseline)
        arrivals = Arrivals(rx.stop.child())
        arrivals.cancel()  # as after a failed apply
        with pytest.raises(Cancelled, match="apply"):
            fetch_buckets(rx, plan, baseline, indexes, arrivals)
    assert not list((rx.store.root / "deltas").rglob("bucket-*.safetensors"))
    assert rx.lock is None and rx.store.state().version == "r0"


class _Manifest:
    """What ArrivingPlans reads of a delta manifest: its version, weight map and files."""

    def __init__(self, version: str, weight_map: dict[str, str]):
        self.version, self.weight_map = version, weight_map

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def _waiting_plans(count: int):
    from storage.format.checkpoint import TensorLocation

    sizes = {f"t{i:04d}": (i % 7) * 10 for i in range(count)}
    names = list(sizes)
    first = {t: f"b{i % 3}" for i, t in enumerate(names)}
    second = {t: f"c{i % 2}" for i, t in enumerate(names) if i % 5 == 0}  # every fifth tensor is in both deltas
    checkpoint = {t: TensorLocation(t, "m.safetensors", 0, n, "U8", (n,)) for t, n in sizes.items()}
    arrivals = Arrivals()
    source = ArrivingPlans([_Manifest("r1", first), _Manifest("r2", second)], {}, checkpoint, arrivals)
    arrivals.admit()
    needs = {t: {("r1", first[t])} | ({("r2", second[t])} if t in second else set()) for t in names}
    return arrivals, source, sizes, needs


def test_take_hands_out_the_ready_tensors_largest_first_then_names_the_missing_file():
    arrivals, source, sizes, needs = _waiting_plans(3000)
    arrived = {("r1", "b0"), ("r1", "b2"), ("r2", "c1")}
    for version, name in sorted(arrived):
        arrivals.arrived(version, name)
    ready = [t for t, keys in needs.items() if keys <= arrived]
    expected = sorted(ready, key=lambda t: (sizes[t], t), reverse=True)
    assert [source.take() for _ in expected] == expected  # as max((nbytes, name)) over the ready ones, each time
    arrivals.arrived("r1", "b1")  # more tensors become ready: they come next, still largest first
    arrived.add(("r1", "b1"))
    more = sorted((t for t, keys in needs.items() if keys <= arrived and t not in ready),
                  key=lambda t: (sizes[t], t), reverse=True)
    assert [source.take() for _ in more] == more
    arrivals.close()  # c0 never came: the tensors waiting for it cannot be patched
    with pytest.raises(StoreError) as info:
        source.take()
    assert (info.value.revision, info.value.file) == ("r2", "c0")


def test_take_raises_the_error_of_a_file_a_waiting_tensor_needs():
    arrivals, source, sizes, needs = _waiting_plans(50)
    arrivals.arrived("r1", "b0")
    taken = [source.take() for t, keys in needs.items() if keys <= {("r1", "b0")}]
    assert taken and all(needs[t] == {("r1", "b0")} for t in taken)
    arrivals.failed("r1", "b1", ObjectNotFound("object not found", file="b1", revision="r1"))
    with pytest.raises(ObjectNotFound) as info:
        source.take()
    assert info.value.file == "b1"
