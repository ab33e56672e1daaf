"""One block of a tensor through its revisions' changes, in order, each revision's checksum kept on the way.

Every revision's checksum is checked on the running bytes. A single revision (a steady refit) hashes the
block once it is patched; a sparse XOR is written and hashed a ``PIECE`` at a time, so the hash reads each
piece from the cache the writes just filled instead of reading the whole block from memory a second time.
Folding two or more (a catch-up), all in ``adler32``, the block is hashed whole once,
after the last revision, over the bytes as written; each earlier revision's adler32 of the block is derived
from that by taking back the later revisions' changes, each computed from the bytes it changed alone
(adler32 is linear in the bytes: ``storage.format.digests.adler32_delta``; the first revision's change is
never taken back, so it is not measured). A dense change is not taken back either: past the first, the block
is hashed before and after it. The final checksum thus still covers every byte as written (an apply
bug cannot go unnoticed), and every intermediate one is the adler32 of the running bytes, without hashing
the block once per revision. Each block's values are appended to the revisions' running checksums
(``combine``); other checksum formats hash the block after each revision.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from storage.format.changes import Change, DenseChange, SparseChange
from storage.format.digests import adler32_delta, adler32_of, adler32_sub

LINEAR_MAX_BLOCK = 2**27  # ``adler32_delta``'s sums stay exact in int64 up to this block size
PIECE = 2**18  # a steady refit's sparse XOR is written and hashed this many bytes at a time (in the L2 cache)


def linear_sums(formats: Sequence[str]) -> bool:
    """Whether revisions checked in ``formats`` (in revision order) have their checksums derived from the
    changed bytes (``fold_block``)."""
    return len(formats) >= 2 and all(f == "adler32" for f in formats)


def fold_block(changes: Sequence[Change | None], block: np.ndarray, spans, hashes: list, linear: bool,
               state) -> None:
    """Apply ``changes`` (one per revision, None where the revision leaves the block alone) to ``block`` in order,
    feeding each revision's checksum in ``hashes`` the block's bytes after it; ``state.steps_in_block`` counts
    the revisions applied (the undo reverts exactly those). ``spans``: the block's byte ranges whose pages are
    written (``storage.format.changes.page_spans``). ``linear`` (``linear_sums``): derive the adler32 values."""
    if not linear or block.size > LINEAR_MAX_BLOCK:
        if len(changes) == 1 and spans != [] and _in_pieces(changes[0], block, spans, hashes[0]):
            state.steps_in_block = 1
            return
        for i, (change, h) in enumerate(zip(changes, hashes)):
            if change is not None and spans != []:
                change.apply(block, spans)
            state.steps_in_block = i + 1
            h.update(block)  # the bytes as written
        return
    size = block.size
    values: list[int] = []  # the block's adler32 after each revision, known so far
    pending: list[tuple[int, int]] = []  # changes of the revisions after those, not yet resolved
    for i, change in enumerate(changes):
        if change is None or spans == []:
            pending.append((0, 0))
        elif not pending:  # the first change after a hash is never taken back: nothing to measure
            change.apply(block, spans)
            pending.append((0, 0))
        elif isinstance(change, SparseChange):
            pending.append(_apply_sparse(change, block))
        else:  # dense: every byte may change; the block is hashed on both sides of it
            _resolve(values, pending, adler32_of(block))
            change.apply(block, spans)
            values.append(adler32_of(block))
        state.steps_in_block = i + 1
    _resolve(values, pending, adler32_of(block))  # the bytes as written, hashed whole
    for value, h in zip(values, hashes):
        h.combine(value, size)


def _resolve(values: list[int], pending: list[tuple[int, int]], now: int) -> None:
    """Append the values after each ``pending`` change, given ``now`` (the block's adler32 after them all)."""
    after = []
    for delta in reversed(pending):
        after.append(now)
        now = adler32_sub(now, delta)
    values.extend(reversed(after))
    pending.clear()


def _apply_sparse(change: SparseChange, block: np.ndarray) -> tuple[int, int]:
    """``change.apply(block)`` (the same writes, ``on_apply`` first); returns what it did to the block's adler32
    (``adler32_delta``), from the bytes it changed."""
    index = change.index
    old = block[index]
    if change.on_apply is not None:
        change.on_apply(block, index)
    new = change.values if change.overwrite else old ^ change.values
    block[index] = new
    return adler32_delta(block.size, index, old, new)


def _in_pieces(change: Change | None, block: np.ndarray, spans, h) -> bool:
    """One revision's XOR (sparse, or dense within ``spans``) written and hashed a piece of the block at a time, so
    the hash reads each piece while the writes have left it in the cache; False (nothing done) for an
    ``overwrite``, no change or a block of one piece.

    If a write fails, the bytes already written are XORed back before the error goes on: the block is then as it
    was, as the undo expects of a revision not counted in ``steps_in_block``."""
    if block.size <= PIECE:
        return False
    if isinstance(change, DenseChange):
        _dense_in_pieces(change.data, block, [(0, block.size)] if spans is None else spans, h)
        return True
    if not isinstance(change, SparseChange) or change.overwrite or change.on_apply is not None:
        return False
    size, index, values = block.size, change.index, change.values
    ends = range(PIECE, size + PIECE, PIECE)
    cuts = index.searchsorted(ends[:-1]).tolist()
    cuts.append(index.size)
    lo = start = 0
    try:
        for end, hi in zip(ends, cuts):
            if hi > lo:
                block[index[lo:hi]] ^= values[lo:hi]
            lo = hi
            h.update(block[start:min(end, size)])
            start = end
    except BaseException:
        block[index[:lo]] ^= values[:lo]
        raise
    return True


def _dense_in_pieces(data: np.ndarray, block: np.ndarray, spans: list[tuple[int, int]], h) -> None:
    """``_in_pieces`` of a dense XOR: ``data`` XORed into the byte ranges ``spans`` (sorted, apart)."""
    size, k, written = block.size, 0, []
    try:
        for start in range(0, size, PIECE):
            end = min(start + PIECE, size)
            while k < len(spans) and spans[k][0] < end:
                a, b = max(spans[k][0], start), min(spans[k][1], end)
                if a < b:
                    np.bitwise_xor(block[a:b], data[a:b], out=block[a:b])
                    written.append((a, b))
                if spans[k][1] > end:
                    break
                k += 1
            h.update(block[start:end])
    except BaseException:
        for a, b in written:
            np.bitwise_xor(block[a:b], data[a:b], out=block[a:b])
        raise
