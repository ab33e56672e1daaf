"""Sparse delta records (``xor_sparse``, ``overwrite``; docs/format.md, section 5; and the opt-in ``xor_gaps``,
``storage.format.gaps``), validated and read in bounded memory (their decoders: ``storage.format.sparse_decoders``).

A record is a count, ``count`` positions, then ``count`` values. A zstd frame
of a few KiB can decode to a record of 5 or 9 bytes per tensor byte, so no
record is held whole unless it fits a process-wide budget
(``storage.format.frames.WHOLE_RECORDS``, 128 MiB). A refit decodes a record
once (``check_record``): whole, within the budget (an RL step's record is
about a tenth of its tensor), validated in that memory before its tensor
changes and applied from it. A record over the budget, or without a declared
size, is validated by one streaming pass (``validate_sparse``), then read
through two streaming readers, a chunk at a time, in step with the tensor's
blocks (the values' reader decodes every position again to reach them).
Extra memory beyond the budget: about ``CHUNK`` entries plus the block,
whatever the count.

``overwrite`` positions may also come unsorted. Such a record is decoded
whole and sorted (9 bytes per entry), so its count is capped at
``unsorted_cap(nbytes)`` = max(nbytes // 8, 65536): about one tensor's size.

Repeated ``overwrite`` positions: the later entry in record order wins, as a
sequential writer would. Entries are reduced to the last one per position
before anything is written, so no write relies on NumPy's unspecified order
for duplicate fancy indices, and the undo log holds one byte per distinct
changed position (at most the tensor's size); undo re-derives the positions
by decoding the frame again.
"""

from __future__ import annotations

import struct

import numpy as np

from storage.errors import CodecError
from storage.format.frames import (
    _HEADER, RecordReaders, ValidatedFrame, _expect_output, _Reader, inspect_frame, sparse_size,
)
from storage.format.gaps import GAPS, validate_gaps

CHUNK = 1 << 18  # entries per streamed chunk (2 MiB of u64 positions)
UNSORTED_MIN_CAP = 1 << 16


def unsorted_cap(nbytes: int) -> int:
    """Most entries an unsorted ``overwrite`` record may hold: decoding one whole costs 9 bytes per entry."""
    return max(nbytes // 8, UNSORTED_MIN_CAP)


def _width(encoding: str) -> tuple[str, int, str, int]:
    fmt, header, dtype = _HEADER[encoding]
    return fmt, header, dtype, np.dtype(dtype).itemsize


def _sparse_header(frame, nbytes: int, encoding: str, context: dict, reader: _Reader) -> int:
    """The record's count (read from ``reader``), checked against the tensor and the frame's declared size."""
    info = inspect_frame(frame, **context)
    count = _read_count(frame, encoding, context, reader)
    if count > nbytes:
        raise CodecError(f"{encoding} record claims {count} positions for a {nbytes}-byte tensor", **context)
    expected = sparse_size(count, encoding)
    if info.content_size is not None and info.content_size != expected:
        raise CodecError(f"{encoding} record of {count} positions should be {expected} bytes, "
                         f"the frame declares {info.content_size}", **context)
    _expect_output(info, expected, **context)
    return count


def _read_count(frame, encoding: str, context: dict, reader: _Reader | None = None) -> int:
    fmt, header, _ = _HEADER[encoding]
    own = reader is None
    if reader is None:
        reader = _Reader(frame, context)
    try:
        return struct.unpack(fmt, reader.read_exact(header, f"{encoding} record header"))[0]
    finally:
        if own:
            reader.close()


def _in_order(pos: np.ndarray, previous: int, strict: bool) -> bool:
    if strict:
        return int(pos[0]) > previous and bool(np.all(pos[1:] > pos[:-1]))
    return int(pos[0]) >= previous and bool(np.all(pos[1:] >= pos[:-1]))


def _outside(encoding: str, position: int, nbytes: int, context: dict) -> CodecError:
    return CodecError(f"{encoding} position {position} is outside the {nbytes}-byte tensor", **context)


def _over_cap(count: int, nbytes: int, context: dict) -> CodecError:
    return CodecError(f"overwrite record has {count} unsorted positions, over the cap of {unsorted_cap(nbytes)} "
                      f"for a {nbytes}-byte tensor (max(nbytes // 8, {UNSORTED_MIN_CAP}); sorted records have "
                      f"no cap)", **context)


def validate_sparse(encoding: str, frame, nbytes: int, context: dict) -> ValidatedFrame:
    """One streaming pass over the whole record: count, lengths, bounds, order, the unsorted cap."""
    _, header, dtype, width = _width(encoding)
    reader = _Reader(frame, context, alone=True)
    try:
        count = _sparse_header(frame, nbytes, encoding, context, reader)
        ordered, previous, left = True, -1, count
        while left:
            n = min(left, CHUNK)
            pos = np.frombuffer(reader.read_exact(width * n, f"{encoding} positions"), dtype=dtype)
            ordered = _check_positions(pos, ordered, previous, encoding, count, nbytes, context)
            previous, left = int(pos[-1]), left - n
        reader.skip(count)
        if not reader.at_end():
            raise CodecError(f"{encoding} record is longer than its count implies", **context)
    finally:
        reader.close()
    return ValidatedFrame(encoding, nbytes, memoryview(frame).nbytes, count, ordered)


def check_record(frame, checked: ValidatedFrame, context: dict) -> tuple[ValidatedFrame, RecordReaders | None]:
    """Validate the record of a frame whose structure alone was checked (``checked.complete`` False).

    A record whose declared size fits ``WHOLE_RECORDS`` is decoded once, whole, and validated in that memory
    (count, lengths, bounds, order, the unsorted cap): the returned readers serve the same decoded bytes to the
    decoder that applies it, so it is decompressed once. Any other record gets the streaming pass
    (``validate_sparse`` / ``validate_gaps``) and no readers. Raises ``CodecError`` as those do.
    """
    encoding, nbytes = checked.encoding, checked.nbytes
    if encoding == GAPS:
        return validate_gaps(frame, nbytes, context), None
    if checked.count is None:  # no declared size: nothing to size one decode by
        return validate_sparse(encoding, frame, nbytes, context), None
    readers = RecordReaders(frame, sparse_size(checked.count, encoding), context, whole=True)
    data = readers.decoded
    if data is None:
        readers.close()
        return validate_sparse(encoding, frame, nbytes, context), None
    try:
        return _validate_decoded(encoding, data, checked, context), readers
    except BaseException:
        readers.close()
        raise


def _validate_decoded(encoding: str, data: memoryview, checked: ValidatedFrame, context: dict) -> ValidatedFrame:
    """``validate_sparse``'s checks over a record already decoded (``data``: at most one byte past its size)."""
    fmt, header, dtype, width = _width(encoding)
    nbytes = checked.nbytes
    if data.nbytes < header:
        raise CodecError(f"{encoding} record header ends after {data.nbytes} decoded bytes", **context)
    count = struct.unpack_from(fmt, data, 0)[0]
    if count > nbytes:
        raise CodecError(f"{encoding} record claims {count} positions for a {nbytes}-byte tensor", **context)
    if data.nbytes < header + width * count:
        raise CodecError(f"{encoding} positions ends after {data.nbytes} decoded bytes", **context)
    if data.nbytes < sparse_size(count, encoding):
        raise CodecError(f"{encoding} values ends after {data.nbytes} decoded bytes", **context)
    if data.nbytes > sparse_size(count, encoding):
        raise CodecError(f"{encoding} record is longer than its count implies", **context)
    positions = np.frombuffer(data[header: header + width * count], dtype=dtype)
    ordered, previous = True, -1
    for start in range(0, count, CHUNK):  # chunk by chunk: the comparisons' scratch stays bounded
        pos = positions[start: start + CHUNK]
        ordered = _check_positions(pos, ordered, previous, encoding, count, nbytes, context)
        previous = int(pos[-1])
    return ValidatedFrame(encoding, nbytes, checked.frame_size, count, ordered)


# --- entry sources: strictly increasing int64 positions (one per position) and their values, chunk by chunk ----


class _SortedStream:
    """A sorted record read as it is applied; order, bounds and lengths are re-checked per chunk."""

    def __init__(self, frame, validated: ValidatedFrame, context: dict, *, values: bool,
                 readers: RecordReaders | None = None):
        self.encoding, self.nbytes, self.context = validated.encoding, validated.nbytes, context
        _, header, self._dtype, self._width = _width(self.encoding)
        self._strict = self.encoding == "xor_sparse"
        # readers of the record ``check_record`` decoded and validated: its entries need no second check
        self._checked = readers is not None
        self._readers = readers if readers is not None else RecordReaders(
            frame, sparse_size(validated.count or 0, self.encoding), context, whole=values)
        self._positions = self._readers.open()
        self._values: _Reader | None = None
        try:
            count = _read_count(frame, self.encoding, context, self._positions)
            if count != validated.count:
                raise CodecError(f"{self.encoding} record holds {count} entries, validated with "
                                 f"{validated.count}", **context)
            if values:
                self._values = self._readers.open()
                self._values.skip(header + self._width * count)
        except BaseException:
            self.close()
            raise
        self._left, self._previous = count, -1
        self._carry: tuple[np.ndarray, np.ndarray | None] | None = None  # last entry, until the next chunk

    def next(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        while self._left:
            n = min(self._left, CHUNK)
            raw = np.frombuffer(self._positions.read_exact(self._width * n, f"{self.encoding} positions"),
                                dtype=self._dtype)
            val = (np.frombuffer(self._values.read_exact(n, f"{self.encoding} values"), dtype=np.uint8)
                   if self._values is not None else None)
            self._left -= n
            if not self._checked and not _in_order(raw, self._previous, self._strict):
                order = "strictly increasing" if self._strict else "sorted, as validated"
                raise CodecError(f"{self.encoding} positions are not {order}", **self.context)
            if not self._checked and int(raw[-1]) >= self.nbytes:
                raise _outside(self.encoding, int(raw[-1]), self.nbytes, self.context)
            self._previous = int(raw[-1])
            # u64 positions below the tensor's size (just checked, or validated) are int64 as they are: no copy
            pos = raw.view(np.int64) if raw.dtype == np.uint64 else raw.astype(np.int64)
            if self._strict:
                return pos, val
            if self._carry is not None:  # overwrite: a position may repeat across chunks
                pos = np.concatenate([self._carry[0], pos])
                val = None if val is None else np.concatenate([self._carry[1], val])
            keep = np.empty(pos.size, dtype=bool)
            np.not_equal(pos[1:], pos[:-1], out=keep[:-1])
            keep[-1] = False  # held back: the next chunk may repeat it
            self._carry = (pos[-1:], None if val is None else val[-1:].copy())
            if keep.any():
                return pos[keep], None if val is None else val[keep]
        carry, self._carry = self._carry, None
        return carry

    def check_end(self) -> None:
        """After the last entry: the values must end exactly where the record does."""
        if not self._left and self._carry is None and self._values is not None and not self._values.at_end():
            raise CodecError(f"{self.encoding} record is longer than its count implies", **self.context)

    def close(self) -> None:
        self._positions.close()
        if self._values is not None:
            self._values.close()
        self._readers.close()


class _UnsortedRecord:
    """An unsorted ``overwrite`` record (count within the cap), decoded whole and sorted by (position, entry)."""

    def __init__(self, frame, validated: ValidatedFrame, context: dict, *, values: bool,
                 readers: RecordReaders | None = None):
        count, nbytes = validated.count or 0, validated.nbytes
        if count > unsorted_cap(nbytes):
            if readers is not None:
                readers.close()
            raise _over_cap(count, nbytes, context)
        keys = np.empty(count, dtype=np.uint64)  # position << 32 | entry index: sorting keeps record order
        self._values: np.ndarray | None = np.empty(count, dtype=np.uint8) if values else None
        reader = readers.open() if readers is not None else _Reader(frame, context)
        try:
            if _read_count(frame, "overwrite", context, reader) != count:
                raise CodecError(f"overwrite record does not hold the {count} entries it was validated with",
                                 **context)
            for start in range(0, count, CHUNK):
                n = min(CHUNK, count - start)
                pos = np.frombuffer(reader.read_exact(4 * n, "overwrite positions"), dtype="<u4")
                if int(pos.max()) >= nbytes:
                    raise _outside("overwrite", int(pos.max()), nbytes, context)
                part = keys[start:start + n]
                part[:] = pos
                part <<= np.uint64(32)
                part |= np.arange(start, start + n, dtype=np.uint64)
            if self._values is not None and reader.read_into(memoryview(self._values)) != count:
                raise CodecError(f"overwrite values end after {reader.position} decoded bytes", **context)
        finally:
            reader.close()
            if readers is not None:
                readers.close()
        keys.sort()
        self._keys, self._next = keys, 0

    def next(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        keys, a = self._keys, self._next
        if a >= keys.size:
            return None
        b = self._next = min(a + CHUNK, keys.size)
        pos = (keys[a:b] >> np.uint64(32)).astype(np.int64)
        keep = np.empty(pos.size, dtype=bool)
        np.not_equal(pos[1:], pos[:-1], out=keep[:-1])
        keep[-1] = b == keys.size or int(keys[b] >> np.uint64(32)) != int(pos[-1])  # the group's last entry wins
        if self._values is None:
            return pos[keep], None
        entries = (keys[a:b][keep] & np.uint64(0xFFFFFFFF)).astype(np.intp)
        return pos[keep], self._values[entries]

    def check_end(self) -> None:
        pass

    def close(self) -> None:
        self._keys, self._values = np.empty(0, dtype=np.uint64), None


def _check_positions(pos: np.ndarray, ordered: bool, previous: int, encoding: str, count: int, nbytes: int,
                     context: dict) -> bool:
    """One chunk of a record's positions: in order (strictly for ``xor_sparse``) or, for an unsorted record,
    within the unsorted cap; all inside the tensor. Returns whether the record is still in order."""
    if ordered and not _in_order(pos, previous, encoding == "xor_sparse"):
        if encoding == "xor_sparse":
            raise CodecError("xor_sparse positions are not strictly increasing", **context)
        if count > unsorted_cap(nbytes):
            raise _over_cap(count, nbytes, context)
        ordered = False
    top = int(pos[-1]) if ordered else int(pos.max())
    if top >= nbytes:
        raise _outside(encoding, top, nbytes, context)
    return ordered
