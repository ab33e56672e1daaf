"""The in-engine loader's parallel reader: every tensor once, byte for byte, in bounded memory; and the benchmark.

``parallel_weights`` is what ``SGLangDefaultLoader.weights`` hands SGLang's
``load_weights`` (tests/unit/installers/test_sglang_loader.py runs it end to end); here it is
read on its own, against the bytes written and against the safetensors
library's own reader. The benchmark runs as a command, as documented.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import tasks.installers.sglang_loader as sglang_loader
from storage.errors import SafetensorsError
from storage.format.checkpoint import INDEX_FILE
from storage.format.safetensors import write_safetensors
from tests.support.sglang_support import fake_sglang  # noqa: F401  (fixture)
import tasks.installers.weights_reader as weights_reader
from tasks.installers.weights_reader import parallel_weights
from tests.system.test_benchmarks_smoke import run_benchmark

NUMPY = {"BF16": np.uint16, "F32": np.float32, "I8": np.int8, "I64": np.int64}
TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "I8": torch.int8, "I64": torch.int64}


def write_shards(folder: Path, shards: list[list[tuple[str, str, tuple, np.ndarray]]]) -> None:
    """``shards`` of ``(name, dtype, shape, array)``, laid out in order (no padding), with an index."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, tensors in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(folder / file, "wb") as fh:
            write_safetensors(fh, [(name, dtype, shape, array.tobytes()) for name, dtype, shape, array in tensors],
                              {"format": "pt"})
        weight_map.update({name: file for name, *_ in tensors})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def mixed_checkpoint(folder: Path, large_elements: int = 300_000) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """bf16, float32, int8, int64, a scalar, empty tensors and a float32 left misaligned by an odd int8, in 3 shards
    (each laid out in name order, as SGLang reads them)."""
    rng = np.random.default_rng(5)

    def arr(dtype: str, shape: tuple) -> np.ndarray:
        if dtype == "BF16":
            return rng.integers(0, 2**16, size=shape, dtype=np.uint16)
        if dtype == "F32":
            return rng.standard_normal(shape).astype(np.float32)
        return rng.integers(-100, 100, size=shape).astype(NUMPY[dtype])

    shards = [
        [("embed.weight", "BF16", (large_elements // 64, 64)), ("norm.weight", "F32", (64,)),
         ("scale", "F32", ()), ("empty.bf16", "BF16", (0, 64))],
        [("m0.odd.int8", "I8", (7,)), ("m1.misaligned.f32", "F32", (5, 3)), ("layer.weight", "BF16", (96, 64)),
         ("empty.int8", "I8", (0,))],
        [("steps", "I64", (3,)), ("head.weight", "BF16", (large_elements // 64, 64))],
    ]
    written = [[(name, dtype, shape, arr(dtype, shape)) for name, dtype, shape in sorted(shard)] for shard in shards]
    write_shards(folder, written)
    return {name: (dtype, shape, array) for shard in written for name, dtype, shape, array in shard}


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 KiB, so large tensors are read by several threads and the window is many tensors deep."""
    monkeypatch.setattr(weights_reader, "READ_CHUNK", 64 * 1024)


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("canonical-refit-read")]


@pytest.mark.parametrize("threads", [1, 3])
def test_every_tensor_once_byte_for_byte(tmp_path, small_chunks, threads):
    want = mixed_checkpoint(tmp_path / "ckpt")

    got = list(parallel_weights(tmp_path / "ckpt", threads))

    names = [name for name, _ in got]
    assert sorted(names) == sorted(want) and len(names) == len(set(names))
    for name, tensor in got:
        dtype, shape, array = want[name]
        assert tensor.dtype == TORCH[dtype] and tuple(tensor.shape) == shape, name
        assert as_bytes(tensor) == array.tobytes(), name
    # the same tensors, in the same order, as the safetensors library's own reader (what SGLang reads with)
    theirs = []
    for path in sorted((tmp_path / "ckpt").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            theirs += [(name, fh.get_tensor(name)) for name in fh.keys()]
    assert [name for name, _ in theirs] == names
    for (name, a), (_, b) in zip(theirs, got):
        assert a.dtype == b.dtype and a.shape == b.shape and as_bytes(a) == as_bytes(b), name
    assert reader_threads() == []  # exhausted: the reader's threads are joined


def test_held_tensors_stay_valid_and_private(tmp_path):
    want = mixed_checkpoint(tmp_path / "ckpt", large_elements=4096)
    files = {p: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}

    held = dict(parallel_weights(tmp_path / "ckpt", 2))
    gc.collect()  # the reader has let go of its mappings; the tensors keep them
    for name, tensor in held.items():
        assert as_bytes(tensor) == want[name][2].tobytes(), name
    held["layer.weight"].fill_(1.0)  # a consumer that writes into a tensor changes neither the file nor its neighbours
    held["m1.misaligned.f32"].zero_()
    assert {p: p.read_bytes() for p in files} == files
    assert as_bytes(held["embed.weight"]) == want["embed.weight"][2].tobytes()
    assert as_bytes(held["m0.odd.int8"]) == want["m0.odd.int8"][2].tobytes()


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status (Linux has it since 4.5)")


def test_copies_nothing_and_reads_a_bounded_window_ahead(tmp_path, small_chunks, monkeypatch):
    want = mixed_checkpoint(tmp_path / "ckpt", large_elements=16 * 2**20 // 2)  # two 16 MiB tensors
    total = sum(array.nbytes for _, _, array in want.values())
    threads = 2
    advised: list[tuple[int, int]] = []  # (mapping address, start) of each chunk a thread faulted in
    lock = threading.Lock()
    real_advise = weights_reader.advise

    def recording_advise(view, start, length, advice):
        with lock:
            advised.append((view.ctypes.data, start))
        real_advise(view, start, length, advice)

    monkeypatch.setattr(weights_reader, "advise", recording_advise)
    locations = sorted(weights_reader.CheckpointIndex.open(tmp_path / "ckpt").tensors.values(),
                       key=lambda t: (t.file, t.name))
    bases: dict[int, str] = {}  # mapping address -> file, learnt from the tensors (views at their offsets)

    def behind(chunk: tuple[int, int], t) -> bool:
        file = bases.get(chunk[0])
        return file is not None and (file < t.file or (file == t.file and chunk[1] < t.offset + t.nbytes))

    chunk = weights_reader.READ_CHUNK
    chunks = [-(-t.nbytes // chunk) for t in locations]
    window = threads * weights_reader.READ_AHEAD

    def count_ahead(t) -> int:
        with lock:
            return sum(1 for c in advised if not behind(c, t))

    before = rss_anon()
    held, ahead, expected = [], [], []
    for k, ((name, tensor), t) in enumerate(zip(parallel_weights(tmp_path / "ckpt", threads), locations,
                                                strict=True)):
        assert name == t.name
        if t.nbytes and t.offset % tensor.element_size() == 0:
            bases[tensor.data_ptr() - t.offset] = t.file
        expected.append(min(window, sum(chunks[k + 1:])))
        deadline = time.monotonic() + 10
        while count_ahead(t) < expected[-1] and time.monotonic() < deadline:  # a consumer slower than the reader
            time.sleep(0.001)
        time.sleep(0.01)
        ahead.append(count_ahead(t))
        held.append(tensor)  # holding every tensor costs no memory: they are views of the page cache
    grown = rss_anon() - before
    assert grown < total // 8, f"anonymous memory grew by {grown} bytes reading {total}"
    assert ahead == expected  # the window of chunks ahead of the consumer, full and never more


def test_closing_early_joins_the_threads_and_a_bad_folder_fails_before_reading(tmp_path, small_chunks):
    mixed_checkpoint(tmp_path / "ckpt")
    weights = parallel_weights(tmp_path / "ckpt", 3)
    first = next(weights)
    assert first[0] and reader_threads()
    weights.close()  # what happens when load_weights raises part-way
    assert reader_threads() == []

    (tmp_path / "ckpt" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(SafetensorsError, match="missing"):
        parallel_weights(tmp_path / "ckpt", 3)  # checked when the iterator is built, before any tensor is read
    assert reader_threads() == []


def test_sglang_adapter_reads_in_parallel_unless_the_model_picks_its_files(tmp_path, monkeypatch, fake_sglang):
    want = mixed_checkpoint(tmp_path / "ckpt", large_elements=4096)
    loader = sglang_loader.SGLangDefaultLoader(threads=2)

    plain = torch.nn.Module()
    got = dict(loader.weights(plain, tmp_path / "ckpt"))
    assert {name: as_bytes(t) for name, t in got.items()} == {name: a.tobytes() for name, (_, _, a) in want.items()}

    calls = []
    monkeypatch.setattr(sglang_loader, "parallel_weights", lambda *a: calls.append(a) or iter(()))
    list(loader.weights(plain, tmp_path / "ckpt"))
    assert calls == [(tmp_path / "ckpt", 2)]
    picky = torch.nn.Module()
    picky.allow_patterns_overrides = ["model-00001-*.safetensors"]
    names = [name for name, _ in loader.weights(picky, tmp_path / "ckpt")]  # SGLang's own reader, its own files
    assert len(calls) == 1 and "embed.weight" in names
    monkeypatch.setenv("CANONICAL_REFIT_LOADER_READER", "sglang")  # the operator's way back to SGLang's reader
    fallback = sglang_loader.SGLangDefaultLoader(threads=2)
    got = dict(fallback.weights(plain, tmp_path / "ckpt"))
    assert len(calls) == 1 and {n: as_bytes(t) for n, t in got.items()} == {n: a.tobytes() for n, (_, _, a) in want.items()}


def test_the_benchmark_writes_the_reference_both_loader_readers_and_the_goal(tmp_path):
    out = tmp_path / "install.json"
    done = run_benchmark("benchmarks.install", "--quick", "--repeat", "1", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["schema"] == "canonical-refit.benchmark.install.v1"
    assert result["model"]["store_status"] == "READY" and result["model"]["bytes"] > 32 * 2**20
    assert result["reference"]["seconds"] > 0 and result["reference"]["gb_s"] > 0
    for reader in ("sequential", "parallel"):
        row = result["loader"][reader]
        assert row["seconds"] > 0 and row["over_reference"] > 0
    goal = result["goal"]
    assert goal["bound"] == 1.3 and goal["met"] == (goal["measured"] <= 1.3)
    assert goal["measured"] == result["loader"]["parallel"]["over_reference"]
    assert "install pause" in done.stdout and "x (bound 1.3)" in done.stdout
