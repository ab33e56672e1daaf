"""The publisher's encoding of one tensor: base and target ``uint8`` arrays in, one zstd frame out.

One pass over the two arrays, a block at a time: the XOR of the block (in a
reused scratch buffer, so no page of fresh memory is faulted in per block),
the changed positions when the encoding is sparse, and the target's checksum
while its bytes are still in cache. A tensor that did not change gives no
frame. The frame is then written in the record layout of docs/format.md,
section 5.6 (or ``storage.format.gaps`` for the opt-in ``xor_gaps``), always with its
content size. Output is deterministic: the same arrays and setting give the
same bytes, so a republish uploads identical objects.

``Encoder`` holds one thread's scratch buffers; ``storage.format.autoselect`` uses
it to measure candidate settings on a sample before a revision is encoded.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from storage.format.digests import new_checksum
from storage.format.gaps import GAPS, gaps_of, varints

DIFF_BLOCK = 1 << 20  # bytes compared per step: the block, its XOR and its mask stay in cache
CANONICAL = ("xor", "xor_sparse", "overwrite")
EXTENDED = (GAPS,)
OVERWRITE_MAX_TENSOR = 2**32  # u32 positions
GAP_BATCH = 1 << 18  # positions turned into varints per batch


class FileSlice:
    """A tensor's bytes in an open file, read block by block with ``pread``.

    Copying a block from the page cache costs less than faulting a mapping of
    it in and out (about 100 against 150 ms per GB here), and the publisher
    then keeps no checkpoint pages mapped. ``Encoder`` takes one wherever it
    takes an array; slicing gives a narrower ``FileSlice``.
    """

    def __init__(self, fd: int, offset: int, nbytes: int):
        self.fd, self.offset, self.size = fd, offset, nbytes
        self.shape, self.ndim = (nbytes,), 1

    def __getitem__(self, key: slice) -> "FileSlice":
        start, stop, _ = key.indices(self.size)
        return FileSlice(self.fd, self.offset + start, max(0, stop - start))

    def read(self, start: int, end: int, out: np.ndarray) -> np.ndarray:
        view, done = memoryview(out)[: end - start], 0
        while done < end - start:
            got = os.preadv(self.fd, [view[done:]], self.offset + start + done)
            if not got:
                raise OSError(f"file ends {end - start - done} bytes before the tensor does")
            done += got
        return out[: end - start]


Source = "np.ndarray | FileSlice"


@dataclass(frozen=True, order=True)
class Setting:
    """An encoding and the zstd level its frames are compressed at."""

    encoding: str
    level: int

    def __str__(self) -> str:
        return f"{self.encoding} (zstd {self.level})"


@dataclass
class Encoded:
    """One tensor's frame (None: unchanged), the target's checksum, and how many bytes changed."""

    frame: bytes | None
    checksum: str | None
    changed_bytes: int | None = None  # counted by the sparse encodings only


class Encoder:
    """Encodes tensors one after the other on one thread, reusing its scratch buffers."""

    def __init__(self, block: int = DIFF_BLOCK):
        self.block = block
        self._xor = np.empty(block, dtype=np.uint8)
        self._mask = np.empty(block, dtype=bool)
        self._words = np.empty(block // 8, dtype=bool)
        self._in = (np.empty(block, dtype=np.uint8), np.empty(block, dtype=np.uint8))
        self._cctx: dict[int, zstandard.ZstdCompressor] = {}

    def _blocks(self, base: Source, target: Source):
        """``(start, base block, target block)`` over the two sources (arrays are sliced, files read)."""
        n = base.size
        for s in range(0, n, self.block):
            e = min(n, s + self.block)
            b = base[s:e] if isinstance(base, np.ndarray) else base.read(s, e, self._in[0])
            t = target[s:e] if isinstance(target, np.ndarray) else target.read(s, e, self._in[1])
            yield s, b, t

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        cctx = self._cctx.get(level)
        if cctx is None:
            cctx = self._cctx[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
        return cctx

    def encode(self, base: Source, target: Source, setting: Setting, *,
               checksum_format: str | None = None) -> Encoded:
        """The frame of ``target`` against ``base`` (1-D uint8 arrays, or ``FileSlice``s, of equal size)."""
        if base.shape != target.shape or base.ndim != 1:
            raise ValueError("base and target must be 1-D arrays of the same size")
        h = new_checksum(checksum_format) if checksum_format else None
        if setting.encoding == "xor":
            return self._dense(base, target, setting.level, h)
        if setting.encoding not in CANONICAL + EXTENDED:
            raise ValueError(f"unknown delta encoding {setting.encoding!r}")
        if setting.encoding == "overwrite" and base.size > OVERWRITE_MAX_TENSOR:
            raise ValueError("overwrite records address at most 4 GiB per tensor")
        positions, values = self.changes(base, target, overwrite=setting.encoding == "overwrite", checksum=h)
        count = sum(p.size for _, p in positions)
        checksum = h.hexdigest() if h else None
        if not count:
            return Encoded(None, checksum, 0)
        frame = self._sparse_frame(setting, positions, values, count)
        return Encoded(frame, checksum, count)

    # --- dense ---------------------------------------------------------------------------------------------------

    def _dense(self, base: Source, target: Source, level: int, h) -> Encoded:
        n = base.size
        if 0 < n <= self.block:  # one block (every tensor of an MoE checkpoint but the large ones): one call
            b = base if isinstance(base, np.ndarray) else base.read(0, n, self._in[0])
            t = target if isinstance(target, np.ndarray) else target.read(0, n, self._in[1])
            x = self._xor[:n]
            np.bitwise_xor(b, t, out=x)
            checksum = None
            if h is not None:
                h.update(t)
                checksum = h.hexdigest()
            return Encoded(self.compressor(level).compress(x) if _any(x) else None, checksum)
        obj = self.compressor(level).compressobj(size=n)
        parts, changed = [], False
        for _, b, t in self._blocks(base, target):
            x = self._xor[: b.size]
            np.bitwise_xor(b, t, out=x)
            if h is not None:
                h.update(t)
            if not changed:
                changed = _any(x)
            parts.append(obj.compress(x))
        parts.append(obj.flush())
        checksum = h.hexdigest() if h else None
        return Encoded(b"".join(parts) if changed else None, checksum)

    # --- sparse ---------------------------------------------------------------------------------------------------

    def changes(self, base: Source, target: Source, *, overwrite: bool = False, checksum=None,
                start: int = 0) -> tuple[list[tuple[int, np.ndarray]], list[np.ndarray]]:
        """Changed positions, per block as ``(block start, uint32 offsets in the block)``, and their values.

        Values are the XOR of base and target, or the target's bytes for
        ``overwrite``. ``start`` is added to every block start (a sample
        taken from inside a tensor keeps the tensor's positions).
        """
        positions, values = [], []
        for s, b, t in self._blocks(base, target):
            x, mask = self._xor[: b.size], self._mask[: b.size]
            np.bitwise_xor(b, t, out=x)
            if checksum is not None:
                checksum.update(t)
            rel = self._nonzero(x, mask)
            if rel.size:
                values.append(t[rel] if overwrite else x[rel])
                positions.append((start + s, rel.astype(np.uint32)))
        return positions, values

    def _nonzero(self, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Offsets of the non-zero bytes of ``x``, ascending. Where at most a quarter of its 8-byte words
        hold a change (RL steps), the words are found first and only theirs are looked into: NumPy finds
        the true entries of a bool array several times faster than the non-zero ones of any other."""
        words, tail = divmod(x.size, 8)
        if not tail:  # a tensor's last block may end inside a word: that one goes byte by byte
            x64, flags = x.view(np.uint64), self._words[:words]
            np.not_equal(x64, 0, out=flags)
            if np.count_nonzero(flags) * 4 <= words:
                hit = np.flatnonzero(flags)
                inner = np.flatnonzero(x64[hit].view(np.uint8) != 0)  # byte offsets inside the changed words
                out = hit[inner >> 3]
                out <<= 3
                out += inner & 7
                return out
        np.not_equal(x, 0, out=mask)
        return np.flatnonzero(mask)

    def _sparse_frame(self, setting: Setting, positions, values, count: int) -> bytes:
        encoding = setting.encoding
        if encoding == GAPS:
            sections = [struct.pack("<Q", count), *_gap_sections(positions), *values]
        else:
            fmt, dtype = ("<Q", "<u8") if encoding == "xor_sparse" else ("<I", "<u4")
            sections = [struct.pack(fmt, count)]
            sections += [_shifted(rel, s, dtype) for s, rel in positions]
            sections += values
        size = sum(memoryview(p).nbytes for p in sections)
        obj = self.compressor(setting.level).compressobj(size=size)
        out = [obj.compress(p) for p in sections]
        out.append(obj.flush())
        return b"".join(out)


def _gap_sections(positions: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
    """The varints of blocks of positions, encoded a batch of blocks at a time (NumPy calls cost per call)."""
    out, batch, previous, pending = [], [], -1, 0
    for i, (start, rel) in enumerate(positions):
        batch.append(rel.astype(np.int64) + start)
        pending += rel.size
        if pending >= GAP_BATCH or i == len(positions) - 1:
            absolute = batch[0] if len(batch) == 1 else np.concatenate(batch)
            out.append(varints(gaps_of(absolute, previous)))
            previous, batch, pending = int(absolute[-1]), [], 0
    return out


def _shifted(rel: np.ndarray, start: int, dtype: str) -> np.ndarray:
    out = rel.astype(dtype)
    if start:
        out += np.array(start, dtype=dtype)
    return out


def _any(x: np.ndarray) -> bool:
    """True if some byte of ``x`` is non-zero (64 bits at a time where the length allows)."""
    words = x.size // 8
    if words and np.count_nonzero(x[: words * 8].view(np.uint64)):
        return True
    return bool(x[words * 8:].any())


def encode_delta(base: np.ndarray, target: np.ndarray, encoding: str, *, level: int = 3) -> bytes:
    """One zstd frame of ``target`` against ``base``; an unchanged tensor gets a frame of no change too."""
    encoded = Encoder().encode(base, target, Setting(encoding, level))
    if encoded.frame is not None:
        return encoded.frame
    empty = np.zeros(0, dtype=np.uint8)
    if encoding == "xor":
        return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(bytes(base.size))
    return Encoder()._sparse_frame(Setting(encoding, level), [], [empty], 0)  # a record of count 0
