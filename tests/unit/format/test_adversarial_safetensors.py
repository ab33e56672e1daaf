"""Hostile safetensors headers: as delta buckets thrown at a store that runs r1, and fuzzed.

A bucket is header-checked right after it is downloaded, before anything is
planned; every case must end in ``SafetensorsError`` (or the ``ManifestError``
of a bucket that disagrees with its index) naming the revision and the file,
with the store bit-for-bit unchanged and memory bounded, however large the
header claims to be.
"""

from __future__ import annotations

import json
import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.support.adversarial_support as av
from storage.errors import ManifestError, SafetensorsError
from storage.format.safetensors import DTYPE_SIZES, parse_bytes

MiB = 2**20


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    return av.hostile_world(tmp_path_factory)


def blob(header, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def entry(dtype="U8", shape=(4,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


T = "model.embed_tokens.weight"
HEADERS = {
    "shorter than the length prefix": b"\x01\x02\x03",
    "header length past the end": blob({T: entry()}, b"abcd", length=1000),
    "header length absurdly large": blob(b"{}", length=2**63),
    "header length just over the 100 MiB limit": blob(b"{}", length=100 * MiB + 1),
    "header not UTF-8": blob(b"\xff\xfe\xfd{}    "),
    "header not JSON": blob(b"{not json"),
    "header a JSON list": blob(b"[1, 2, 3]"),
    "duplicate tensor names": blob(b'{"a": %s, "a": %s}' % (json.dumps(entry()).encode(), json.dumps(entry()).encode()),
                                   b"abcd"),
    "offsets past the end": blob({T: entry(offsets=(0, 4))}, b"ab"),
    "offsets reversed": blob({T: entry(offsets=(4, 0))}, b"abcd"),
    "offsets overlapping": blob({T: entry(), "x": entry(offsets=(2, 6))}, b"abcdef"),
    "offsets not integers": blob({T: entry(offsets=(0.0, 4.0))}, b"abcd"),
    "offsets of three numbers": blob({T: entry(offsets=(0, 2, 4))}, b"abcd"),
    "unknown dtype": blob({T: entry(dtype="Q9")}, b"abcd"),
    "shape whose product overflows 64 bits": blob({T: entry(shape=(2**62, 2**62))}, b"abcd"),
    "negative dimension": blob({T: entry(shape=(-4,))}, b"abcd"),
    "dimension as a string": blob({T: entry(shape=("4",))}, b"abcd"),
    "size disagrees with shape": blob({T: entry(shape=(5,))}, b"abcd"),
    "extra key in a tensor entry": blob({T: entry() | {"offset": 0}}, b"abcd"),
    "metadata with a number": blob({"__metadata__": {T: 1}, T: entry()}, b"abcd"),
    "empty tensor name": blob({"": entry()}, b"abcd"),
}
BUCKET_SHAPE = {
    "delta tensor of dtype BF16": blob({"__metadata__": {T: "00000001"}, T: entry("BF16", (2,))}, b"abcd"),
    "delta tensor of two dimensions": blob({"__metadata__": {T: "00000001"}, T: entry(shape=(2, 2))}, b"abcd"),
    "tensor the index does not map here": blob({"__metadata__": {"x": "00000001"}, "x": entry()}, b"abcd"),
    "no __metadata__": blob({T: entry()}, b"abcd"),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_bad_bucket_headers_are_rejected_with_the_store_unchanged(world, case):
    bucket = world.bucket_names("d2")[0]
    version = world.new("d2", files={bucket: HEADERS[case]})
    av.assert_rejected(world.refit(version), SafetensorsError, file=bucket)


@pytest.mark.parametrize("case", sorted(BUCKET_SHAPE))
def test_buckets_that_break_the_delta_layout_are_rejected(world, case):
    bucket = world.bucket_names("d2")[0]
    version = world.new("d2", files={bucket: BUCKET_SHAPE[case]})
    av.assert_rejected(world.refit(version), ManifestError, file=bucket)


# --- fuzzing ----------------------------------------------------------------------------------------------------

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                        st.text(max_size=8))
entries = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from(sorted(DTYPE_SIZES)), json_scalar),
     "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), json_scalar),
     "data_offsets": st.one_of(st.lists(st.integers(-8, 4096), min_size=0, max_size=3), json_scalar)},
    optional={"extra": json_scalar},
)
headers = st.dictionaries(st.text(max_size=6), st.one_of(entries, json_scalar), max_size=5)


@settings(max_examples=400, deadline=None)
@given(header=headers, data=st.binary(max_size=512), length_delta=st.integers(-16, 16) | st.just(0))
def test_fuzzed_headers_parse_or_give_a_safetensors_error(header, data, length_delta):
    raw = json.dumps(header).encode()
    file = struct.pack("<Q", max(0, len(raw) + length_delta)) + raw + data
    tracemalloc.start()
    try:
        parsed = parse_bytes(file, file="fuzz.safetensors", revision="h")
    except SafetensorsError as exc:
        assert (exc.revision, exc.file) == ("h", "fuzz.safetensors")
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 4 * MiB
    spans = sorted((t.start, t.end) for t in parsed.tensors.values())
    assert all(0 <= s <= e <= parsed.data_size for s, e in spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for t in parsed.tensors.values():
        count = 1
        for d in t.shape:
            count *= d
        assert count * DTYPE_SIZES[t.dtype] == t.nbytes


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_parse_or_give_a_safetensors_error(raw):
    try:
        parse_bytes(raw, file="f", revision="h")
    except SafetensorsError:
        pass
