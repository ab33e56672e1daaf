"""Digests, checksums, safetensors headers and the delta codec (docs/format.md, sections 3 and 5)."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zlib

import blake3
import numpy as np
import pytest
import xxhash
import zstandard
from safetensors.numpy import load as st_load

from storage.format.checkpoint import CheckpointIndex, check_shard_name
from storage.format.codec import make_decoder, sparse_record
from storage.format.encoding import encode_delta
from storage.format.frames import inspect_frame
from storage.format.digests import checksum_bytes, checksum_ranges, format_digest, new_checksum, snapshot_digest
from storage.errors import CodecError, FormatError, ManifestError, SafetensorsError
from storage.format.safetensors import parse_bytes, read_header, write_safetensors

ENCODINGS = ("xor", "xor_sparse", "overwrite")
FORMATS = ("adler32", "xxh3-128", "blake3")


def _spec_checksum(fmt: str, data: bytes) -> str:
    if fmt == "adler32":
        return f"{zlib.adler32(data, 1) & 0xffffffff:08x}"
    if fmt == "xxh3-128":
        return xxhash.xxh3_128(data).hexdigest()
    return blake3.blake3(data).hexdigest()


@pytest.mark.parametrize("fmt", FORMATS)
def test_checksums_match_reference_implementations_incrementally(fmt):
    data = np.random.default_rng(1).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    h = new_checksum(fmt)
    for start in range(0, len(data), 4096):
        h.update(data[start:start + 4096])
    assert h.hexdigest() == _spec_checksum(fmt, data) == checksum_bytes(fmt, data)
    assert len(h.hexdigest()) == {"adler32": 8, "xxh3-128": 32, "blake3": 64}[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_checksums_of_ranges_match_the_reference_range_by_range(fmt):
    data = np.random.default_rng(2).integers(0, 256, 5_000, dtype=np.uint8).tobytes()
    offsets, sizes = [0, 0, 17, 4_000, 4_999], [0, 1, 300, 1_000, 1]
    assert checksum_ranges(fmt, memoryview(data), offsets, sizes) == \
        [_spec_checksum(fmt, data[o: o + n]) for o, n in zip(offsets, sizes)]


def test_adler32_is_zero_padded_hex():
    assert checksum_bytes("adler32", b"") == "00000001"


def test_unknown_checksum_format_names_it():
    with pytest.raises(FormatError, match="'md5'"):
        new_checksum("md5")


def test_digests_follow_the_spec_from_scratch():
    tensors = [("b", "BF16", (2, 3)), ("a", "F32", (4,))]
    entries = [{"name": "a", "dtype": "F32", "shape": [4]}, {"name": "b", "dtype": "BF16", "shape": [2, 3]}]
    expected_format = "sha256:" + hashlib.sha256(
        json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert format_digest(tensors) == expected_format
    sums = {"a": "0000abcd", "b": "12345678"}
    body = {"checksum_format": "adler32", "format_digest": expected_format, "tensors": sums}
    expected = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert snapshot_digest("adler32", expected_format, sums) == expected


# --- safetensors ------------------------------------------------------------------------------


def _st(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def test_writer_round_trips_through_safetensors_numpy():
    a = np.arange(12, dtype=np.uint8)
    b = np.linspace(0, 1, 5, dtype=np.float32)
    buf = io.BytesIO()
    write_safetensors(buf, [("x", "U8", a.shape, a), ("y", "F32", b.shape, b)], {"x": "00000001"})
    loaded = st_load(buf.getvalue())
    assert np.array_equal(loaded["x"], a) and np.array_equal(loaded["y"], b)


@pytest.mark.parametrize("blob, message", [
    (b"\x01\x00", "too short"),
    (_st({}, length=10**12), "exceeds"),
    (_st({}, length=64), "runs past the end"),
    (_st(b"\xff\xfe{}"), "UTF-8"),
    (_st(b"[1,2]"), "not an object"),
    (_st(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
         b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"x"), "duplicate"),
    (_st({"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}, b"x"), "unknown dtype"),
    (_st({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"x"), "non-negative"),
    (_st({"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 0]}}, b"xx"), "not in order"),
    (_st({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"xx"), "run past"),
    (_st({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
          "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"xyz"), "overlap"),
    (_st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"abcd"), "does not match shape"),
    (_st({"a": {"dtype": "U8", "shape": [2**62, 2**62], "data_offsets": [0, 1]}}, b"x"), "does not match shape"),
    (_st({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}}, b"x"), "exactly"),
    (_st({"__metadata__": {"a": 1}}), "strings"),
])
def test_strict_header_rejections_name_the_problem(blob, message):
    with pytest.raises(SafetensorsError, match=message) as info:
        parse_bytes(blob, file="bucket.safetensors", revision="r7")
    assert "bucket.safetensors" in str(info.value) and "r7" in str(info.value)


def test_header_length_is_checked_before_reading_the_header(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(SafetensorsError, match="exceeds"):
        read_header(path)


def test_checkpoint_index_locates_tensors_across_shards(tmp_path):
    from flows.synthetic import ModelShape, random_model, write_checkpoint

    tensors = random_model(ModelShape(vocab=64, hidden=16, intermediate=32, layers=1))
    write_checkpoint(tmp_path, tensors, shards=2)
    index = CheckpointIndex.open(tmp_path)
    assert set(index.tensors) == set(tensors)
    for name, array in tensors.items():
        loc = index.tensors[name]
        with open(tmp_path / loc.file, "rb") as fh:
            fh.seek(loc.offset)
            assert fh.read(loc.nbytes) == array.tobytes()
    assert index.format_digest() == format_digest((n, "BF16", a.shape) for n, a in tensors.items())


def test_checkpoint_index_rejects_a_shard_missing_a_mapped_tensor(tmp_path):
    from flows.synthetic import ModelShape, random_model, write_checkpoint

    write_checkpoint(tmp_path, random_model(ModelShape(vocab=64, hidden=16, intermediate=32, layers=1)))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="ghost.weight"):
        CheckpointIndex.open(tmp_path)


@pytest.mark.parametrize("name", ["/tmp/x.safetensors", "../x.safetensors", "a/b.safetensors", ".", "..",
                                  "x.bin", "", ".safetensors", "a\\b.safetensors"])
def test_unsafe_shard_names_are_rejected(name):
    with pytest.raises(ManifestError, match="unsafe shard file name"):
        check_shard_name(name, revision="r1", file="index.json", tensor="t")


# --- codec ------------------------------------------------------------------------------------


def _pair(n=300_000, changed=0.3, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n, dtype=np.uint8)
    target = base.copy()
    mask = rng.random(n) < changed
    target[mask] ^= rng.integers(1, 256, int(mask.sum()), dtype=np.uint8)
    return base, target


def _apply(encoding, frame, base, block=4096):
    dest = base.copy()
    decoder = make_decoder(encoding, frame, dest.size, block_size=block, revision="r1", file="b", tensor="t")
    for off in range(0, dest.size, block):
        decoder.apply(dest[off:off + block], off)
    decoder.finish()
    return dest


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("changed", [0.0, 0.001, 0.5, 1.0])
def test_every_encoding_round_trips(encoding, changed):
    base, target = _pair(changed=changed)
    frame = encode_delta(base, target, encoding)
    assert np.array_equal(_apply(encoding, frame, base), target)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_checksums_in_every_format(encoding, fmt):
    base, target = _pair(n=50_000, changed=0.05, seed=3)
    frame = encode_delta(base, target, encoding)
    dest = _apply(encoding, frame, base)
    assert checksum_bytes(fmt, dest) == _spec_checksum(fmt, target.tobytes())


@pytest.mark.parametrize("n", [3 * 2**20 + 5, 2**20, 4097])  # blocks of 1 MiB, a tail not a multiple of 8
@pytest.mark.parametrize("share", [0.0005, 0.02, 0.2, 0.9])  # few changed words, and most of them
@pytest.mark.parametrize("encoding", ["xor_sparse", "overwrite"])
def test_the_publishers_sparse_record_is_the_reference_record(n, share, encoding):
    """Whichever way the publisher finds the changed bytes (word by word when changes are rare), its record is
    byte for byte the one built from scratch (``sparse_record``: every position where base and target differ)."""
    rng = np.random.default_rng(int(share * 1e4) + n)
    base = rng.integers(0, 256, n, dtype=np.uint8)
    target = base.copy()
    hit = rng.random(n) < share
    target[hit] ^= rng.integers(1, 256, int(hit.sum()), dtype=np.uint8)
    target[-1] ^= 1  # the very last byte, in the tail
    frame = encode_delta(base, target, encoding, level=1)
    assert zstandard.ZstdDecompressor().decompress(frame) == sparse_record(base, target, encoding)


def test_sparse_records_have_the_spec_layout():
    base = np.zeros(10, dtype=np.uint8)
    target = base.copy()
    target[[2, 7]] = [5, 9]
    rec = sparse_record(base, target, "xor_sparse")
    assert rec == struct.pack("<Q", 2) + struct.pack("<QQ", 2, 7) + bytes([5, 9])
    rec = sparse_record(base, target, "overwrite")
    assert rec == struct.pack("<I", 2) + struct.pack("<II", 2, 7) + bytes([5, 9])


def test_overwrite_later_entries_win_for_repeated_positions():
    record = struct.pack("<I", 3) + struct.pack("<III", 4, 1, 4) + bytes([10, 20, 30])
    frame = zstandard.ZstdCompressor().compress(record)
    out = _apply("overwrite", frame, np.zeros(8, dtype=np.uint8), block=3)
    assert out.tolist() == [0, 20, 0, 0, 30, 0, 0, 0]


def _frame(data: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(**kw).compress(data)


@pytest.mark.parametrize("make, message", [
    (lambda: _frame(b"\x00" * 99), "declares 99"),
    (lambda: _frame(b"\x00" * 101), "declares 101"),
    (lambda: _frame(b"\x00" * 100)[:-3], "truncated"),
    (lambda: _frame(b"\x00" * 100) + b"junk", "trailing"),
    (lambda: b"not a zstd frame at all", "magic"),
    (lambda: _frame(b"\x00" * 100) + _frame(b"\x00"), "trailing"),
])
def test_bad_dense_frames_are_rejected_before_decoding(make, message):
    with pytest.raises(CodecError, match=message) as info:
        make_decoder("xor", make(), 100, block_size=64, revision="r3", file="bucket-0.safetensors", tensor="w")
    assert "r3" in str(info.value) and "bucket-0.safetensors" in str(info.value) and "'w'" in str(info.value)


def test_decompression_bomb_without_declared_size_is_stopped_at_the_tensor_size():
    bomb = _frame(b"\x00" * (64 * 2**20), write_content_size=False)
    info = inspect_frame(bomb)
    assert info.content_size is None and info.min_output > 4096
    with pytest.raises(CodecError, match="at least"):
        make_decoder("xor", bomb, 4096, block_size=1024)


def test_dense_frame_without_size_that_is_too_short_fails_while_applying():
    frame = _frame(bytes(range(250)) * 40, write_content_size=False)  # a compressed block: size unknown
    assert inspect_frame(frame).max_output >= 12_000
    base = np.zeros(12_000, dtype=np.uint8)
    with pytest.raises(CodecError, match="only 10000 bytes"):
        decoder = make_decoder("xor", frame, 12_000, block_size=512)
        for off in range(0, 12_000, 512):
            decoder.apply(base[off:off + 512], off)


@pytest.mark.parametrize("record, nbytes, message", [
    (struct.pack("<Q", 2) + struct.pack("<QQ", 1, 5) + b"\x01", 8, "ends after"),
    (struct.pack("<Q", 1) + struct.pack("<Q", 1) + b"\x01\x02", 8, "longer than its count"),
    (struct.pack("<Q", 2) + struct.pack("<QQ", 5, 1) + b"\x01\x01", 8, "strictly increasing"),
    (struct.pack("<Q", 2) + struct.pack("<QQ", 3, 3) + b"\x01\x01", 8, "strictly increasing"),
    (struct.pack("<Q", 1) + struct.pack("<Q", 8) + b"\x01", 8, "outside"),
    (struct.pack("<Q", 2**40), 8, "claims"),
])
def test_bad_xor_sparse_records_are_rejected_before_any_byte_changes(record, nbytes, message):
    frame = _frame(record, write_content_size=False)
    with pytest.raises(CodecError, match=message):
        make_decoder("xor_sparse", frame, nbytes, block_size=4)


@pytest.mark.parametrize("record, message", [
    (struct.pack("<I", 2) + struct.pack("<II", 1, 9) + b"\x01\x01", "outside"),
    (struct.pack("<I", 1) + struct.pack("<I", 1), "ends after|at most 8 bytes"),
    (struct.pack("<I", 1) + struct.pack("<I", 1) + b"\x01\x00", "longer|at least 10 bytes"),
])
def test_bad_overwrite_records_are_rejected(record, message):
    with pytest.raises(CodecError, match=message):
        make_decoder("overwrite", _frame(record, write_content_size=False), 8, block_size=4)


def test_sparse_record_whose_declared_size_disagrees_with_its_count_is_rejected():
    record = struct.pack("<Q", 1) + struct.pack("<Q", 1) + b"\x01"
    frame = _frame(record + b"\x00")  # declares 18 bytes, count implies 17
    with pytest.raises(CodecError, match="should be 17 bytes"):
        make_decoder("xor_sparse", frame, 8, block_size=4)
