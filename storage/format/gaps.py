"""The opt-in ``xor_gaps`` delta encoding: a sparse XOR record with varint gaps instead of u64 positions.

An RL step changes about 2 % of bf16 elements, each by one ulp, so a sparse
record of the changed bytes is small, but ``xor_sparse`` spends 8 bytes on
each position. ``xor_gaps`` writes the distance from the previous position
as a LEB128 varint (one byte for a gap under 128, two under 16384), which
zstd then compresses to about 1.3 % of the tensor's bytes at 2 % changed
elements (``xor_sparse``: 1.85 %, dense ``xor``: 2.4 %). The decoded record,
all integers little-endian:

    u64 count
    count varints     gap_i = pos_i - pos_{i-1} - 1, with pos_{-1} = -1 (so positions strictly increase)
    count u8 values   XORed into the tensor at pos_i

A varint is minimal LEB128: 7 bits per byte, low group first, the high bit
set on every byte but the last, at most 9 bytes (values below 2**63), and a
varint of more than one byte never ends in a 0x00 byte. A record is valid
only if count <= the tensor's size, every position lies inside the tensor,
and the record ends exactly after its count-th value, so its length is
``8 + positions_bytes + count``. It is validated whole, in one streaming
pass, before any byte of its tensor changes, and applied while it streams:
memory is bounded by one chunk of varint bytes whatever the count.

Readers of the canonical format do not know this encoding: a publisher uses
it only when asked by name (``--encoding xor_gaps``), never by default.
"""

from __future__ import annotations

import struct

import numpy as np

from storage.errors import CodecError
from storage.format.frames import RecordReaders, ValidatedFrame, _Reader, inspect_frame

GAPS = "xor_gaps"
MAX_VARINT = 9  # bytes: 63 bits, more than any tensor offset
GAP_CHUNK_BYTES = 1 << 18  # varint bytes decoded per step: at most this many positions (2 MiB of int64)
_U64 = np.uint64


# --- encoding (publisher) ------------------------------------------------------------------------------------


def varints(gaps: np.ndarray) -> np.ndarray:
    """Minimal LEB128 encoding of non-negative ``gaps`` (any integer dtype below 2**63), as uint8.

    Column k of an (entries x longest) byte matrix holds every entry's k-th
    7-bit group; the groups an entry needs are kept in row order.
    """
    g = np.asarray(gaps).astype(_U64, copy=False)
    if g.size == 0:
        return np.empty(0, dtype=np.uint8)
    top = int(g.max())
    if top < 0x80:  # every gap fits one byte
        return g.astype(np.uint8)
    if top >= 1 << 63:
        raise ValueError("xor_gaps gaps must be below 2**63")
    if top < 1 << 14:  # one or two bytes each (RL sparsity): build them as 16-bit pairs
        two = g >= _U64(0x80)
        g16 = g.astype(np.uint16)
        pairs = (g16 & 0x7F) | (two.astype(np.uint16) << 7) | ((g16 >> 7) << 8)
        keep = np.empty((g.size, 2), dtype=bool)
        keep[:, 0], keep[:, 1] = True, two
        return pairs.astype("<u2").view(np.uint8).reshape(-1, 2)[keep]
    longest = 1
    while top >= 1 << (7 * longest):
        longest += 1
    groups = np.empty((g.size, longest), dtype=np.uint8)
    keep = np.empty((g.size, longest), dtype=bool)
    keep[:, 0] = True
    for k in range(longest):
        column = (g >> _U64(7 * k)).astype(np.uint8)
        column &= 0x7F
        if k + 1 < longest:
            more = g >= _U64(1 << (7 * (k + 1)))
            column |= more.view(np.uint8) << 7
            keep[:, k + 1] = more
        groups[:, k] = column
    return groups[keep]


def gaps_of(positions: np.ndarray, previous: int = -1) -> np.ndarray:
    """Gaps of strictly increasing ``positions`` following ``previous`` (-1 before the first)."""
    pos = np.asarray(positions, dtype=np.int64)
    out = np.empty(pos.size, dtype=np.int64)
    if pos.size:
        out[0] = pos[0] - previous - 1
        np.subtract(pos[1:], pos[:-1], out=out[1:])
        out[1:] -= 1
    return out


def gaps_record(positions: np.ndarray, values: np.ndarray) -> bytes:
    """The whole ``xor_gaps`` record of strictly increasing ``positions`` and their XOR ``values``."""
    return struct.pack("<Q", len(positions)) + varints(gaps_of(positions)).tobytes() + \
        np.asarray(values, dtype=np.uint8).tobytes()


# --- decoding (receiver) -------------------------------------------------------------------------------------


def _decode(buf: np.ndarray, ends: np.ndarray, context: dict) -> np.ndarray:
    """Values of the varints of ``buf`` that end at ``ends`` (the first starts at 0), checked minimal."""
    cont = buf[: int(ends[-1]) + 1] >= 0x80
    if not cont.any():  # every varint is one byte
        return buf[ends].astype(_U64)
    if not (cont[1:] & cont[:-1]).any():  # none longer than two bytes (RL sparsity): no per-varint loop
        last = buf[ends].astype(np.uint32)
        before = np.empty_like(last)
        before[0] = buf[0] if ends[0] == 1 else 0  # the byte before the first end, if it is in a varint
        before[1:] = buf[ends[1:] - 1]
        two = before >= 0x80
        if ends[0] == 0:
            two[0] = False
        if np.any(two & (last == 0)):
            raise CodecError("xor_gaps varint is not minimal (its last byte is 0x00)", **context)
        value = last << (two.astype(np.uint32) * 7)
        value |= (before & 0x7F) * two
        return value.astype(_U64)
    return _decode_long(buf, ends, context)


def _decode_long(buf: np.ndarray, ends: np.ndarray, context: dict) -> np.ndarray:
    starts = np.empty_like(ends)
    starts[0] = 0
    np.add(ends[:-1], 1, out=starts[1:])
    lengths = ends - starts + 1
    longest = int(lengths.max())
    if longest > MAX_VARINT:
        raise CodecError(f"xor_gaps varint of {longest} bytes (at most {MAX_VARINT})", **context)
    if not buf[ends[lengths > 1]].all():
        raise CodecError("xor_gaps varint is not minimal (its last byte is 0x00)", **context)
    value = (buf[starts] & 0x7F).astype(_U64)
    for k in range(1, longest):
        sel = np.flatnonzero(lengths > k)
        value[sel] |= (buf[starts[sel] + k] & 0x7F).astype(_U64) << _U64(7 * k)
    return value


class GapPositions:
    """Positions of an ``xor_gaps`` record, read from its varint section a chunk at a time.

    Every position is checked inside the tensor as it is produced (gaps are
    non-negative, so positions strictly increase by construction). After the
    last gap, ``consumed`` is the varint section's length and ``leftover``
    the record bytes read past it (the start of the values).
    """

    def __init__(self, reader: _Reader, count: int, nbytes: int, context: dict):
        self._reader, self.count, self.nbytes, self.context = reader, count, nbytes, context
        self.left, self.previous, self.consumed = count, -1, 0
        self._tail = np.empty(0, dtype=np.uint8)
        self.leftover = np.empty(0, dtype=np.uint8)
        self._scratch = np.empty(GAP_CHUNK_BYTES, dtype=np.uint8)

    def next(self) -> np.ndarray | None:
        """The next positions (int64, at most ``GAP_CHUNK_BYTES``), or None after the last one."""
        if not self.left:
            return None
        got = self._reader.read_into(memoryview(self._scratch))
        if not got and not self._tail.size:
            raise CodecError(f"xor_gaps record ends after {self.count - self.left} of its {self.count} gaps",
                             **self.context)
        buf = np.concatenate([self._tail, self._scratch[:got]]) if self._tail.size else self._scratch[:got]
        ends = np.flatnonzero(buf < 0x80)
        if ends.size > self.left:
            ends = ends[: self.left]
        used = int(ends[-1]) + 1 if ends.size else 0
        if self.left == ends.size:  # the section ends inside this chunk: the rest are values
            self.leftover = buf[used:].copy()
            self._tail = np.empty(0, dtype=np.uint8)
        else:
            if buf.size - used > MAX_VARINT or not got:
                what = "is longer than" if buf.size - used > MAX_VARINT else "ends inside a varint of"
                raise CodecError(f"xor_gaps record {what} {MAX_VARINT} bytes after gap {self.count - self.left}",
                                 **self.context)
            self._tail = buf[used:].copy()
        self.consumed += used
        if not ends.size:
            return np.empty(0, dtype=np.int64)
        gaps = _decode(buf, ends, self.context)
        room = self.nbytes - self.previous - 1  # a gap of `room` or more leaves the tensor
        if int(gaps.max()) >= room:
            raise self._outside(gaps)
        positions = np.cumsum(gaps + _U64(1))  # < ends.size * nbytes: no wrap for any real tensor size
        last = self.previous + int(positions[-1])
        if last >= self.nbytes:
            raise self._outside(gaps)
        self.left -= ends.size
        out = positions.astype(np.int64)
        out += self.previous
        self.previous = last
        return out

    def _outside(self, gaps: np.ndarray) -> CodecError:
        positions = self.previous + np.cumsum(gaps.astype(object) + 1)  # exact, only on the error path
        bad = next(int(p) for p in positions if p >= self.nbytes)
        return CodecError(f"xor_gaps position {bad} is outside the {self.nbytes}-byte tensor", **self.context)


def _count(reader: _Reader, context: dict) -> int:
    return struct.unpack("<Q", reader.read_exact(8, "xor_gaps record header"))[0]


def _longest(nbytes: int) -> int:
    """Most bytes a minimal varint of a gap inside an ``nbytes``-byte tensor can have (a gap is < nbytes)."""
    return max(1, min(MAX_VARINT, -(-max(1, (nbytes - 1).bit_length()) // 7)))


class _GapSum:
    """Validation of the varint section without decoding each varint: structure, and the sum of the gaps.

    Positions strictly increase by construction, so the record stays inside
    the tensor if and only if its last position, ``sum(gaps) + count - 1``,
    does. Each byte adds its 7 bits times 128 to the power of its index in
    its varint; bytes with index >= k are those preceded by k continuation
    bytes, a few vectorized passes over the bytes.
    """

    def __init__(self, reader: _Reader, count: int, nbytes: int, context: dict):
        self._reader, self.count, self.nbytes, self.context = reader, count, nbytes, context
        self.longest = _longest(nbytes)
        self.left, self.total, self.consumed = count, 0, 0
        self.leftover = np.empty(0, dtype=np.uint8)
        self._scratch = np.empty(GAP_CHUNK_BYTES, dtype=np.uint8)

    def run(self) -> None:
        tail = np.empty(0, dtype=np.uint8)
        while self.left:
            got = self._reader.read_into(memoryview(self._scratch))
            if not got:
                what = "inside a varint" if tail.size else "early"
                raise CodecError(f"xor_gaps record ends {what}, after {self.count - self.left} of its "
                                 f"{self.count} gaps", **self.context)
            buf = np.concatenate([tail, self._scratch[:got]]) if tail.size else self._scratch[:got]
            term = buf < 0x80
            found = int(np.count_nonzero(term))
            if found >= self.left:  # the section ends in this chunk: the rest are values
                end = int(np.flatnonzero(term)[self.left - 1]) + 1
                self.leftover, tail, found = buf[end:].copy(), np.empty(0, dtype=np.uint8), self.left
            else:
                end = buf.size - int(np.argmax(term[::-1])) if found else 0  # just after the last varint's end
                tail = buf[end:].copy()
                if tail.size >= self.longest:
                    raise self._too_long()
            self._add(buf[:end], term[:end])
            self.consumed += end
            self.left -= found
        if self.total + self.count > self.nbytes:
            raise CodecError(f"xor_gaps position {self.total + self.count - 1} is outside the {self.nbytes}-byte "
                             "tensor", **self.context)

    def _add(self, varint_bytes: np.ndarray, term: np.ndarray) -> None:
        if not varint_bytes.size:
            return
        low = varint_bytes & 0x7F
        self.total += int(low.sum(dtype=np.uint64))
        if term.all():
            return
        deeper = np.empty(term.size, dtype=bool)  # byte i is at index >= k of its varint
        deeper[0] = False
        np.logical_not(term[:-1], out=deeper[1:])
        if np.any(deeper & (varint_bytes == 0)):
            raise CodecError("xor_gaps varint is not minimal (its last byte is 0x00)", **self.context)
        cont = ~term
        for k in range(1, self.longest + 1):
            if not deeper.any():
                return
            if k == self.longest:
                raise self._too_long()
            weight = (1 << (7 * k)) - (1 << (7 * (k - 1)))
            self.total += int(low.sum(where=deeper, dtype=np.uint64)) * weight
            nxt = np.empty_like(deeper)
            nxt[0] = False
            np.logical_and(deeper[:-1], cont[:-1], out=nxt[1:])
            deeper = nxt

    def _too_long(self) -> CodecError:
        return CodecError(f"xor_gaps varint longer than {self.longest} bytes: its gap leaves the {self.nbytes}-byte "
                          f"tensor (or exceeds {MAX_VARINT} bytes)", **self.context)


def validate_gaps(frame, nbytes: int, context: dict) -> ValidatedFrame:
    """One streaming pass over the whole record: count, varints, bounds, exact length."""
    info = inspect_frame(frame, **context)
    reader = _Reader(frame, context, alone=True)
    try:
        count = _count(reader, context)
        if count > nbytes:
            raise CodecError(f"xor_gaps record claims {count} positions for a {nbytes}-byte tensor", **context)
        low, high = 8 + 2 * count, 8 + (MAX_VARINT + 1) * count
        if info.content_size is not None and not low <= info.content_size <= high:
            raise CodecError(f"xor_gaps record of {count} positions is {low} to {high} bytes, the frame "
                             f"declares {info.content_size}", **context)
        if info.min_output > high or info.max_output < low:
            decodes = (f"{info.min_output}" if info.min_output == info.max_output
                       else f"{info.min_output} to {info.max_output}")
            raise CodecError(f"xor_gaps record ends too early or runs too long: the frame decodes to {decodes} "
                             f"bytes, a record of {count} position(s) is {low} to {high}", **context)
        gaps = _GapSum(reader, count, nbytes, context)
        gaps.run()
        size = 8 + gaps.consumed + count
        if info.content_size is not None and info.content_size != size:
            raise CodecError(f"xor_gaps record of {count} positions is {size} bytes, the frame declares "
                             f"{info.content_size}", **context)
        if gaps.leftover.size > count:
            raise CodecError("xor_gaps record is longer than its count implies", **context)
        reader.skip(count - gaps.leftover.size)
        if not reader.at_end():
            raise CodecError("xor_gaps record is longer than its count implies", **context)
    finally:
        reader.close()
    return ValidatedFrame(GAPS, nbytes, memoryview(frame).nbytes, count, True, gaps.consumed)


class GapsStream:
    """An ``xor_gaps`` record read as it is applied (the ``storage.format.sparse`` source interface)."""

    def __init__(self, frame, validated: ValidatedFrame, context: dict, *, values: bool):
        self.context = context
        self._validated = validated
        size = 8 + (validated.positions_bytes or 0) + (validated.count or 0)
        self._readers = RecordReaders(frame, size, context, whole=values)
        self._reader = self._readers.open()
        self._values: _Reader | None = None
        try:
            count = _count(self._reader, context)
            if count != validated.count or validated.positions_bytes is None:
                raise CodecError(f"xor_gaps record holds {count} entries, validated with {validated.count}",
                                 **context)
            self._positions = GapPositions(self._reader, count, validated.nbytes, context)
            if values:
                self._values = self._readers.open()
                self._values.skip(8 + validated.positions_bytes)
        except BaseException:
            self.close()
            raise

    def next(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        pos = self._positions.next()
        if pos is None:
            return None
        val = None
        if self._values is not None:
            val = np.frombuffer(self._values.read_exact(pos.size, "xor_gaps values"), dtype=np.uint8)
        return pos, val

    def check_end(self) -> None:
        """After the last entry: the sections end where validation found them."""
        if self._positions.left:
            return
        if self._positions.consumed != self._validated.positions_bytes:
            raise CodecError("xor_gaps varints end elsewhere than validated", **self.context)
        if self._values is not None and not self._values.at_end():
            raise CodecError("xor_gaps record is longer than its count implies", **self.context)

    def close(self) -> None:
        self._reader.close()
        if self._values is not None:
            self._values.close()
        self._readers.close()
