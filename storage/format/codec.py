"""Delta frames: validate and apply on the receiver (docs/format.md, section 5); encoding is in storage.format.encoding.

A tensor delta is one zstd frame. Dense ``xor`` decodes to the XOR of base and
target bytes; ``xor_sparse``, ``overwrite`` (and the opt-in ``xor_gaps``) decode to a record of byte
positions and values. Receivers check a frame's structure before decoding
it (``check_frame``: one frame, exact length, declared sizes), decode in bounded blocks, and
never write past the tensor. A sparse record (``storage.format.sparse``) is validated
whole before any byte of its tensor changes: as it is decoded for applying, once
(``validate_frame`` is the separate streaming pass, whose ``ValidatedFrame`` lets a
decoder skip it).
"""

from __future__ import annotations

import struct
from typing import Protocol

import numpy as np

from storage.format.changes import DenseChange, SparseChange
from storage.errors import CodecError
from storage.format.frames import (_HEADER, SMALL_FRAME, ValidatedFrame, _expect_output, _Reader, decode_small,
                                   inspect_frame)
from storage.format.gaps import GAPS, gaps_record, validate_gaps
from storage.format.sparse import validate_sparse
from storage.format.sparse_decoders import SparseOverwrite, SparseXor

DENSE_PAGES_RATIO = 1 / 16  # a dense frame over this share of its tensor changes practically every page
_MAX_POSITIONS = {"xor_sparse": 2**64 - 1, "overwrite": 2**32 - 1}


# --- the uncompressed record of one tensor's change (the publisher encodes in storage.format.encoding) ---


def sparse_record(base: np.ndarray, target: np.ndarray, encoding: str) -> bytes:
    """The uncompressed ``xor_sparse`` / ``overwrite`` / ``xor_gaps`` record of the changed bytes."""
    positions = np.flatnonzero(base != target)
    if encoding == GAPS:
        return gaps_record(positions, base[positions] ^ target[positions])
    fmt, _, pos_dtype = _HEADER[encoding]
    if encoding == "overwrite" and base.size > _MAX_POSITIONS["overwrite"] + 1:
        raise ValueError("overwrite records address at most 4 GiB per tensor")
    values = target[positions] if encoding == "overwrite" else base[positions] ^ target[positions]
    return struct.pack(fmt, positions.size) + positions.astype(pos_dtype).tobytes() + values.tobytes()


# --- decoders (receiver) -----------------------------------------------------------------------


def validate_frame(encoding: str, frame, nbytes: int, **context) -> ValidatedFrame:
    """Validate ``frame`` completely for a tensor of ``nbytes`` (bounded memory); nothing is applied.

    Raises ``CodecError`` naming ``context`` on the first problem. Pass the
    result to ``make_decoder(..., validated=...)`` to apply the same frame
    without a second validation pass.
    """
    if encoding == "xor":
        _expect_output(inspect_frame(frame, **context), nbytes, **context)
        return ValidatedFrame("xor", nbytes, memoryview(frame).nbytes)
    if encoding in _HEADER:
        return validate_sparse(encoding, frame, nbytes, context)
    if encoding == GAPS:
        return validate_gaps(frame, nbytes, context)
    raise CodecError(f"unsupported delta encoding {encoding!r}", **context)


def check_frame(encoding: str, frame, nbytes: int, **context) -> ValidatedFrame:
    """The checks of ``frame`` that need no decompression: what a refit makes before the store changes.

    One zstd frame, exactly (``inspect_frame``: magic, block headers, no trailing bytes, no dictionary), whose
    declared decoded size fits a tensor of ``nbytes``: a dense frame's is the tensor's size, a sparse record's
    one its layout allows (``count`` positions within the tensor). The record itself (positions, order, bounds,
    values, the count it holds) is validated by the decoder as it decodes it, once, before the first byte of
    its tensor changes (``storage.format.sparse``); the summary returned says so (``complete=False``).
    """
    if encoding == "xor":
        _expect_output(inspect_frame(frame, **context), nbytes, **context)
        return ValidatedFrame("xor", nbytes, memoryview(frame).nbytes)
    if encoding not in _HEADER and encoding != GAPS:
        raise CodecError(f"unsupported delta encoding {encoding!r}", **context)
    info = inspect_frame(frame, **context)
    count = None
    if encoding in _HEADER and info.content_size is not None:
        _, header, pos_dtype = _HEADER[encoding]
        entry = np.dtype(pos_dtype).itemsize + 1
        count, extra = divmod(info.content_size - header, entry)
        if info.content_size < header or extra:
            raise CodecError(f"{encoding} record of {info.content_size} bytes is not a count and whole entries",
                             **context)
        if count > nbytes:
            raise CodecError(f"{encoding} record claims {count} positions for a {nbytes}-byte tensor", **context)
    return ValidatedFrame(encoding, nbytes, memoryview(frame).nbytes, count, complete=False)


class Decoder(Protocol):
    """Applies one revision's delta of one tensor block by block, in order.

    ``changes`` decodes the next block without writing anything (None: the
    block does not change), so the patcher can map exactly the pages that
    will be written; ``apply`` is ``changes`` then writing them.
    """

    def changes(self, offset: int, size: int) -> DenseChange | SparseChange | None: ...
    def apply(self, block: np.ndarray, offset: int) -> None: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


class DenseXor:
    """Dense XOR: stream the frame in blocks and XOR them into the destination."""

    def __init__(self, frame, nbytes: int, block_size: int, *, validated: ValidatedFrame | None = None, **context):
        self.context = context
        self.nbytes = nbytes
        if validated is None:
            _expect_output(inspect_frame(frame, **context), nbytes, **context)
        # a tiny tensor (one block) is decoded in one call; a frame that does not decode cleanly to exactly
        # its bytes goes through the streaming reader, which names the problem at the block it shows up in
        whole = decode_small(frame, nbytes) if nbytes <= min(SMALL_FRAME, block_size) else None
        self._whole = None if whole is None else np.frombuffer(whole, dtype=np.uint8)
        self._reader = _Reader(frame, context) if whole is None else None
        self._scratch = np.empty(min(block_size, max(nbytes, 1)), dtype=np.uint8) if whole is None else None
        # a frame this large changes nearly every page: do not look for unchanged pages
        self._all_pages = memoryview(frame).nbytes > nbytes * DENSE_PAGES_RATIO

    def changes(self, offset: int, size: int) -> DenseChange:
        if self._whole is not None:
            got = max(0, min(size, self.nbytes - offset))
            if got != size:
                raise CodecError(f"dense frame decodes to only {offset + got} bytes, the tensor has {self.nbytes}",
                                 **self.context)
            return DenseChange(self._whole[offset: offset + size], self._all_pages)
        if size > self._scratch.size:  # a caller's block larger than promised: grow once
            self._scratch = np.empty(size, dtype=np.uint8)
        scratch = self._scratch[:size]
        got = self._reader.read_into(memoryview(scratch))
        if got != size:
            raise CodecError(
                f"dense frame decodes to only {offset + got} bytes, the tensor has {self.nbytes}", **self.context
            )
        return DenseChange(scratch, self._all_pages)

    def apply(self, block: np.ndarray, offset: int) -> None:
        self.changes(offset, block.size).apply(block)

    def finish(self) -> None:
        if self._reader is None:
            return  # decoded whole: exactly the tensor's bytes
        try:
            if not self._reader.at_end():
                raise CodecError(f"dense frame decodes to more than the tensor's {self.nbytes} bytes", **self.context)
        finally:
            self._reader.close()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


def make_decoder(encoding: str, frame, nbytes: int, *, block_size: int,
                 validated: ValidatedFrame | None = None, **context) -> Decoder:
    """Return the decoder of ``frame`` for a tensor of ``nbytes``, validating the frame first.

    ``validated`` is what ``validate_frame`` returned for this same frame: the
    validation pass is then skipped; given what ``check_frame`` returned
    (``complete`` False), a sparse decoder validates its record as it is made,
    decoding it once. Decoding still re-checks bounds, order,
    counts and lengths as it streams, so a wrong summary gives a ``CodecError``
    while applying, never a write outside the block.
    """
    if validated is None:
        validated = validate_frame(encoding, frame, nbytes, **context)
    elif (validated.encoding, validated.nbytes, validated.frame_size) != (encoding, nbytes, memoryview(frame).nbytes):
        raise ValueError(f"validated summary {validated} does not describe this {encoding!r} frame")
    if encoding == "xor":
        return DenseXor(frame, nbytes, block_size, validated=validated, **context)
    if encoding in ("xor_sparse", GAPS):
        return SparseXor(frame, nbytes, validated=validated, **context)
    return SparseOverwrite(frame, nbytes, validated=validated, **context)
