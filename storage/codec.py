"""Delta frames: encode on the publisher, validate and apply on the receiver (SPEC section 5).

A tensor delta is one zstd frame. Dense ``xor`` decodes to the XOR of base and
target bytes; ``xor_sparse`` and ``overwrite`` decode to a record of byte
positions and values. Receivers validate a frame's structure before decoding
it (one frame, exact length, declared sizes), decode in bounded blocks, and
never write past the tensor. Sparse records are validated whole before any
byte of their tensor changes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import zstandard

from storage.errors import CodecError

ZSTD_MAGIC = 0xFD2FB528
BLOCK_SIZE_MAX = 128 * 1024
ENCODE_BLOCK = 16 * 2**20
SPARSE_CHUNK = 1 << 20  # positions per validation/apply chunk
_MAX_POSITIONS = {"xor_sparse": 2**64 - 1, "overwrite": 2**32 - 1}
_HEADER = {"xor_sparse": ("<Q", 8, "<u8"), "overwrite": ("<I", 4, "<u4")}


# --- encoding (publisher) -----------------------------------------------------------------


def encode_delta(base: np.ndarray, target: np.ndarray, encoding: str, *, level: int = 3) -> bytes:
    """One zstd frame encoding ``target`` against ``base`` (1-D uint8 arrays of equal size)."""
    if base.shape != target.shape:
        raise ValueError("base and target must have the same size")
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    if encoding == "xor":
        return _encode_dense_xor(cctx, base, target)
    if encoding in ("xor_sparse", "overwrite"):
        return cctx.compress(sparse_record(base, target, encoding))
    raise ValueError(f"unknown delta encoding {encoding!r}")


def _encode_dense_xor(cctx: zstandard.ZstdCompressor, base: np.ndarray, target: np.ndarray) -> bytes:
    n = base.size
    obj = cctx.compressobj(size=n)
    parts = []
    scratch = np.empty(min(n, ENCODE_BLOCK), dtype=np.uint8)
    for start in range(0, n, ENCODE_BLOCK):
        end = min(n, start + ENCODE_BLOCK)
        block = scratch[: end - start]
        np.bitwise_xor(base[start:end], target[start:end], out=block)
        parts.append(obj.compress(block))
    parts.append(obj.flush())
    return b"".join(parts)


def sparse_record(base: np.ndarray, target: np.ndarray, encoding: str) -> bytes:
    """The uncompressed ``xor_sparse`` / ``overwrite`` record of the changed bytes."""
    fmt, _, pos_dtype = _HEADER[encoding]
    positions = np.flatnonzero(base != target)
    if encoding == "overwrite" and base.size > _MAX_POSITIONS["overwrite"] + 1:
        raise ValueError("overwrite records address at most 4 GiB per tensor")
    values = target[positions] if encoding == "overwrite" else base[positions] ^ target[positions]
    return struct.pack(fmt, positions.size) + positions.astype(pos_dtype).tobytes() + values.tobytes()


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


class _Reader:
    """Bounded reads from one zstd frame; zstd errors become ``CodecError``."""

    def __init__(self, frame, context: dict):
        self.context = context
        self._reader = zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False)
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


# --- decoders (receiver) -----------------------------------------------------------------------


class Decoder(Protocol):
    """Applies one revision's delta of one tensor block by block, in order."""

    def apply(self, block: np.ndarray, offset: int) -> None: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


class DenseXor:
    """Dense XOR: stream the frame in blocks and XOR them into the destination."""

    def __init__(self, frame, nbytes: int, block_size: int, **context):
        self.context = context
        self.nbytes = nbytes
        _expect_output(inspect_frame(frame, **context), nbytes, **context)
        self._reader = _Reader(frame, context)
        self._scratch = np.empty(min(block_size, max(nbytes, 1)), dtype=np.uint8)

    def apply(self, block: np.ndarray, offset: int) -> None:
        n = block.size
        scratch = self._scratch[:n]
        got = self._reader.read_into(memoryview(scratch))
        if got != n:
            raise CodecError(
                f"dense frame decodes to only {offset + got} bytes, the tensor has {self.nbytes}", **self.context
            )
        np.bitwise_xor(block, scratch, out=block)

    def finish(self) -> None:
        try:
            if not self._reader.at_end():
                raise CodecError(f"dense frame decodes to more than the tensor's {self.nbytes} bytes", **self.context)
        finally:
            self._reader.close()

    def close(self) -> None:
        self._reader.close()


class SparseXor:
    """``xor_sparse``: u64 count, strictly increasing u64 positions, u8 values XORed in.

    Validated by one streaming pass before any byte changes; applied with two
    streaming readers (positions and values), so memory stays bounded.
    """

    def __init__(self, frame, nbytes: int, **context):
        self.frame, self.nbytes, self.context = frame, nbytes, context
        self.count = _sparse_header(frame, nbytes, "xor_sparse", context)
        self._validate()
        self._positions = _Reader(frame, context)
        self._positions.skip(8)
        self._values = _Reader(frame, context)
        self._values.skip(8 + 8 * self.count)
        self._pending = np.empty(0, dtype=np.uint64)
        self._pending_values = np.empty(0, dtype=np.uint8)
        self._left = self.count

    def _validate(self) -> None:
        reader = _Reader(self.frame, self.context)
        try:
            reader.skip(8)
            previous, left = -1, self.count
            while left:
                n = min(left, SPARSE_CHUNK)
                chunk = np.frombuffer(reader.read_exact(8 * n, "xor_sparse positions"), dtype="<u8")
                if int(chunk[0]) <= previous or (n > 1 and not bool(np.all(chunk[1:] > chunk[:-1]))):
                    raise CodecError("xor_sparse positions are not strictly increasing", **self.context)
                if int(chunk[-1]) >= self.nbytes:
                    raise CodecError(f"xor_sparse position {int(chunk[-1])} is outside the "
                                     f"{self.nbytes}-byte tensor", **self.context)
                previous, left = int(chunk[-1]), left - n
            reader.skip(self.count)
            if not reader.at_end():
                raise CodecError("xor_sparse record is longer than its count implies", **self.context)
        finally:
            reader.close()

    def _refill(self) -> None:
        n = min(self._left, SPARSE_CHUNK)
        positions = np.frombuffer(self._positions.read_exact(8 * n, "xor_sparse positions"), dtype="<u8")
        values = np.frombuffer(self._values.read_exact(n, "xor_sparse values"), dtype=np.uint8)
        self._pending = np.concatenate([self._pending, positions])
        self._pending_values = np.concatenate([self._pending_values, values])
        self._left -= n

    def apply(self, block: np.ndarray, offset: int) -> None:
        end = offset + block.size
        while self._left and (self._pending.size == 0 or int(self._pending[-1]) < end):
            self._refill()
        k = int(np.searchsorted(self._pending, end))
        if k:
            idx = self._pending[:k].astype(np.int64) - offset
            block[idx] ^= self._pending_values[:k]
            self._pending, self._pending_values = self._pending[k:], self._pending_values[k:]

    def finish(self) -> None:
        self.close()

    def close(self) -> None:
        self._positions.close()
        self._values.close()


class SparseOverwrite:
    """``overwrite``: u32 count, u32 positions, u8 values that replace the base bytes.

    Positions need not be sorted, so the record (at most 5 bytes per tensor
    byte) is decoded whole, validated, and then sorted stably so that later
    entries for the same position win, as in record order. The bytes it
    replaces are kept (one byte per entry), so ``undo`` can put them back.
    """

    def __init__(self, frame, nbytes: int, **context):
        self.context = context
        count = _sparse_header(frame, nbytes, "overwrite", context)
        reader = _Reader(frame, context)
        try:
            reader.skip(4)
            positions = np.frombuffer(reader.read_exact(4 * count, "overwrite positions"), dtype="<u4")
            values = np.frombuffer(reader.read_exact(count, "overwrite values"), dtype=np.uint8)
            if not reader.at_end():
                raise CodecError("overwrite record is longer than its count implies", **context)
        finally:
            reader.close()
        if count and int(positions.max()) >= nbytes:
            raise CodecError(f"overwrite position {int(positions.max())} is outside the {nbytes}-byte tensor",
                             **context)
        order = np.argsort(positions, kind="stable")
        self._positions = positions[order].astype(np.int64)
        self._values = values[order]
        self._next = 0
        self._replaced: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def apply(self, block: np.ndarray, offset: int) -> None:
        end = self._next + int(np.searchsorted(self._positions[self._next:], offset + block.size))
        if end > self._next:
            index = self._positions[self._next:end] - offset
            self._replaced[offset] = (index, block[index].copy())
            block[index] = self._values[self._next:end]
            self._next = end

    def undo(self, block: np.ndarray, offset: int) -> None:
        """Put back the bytes ``apply`` replaced in the block at ``offset``."""
        saved = self._replaced.pop(offset, None)
        if saved is not None:
            block[saved[0]] = saved[1]

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def _sparse_header(frame, nbytes: int, encoding: str, context: dict) -> int:
    fmt, header, pos_dtype = _HEADER[encoding]
    info = inspect_frame(frame, **context)
    reader = _Reader(frame, context)
    try:
        first = reader.read_exact(header, f"{encoding} record header")
    finally:
        reader.close()
    (count,) = struct.unpack(fmt, first)
    if count > nbytes:
        raise CodecError(f"{encoding} record claims {count} positions for a {nbytes}-byte tensor", **context)
    expected = sparse_size(count, encoding)
    if info.content_size is not None and info.content_size != expected:
        raise CodecError(f"{encoding} record of {count} positions should be {expected} bytes, "
                         f"the frame declares {info.content_size}", **context)
    _expect_output(info, expected, **context)
    return count


def make_decoder(encoding: str, frame, nbytes: int, *, block_size: int, **context) -> Decoder:
    """Validate ``frame`` for a tensor of ``nbytes`` and return its decoder."""
    if encoding == "xor":
        return DenseXor(frame, nbytes, block_size, **context)
    if encoding == "xor_sparse":
        return SparseXor(frame, nbytes, **context)
    if encoding == "overwrite":
        return SparseOverwrite(frame, nbytes, **context)
    raise CodecError(f"unsupported delta encoding {encoding!r}", **context)
