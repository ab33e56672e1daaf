"""Property-based fuzzing of every parser of hostile bytes: JSON documents, catalog records, index manifests,
safetensors headers and sparse delta records.

Each parser holds the same two properties for any input: it returns a valid result or raises the typed
``RefitError`` of its kind naming the input (never another exception), and its peak memory (tracemalloc)
stays bounded for inputs up to the sizes drawn here. A valid result is also checked for what it must mean
(the JSON value ``json.loads`` gives; the bytes a sparse record describes).

``REFIT_FUZZ=long python -m pytest tests/unit/format/test_fuzz_parsers.py`` runs many more examples
(docs/development.md); the default keeps the module to about a minute.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tracemalloc

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.jsonio import bounded_json
from storage.jsonio.bounded_json import RECORD, JsonLimits, load_json
from storage.catalog.manifests import parse_manifest
from storage.catalog.records import Revision, parse_revision
from storage.errors import CatalogError, CodecError, FormatError, ManifestError, RefitError, SafetensorsError
from storage.format.codec import make_decoder
from storage.format.safetensors import parse_bytes

MiB = 2**20
LONG = os.environ.get("REFIT_FUZZ", "") == "long"  # not CANONICAL_REFIT_*: conftest clears those
FUZZ = settings(max_examples=5000 if LONG else 400, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BOUND = 8 * MiB  # peak memory any parse of the inputs drawn here may take

DIGEST = "sha256:" + "ab" * 32
RECORD_FIELDS = {
    "schema": "canonical-refit.revision.v1", "model": "org/m", "version": "r2", "sequence": 2,
    "payload_format": "xor_delta", "base_version": "r1", "base_digest": DIGEST, "target_digest": DIGEST,
    "format_digest": DIGEST, "checksum_format": "xxh3-128",
    "uri": "s3://bucket/r2/delta.safetensors.index.json", "created_at_unix_ms": 1,
}
INDEX_DOC = {"metadata": {"version": "r2", "base_version": "r1", "compression_format": "zstd",
                          "delta_encoding": "xor", "checksum_format": "xxh3-128"},
             "weight_map": {"model.a": "bucket-00000.safetensors", "model.b": "bucket-00001.safetensors"}}
HEADER_DOC = {"__metadata__": {"model.a": "xxh3-128:" + "0" * 32},
              "model.a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
              "model.b": {"dtype": "F16", "shape": [2, 1], "data_offsets": [4, 8]}}

# --- what is drawn -------------------------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=12), st.sampled_from(["r1", "r2", "xor", "zstd", "U8", "org/m", DIGEST]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=20)
TOKENS = [b"[", b"]", b"{", b"}", b",", b":", b'"', b"\\", b"\\u", b"d800", b"NaN", b"Infinity", b"1e999",
          b"\xef\xbb\xbf", b"\xff", b"\xed\xa0\x80", b"\x00", b" ", b"null", b"0", b"-", b'"a"']


@st.composite
def mutated(draw, doc) -> bytes:
    """``doc`` as JSON, then a few byte-level edits: hostile tokens inserted, bytes cut, runs repeated."""
    raw = bytearray(json.dumps(doc).encode())
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(raw)))
        action = draw(st.sampled_from(["insert", "cut", "repeat", "nest"]))
        if action == "insert":
            raw[at:at] = draw(st.sampled_from(TOKENS))
        elif action == "cut":
            del raw[at:at + draw(st.integers(1, 8))]
        elif action == "repeat":
            raw[at:at] = bytes(raw[at:at + draw(st.integers(1, 4))]) * draw(st.integers(1, 2000))
        else:
            depth = draw(st.integers(1, 3000))
            raw[at:at] = b"[" * depth + b"]" * depth * draw(st.sampled_from([0, 1]))
    return bytes(raw)


@st.composite
def edited(draw, doc) -> bytes:
    """``doc`` with a few of its fields replaced by any JSON value."""
    out = dict(doc)
    for key in draw(st.lists(st.sampled_from(sorted(doc)), max_size=3)):
        out[key] = draw(json_values)
    return json.dumps(out).encode()


def documents(doc):
    """Bytes that are ``doc`` edited as JSON, or ``doc``'s bytes mutated, or any JSON, or any bytes at all."""
    return st.one_of(edited(doc), mutated(doc), st.binary(max_size=256), json_values.map(lambda v: json.dumps(v).encode()))


def within_bound(parse, raw):
    """(result or exception, peak bytes) of ``parse(raw)``; anything but a ``RefitError`` fails the test."""
    tracemalloc.start()
    try:
        try:
            out = parse(raw)
        except RefitError as exc:
            out = exc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BOUND, f"peak {peak:,} bytes for {len(raw):,} input bytes"
    return out


# --- the JSON parser ------------------------------------------------------------------------------------------------


@FUZZ
@given(raw=st.one_of(mutated({"a": [1, {"b": "c"}], "d": None}), st.binary(max_size=512),
                     json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode())))
def test_load_json_gives_json_loads_value_or_a_format_error(raw):
    out = within_bound(lambda r: load_json(r, RECORD, file="x.json"), raw)
    if isinstance(out, RefitError):
        assert isinstance(out, FormatError) and out.file == "x.json"
        return
    text = raw.decode("utf-8")  # accepted: strict UTF-8 ...
    assert not raw.startswith(b"\xef\xbb\xbf")
    assert json.loads(text) == out  # ... and exactly what json.loads reads
    floats = []
    json.loads(text, parse_float=lambda s: floats.append(float(s)) or 0.0,
               object_pairs_hook=lambda pairs: _no_repeats(pairs))
    assert all(math.isfinite(f) for f in floats)


def _no_repeats(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys))
    return dict(pairs)


def _reference_structure(data: bytes) -> tuple[int, int]:
    depth = deepest = 0
    elements, inside, run = 1, False, 0
    for byte in data:
        ch = chr(byte)
        if ch == '"' and run % 2 == 0:
            inside = not inside
        elif not inside:
            if ch in "[{":
                depth += 1
                deepest = max(deepest, depth)
                elements += 1
            elif ch in "]}":
                depth -= 1
            elif ch in ",:":
                elements += 1
        run = run + 1 if ch == "\\" else 0
    return deepest, elements


@FUZZ
@given(raw=st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b",", b":", b'"', b"\\", b"a"]), max_size=200)
       .map(b"".join), chunk=st.sampled_from([1, 2, 3, 7, 64]))
def test_the_structure_scan_counts_what_json_would_build(raw, chunk):
    """The chunked NumPy scan against a byte-at-a-time reading of JSON's string rules, at any chunk size."""
    saved, bounded_json._CHUNK = bounded_json._CHUNK, chunk
    try:
        assert bounded_json._scan(raw, 1 << 30, 1 << 30) == _reference_structure(raw)
    finally:
        bounded_json._CHUNK = saved


@FUZZ
@given(depth=st.integers(0, 200), width=st.integers(0, 50), opener=st.sampled_from([b"[", b'{"k":']))
def test_depth_and_elements_are_refused_before_parsing_or_parsed(depth, width, opener):
    limits = JsonLimits("test", MiB, 16, 100, free_elements=100)
    closer = b"]" if opener == b"[" else b"}"
    raw = opener * depth + b"[" + b"0," * width + b"0]" + closer * depth
    out = within_bound(lambda r: load_json(r, limits), raw)
    elements = 2 + depth + width + (depth if opener != b"[" else 0)  # the top value, the brackets, , and :
    if depth + 1 > 16 or elements > 100:
        assert isinstance(out, FormatError), out
    else:
        assert out == json.loads(raw)


# --- catalog records, index manifests, safetensors headers -------------------------------------------------------


@FUZZ
@given(raw=documents(RECORD_FIELDS))
def test_records_parse_or_give_a_catalog_error(raw):
    out = within_bound(lambda r: parse_revision(r, version="r2", model="org/m", file="s3://bucket/c/r2.json"), raw)
    if isinstance(out, RefitError):
        assert isinstance(out, CatalogError) and out.file == "s3://bucket/c/r2.json" and out.revision == "r2"
    else:
        assert isinstance(out, Revision) and out.version == "r2" and out.model == "org/m"


@FUZZ
@given(raw=documents(INDEX_DOC))
def test_indexes_parse_or_give_a_manifest_error(raw):
    record = parse_revision(RECORD_FIELDS, version="r2", model="org/m", file="r2.json")
    out = within_bound(lambda r: parse_manifest(r, record), raw)
    if isinstance(out, RefitError):
        assert isinstance(out, ManifestError) and out.file == record.uri and out.revision == "r2"
    else:
        assert all(isinstance(f, str) and "/" not in f and f.endswith(".safetensors") for f in out.files)
        assert out.delta_encoding in ("xor", "xor_sparse", "overwrite", "xor_gaps")


@FUZZ
@given(header=documents(HEADER_DOC), data=st.binary(max_size=16), pad=st.integers(0, 7))
def test_headers_parse_or_give_a_safetensors_error(header, data, pad):
    header += b" " * pad
    blob = struct.pack("<Q", len(header)) + header + data
    out = within_bound(lambda r: parse_bytes(r, file="s3://bucket/r2/b.safetensors", revision="r2"), blob)
    if isinstance(out, RefitError):
        assert isinstance(out, SafetensorsError) and out.file == "s3://bucket/r2/b.safetensors"
        return
    for info in out.tensors.values():  # every tensor inside the data section, none overlapping
        assert 0 <= info.start <= info.end <= out.data_size
    spans = sorted((t.start, t.end) for t in out.tensors.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


# --- sparse records -------------------------------------------------------------------------------------------------


@st.composite
def sparse_records(draw):
    """(encoding, tensor size, frame): a record close to valid (its count, positions and values drawn, each
    sometimes wrong), zstd-compressed with or without its content size, sometimes with its bytes cut."""
    encoding = draw(st.sampled_from(["xor_sparse", "overwrite"]))
    nbytes = draw(st.integers(0, 4096))
    positions = draw(st.lists(st.integers(0, nbytes + 2), max_size=64))
    if draw(st.booleans()):
        positions = sorted(set(positions)) if encoding == "xor_sparse" else sorted(positions)
    fmt, width = ("<Q", "<u8") if encoding == "xor_sparse" else ("<I", "<u4")
    count = len(positions) + draw(st.sampled_from([0, 0, 0, -1, 1, 2**31]))
    values = draw(st.binary(min_size=len(positions), max_size=len(positions)))
    record = struct.pack(fmt, max(0, min(count, 2**32 - 1))) + np.array(positions, dtype=width).tobytes() + values
    record += draw(st.sampled_from([b"", b"", b"\x00", b"\x01" * 9]))
    frame = zstandard.ZstdCompressor(write_content_size=draw(st.booleans())).compress(record)
    if draw(st.booleans()):
        frame = frame[: draw(st.integers(0, len(frame)))]
    return encoding, nbytes, frame


@FUZZ
@given(case=sparse_records(), block=st.sampled_from([1, 7, 1024, 65536]))
def test_sparse_records_apply_exactly_or_give_a_codec_error(case, block):
    encoding, nbytes, frame = case
    base = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    tensor = base.copy()

    def apply(frame):
        decoder = make_decoder(encoding, frame, nbytes, block_size=block, revision="r2", file="b", tensor="t")
        try:
            for offset in range(0, nbytes, block):
                decoder.apply(tensor[offset:offset + block], offset)
            decoder.finish()
        finally:
            decoder.close()
        return tensor

    out = within_bound(apply, frame)
    if isinstance(out, RefitError):
        assert isinstance(out, CodecError) and (out.revision, out.file, out.tensor) == ("r2", "b", "t")
        return
    record = zstandard.ZstdDecompressor().decompress(frame, max_output_size=1 << 20)
    fmt, width = ("<Q", "<u8") if encoding == "xor_sparse" else ("<I", "<u4")
    (count,) = struct.unpack_from(fmt, record)
    head = struct.calcsize(fmt)
    positions = np.frombuffer(record, dtype=width, count=count, offset=head).astype(np.int64)
    values = np.frombuffer(record, dtype=np.uint8, count=count, offset=head + count * np.dtype(width).itemsize)
    expected = base.copy()
    for position, value in zip(positions.tolist(), values.tolist()):  # in record order: the later entry wins
        expected[position] = expected[position] ^ value if encoding == "xor_sparse" else value
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("encoding", ["xor_sparse", "overwrite"])
def test_a_fuzzed_sparse_record_is_checked_for_exact_content(encoding):
    """The property's oracle is not vacuous: a valid record is applied, and its exact bytes are compared."""
    nbytes, positions, values = 16, [1, 5, 9], b"\x07\x08\x09"
    fmt, width = ("<Q", "<u8") if encoding == "xor_sparse" else ("<I", "<u4")
    record = struct.pack(fmt, 3) + np.array(positions, dtype=width).tobytes() + values
    frame = zstandard.ZstdCompressor().compress(record)
    tensor = np.zeros(nbytes, dtype=np.uint8)
    decoder = make_decoder(encoding, frame, nbytes, block_size=nbytes, revision="r", file="f", tensor="t")
    decoder.apply(tensor, 0)
    decoder.finish()
    decoder.close()
    assert tensor.tolist() == [0, 7, 0, 0, 0, 8, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0]
