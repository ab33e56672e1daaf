"""Sparse frames (``xor_sparse``, ``overwrite``) in bounded memory, with deterministic repeats, validated once.

A frame of a few KiB can decode to a record of 5 bytes per tensor byte. The
big cases build such records for a 64 MiB tensor and check, with
``tracemalloc`` (NumPy reports its buffers to it), that validating and
applying them allocates well under the tensor's size, and that the result
matches a from-scratch reference: a sequential writer in plain NumPy, fed the
same entries in record order. Memory is asserted, never time.
"""

from __future__ import annotations

import struct
import tracemalloc
from typing import Callable, Iterator

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import storage.format.codec as codec
import storage.format.frames as frames
import storage.format.sparse as sparse
from storage.format.codec import ValidatedFrame, make_decoder, validate_frame
from storage.format.encoding import encode_delta
from storage.errors import CodecError

MiB = 2**20
CTX = {"revision": "r9", "file": "bucket-0.safetensors", "tensor": "w"}
LAYOUT = {"xor_sparse": ("<Q", "<u8"), "overwrite": ("<I", "<u4")}
Chunks = Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]


def frame_of(encoding: str, positions, values, *, content_size: bool = True) -> bytes:
    fmt, dtype = LAYOUT[encoding]
    record = (struct.pack(fmt, len(positions)) + np.asarray(positions, dtype=dtype).tobytes()
              + np.asarray(values, dtype=np.uint8).tobytes())
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(record)


def streamed_frame(encoding: str, count: int, chunks: Chunks) -> bytes:
    """The frame of a record too big to build whole: positions, then values, chunk by chunk."""
    fmt, dtype = LAYOUT[encoding]
    width = np.dtype(dtype).itemsize
    obj = zstandard.ZstdCompressor(level=3).compressobj(size=width + count * (width + 1))
    parts = [obj.compress(struct.pack(fmt, count))]
    parts += [obj.compress(p.astype(dtype).tobytes()) for p, _ in chunks()]
    parts += [obj.compress(v.astype(np.uint8).tobytes()) for _, v in chunks()]
    return b"".join(parts) + obj.flush()


def reference(base: np.ndarray, encoding: str, chunks: Chunks) -> np.ndarray:
    """A sequential writer, from scratch: the entries in record order, a chunk at a time; later ones win."""
    out = base.copy()
    for pos, val in chunks():
        pos = pos.astype(np.int64)
        if encoding == "xor_sparse":
            out[pos] ^= val  # strictly increasing: no repeats
        elif np.all(pos[1:] >= pos[:-1]):  # sorted: the last entry of each run of equal positions wins
            last = np.append(pos[1:] != pos[:-1], True)
            out[pos[last]] = val[last]
        else:
            last, first_of_reversed = np.unique(pos[::-1], return_index=True)
            out[last] = val[::-1][first_of_reversed]
    return out


def pattern(count: int, position: Callable[[np.ndarray], np.ndarray], step: int = 1 << 22) -> Chunks:
    def chunks():
        for start in range(0, count, step):
            i = np.arange(start, min(count, start + step), dtype=np.int64)
            yield position(i), (i % 251 + 1).astype(np.uint8)
    return chunks


def apply_all(decoder, dest: np.ndarray, block: int) -> None:
    for offset in range(0, dest.size, block):
        decoder.apply(dest[offset:offset + block], offset)
    decoder.finish()


def traced(fn):
    """``fn()``'s result and the peak bytes it allocated (tracemalloc: Python objects and NumPy buffers)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        result = fn()
        return result, tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def validate_and_apply(encoding: str, frame: bytes, dest: np.ndarray, block: int = MiB):
    """What the patcher does: validate once (bucket_steps), then apply with the summary (_apply_tensor)."""
    summary = validate_frame(encoding, frame, dest.size, **CTX)
    decoder = make_decoder(encoding, frame, dest.size, block_size=block, validated=summary, **CTX)
    apply_all(decoder, dest, block)
    return decoder


# --- the reported case: a tiny frame, count = nbytes -----------------------------------------------------------


def test_overwrite_with_a_count_of_nbytes_applies_and_undoes_in_bounded_memory():
    n = 64 * MiB
    chunks = pattern(n, lambda i: (i // 3000) * 2999)  # sorted; runs of 3000 repeats straddle decoder chunks
    frame = streamed_frame("overwrite", n, chunks)
    assert len(frame) < MiB
    base = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    dest = base.copy()
    decoder, peak = traced(lambda: validate_and_apply("overwrite", frame, dest))
    assert peak < n // 2
    assert np.array_equal(dest, reference(base, "overwrite", chunks))
    _, peak = traced(lambda: [decoder.undo(dest[o:o + MiB], o) for o in reversed(range(0, n, MiB))])
    assert peak < n // 2
    assert np.array_equal(dest, base)


def test_xor_sparse_with_a_huge_count_streams():
    n = 32 * MiB
    chunks = pattern(n // 2, lambda i: 2 * i + 1)
    frame = streamed_frame("xor_sparse", n // 2, chunks)
    base = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    dest = base.copy()
    _, peak = traced(lambda: validate_and_apply("xor_sparse", frame, dest))
    assert peak < n // 2
    assert np.array_equal(dest, reference(base, "xor_sparse", chunks))


def test_unsorted_overwrite_over_the_cap_is_rejected_naming_the_tensor_in_bounded_memory():
    n = 64 * MiB
    frame = streamed_frame("overwrite", n, pattern(n, lambda i: i % 65536))  # periodic: unsorted, tiny frame
    assert len(frame) < MiB
    with pytest.raises(CodecError, match=f"cap of {n // 8}") as info:
        _, peak = traced(lambda: validate_frame("overwrite", frame, n, **CTX))
    assert (info.value.revision, info.value.file, info.value.tensor) == ("r9", "bucket-0.safetensors", "w")
    _, peak = traced(lambda: pytest.raises(CodecError, make_decoder, "overwrite", frame, n, block_size=MiB, **CTX))
    assert peak < 16 * MiB


def test_unsorted_overwrite_at_the_cap_costs_about_one_tensor():
    n = 16 * MiB
    count = sparse.unsorted_cap(n)
    rng = np.random.default_rng(3)
    positions = rng.integers(0, n, count, dtype=np.int64)  # unsorted, with repeats
    values = rng.integers(0, 256, count, dtype=np.uint8)
    frame = frame_of("overwrite", positions, values)
    base = rng.integers(0, 256, n, dtype=np.uint8)
    dest = base.copy()
    decoder, peak = traced(lambda: validate_and_apply("overwrite", frame, dest))
    assert peak < 10 * count + 12 * MiB  # documented: 9 bytes per entry decoded whole, 1 saved to undo, chunks
    assert np.array_equal(dest, reference(base, "overwrite", lambda: iter([(positions, values)])))
    for offset in range(0, n, MiB):
        decoder.undo(dest[offset:offset + MiB], offset)
    assert np.array_equal(dest, base)


def test_an_unsorted_record_within_the_cap_for_a_tiny_tensor_is_accepted():
    frame = frame_of("overwrite", [7, 0, 7, 3], [1, 2, 3, 4])  # the cap never goes below 65536 entries
    summary = validate_frame("overwrite", frame, 8, **CTX)
    assert summary == ValidatedFrame("overwrite", 8, len(frame), 4, ordered=False)


# --- repeated positions and undo, against a sequential writer ---------------------------------------------------


def sequential(base: np.ndarray, encoding: str, positions, values) -> np.ndarray:
    out = base.copy()
    for p, v in zip(positions, values):
        out[p] = v if encoding == "overwrite" else out[p] ^ v
    return out


@pytest.mark.parametrize("positions", [[1, 4, 4, 4], [4, 1, 4, 4], [4, 4, 1, 4]])
@pytest.mark.parametrize("chunk", [1, 2, 3, 1 << 18])
def test_repeated_overwrite_positions_the_last_entry_wins_and_undo_restores_the_base(monkeypatch, positions, chunk):
    monkeypatch.setattr(sparse, "CHUNK", chunk)
    values = [10, 20, 30, 40]
    base = np.arange(8, dtype=np.uint8) + 100
    dest = base.copy()
    decoder = make_decoder("overwrite", frame_of("overwrite", positions, values), 8, block_size=3, **CTX)
    apply_all(decoder, dest, 3)
    assert dest.tolist() == sequential(base, "overwrite", positions, values).tolist()
    assert dest[4] == 40
    for offset in (3, 0, 6):
        decoder.undo(dest[offset:offset + 3], offset)
    assert dest.tolist() == base.tolist()


records = st.integers(1, 60).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 255)), max_size=n),  # count <= nbytes
))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(record=records, encoding=st.sampled_from(["xor_sparse", "overwrite"]), sort=st.booleans(),
       block=st.integers(1, 9), chunk=st.integers(1, 7), validated=st.booleans(), stop=st.integers(0, 50),
       whole=st.booleans(), data=st.data())
def test_sparse_records_match_a_sequential_writer_and_undo_in_any_order(record, encoding, sort, block, chunk,
                                                                         validated, stop, whole, data):
    """Decoded whole (within the budget) or streamed, the record writes what a sequential writer does, and the
    budget is given back when the decoder closes."""
    budget = frames.WholeRecordBudget(frames.WHOLE_RECORDS.available if whole else 0)
    held_before = budget.available
    old_budget, frames.WHOLE_RECORDS = frames.WHOLE_RECORDS, budget
    n, entries = record
    if encoding == "xor_sparse":
        entries = sorted(dict(entries).items())  # strictly increasing positions
    elif sort:
        entries = sorted(entries, key=lambda e: e[0])  # stable: repeats keep record order
    positions, values = [p for p, _ in entries], [v for _, v in entries]
    frame = frame_of(encoding, positions, values)
    base = np.frombuffer(bytes(range(100, 100 + n)), dtype=np.uint8).copy()
    old, sparse.CHUNK = sparse.CHUNK, chunk
    try:
        summary = validate_frame(encoding, frame, n, **CTX) if validated else None
        decoder = make_decoder(encoding, frame, n, block_size=block, validated=summary, **CTX)
        dest = base.copy()
        offsets = list(range(0, n, block))
        applied = offsets[: max(1, stop % (len(offsets) + 1))]  # a pass that may stop early
        for offset in applied:
            decoder.apply(dest[offset:offset + block], offset)
        if applied == offsets:
            decoder.finish()
            assert dest.tolist() == sequential(base, encoding, positions, values).tolist()
        if encoding == "overwrite":
            for offset in data.draw(st.permutations(applied)):
                decoder.undo(dest[offset:offset + block], offset)
            assert dest.tolist() == base.tolist()
        decoder.close()
        assert budget.available == held_before
    finally:
        sparse.CHUNK, frames.WHOLE_RECORDS = old, old_budget


# --- rejections happen before any byte changes; validated once -------------------------------------------------

N = 64
REJECTED = {
    "xor_sparse": {
        "count says more than the record holds": struct.pack("<Q", 3) + struct.pack("<QQ", 1, 2) + b"\1\1",
        "record longer than its count": struct.pack("<Q", 1) + struct.pack("<Q", 1) + b"\1\1",
        "positions unsorted": struct.pack("<Q", 2) + struct.pack("<QQ", 5, 3) + b"\1\1",
        "position repeated": struct.pack("<Q", 2) + struct.pack("<QQ", 5, 5) + b"\1\1",
        "position at the end": struct.pack("<Q", 1) + struct.pack("<Q", N) + b"\1",
        "position far past the end": struct.pack("<Q", 1) + struct.pack("<Q", 2**63) + b"\1",
        "count larger than the tensor": struct.pack("<Q", 2**40),
        "shorter than its header": b"\1\0",
    },
    "overwrite": {
        "count says more than the record holds": struct.pack("<I", 5) + struct.pack("<I", 1) + b"\1",
        "record longer than its count": struct.pack("<I", 1) + struct.pack("<I", 1) + b"\1\1",
        "position at the end": struct.pack("<I", 1) + struct.pack("<I", N) + b"\1",
        "unsorted, position past the end": struct.pack("<I", 2) + struct.pack("<II", N + 9, 9) + b"\1\1",
        "count larger than the tensor": struct.pack("<I", 2**32 - 1) + struct.pack("<I", 1) + b"\1",
        "shorter than its header": b"\1",
    },
}


@pytest.mark.parametrize("encoding,case", [(e, c) for e, cases in REJECTED.items() for c in sorted(cases)])
@pytest.mark.parametrize("content_size", [True, False])
def test_spec_rejections_happen_before_any_byte_changes(monkeypatch, encoding, case, content_size):
    monkeypatch.setattr(sparse, "CHUNK", 1)  # a bad entry after good chunks is still found up front
    record = REJECTED[encoding][case]
    frame = zstandard.ZstdCompressor(write_content_size=content_size).compress(record)
    with pytest.raises(CodecError) as info:
        validate_frame(encoding, frame, N, **CTX)
    assert info.value.tensor == "w" and info.value.revision == "r9"
    with pytest.raises(CodecError):
        make_decoder(encoding, frame, N, block_size=16, **CTX)  # a decoder exists only for a valid frame


def test_a_bad_position_at_the_end_of_a_huge_record_is_rejected_up_front():
    n = 16 * MiB
    frame = streamed_frame("overwrite", n, pattern(n, lambda i: i + (i == n - 1)))
    with pytest.raises(CodecError, match=f"position {n} is outside"):
        traced(lambda: validate_frame("overwrite", frame, n, **CTX))


def test_a_validated_frame_is_not_validated_again(monkeypatch):
    base = np.random.default_rng(5).integers(0, 256, 50_000, dtype=np.uint8)
    target = base.copy()
    target[::7] ^= 0x5A
    for encoding in ("xor", "xor_sparse", "overwrite"):
        frame = encode_delta(base, target, encoding)
        summary = validate_frame(encoding, frame, base.size, **CTX)
        with monkeypatch.context() as m:
            for module, name in ((sparse, "validate_sparse"), (sparse, "inspect_frame"), (codec, "inspect_frame")):
                m.setattr(module, name, lambda *a, **k: pytest.fail("validated twice"))
            dest = base.copy()
            apply_all(make_decoder(encoding, frame, base.size, block_size=4096, validated=summary, **CTX), dest, 4096)
        assert np.array_equal(dest, target), encoding


@pytest.fixture(params=["whole", "streamed"])
def record_budget(request, monkeypatch):
    """Records decoded whole within the budget, or (no budget) streamed twice: both must behave alike."""
    if request.param == "streamed":
        monkeypatch.setattr(frames, "WHOLE_RECORDS", frames.WholeRecordBudget(0))
    return request.param


def test_a_record_within_the_budget_is_decompressed_once(monkeypatch):
    n = 4 * MiB
    chunks = pattern(n // 64, lambda i: 64 * i + 3)
    frame = streamed_frame("xor_sparse", n // 64, chunks)
    summary = validate_frame("xor_sparse", frame, n, **CTX)
    opened = []
    real = frames._Reader

    class Counting(real):
        def __init__(self, *a, **k):
            opened.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(frames, "_Reader", Counting)
    base = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    for budget, readers in ((0, 2), (frames.WHOLE_RECORDS.available, 1)):
        monkeypatch.setattr(frames, "WHOLE_RECORDS", frames.WholeRecordBudget(budget))
        opened.clear()
        dest = base.copy()
        apply_all(make_decoder("xor_sparse", frame, n, block_size=MiB, validated=summary, **CTX), dest, MiB)
        assert np.array_equal(dest, reference(base, "xor_sparse", chunks))
        assert len(opened) == readers  # whole: one decompression; streamed: positions, and again for the values
        assert frames.WHOLE_RECORDS.available == budget
    # a decoder abandoned half way (a failed apply never calls finish) gives the budget back when it goes
    abandoned = make_decoder("xor_sparse", frame, n, block_size=MiB, validated=summary, **CTX)
    abandoned.apply(base.copy()[:MiB], 0)
    assert frames.WHOLE_RECORDS.available < budget
    del abandoned
    assert frames.WHOLE_RECORDS.available == budget


@pytest.mark.parametrize("positions, summary_says", [
    ([9, 2, 30], {"ordered": True}),  # unsorted, validated as sorted
    ([2, 9, 70], {"ordered": True}),  # past the tensor
    ([9, 2, 70], {"ordered": False}),
    ([2, 9, 30], {"count": 2}),
])
def test_a_wrong_summary_gives_a_codec_error_and_never_writes_outside_the_block(positions, summary_says,
                                                                                 record_budget):
    frame = frame_of("overwrite", positions, [1, 2, 3])
    summary = ValidatedFrame(**{**dict(encoding="overwrite", nbytes=N, frame_size=len(frame), count=3,
                                       ordered=True), **summary_says})
    memory = np.full(3 * N, 0xEE, dtype=np.uint8)
    dest = memory[N:2 * N]
    with pytest.raises(CodecError):
        apply_all(make_decoder("overwrite", frame, N, block_size=16, validated=summary, **CTX), dest, 16)
    assert (memory[:N] == 0xEE).all() and (memory[2 * N:] == 0xEE).all()


def test_a_summary_of_another_frame_is_refused():
    frame = frame_of("overwrite", [1], [1])
    summary = validate_frame("overwrite", frame, N, **CTX)
    with pytest.raises(ValueError):
        make_decoder("overwrite", frame + b"", N + 1, block_size=16, validated=summary, **CTX)
