"""The opt-in ``xor_gaps`` encoding (``storage.format.gaps``): its exact layout, round trips, and strict rejections.

A record is a u64 count, ``count`` minimal LEB128 gaps (gap_i = pos_i - pos_{i-1} - 1,
pos_{-1} = -1) and ``count`` XOR values. Every rejection happens in validation, before
any byte of the tensor changes, and names the revision, file and tensor; the
big cases check with ``tracemalloc`` that memory stays bounded whatever the count.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import storage.format.codec as codec
import storage.format.gaps as gaps
import storage.format.sparse as sparse
from storage.format.codec import make_decoder, sparse_record, validate_frame
from storage.format.encoding import Encoder, Setting, encode_delta
from storage.errors import CodecError
from storage.format.gaps import gaps_record, varints
from tests.unit.format.test_codec_memory import traced

MiB = 2**20
CTX = {"revision": "r9", "file": "bucket-0.safetensors", "tensor": "w"}


def leb128(value: int) -> bytes:
    """A from-scratch minimal LEB128 encoder (the reference the vectorized one is checked against)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def record(positions, values, *, count=None, extra=b"") -> bytes:
    gap_bytes, previous = b"", -1
    for p in positions:
        gap_bytes += leb128(p - previous - 1)
        previous = p
    n = len(positions) if count is None else count
    return struct.pack("<Q", n) + gap_bytes + bytes(values) + extra


def frame(data: bytes, *, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(data)


def apply_all(decoder, dest: np.ndarray, block: int) -> None:
    for offset in range(0, dest.size, block):
        decoder.apply(dest[offset:offset + block], offset)
    decoder.finish()


# --- the layout ---------------------------------------------------------------------------------------------------


def test_the_record_has_the_documented_layout():
    base = np.zeros(20_000, dtype=np.uint8)
    target = base.copy()
    target[[0, 1, 130, 19_999]] = [1, 3, 7, 0xFF]
    rec = sparse_record(base, target, "xor_gaps")
    # gaps 0, 0, 128 (two bytes: 0x80 0x01), 19868 (0x9c 0x9b 0x01)
    assert rec == (struct.pack("<Q", 4) + bytes([0x00, 0x00, 0x80, 0x01, 0x9C, 0x9B, 0x01])
                   + bytes([1, 3, 7, 0xFF]))
    assert rec == record([0, 1, 130, 19_999], [1, 3, 7, 0xFF])
    empty = sparse_record(base, base, "xor_gaps")
    assert empty == struct.pack("<Q", 0)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.integers(0, 2**62), max_size=40))
def test_varints_are_minimal_leb128(values):
    got = varints(np.array(values, dtype=np.uint64)).tobytes()
    assert got == b"".join(leb128(v) for v in values)


@pytest.mark.parametrize("changed", [0.0, 0.001, 0.02, 0.5, 1.0])
@pytest.mark.parametrize("block", [1, 4096, MiB])
def test_round_trips_against_a_sequential_writer(changed, block):
    rng = np.random.default_rng(int(changed * 1000) + block)
    n = 70_001
    base = rng.integers(0, 256, n, dtype=np.uint8)
    target = base.copy()
    mask = rng.random(n) < changed
    target[mask] ^= rng.integers(1, 256, int(mask.sum()), dtype=np.uint8)
    for level in (1, 3):
        fr = encode_delta(base, target, "xor_gaps", level=level)
        assert zstandard.get_frame_parameters(fr).content_size == 8 + len(varints(
            np.diff(np.flatnonzero(mask), prepend=-1) - 1)) + int(mask.sum())
        dest = base.copy()
        apply_all(make_decoder("xor_gaps", fr, n, block_size=block, **CTX), dest, block if block > 1 else 997)
        assert np.array_equal(dest, target)


def test_the_publisher_encoder_matches_the_whole_record_across_blocks_and_batches(monkeypatch):
    import storage.format.encoding as encoding

    monkeypatch.setattr(encoding, "GAP_BATCH", 7)  # many batches, each continuing the previous one's gaps
    rng = np.random.default_rng(4)
    base = rng.integers(0, 256, 300_000, dtype=np.uint8)
    target = base.copy()
    target[rng.choice(base.size, 5_000, replace=False)] ^= 0x11
    target[[0, base.size - 1]] ^= 0x22
    encoded = Encoder(block=4096).encode(base, target, Setting("xor_gaps", 3), checksum_format="adler32")
    assert zstandard.ZstdDecompressor().decompress(encoded.frame) == sparse_record(base, target, "xor_gaps")
    assert encoded.changed_bytes == int(np.count_nonzero(base != target))


def test_a_validated_frame_is_not_validated_again(monkeypatch):
    base = np.random.default_rng(5).integers(0, 256, 50_000, dtype=np.uint8)
    target = base.copy()
    target[::7] ^= 0x5A
    fr = encode_delta(base, target, "xor_gaps")
    summary = validate_frame("xor_gaps", fr, base.size, **CTX)
    assert (summary.count, summary.positions_bytes) == (len(range(0, base.size, 7)), summary.positions_bytes)
    with monkeypatch.context() as m:
        for module, name in ((gaps, "validate_gaps"), (gaps, "inspect_frame"), (codec, "validate_gaps")):
            m.setattr(module, name, lambda *a, **k: pytest.fail("validated twice"))
        dest = base.copy()
        apply_all(make_decoder("xor_gaps", fr, base.size, block_size=4096, validated=summary, **CTX), dest, 4096)
    assert np.array_equal(dest, target)


# --- rejections: all before any byte changes -------------------------------------------------------------------

N = 300
REJECTED = {
    "count larger than the tensor": (struct.pack("<Q", N + 1) + bytes(N + 1) * 2, "claims"),
    "count says more than the record holds": (record([1, 2], [1, 1], count=3), "ends"),
    "record longer than its count": (record([1], [1], extra=b"\x01"), "longer than its count"),
    "position at the tensor's end": (record([N], [1]), "outside"),
    "gaps run past the end": (record([100, 200, N + 50], [1, 1, 1]), "outside"),
    "position far past the end": (record([2**62], [1]), "longer than|outside"),
    "varint of ten bytes": (struct.pack("<Q", 1) + b"\x80" * 9 + b"\x01" + b"\x01", "longer than"),
    "non-minimal varint": (struct.pack("<Q", 1) + b"\x85\x00" + b"\x01", "not minimal"),
    "ends inside a varint": (struct.pack("<Q", 1) + b"\x85", "ends|at least"),
    "shorter than its header": (b"\x01\x00", "ends after|at least"),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
@pytest.mark.parametrize("content_size", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 1 << 18])
def test_spec_rejections_happen_before_any_byte_changes(monkeypatch, case, content_size, chunk):
    monkeypatch.setattr(gaps, "GAP_CHUNK_BYTES", chunk)  # a bad varint after good chunks is still found up front
    data, message = REJECTED[case]
    fr = frame(data, content_size=content_size)
    with pytest.raises(CodecError, match=message + ("|declares" if content_size else "")) as info:
        validate_frame("xor_gaps", fr, N, **CTX)
    assert (info.value.revision, info.value.file, info.value.tensor) == ("r9", "bucket-0.safetensors", "w")
    with pytest.raises(CodecError):
        make_decoder("xor_gaps", fr, N, block_size=16, **CTX)  # a decoder exists only for a valid frame


def test_a_declared_size_that_disagrees_with_the_record_is_rejected():
    data = record([3, 9], [1, 2])
    with pytest.raises(CodecError, match="declares"):
        validate_frame("xor_gaps", frame(data + b"\x00"), N, **CTX)  # one byte more than the record
    with pytest.raises(CodecError, match="declares"):
        validate_frame("xor_gaps", zstandard.ZstdCompressor().compress(struct.pack("<Q", 5) + b"\x00\x01"), N, **CTX)


def test_the_last_valid_position_is_accepted_and_one_past_it_is_not():
    ok = frame(record([0, N - 1], [1, 2]))
    dest = np.zeros(N, dtype=np.uint8)
    apply_all(make_decoder("xor_gaps", ok, N, block_size=64, **CTX), dest, 64)
    assert dest[0] == 1 and dest[N - 1] == 2 and dest.sum() == 3
    with pytest.raises(CodecError, match="outside"):
        validate_frame("xor_gaps", ok, N - 1, **CTX)


def test_a_summary_that_does_not_match_the_frame_gives_a_codec_error_while_applying():
    fr = frame(record([5, 9], [1, 2]))
    summary = validate_frame("xor_gaps", fr, N, **CTX)
    from dataclasses import replace

    memory = np.full(3 * N, 0xEE, dtype=np.uint8)
    dest = memory[N:2 * N]
    for wrong in (replace(summary, count=1), replace(summary, positions_bytes=1)):
        with pytest.raises(CodecError):
            apply_all(make_decoder("xor_gaps", fr, N, block_size=16, validated=wrong, **CTX), dest, 16)
    assert (memory[:N] == 0xEE).all() and (memory[2 * N:] == 0xEE).all()


# --- bounded memory ---------------------------------------------------------------------------------------------


def test_a_huge_count_validates_and_applies_in_bounded_memory():
    n = 64 * MiB  # count = nbytes: every byte changes; the frame is a few KiB
    obj = zstandard.ZstdCompressor(level=3).compressobj(size=8 + 2 * n)
    parts = [obj.compress(struct.pack("<Q", n))]
    zeros, ones = bytes(4 * MiB), b"\x01" * (4 * MiB)
    parts += [obj.compress(zeros) for _ in range(n // len(zeros))]
    parts += [obj.compress(ones) for _ in range(n // len(ones))]
    fr = b"".join(parts) + obj.flush()
    assert len(fr) < MiB
    summary, peak = traced(lambda: validate_frame("xor_gaps", fr, n, **CTX))
    assert summary.count == n and summary.positions_bytes == n
    assert peak < 24 * MiB, peak
    dest = np.zeros(n, dtype=np.uint8)
    _, peak = traced(lambda: apply_all(make_decoder("xor_gaps", fr, n, block_size=MiB, validated=summary, **CTX),
                                       dest, MiB))
    assert peak < 48 * MiB, peak
    assert int(dest.min()) == 1 == int(dest.max())
    with pytest.raises(CodecError, match="claims|outside"):
        traced(lambda: validate_frame("xor_gaps", fr, n - 1, **CTX))


def test_the_sparse_chunk_size_does_not_change_the_result(monkeypatch):
    rng = np.random.default_rng(9)
    base = rng.integers(0, 256, 100_000, dtype=np.uint8)
    target = base.copy()
    target[rng.choice(base.size, 3_000, replace=False)] ^= 1
    fr = gaps_record(np.flatnonzero(base != target), (base ^ target)[base != target])
    fr = frame(fr)
    for chunk in (1, 2, 5, 1 << 18):
        monkeypatch.setattr(gaps, "GAP_CHUNK_BYTES", chunk)
        monkeypatch.setattr(sparse, "CHUNK", chunk)
        dest = base.copy()
        apply_all(make_decoder("xor_gaps", fr, base.size, block_size=4099, **CTX), dest, 4099)
        assert np.array_equal(dest, target), chunk
