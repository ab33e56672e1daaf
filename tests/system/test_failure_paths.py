"""Failure paths of the product's own flow: a fetch beside a failing apply, workers and their first error.

Each test drives the flow the CLI and the deployments run (``flows.refit``),
or the patcher it calls, and proves one rule: the concurrent fetch is
cancelled and joined before anything else touches the store and before the
lock goes; a cached artifact that fails validation is discarded so a
repaired object is fetched again; the apply workers are stopped and joined
whatever interrupts them, and the error reported is the first real one.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tests.support.s3_support import s3  # noqa: F401  (s3 is a fixture)

from flows.synthetic import ModelShape
from tests.support.lab import Lab, independent_digest
from storage import errors
from storage.errors import Cancelled, ChecksumMismatch, FormatError, Interrupted
from storage.store.local_store import LocalStore
from storage.objects.store import ObjectStore
from storage.patch.patcher import PatchStep, StaticPlans, TensorPlan, apply_patches
from storage.urls import join_url, parent_url
from testbed.s3proxy import Faults

SHAPE = ModelShape(vocab=2048, hidden=128, intermediate=352, layers=4, shards=2)  # ~2.7 MB: 3 buckets of 1 MiB


@pytest.fixture
def trace(monkeypatch, tmp_path):
    """The order in which this process reached the product's named points (``storage.runtime.killpoints``)."""
    import storage.runtime.killpoints as kp

    path = tmp_path / "trace.log"
    monkeypatch.setattr(kp, "_TRACE", str(path))
    return lambda: [json.loads(x)["what"] for x in path.read_text().splitlines()] if path.exists() else []


def _flip_inside_first_frame(data: bytes) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    start, end = min((v["data_offsets"] for v in header.values()), key=lambda o: o[0])
    at = 8 + n + (start + end) // 2
    return data[:at] + bytes([data[at] ^ 0xFF, data[at + 1] ^ 0xFF]) + data[at + 2 :]


def test_a_failed_apply_stops_and_joins_the_fetch_then_a_repaired_object_is_fetched_again(
        prefect_api, s3, tmp_path, trace):
    lab = Lab(tmp_path / "lab", shape=SHAPE)
    lab.catalog = f"{s3.prefix('beside')}/catalog"
    lab.publish("initial", storage=s3.settings())
    lab.publish("delta", storage=s3.settings())
    lab.publish("delta", storage=s3.settings(), bucket_max_mib=1)
    cache = tmp_path / "cache"
    state, result = lab.refit(target="r1", cache_dir=cache, storage=s3.settings())
    assert state.name == "Ready", result.error
    bucket = join_url(parent_url(lab.catalog), "revisions", "r2", "bucket-00000.safetensors")
    objects = ObjectStore(s3.settings())
    fs, path = objects.locate(bucket)
    good = fs.cat_file(path)
    assert len(objects.list_names(parent_url(bucket), ".safetensors")) >= 3
    fs.pipe_file(path, _flip_inside_first_frame(good))  # corrupt in the object store, same size

    # every bucket GET is held, two at a time: when the corrupt bucket fails the apply, another is in flight
    with s3.proxy(Faults(get_latency_s=1.0, latency_suffix=".safetensors")) as proxy:
        state, result = lab.refit(target="r2", cache_dir=cache, storage=s3.settings(proxy.url, concurrency=2))
        bucket_gets = [r for r in proxy.requests("/revisions/r2/bucket-", "GET")]
    assert state.name == "Failed" and result.status == "FAILED"
    assert issubclass(getattr(errors, result.error_detail["type"]), FormatError)
    assert result.error_detail["file"] == bucket  # the remote object ...
    local = Path(result.error_detail["local_file"])  # ... and the local copy, which is gone
    assert local.name == "bucket-00000.safetensors" and not local.exists()
    assert "the next run downloads it again" in result.error and "refit" in result.next_step
    stages = {s["name"]: s for s in result.stages}
    assert "attempts" not in stages["fetch buckets"]  # a stage runs once: no attempt count to report
    # the fetch ended before the roll back started, and before the flow returned: nothing in flight
    points = trace()
    assert "fetch.stopped" in points and "rollback.start" in points
    assert points.index("fetch.stopped") < points.index("rollback.start")
    assert len({r.path for r in bucket_gets}) >= 2  # downloads were running beside the failing apply
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("fetch", "stage-fetch"))]
    store = LocalStore(cache, lab.model)
    assert store.state().status == "READY" and store.state().version == "r1" and store.active().version == "r1"
    assert not [p for p in store.root.rglob(".*") if p.name.endswith((".tmp", ".part")) and
                not (p.parent / (p.name + ".json")).exists()]
    with store.exclusive(0.5, "test"):  # the lock was released
        pass

    fs.pipe_file(path, good)  # the publisher repairs the object; the next refit needs no manual step
    state, result = lab.refit(target="r2", cache_dir=cache, storage=s3.settings())
    assert state.name == "Ready", result.error
    assert result.target_digest == independent_digest(lab.expected("r2"))[1]
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")


# -- the patcher's workers ---------------------------------------------------------------------------------


class _Slow:
    """A plan source over real plans whose ``plan`` can block and whose ``cancel`` can be slow."""

    def __init__(self, plans, *, block_on=None, cancel_delay_s=0.0):
        self.inner = StaticPlans(plans)
        self.block_on, self.cancel_delay_s = block_on, cancel_delay_s
        self.release = threading.Event()
        self.entered = threading.Event()

    def names(self):
        return self.inner.names()

    def take(self):
        return self.inner.take()

    def plan(self, name):
        if name == self.block_on:
            self.entered.set()
            self.release.wait(10)
        return self.inner.plan(name)

    def cancel(self):
        time.sleep(self.cancel_delay_s)
        self.release.set()

    def prepare(self):
        pass

    def total_bytes(self):
        return self.inner.total_bytes()


def _checkpoint_with_deltas(tmp_path: Path, sizes: dict[str, int], bad: set[str] = frozenset()):
    """A one-shard checkpoint of ``sizes`` tensors (uint8) and one dense-xor bucket per tensor."""
    import zstandard

    from storage.format.checkpoint import CheckpointIndex
    from storage.format.digests import checksum_bytes
    from storage.format.safetensors import write_safetensors

    rng = np.random.default_rng(0)
    base = {n: rng.integers(0, 256, s, dtype=np.uint8) for n, s in sizes.items()}
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as fh:
        write_safetensors(fh, [(n, "U8", [a.size], a.tobytes()) for n, a in base.items()], {})
    index = CheckpointIndex.open(folder)
    plans = []
    for name, array in base.items():
        target = array ^ rng.integers(0, 2, array.size, dtype=np.uint8)
        frame = zstandard.ZstdCompressor().compress((array ^ target).tobytes())
        bucket = tmp_path / f"{name}.bin"
        bucket.write_bytes(frame)
        checksum = checksum_bytes("adler32", target if name not in bad else target ^ 1)
        step = PatchStep("r1", "xor", bucket, f"file://{bucket}", 0, len(frame), checksum, "adler32")
        plans.append(TensorPlan(index.tensors[name], (step,)))
    checksums = index.checksums("adler32")
    return index, plans, checksums


def test_the_first_error_is_reported_not_a_worker_stopped_because_of_it(tmp_path):
    """A worker that stops because another failed never hides that failure (even if it records first)."""
    index, plans, base = _checkpoint_with_deltas(tmp_path, {"a": 8 << 20, "bad": 1 << 16}, bad={"bad"})
    source = _Slow(plans, cancel_delay_s=0.5)  # the failing worker is slow to tell the source
    with pytest.raises(ChecksumMismatch) as caught:
        apply_patches(index, source, target_checksum_format="adler32", workers=2, block_size=4096,
                      undo_to=base, undo_format="adler32")
    assert caught.value.tensor == "bad" and caught.value.undone is True
    assert index.checksums("adler32") == base  # every patched byte was undone


def test_an_interrupt_in_the_calling_thread_stops_and_joins_the_workers_before_undoing(tmp_path):
    # Python's own Ctrl-C (KeyboardInterrupt in the main thread), whatever handler an earlier test left
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    index, plans, base = _checkpoint_with_deltas(tmp_path, {"a": 1 << 20, "b": 1 << 20})
    source = _Slow(plans, block_on="b")  # one worker parks in plan(): the main thread is left joining
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt) as caught:  # an interrupt stays an interrupt, not bad input
            apply_patches(index, source, target_checksum_format="adler32", workers=2, block_size=4096,
                          undo_to=base, undo_format="adler32")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert not isinstance(caught.value, FormatError)
    assert caught.value.undone is True
    assert not [t.name for t in threading.enumerate() if t.name.startswith("apply-")]  # workers joined
    assert index.checksums("adler32") == base


def test_a_stopped_run_stops_its_workers_with_an_interrupt(tmp_path):
    from storage.runtime.cancel import StopToken

    index, plans, base = _checkpoint_with_deltas(tmp_path, {"a": 4 << 20})
    token = StopToken(interrupt=True)
    token.stop("SIGTERM")
    with pytest.raises(Interrupted):
        apply_patches(index, plans, target_checksum_format="adler32", workers=2, block_size=4096, stop=token,
                      undo_to=base, undo_format="adler32")
    assert index.checksums("adler32") == base


def test_cancelled_work_is_not_mistaken_for_the_cause():
    from storage.patch.patcher import _first_error

    cause = ChecksumMismatch("tensor bytes hash to x", tensor="bad")
    assert _first_error([Cancelled("stopped: tensor failed"), cause]) is cause
    assert isinstance(_first_error([Cancelled("stopped")]), Cancelled)
