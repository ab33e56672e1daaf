"""zstd frames as the receiver meets them: strict structure checks, bounded reads, validation summaries.

``inspect_frame`` walks a frame's block headers without decompressing it,
so trailing data, truncation, skippable frames, dictionaries and reserved
block types are rejected up front; ``_Reader`` reads a frame in bounded
pieces; ``ValidatedFrame`` is what one full validation pass proved, so the
pass that applies a frame need not repeat it. The record layouts of the
sparse encodings (``xor_sparse``, ``overwrite``) are defined here too.
"""

from __future__ import annotations

import struct
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import zstandard

from storage.errors import CodecError

ZSTD_MAGIC = 0xFD2FB528
BLOCK_SIZE_MAX = 128 * 1024
_HEADER = {"xor_sparse": ("<Q", 8, "<u8"), "overwrite": ("<I", 4, "<u4")}  # count format, its size, position dtype


def sparse_size(changed: int, encoding: str) -> int:
    """Uncompressed record size for ``changed`` positions."""
    _, header, pos_dtype = _HEADER[encoding]
    return header + changed * (np.dtype(pos_dtype).itemsize + 1)


# --- frame structure (receiver) ---------------------------------------------------------------


@dataclass(frozen=True)
class FrameInfo:
    """What a frame's headers promise, checked without decompressing it."""

    content_size: int | None
    min_output: int
    max_output: int


def inspect_frame(frame, **context) -> FrameInfo:
    """Validate that ``frame`` is exactly one zstd frame and bound its decoded size.

    Walks the block headers (as ``ZSTD_findFrameCompressedSize`` does), so
    trailing bytes, truncation, skippable frames, dictionaries and reserved
    block types are rejected before a byte is decompressed.
    """
    view = memoryview(frame).cast("B")
    size = view.nbytes
    if size < 4 or struct.unpack_from("<I", view, 0)[0] != ZSTD_MAGIC:
        raise CodecError("delta is not a zstd frame (bad magic number)", **context)
    try:
        params = zstandard.get_frame_parameters(view)
        pos = zstandard.frame_header_size(view)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame header is invalid ({exc})", **context) from None
    if params.dict_id:
        raise CodecError(f"zstd frame needs dictionary {params.dict_id}, which is not supported", **context)
    content_size = None if params.content_size == zstandard.CONTENTSIZE_UNKNOWN else params.content_size
    block_max = min(params.window_size or BLOCK_SIZE_MAX, BLOCK_SIZE_MAX)
    min_out = max_out = 0
    while True:
        if pos + 3 > size:
            raise CodecError("zstd frame is truncated (block header past the end)", **context)
        header = view[pos] | (view[pos + 1] << 8) | (view[pos + 2] << 16)
        last, block_type, block_size = header & 1, (header >> 1) & 3, header >> 3
        pos += 3
        if block_type == 3:
            raise CodecError("zstd frame has a reserved block type", **context)
        if block_size > block_max:
            raise CodecError(f"zstd block of {block_size} bytes exceeds the {block_max}-byte maximum", **context)
        if block_type == 0:  # raw
            pos += block_size
            min_out += block_size
            max_out += block_size
        elif block_type == 1:  # RLE: one byte repeated block_size times
            pos += 1
            min_out += block_size
            max_out += block_size
        else:  # compressed
            pos += block_size
            max_out += block_max
        if pos > size:
            raise CodecError("zstd frame is truncated (block runs past the end)", **context)
        if last:
            break
    if params.has_checksum:
        pos += 4
    if pos > size:
        raise CodecError("zstd frame is truncated (content checksum missing)", **context)
    if pos != size:
        raise CodecError(f"{size - pos} bytes of trailing data after the zstd frame", **context)
    if content_size is not None:
        if min_out > content_size:  # raw/RLE blocks alone outgrow what the header declares
            raise CodecError(f"zstd frame declares {content_size} decoded bytes but its blocks decode to at "
                             f"least {min_out}", **context)
        min_out = max_out = content_size
    return FrameInfo(content_size, min_out, max_out)


def _expect_output(info: FrameInfo, expected: int, **context) -> None:
    if info.content_size is not None and info.content_size != expected:
        raise CodecError(f"zstd frame declares {info.content_size} decoded bytes, expected {expected}", **context)
    if info.min_output > expected:
        raise CodecError(f"zstd frame decodes to at least {info.min_output} bytes, more than {expected}", **context)
    if info.max_output < expected:
        raise CodecError(f"zstd frame decodes to at most {info.max_output} bytes, fewer than {expected}", **context)


_THREAD = threading.local()


def _own_decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompression context, for readers used one at a time (creating one costs more than
    decoding a small frame)."""
    dctx = getattr(_THREAD, "dctx", None)
    if dctx is None:
        dctx = _THREAD.dctx = zstandard.ZstdDecompressor()
    return dctx


SMALL_FRAME = 64 * 2**10  # decoded bytes up to which a dense frame is decoded in one call


def decode_small(frame, nbytes: int) -> bytes | None:
    """The ``nbytes`` a small frame decodes to, in one call with this thread's one-shot context; None if it
    does not decode to exactly that (the streaming reader then finds and names the problem).

    A stream reader allocates its own context and window per frame, which
    costs more than decoding a frame of a tiny tensor.
    """
    dctx = getattr(_THREAD, "oneshot", None)
    if dctx is None:
        dctx = _THREAD.oneshot = zstandard.ZstdDecompressor()
    try:
        data = dctx.decompress(frame, max_output_size=max(1, nbytes))
    except zstandard.ZstdError:
        return None
    return data if len(data) == nbytes else None


class _Reader:
    """Bounded reads from one zstd frame; zstd errors become ``CodecError``.

    ``alone``: no other reader of this thread is open until this one is closed, so it may use the thread's
    shared decompression context.
    """

    def __init__(self, frame, context: dict, *, alone: bool = False):
        self.context = context
        dctx = _own_decompressor() if alone else zstandard.ZstdDecompressor()
        self._reader = dctx.stream_reader(frame, read_across_frames=False)
        self.position = 0

    def read_into(self, buf: memoryview) -> int:
        total, want = 0, buf.nbytes
        try:
            while total < want:
                got = self._reader.readinto(buf[total:])
                if not got:
                    break
                total += got
        except zstandard.ZstdError as exc:
            raise CodecError(f"corrupt zstd data ({exc})", **self.context) from None
        self.position += total
        return total

    def read_exact(self, n: int, what: str) -> memoryview:
        buf = memoryview(bytearray(n))
        got = self.read_into(buf)
        if got != n:
            raise CodecError(f"{what} ends after {self.position} decoded bytes", **self.context)
        return buf

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 4 * 2**20) or 1))
        while n:
            step = min(n, scratch.nbytes)
            if self.read_into(scratch[:step]) != step:
                raise CodecError(f"frame ends after {self.position} decoded bytes", **self.context)
            n -= step

    def at_end(self) -> bool:
        return self.read_into(memoryview(bytearray(1))) == 0

    def close(self) -> None:
        self._reader.close()


class _DecodedReader:
    """``_Reader``'s reads over a record already decoded whole: slices, no second decompression."""

    def __init__(self, data: memoryview, context: dict):
        self._data, self.context, self.position = data, context, 0

    def read_into(self, buf: memoryview) -> int:
        n = min(buf.nbytes, self._data.nbytes - self.position)
        buf[:n] = self._data[self.position: self.position + n]
        self.position += n
        return n

    def read_exact(self, n: int, what: str) -> memoryview:
        if self.position + n > self._data.nbytes:
            self.position = self._data.nbytes
            raise CodecError(f"{what} ends after {self.position} decoded bytes", **self.context)
        self.position += n
        return self._data[self.position - n: self.position]

    def skip(self, n: int) -> None:
        if self.position + n > self._data.nbytes:
            self.position = self._data.nbytes
            raise CodecError(f"frame ends after {self.position} decoded bytes", **self.context)
        self.position += n

    def at_end(self) -> bool:
        return self.position == self._data.nbytes

    def close(self) -> None:
        pass


class WholeRecordBudget:
    """Bytes of records that may be held decoded at once, process-wide (thread-safe)."""

    def __init__(self, nbytes: int):
        self._left, self._lock = nbytes, threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self._left:
                return False
            self._left -= n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._left += n

    @property
    def available(self) -> int:
        with self._lock:
            return self._left


# a record applied while it streams is decompressed twice (its values follow all its positions, so a
# second reader decodes the positions again to reach them); one decoded whole, within this budget, once
WHOLE_RECORDS = WholeRecordBudget(128 * 2**20)


class RecordReaders:
    """Opens readers of one record: over a single whole decode when ``size`` bytes fit ``WHOLE_RECORDS``,
    else each a fresh streaming ``_Reader``.

    The budget comes back when the decoded bytes are freed (``close`` drops this object's reference; views
    still held elsewhere keep them, and the budget, until they go too), on every path, failures included.
    """

    def __init__(self, frame, size: int, context: dict, *, whole: bool):
        self._frame, self._context, self._data = frame, context, None
        budget = WHOLE_RECORDS
        if not (whole and 0 < size and budget.take(size + 1)):
            return
        buf = np.empty(size + 1, dtype=np.uint8)  # one byte more: a longer record fails where streaming does
        weakref.finalize(buf, budget.give, size + 1)
        reader = _Reader(frame, context, alone=True)
        try:
            got = reader.read_into(memoryview(buf))
        finally:
            reader.close()
        self._data = memoryview(buf)[:got]  # so does a shorter one

    @property
    def decoded(self) -> memoryview | None:
        """The record decoded whole (at most ``size + 1`` bytes: a longer one shows as ``size + 1``), or None when
        it did not fit the budget (readers then stream)."""
        return self._data

    def open(self) -> "_Reader | _DecodedReader":
        if self._data is None:
            return _Reader(self._frame, self._context)
        return _DecodedReader(self._data, self._context)

    def close(self) -> None:
        self._data = None


@dataclass(frozen=True)
class ValidatedFrame:
    """What one full validation pass proved about a frame, so the decoder that applies it can skip the pass.

    ``complete`` False: only the frame's structure was checked (``storage.format.codec.check_frame``: headers,
    declared sizes; no decompression), so the decoder validates the record as it decodes it, once; a sparse
    record's ``count`` is then the one its declared content size implies (None when undeclared).

    ``count`` is a sparse record's number of entries (None for dense ``xor``);
    ``ordered`` says its positions never decrease, so it can be applied while
    it streams (an unordered ``overwrite`` record is decoded whole, hence capped);
    ``positions_bytes`` is the length of an ``xor_gaps`` record's varint
    section (its values start at ``8 + positions_bytes``), None otherwise.
    """

    encoding: str
    nbytes: int
    frame_size: int
    count: int | None = None
    ordered: bool = True
    positions_bytes: int | None = None
    complete: bool = True


_FCS_BYTES = np.array([1, 2, 4, 8], dtype=np.int64)


def plain_xor_frames(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """For each frame ``data[starts[i]:ends[i]]`` of a dense ``xor`` delta of a tensor of ``nbytes[i]`` (> 0):
    True where it is, by its headers alone, one single-segment zstd frame of one raw or compressed block that
    declares exactly ``nbytes[i]`` decoded bytes and ends where its block (and checksum) end.

    One pass of array operations over a bucket's frames. A frame marked True is one ``inspect_frame`` accepts
    and ``check_frame("xor", ...)`` summarises as ``ValidatedFrame("xor", nbytes, size)``; a frame marked False
    is merely not of this common shape (``check_frame`` then decides, and names any problem).
    """
    n = starts.size
    size = ends - starts
    ok = (size >= 9) & (nbytes > 0)
    last = data.size - 1
    at = np.where(ok, starts, 0)

    def byte(offset) -> np.ndarray:
        return data[np.minimum(at + offset, last)].astype(np.int64)

    magic = byte(0) | byte(1) << 8 | byte(2) << 16 | byte(3) << 24
    fhd = byte(4)
    ok &= (magic == ZSTD_MAGIC) & ((fhd & 0x3B) == 0x20)  # single segment, no dictionary, reserved bits clear
    width = _FCS_BYTES[fhd >> 6]
    content = np.zeros(n, dtype=np.int64)
    for k in range(8):  # little-endian, ``width`` bytes from offset 5
        content |= np.where(k < width, byte(5 + k), 0) << (8 * k)
    content += np.where(width == 2, 256, 0)
    ok &= (width < 8) | (content >= 0)
    head = 5 + width
    block = byte(head) | byte(head + 1) << 8 | byte(head + 2) << 16
    kind, length = (block >> 1) & 3, block >> 3
    body = np.where(kind == 1, 1, length)
    ok &= (block & 1 == 1) & ((kind == 0) | (kind == 2)) & (length <= np.minimum(nbytes, BLOCK_SIZE_MAX))
    ok &= content == nbytes
    ok &= head + 3 + body + np.where(fhd & 4 != 0, 4, 0) == size
    return ok
