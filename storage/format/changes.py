"""What one revision's delta does to one block of a tensor, known before the block is touched.

Decoding and writing are two steps. A decoder first turns its frame's next
block into a ``DenseChange`` (the decoded XOR bytes) or a ``SparseChange``
(positions and values), or ``None`` when nothing in the block changes; the
patcher then learns from ``touched_pages`` which pages of the checkpoint will
be written, maps exactly those writable (``MADV_POPULATE_WRITE`` dirties every
page it maps on a shared file mapping), and only then applies the changes in
revision order. A page no revision changes is never written, so it stays
clean; a page several folded revisions change is dirtied once.
"""

from __future__ import annotations

import mmap

import numpy as np

PAGE = mmap.PAGESIZE
_WORDS_PER_PAGE = PAGE // 8


class DenseChange:
    """XOR of a decoded block into the destination.

    ``all_pages`` says the frame is too dense for some page to stay
    unchanged to be worth looking for (its pages are then all treated as
    written, which is always safe: a page written with its own bytes is only
    dirtied, never wrong).
    """

    __slots__ = ("data", "all_pages")

    def __init__(self, data: np.ndarray, all_pages: bool):
        self.data, self.all_pages = data, all_pages

    def apply(self, block: np.ndarray, spans: list[tuple[int, int]] | None = None) -> None:
        """XOR into the whole block, or only into ``spans`` (byte ranges of it): a store into a page, even of
        the byte already there, dirties that page."""
        if spans is None:
            np.bitwise_xor(block, self.data, out=block)
            return
        for a, b in spans:
            np.bitwise_xor(block[a:b], self.data[a:b], out=block[a:b])

    def mark(self, pages: np.ndarray, head: int) -> bool:
        """Set ``pages[p]`` for every page with a non-zero byte; True if every page is then set.

        ``head`` is the block's offset inside its first page.
        """
        if self.all_pages:
            pages[:] = True
            return True
        data, n = self.data, self.data.size
        first = min(n, (PAGE - head) % PAGE)  # bytes in a first, partial page
        if first:
            pages[0] |= bool(data[:first].any())
        full = (n - first) // PAGE
        if full:
            middle = data[first: first + full * PAGE]
            if first % 8 == 0:  # aligned: one pass over 64-bit words
                rows = np.bitwise_or.reduce(middle.view(np.uint64).reshape(full, _WORDS_PER_PAGE), axis=1)
            else:
                rows = np.bitwise_or.reduce(middle.reshape(full, PAGE), axis=1)
            p0 = 1 if first else 0
            pages[p0: p0 + full] |= rows != 0
        rest = n - first - full * PAGE
        if rest:
            pages[-1] |= bool(data[n - rest:].any())
        return bool(pages.all())


class SparseChange:
    """Values XORed into (or written over) positions of the block; ``on_apply`` sees the block first."""

    __slots__ = ("index", "values", "overwrite", "on_apply")

    def __init__(self, index: np.ndarray, values: np.ndarray, *, overwrite: bool = False, on_apply=None):
        self.index, self.values, self.overwrite, self.on_apply = index, values, overwrite, on_apply

    def apply(self, block: np.ndarray, spans: list[tuple[int, int]] | None = None) -> None:
        """Write the entries (every one lies in a page ``mark`` flagged, so ``spans`` is not needed)."""
        if self.on_apply is not None:
            self.on_apply(block, self.index)
        if self.overwrite:
            block[self.index] = self.values  # distinct positions: one entry per position
        else:
            block[self.index] ^= self.values

    def mark(self, pages: np.ndarray, head: int) -> bool:
        index = self.index
        if index.size:
            # positions are sorted: a binary search per page boundary counts the entries below it, so the
            # entries themselves are not read (a page is written when the count grows across it)
            below = index.searchsorted(np.arange(PAGE - head, pages.size * PAGE - head, PAGE))
            written = np.empty(pages.size, dtype=bool)
            np.not_equal(below, np.concatenate(([0], below[:-1])), out=written[:-1])
            written[-1] = below[-1] != index.size if below.size else True
            pages |= written
        return bool(pages.all())


Change = DenseChange | SparseChange


def touched_pages(changes: list[Change | None], head: int, size: int) -> np.ndarray | bool:
    """Pages of a block (``size`` bytes from ``head`` bytes into its first page) any change writes.

    Returns False when no change writes anything, True when every page is
    written, else a bool per page.
    """
    live = [c for c in changes if c is not None]
    if not live:
        return False
    pages = np.zeros((head + size + PAGE - 1) // PAGE, dtype=bool)
    for change in live:
        if change.mark(pages, head):
            return True
    return pages if pages.any() else False


def page_spans(pages: np.ndarray | bool, head: int, size: int) -> list[tuple[int, int]] | None:
    """Byte ranges of a block covered by its flagged pages (None: all of it; [] for none)."""
    if pages is True:
        return None
    if pages is False:
        return []
    return [(max(0, first * PAGE - head), min(size, (first + count) * PAGE - head))
            for first, count in page_runs(pages)]


def page_runs(pages: np.ndarray) -> list[tuple[int, int]]:
    """``(first page, page count)`` of each run of set flags."""
    edges = np.diff(np.concatenate(([0], pages.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]
