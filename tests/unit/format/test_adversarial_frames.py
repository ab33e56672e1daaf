"""Hostile zstd frames and sparse records, thrown at a store that runs r1.

Each case is a copy of a valid delta on r1 with one frame or record broken.
Everything that can be known from a frame's headers and declared size is
rejected before the store changes (bit-for-bit); what only decoding reveals
(corrupt compressed bytes, a sparse record's positions, count or length, a
wrong checksum) is rejected while patching in place, each record being decoded
once: the tensors already patched are undone in place and re-verified, and the
same error is raised with the installed version restored (its verified bytes,
READY at r1, nothing handed to the engine). Memory stays bounded: no bomb is
ever decompressed past the tensor's size.
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.support.adversarial_support as av
from storage.format.codec import make_decoder
from storage.errors import ChecksumMismatch, CodecError, FormatError

MiB = 2**20


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    return av.hostile_world(tmp_path_factory)


@pytest.fixture(scope="module")
def dense(world):
    return av.frame_tensor(world, "d2")  # (bucket, tensor, nbytes)


def _sparse(world, template):
    bucket = world.bucket_names(template)[0]
    _, _, frames = av.read_bucket(world.revisions / template / bucket)
    tensor = max(frames, key=lambda n: len(frames[n]))
    return bucket, tensor, av.tensor_nbytes(world, tensor)


def xor_sparse(count, positions, values=None, extra=b""):
    values = bytes(len(positions)) if values is None else values
    return struct.pack("<Q", count) + np.asarray(positions, dtype="<u8").tobytes() + values + extra


def overwrite(count, positions, values=None, extra=b""):
    values = bytes(len(positions)) if values is None else values
    return struct.pack("<I", count) + np.asarray(positions, dtype="<u4").tobytes() + values + extra


RLE = 1
DENSE_EARLY = {
    "truncated by 5 bytes": lambda f, n: f[:-5],
    "truncated to its magic number": lambda f, n: f[:4],
    "trailing garbage": lambda f, n: f + b"garbage",
    "two frames": lambda f, n: f + f,
    "not a zstd frame": lambda f, n: b"\x00" * 16,
    "empty": lambda f, n: b"",
    "declares one byte fewer": lambda f, n: av.compress(av.decoded(f)[:-1]),
    "declares one byte more": lambda f, n: av.compress(av.decoded(f) + b"\x00"),
    "bomb declaring 1 TiB": lambda f, n: av.raw_frame([(RLE, 128 * 1024, b"\x00")], content_size=2**40),
    "bomb of 2.6 GB in RLE blocks, size undeclared": lambda f, n: av.raw_frame([(RLE, 128 * 1024, b"\x00")] * 20000),
    "blocks outgrow the declared size": lambda f, n: av.raw_frame([(RLE, n // 2, b"\x00")] * 3, content_size=n),
    "reserved block type": lambda f, n: av.raw_frame([(3, 10, b"")], content_size=n),
    "needs a dictionary": lambda f, n: av.compress(av.decoded(f))[:4] + b"\x01\x07\x01" + b"\x00" * 8,
}
DENSE_LATE = {
    "size undeclared, decodes one byte short": (lambda f, n: av.compress(av.decoded(f)[:-1], content_size=False),
                                                CodecError),
    "size undeclared, decodes one byte long": (lambda f, n: av.compress(av.decoded(f) + b"\x01", content_size=False),
                                               CodecError),
    "one compressed byte flipped": (lambda f, n: f[: len(f) // 2] + bytes([f[len(f) // 2] ^ 0x5A]) + f[len(f) // 2 + 1:],
                                    FormatError),
    "valid frame of other bytes": (lambda f, n: av.compress(bytes(n)), ChecksumMismatch),
}


@pytest.mark.parametrize("case", sorted(DENSE_EARLY))
def test_dense_frames_rejected_before_the_store_changes(world, dense, case):
    bucket, tensor, n = dense
    version = world.new("d2", files={bucket: av.replace_frame(tensor, lambda f: DENSE_EARLY[case](f, n))})
    av.assert_rejected(world.refit(version), FormatError, tensor=tensor, file=bucket)


@pytest.mark.parametrize("case", sorted(DENSE_LATE))
def test_dense_frames_only_decoding_reveals_restore_the_installed_version(world, dense, case):
    bucket, tensor, n = dense
    make, kind = DENSE_LATE[case]
    version = world.new("d2", files={bucket: av.replace_frame(tensor, lambda f: make(f, n))})
    av.assert_rejected(world.refit(version), kind, tensor=tensor, file=bucket, late=True)


def test_wrong_checksum_in_bucket_metadata_restores_the_installed_version(world, dense):
    bucket, tensor, _ = dense
    version = world.new("d2", files={bucket: av.replace_frame(tensor, lambda f: f, checksum="00000001")})
    av.assert_rejected(world.refit(version), ChecksumMismatch, tensor=tensor, file=bucket, late=True)


SPARSE = {
    "xor_sparse": {
        "positions unsorted": lambda n: xor_sparse(2, [5, 3]),
        "position repeated": lambda n: xor_sparse(2, [5, 5]),
        "position at the tensor's end": lambda n: xor_sparse(1, [n]),
        "position far past the end": lambda n: xor_sparse(1, [2**63]),
        "count says more than the record holds": lambda n: xor_sparse(3, [1, 2]),
        "record longer than its count": lambda n: xor_sparse(1, [1], extra=b"z"),
        "count larger than the tensor": lambda n: xor_sparse(2**63, [1]),
        "shorter than its header": lambda n: b"\x01\x00",
    },
    "overwrite": {
        "position at the tensor's end": lambda n: overwrite(1, [n]),
        "count says more than the record holds": lambda n: overwrite(5, [1]),
        "record longer than its count": lambda n: overwrite(1, [1], extra=b"zz"),
        "count larger than the tensor": lambda n: overwrite(2**32 - 1, [1]),
        "shorter than its header": lambda n: b"\x01",
    },
}


# what the frame's declared size alone gives away (its length is not a count and whole entries)
SPARSE_STRUCTURAL = {("xor_sparse", "record longer than its count"), ("xor_sparse", "shorter than its header"),
                     ("overwrite", "record longer than its count"), ("overwrite", "shorter than its header")}
SPARSE_MESSAGES = {"positions unsorted": "not strictly increasing", "position repeated": "not strictly increasing",
                   "position at the tensor's end": "outside the", "position far past the end": "outside the",
                   "count says more than the record holds": "ends after",
                   "count larger than the tensor": "positions for a", "record longer than its count": "whole entries",
                   "shorter than its header": "whole entries"}


@pytest.mark.parametrize("encoding,case", [(e, c) for e, cases in SPARSE.items() for c in sorted(cases)])
def test_sparse_records_rejected_and_the_installed_version_kept(world, encoding, case):
    """A record's size is checked before the store changes; its content as it is decoded, before its own tensor
    changes: by then other tensors may be patched, and they are undone (the verified bytes back, re-verified)."""
    template = {"xor_sparse": "s2", "overwrite": "o2"}[encoding]
    bucket, tensor, n = _sparse(world, template)
    record = SPARSE[encoding][case](n)
    version = world.new(template, files={bucket: av.replace_frame(tensor, lambda f: av.compress(record))})
    out = world.refit(version)
    av.assert_rejected(out, CodecError, tensor=tensor, file=bucket, late=(encoding, case) not in SPARSE_STRUCTURAL)
    assert SPARSE_MESSAGES[case] in str(out.error), out.error


def test_valid_sparse_record_with_a_wrong_result_restores_the_installed_version(world):
    bucket, tensor, n = _sparse(world, "o2")
    record = overwrite(2, [9, 3], b"\x01\x02")  # unsorted is legal for overwrite; the checksum is not met
    version = world.new("o2", files={bucket: av.replace_frame(tensor, lambda f: av.compress(record))})
    av.assert_rejected(world.refit(version), ChecksumMismatch, tensor=tensor, file=bucket, late=True)


# --- fuzzing ----------------------------------------------------------------------------------------------------

mutations = st.one_of(
    st.tuples(st.just("truncate"), st.integers(1, 64)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("flip"), st.integers(0, 2**31), st.integers(1, 255)),
    st.tuples(st.just("replace"), st.binary(max_size=256)),
)


def mutate(frame: bytes, mutation) -> bytes:
    kind = mutation[0]
    if kind == "truncate":
        return frame[: max(0, len(frame) - mutation[1])]
    if kind == "append":
        return frame + mutation[1]
    if kind == "flip":
        i = mutation[1] % len(frame)
        return frame[:i] + bytes([frame[i] ^ mutation[2]]) + frame[i + 1:]
    return mutation[1]


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(template=st.sampled_from(["d2", "s2", "o2"]), which=st.integers(0, 10**6), mutation=mutations)
def test_fuzzed_frames_are_installed_exactly_or_rejected_cleanly(world, template, which, mutation):
    bucket = world.bucket_names(template)[0]
    _, _, frames = av.read_bucket(world.revisions / template / bucket)
    tensor = sorted(frames)[which % len(frames)]
    version = world.new(template, files={bucket: av.replace_frame(tensor, lambda f: mutate(f, mutation))})
    av.accepted_or_rejected(world.refit(version), world.lab.expected(template))


@settings(max_examples=300, deadline=None)
@given(encoding=st.sampled_from(["xor", "xor_sparse", "overwrite"]), frame=st.binary(max_size=512),
       nbytes=st.integers(0, 1 << 20), compress_it=st.booleans())
def test_any_bytes_as_a_frame_give_a_codec_error_in_bounded_memory(encoding, frame, nbytes, compress_it):
    data = av.compress(frame) if compress_it else frame
    tracemalloc.start()
    try:
        decoder = make_decoder(encoding, data, nbytes, block_size=64 * 1024, revision="h", file="b", tensor="t")
        block = np.zeros(max(1, min(nbytes, 64 * 1024)), dtype=np.uint8)  # an empty tensor has no block
        for offset in range(0, nbytes, block.size):
            decoder.apply(block[: min(block.size, nbytes - offset)], offset)
        decoder.finish()
    except CodecError as exc:
        assert (exc.revision, exc.file, exc.tensor) == ("h", "b", "t")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 8 * MiB
