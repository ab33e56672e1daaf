"""Each record is decoded once, validated as it is applied; a rejection after other tensors were patched undoes
them in place and re-verifies them before the same error is raised (storage.patch.patcher, storage.patch.applier).

Every rejection point of the apply pass is thrown at a checkpoint several tensors into the pass: corrupt
compressed bytes, a wrong decoded size (short: mid-tensor; long: after the last block), a checksum missed on the
running value of a catch-up, bad sparse positions, counts and lengths, ``overwrite`` records (rejected, and
applied then undone from the bytes they replaced), a failure in the middle of a block, a download that fails
while applying. Each must raise the error the bad record deserves (type, message, revision, bucket, tensor),
say ``undone``, and leave the checkpoint byte for byte equal to the base.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard

from storage.errors import ChecksumMismatch, CodecError, ObjectNotFound, RefitError
from storage.format.changes import DenseChange
from storage.patch.patcher import apply_patches, plan_patches
from storage.patch.pipeline import Arrivals, ArrivingPlans
from tests.unit.patch.test_pipeline import Chain, checksums_of, rewrite_bucket

BLOCK = 4096  # several blocks a tensor: a record that fails late fails mid-tensor


def take_order(chain: Chain, delta: int) -> list[str]:
    """The tensors of delta ``delta`` (1-based) in the order one apply worker takes them (largest first)."""
    names = chain.manifests[delta - 1].weight_map
    return sorted(names, key=lambda n: (-chain.index.tensors[n].nbytes, n))


def victim_of(chain: Chain, delta: int, *, nth: int = 3) -> tuple[str, str]:
    """(tensor, bucket file) of a multi-block tensor taken ``nth``: tensors before it are patched by then."""
    order = [n for n in take_order(chain, delta) if chain.index.tensors[n].nbytes > 2 * BLOCK]
    name = order[min(nth, len(order) - 1)]
    return name, chain.manifests[delta - 1].weight_map[name]


def edit_frame(chain: Chain, delta: int, tensor: str, make=None, *, checksum: str | None = None) -> str:
    """Replace ``tensor``'s frame in delta ``delta`` by ``make(decoded record)`` (and/or its checksum); the bucket."""
    bucket = chain.manifests[delta - 1].weight_map[tensor]

    def edit(frames, metadata):
        if make is not None:
            frames[tensor] = make(zstandard.ZstdDecompressor().decompress(frames[tensor]))
        if checksum is not None:
            metadata[tensor] = checksum
        return frames, metadata

    rewrite_bucket(chain.folders[f"r{delta}"] / bucket, edit)
    return bucket


def reject(chain: Chain, *, workers: int = 1, arriving: bool = False, **kw):
    """Apply the chain to a copy of the base with the undo on; returns (error, checkpoint copy, bytes patched)."""
    work = chain.work()
    patched: list[int] = []
    if arriving:
        arrivals = Arrivals()
        source = ArrivingPlans(chain.manifests, chain.folders, chain.index.tensors, arrivals)
        arrivals.admit()
        for manifest in chain.manifests:
            for name in manifest.files:
                arrivals.arrived(manifest.version, name)
        arrivals.close()
    else:
        source = plan_patches(chain.manifests, chain.folders, chain.index.tensors)
    with pytest.raises(RefitError) as info:
        apply_patches(work, source, target_checksum_format="adler32", workers=workers, block_size=BLOCK,
                      progress=patched.append, undo_to=checksums_of(chain.index), undo_format="adler32", **kw)
    return info.value, work, sum(patched)


def assert_undone(chain: Chain, error, work, patched: int, kind: type, message: str, *, revision: str,
                  bucket: str, tensor: str) -> None:
    assert type(error) is kind, f"{type(error).__name__}: {error}"
    assert message in str(error), str(error)
    assert (error.revision, error.tensor) == (revision, tensor), error
    assert error.file.endswith(bucket), error
    assert error.mutation_started and error.undone is True
    assert patched > 0  # other tensors had been patched before the rejection: it was undone, not avoided
    assert chain.bytes_of(work) == chain.expected(0)  # the verified bytes, every one back


PATTERN = bytes(range(1, 8)) * 2**16


def compress(data: bytes, *, content_size: bool = True, checksum: bool = False) -> bytes:
    cctx = zstandard.ZstdCompressor(write_content_size=content_size, write_checksum=checksum)
    if content_size:
        return cctx.compress(data)
    stream = cctx.compressobj()  # no size hint: a wide window, so the blocks' headers bound the size loosely
    return stream.compress(data) + stream.flush()


DENSE = {  # case: (edit of the decoded frame, error type, message)
    "corrupt compressed bytes (content checksum)":
        (lambda raw: (lambda f: f[:-4] + bytes(b ^ 0xFF for b in f[-4:]))(compress(raw, checksum=True)),
         CodecError, "corrupt zstd data"),
    # compressed blocks (a pattern): their headers only bound the size, so decoding tells it is short, mid-tensor
    "decodes short, size undeclared": (lambda raw: compress(PATTERN[:len(raw) - 3 * BLOCK], content_size=False),
                                       CodecError, "decodes to only"),
    "decodes long, size undeclared": (lambda raw: compress(raw + b"\x01", content_size=False),
                                      CodecError, "decodes to more than"),
    "other bytes of the right size": (lambda raw: compress(bytes(len(raw))), ChecksumMismatch, "hash to"),
}


@pytest.mark.parametrize("case", sorted(DENSE))
@pytest.mark.parametrize("arriving", [False, True], ids=["planned", "arriving"])
def test_a_dense_frame_rejected_while_applying_is_undone(lab, tmp_path, case, arriving):
    chain = Chain(lab, tmp_path, 1)
    tensor, _ = victim_of(chain, 1)
    make, kind, message = DENSE[case]
    bucket = edit_frame(chain, 1, tensor, make)
    error, work, patched = reject(chain, arriving=arriving)
    assert_undone(chain, error, work, patched, kind, message, revision="r1", bucket=bucket, tensor=tensor)


def test_a_checksum_missed_on_the_running_value_of_a_catch_up_is_undone(lab, tmp_path):
    chain = Chain(lab, tmp_path, 3)
    tensor, _ = victim_of(chain, 2)
    bucket = edit_frame(chain, 2, tensor, checksum="00000001")  # r2's value, checked between r1 and r3
    error, work, patched = reject(chain, workers=2)
    assert_undone(chain, error, work, patched, ChecksumMismatch, "the bucket says 00000001", revision="r2",
                  bucket=bucket, tensor=tensor)


def _xor_sparse(positions, count=None, extra=b"") -> bytes:
    values = bytes([1]) * len(positions)
    return struct.pack("<Q", len(positions) if count is None else count) + \
        np.asarray(positions, dtype="<u8").tobytes() + values + extra


def _overwrite(positions, count=None) -> bytes:
    return struct.pack("<I", len(positions) if count is None else count) + \
        np.asarray(positions, dtype="<u4").tobytes() + bytes([7]) * len(positions)


SPARSE = {  # case: (encoding, record for a tensor of n bytes, message)
    "xor_sparse positions unsorted": ("xor_sparse", lambda n: _xor_sparse([9, 3]), "not strictly increasing"),
    "xor_sparse position past the end": ("xor_sparse", lambda n: _xor_sparse([1, n]), "outside the"),
    "xor_sparse count beyond its entries": ("xor_sparse", lambda n: _xor_sparse([1, 2], count=3), "ends after"),
    "xor_sparse count larger than the tensor": ("xor_sparse", lambda n: _xor_sparse([1], count=n + 1),
                                                "positions for a"),
    "overwrite position past the end": ("overwrite", lambda n: _overwrite([5, n + 7]), "outside the"),
    "overwrite count beyond its entries": ("overwrite", lambda n: _overwrite([3, 1], count=3), "ends after"),
    "overwrite count larger than the tensor": ("overwrite", lambda n: _overwrite([2], count=n + 1),
                                               "positions for a"),
}


@pytest.mark.parametrize("case", sorted(SPARSE))
def test_a_bad_sparse_record_is_rejected_when_decoded_and_the_others_undone(lab, tmp_path, case):
    encoding, record, message = SPARSE[case]
    chain = Chain(lab, tmp_path, 1, encodings={1: encoding})
    tensor, _ = victim_of(chain, 1)
    n = chain.index.tensors[tensor].nbytes
    bucket = edit_frame(chain, 1, tensor, lambda raw: compress(record(n)))
    error, work, patched = reject(chain)
    assert_undone(chain, error, work, patched, CodecError, message, revision="r1", bucket=bucket, tensor=tensor)


@pytest.mark.parametrize("encodings", [{1: "overwrite"}, {1: "xor", 2: "overwrite", 3: "xor_sparse"}])
def test_overwrite_records_applied_then_rejected_put_back_the_bytes_they_replaced(lab, tmp_path, encodings):
    chain = Chain(lab, tmp_path, len(encodings), encodings=encodings)
    last = len(encodings)
    tensor, _ = victim_of(chain, last, nth=5)
    bucket = edit_frame(chain, last, tensor, checksum="00000002")
    error, work, patched = reject(chain, workers=2)
    assert_undone(chain, error, work, patched, ChecksumMismatch, "the bucket says 00000002",
                  revision=f"r{last}", bucket=bucket, tensor=tensor)


def test_a_failure_in_the_middle_of_a_block_is_undone_exactly(lab, tmp_path, monkeypatch):
    """Two deltas folded: the first one's change is written into a block, the second's write fails (an I/O error
    of the mapping): the block holds one step of two, and only that step is reverted."""
    chain = Chain(lab, tmp_path, 2)
    calls = {"n": 0}
    original = DenseChange.apply

    def failing(self, block, spans=None):
        calls["n"] += 1
        if calls["n"] == 42:  # an even call: the second delta's write into a block the first one just wrote
            raise OSError(5, "Input/output error")
        return original(self, block, spans)

    monkeypatch.setattr(DenseChange, "apply", failing)
    error, work, patched = reject(chain)
    assert isinstance(error, CodecError) and "OSError" in str(error) and error.undone is True
    assert calls["n"] > 42 and patched > 0  # the undo wrote through it too
    assert chain.bytes_of(work) == chain.expected(0)


def test_a_download_that_fails_while_applying_is_undone_with_its_error(lab, tmp_path):
    chain = Chain(lab, tmp_path, 1, bucket_bytes=30_000)
    manifest = chain.manifests[0]
    arrivals = Arrivals()
    source = ArrivingPlans(chain.manifests, chain.folders, chain.index.tensors, arrivals)
    work = chain.work()
    arrivals.admit()
    for name in manifest.files[:-1]:
        arrivals.arrived("r1", name)
    arrivals.failed("r1", manifest.files[-1], ObjectNotFound("object not found", file=manifest.files[-1],
                                                             revision="r1"))
    arrivals.close()
    patched: list[int] = []
    with pytest.raises(ObjectNotFound) as info:
        apply_patches(work, source, target_checksum_format="adler32", workers=2, progress=patched.append,
                      undo_to=checksums_of(chain.index), undo_format="adler32")
    assert (info.value.revision, info.value.file, info.value.undone) == ("r1", manifest.files[-1], True)
    assert sum(patched) > 0
    assert chain.bytes_of(work) == chain.expected(0)


def test_an_undo_that_cannot_restore_the_base_says_so(lab, tmp_path):
    """The re-verification is real: told the base hashes to something else, the undo reports ``undone`` False
    (the caller then rebuilds instead of putting the folder back)."""
    chain = Chain(lab, tmp_path, 1)
    tensor, _ = victim_of(chain, 1)
    edit_frame(chain, 1, tensor, checksum="00000003")
    work = chain.work()
    wrong = {name: "00000000" for name in checksums_of(chain.index)}
    with pytest.raises(ChecksumMismatch) as info:
        apply_patches(work, plan_patches(chain.manifests, chain.folders, chain.index.tensors),
                      target_checksum_format="adler32", workers=1, block_size=BLOCK, undo_to=wrong,
                      undo_format="adler32")
    assert info.value.undone is False
    assert chain.bytes_of(work) == chain.expected(0)  # the bytes were reverted all the same


@pytest.mark.parametrize("encoding", ["xor_sparse", "overwrite"])
def test_a_sparse_record_is_decompressed_once_when_applied(lab, tmp_path, monkeypatch, encoding):
    """The bucket check decompresses nothing; the apply pass decodes each record once, validates it in that memory
    and applies it from there (no second streaming pass)."""
    import storage.format.frames as frames
    import storage.format.sparse as sparse

    chain = Chain(lab, tmp_path, 1, encodings={1: encoding})
    opened: list[int] = []
    original = frames._Reader.__init__

    def counting(self, frame, context, **kw):
        opened.append(len(frame))
        original(self, frame, context, **kw)

    def second_pass(*args, **kwargs):
        raise AssertionError("a record was validated by a second pass")

    monkeypatch.setattr(frames._Reader, "__init__", counting)
    monkeypatch.setattr(sparse, "validate_sparse", second_pass)
    plans = plan_patches(chain.manifests, chain.folders, chain.index.tensors)
    assert opened == []  # structure only
    work = chain.work()
    apply_patches(work, plans, target_checksum_format="adler32", workers=2)
    assert chain.bytes_of(work) == chain.expected(1)
    assert len(opened) == len(plans)  # one decompression a record
