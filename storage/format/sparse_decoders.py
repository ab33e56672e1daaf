"""Sparse decoders (``xor_sparse``, ``overwrite``, ``xor_gaps``): a record's entries block by block, in step with
the tensor's blocks, and an ``overwrite``'s undo (``storage.format.sparse`` has the records and their checks).

A decoder given a summary of the frame's structure alone (``ValidatedFrame.complete`` False) validates the
record when it is made, decoding it once (``check_record``): a bad record is rejected before its tensor changes,
and the decoded bytes are the ones applied.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from storage.errors import CodecError
from storage.format.changes import SparseChange
from storage.format.frames import RecordReaders, ValidatedFrame, sparse_size
from storage.format.gaps import GAPS, GapsStream
from storage.format.sparse import _SortedStream, _UnsortedRecord, check_record


class _Cursor:
    """Walks a source's entries in position order, one position range (a block) at a time."""

    def __init__(self, source: "_SortedStream | _UnsortedRecord | GapsStream"):
        self.source = source
        self.reached = 0  # no entry below this position can be returned any more
        self._pos = np.empty(0, dtype=np.int64)
        self._val: np.ndarray | None = None
        self._i = 0

    def entries(self, start: int, end: int) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Entries with start <= position < end, a chunk at a time; those below ``start`` are passed over."""
        self.reached = end
        while True:
            if self._i == self._pos.size:
                chunk = self.source.next()
                if chunk is None:
                    return
                (self._pos, self._val), self._i = chunk, 0
            pos = self._pos
            lo = self._i + int(np.searchsorted(pos[self._i:], start))
            hi = lo + int(np.searchsorted(pos[lo:], end))
            self._i = hi
            if hi > lo:
                yield pos[lo:hi], None if self._val is None else self._val[lo:hi]
            if hi < pos.size:
                return


class _SparseDecoder:
    """Shared plumbing: sources are opened on first use, so a decoder built only to be closed costs nothing."""

    def __init__(self, frame, nbytes: int, *, validated: ValidatedFrame, **context):
        self.frame, self.nbytes, self.context = frame, nbytes, context
        self._record: RecordReaders | None = None  # the record decoded (and validated) whole, for the first source
        if not validated.complete:  # only the frame's structure was checked: validate the record now, decoding it
            validated, self._record = check_record(frame, validated, context)
        self.validated = validated
        self._cursor: _Cursor | None = None
        self._whole: tuple[np.ndarray, np.ndarray] | None = None  # a sorted xor_sparse record's entries, decoded
        self._next = 0  # ... and the first of them not yet handed out
        self._applied_to = 0

    def _source(self, *, values: bool):
        record, self._record = self._record, None  # its decoded bytes serve one source, then go
        if self.validated.encoding == GAPS:
            return GapsStream(self.frame, self.validated, self.context, values=values)
        kind = _SortedStream if self.validated.ordered else _UnsortedRecord
        if record is not None and not values:  # positions only (an overwrite's undo): streamed, nothing held
            record.close()
            record = None
        return kind(self.frame, self.validated, self.context, values=values, readers=record)

    def _block_entries(self, offset: int, size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Positions (relative to ``offset``) and values of the entries in ``[offset, offset + size)``."""
        if offset != self._applied_to:
            raise ValueError(f"blocks must be applied in order from 0: expected offset {self._applied_to}, "
                             f"got {offset}")
        self._applied_to = offset + size
        if self._cursor is None and self._whole is None and not self._take_whole():
            self._cursor = _Cursor(self._source(values=True))
        if self._whole is not None:  # blocks come in order: the block's entries start where the last one's ended
            pos, val = self._whole
            lo, hi = self._next, int(pos.searchsorted(offset + size))
            self._next = hi
            if hi == lo:
                return None
            return (pos[lo:hi] - offset if offset else pos[lo:hi]), val[lo:hi]
        parts = list(self._cursor.entries(offset, offset + size))
        if not parts:
            return None
        if len(parts) == 1:
            pos, val = parts[0]
        else:
            pos, val = np.concatenate([p for p, _ in parts]), np.concatenate([v for _, v in parts])
        return (pos - offset if offset else pos), val

    def _take_whole(self) -> bool:
        """Hold a sorted ``xor_sparse`` record decoded (and validated) whole as its position and value arrays,
        views of the decoded bytes; False for any other record (it is read through a ``_Cursor``)."""
        record, validated = self._record, self.validated
        if record is None or record.decoded is None or validated.encoding != "xor_sparse" or not validated.ordered:
            return False
        count, data = validated.count or 0, record.decoded
        if data.nbytes != sparse_size(count, "xor_sparse"):  # ``check_record`` rejected any other size already
            return False
        self._record = None
        record.close()  # the arrays below keep the decoded bytes (and their budget) until ``close``
        # u64 positions validated below the tensor's size are int64 as they are: no copy
        positions = np.frombuffer(data, dtype="<u8", count=count, offset=8).view(np.int64)
        self._whole = positions, np.frombuffer(data, dtype=np.uint8, count=count, offset=8 + 8 * count)
        return True

    def apply(self, block: np.ndarray, offset: int) -> None:
        change = self.changes(offset, block.size)
        if change is not None:
            change.apply(block)

    def finish(self) -> None:
        try:
            if self._cursor is not None:
                self._cursor.source.check_end()
        finally:
            self.close()

    def close(self) -> None:
        self._whole = None
        if self._record is not None:
            self._record.close()
            self._record = None
        if self._cursor is not None:
            self._cursor.source.close()
            self._cursor = None


class SparseXor(_SparseDecoder):
    """``xor_sparse`` (u64 positions) and ``xor_gaps`` (varint gaps): values XORed in at strictly increasing
    positions; streamed."""

    def changes(self, offset: int, size: int) -> SparseChange | None:
        """The block's entries, ready to apply once the patcher has mapped their pages."""
        entries = self._block_entries(offset, size)
        return None if entries is None else SparseChange(*entries)


class SparseOverwrite(_SparseDecoder):
    """``overwrite``: u32 count, u32 positions (any order), u8 values that replace the base bytes.

    Keeps the bytes it replaced (one per distinct position) so ``undo`` can
    put them back; the positions are re-derived from the frame on undo.
    """

    def __init__(self, frame, nbytes: int, *, validated: ValidatedFrame, **context):
        super().__init__(frame, nbytes, validated=validated, **context)
        self._replaced: dict[int, np.ndarray] = {}
        self._undo: _Cursor | None = None

    def changes(self, offset: int, size: int) -> SparseChange | None:
        entries = self._block_entries(offset, size)
        if entries is None:
            return None

        def save(block: np.ndarray, index: np.ndarray) -> None:
            self._replaced[offset] = block[index]  # fancy indexing copies

        return SparseChange(*entries, overwrite=True, on_apply=save)

    def undo(self, block: np.ndarray, offset: int) -> None:
        """Put back the bytes ``apply`` replaced in the block at ``offset`` (blocks in any order)."""
        saved = self._replaced.pop(offset, None)
        if saved is None:
            return
        if self._undo is None or self._undo.reached > offset:  # behind the cursor: decode from the start
            self._close_undo()
            self._undo = _Cursor(self._source(values=False))
        done = 0
        for pos, _ in self._undo.entries(offset, offset + block.size):
            index = pos - offset
            if done + index.size > saved.size:
                break
            block[index] = saved[done:done + index.size]
            done += index.size
        if not self._replaced:
            self._close_undo()
        if done != saved.size:
            raise CodecError("overwrite frame no longer matches the bytes saved to undo it", **self.context)

    def _close_undo(self) -> None:
        if self._undo is not None:
            self._undo.source.close()
            self._undo = None
