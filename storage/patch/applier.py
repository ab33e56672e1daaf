"""Patching one tensor in place, block by block, touching only the pages that change (and undoing it).

For each block, every revision's decoder first says what it changes
(``storage.format.changes``), without writing. The block is then mapped: pages some
revision writes are populated writable in one ``MADV_POPULATE_WRITE`` call
per run of them (on a shared file mapping that marks them dirty, so it is
never used for pages that do not change); the rest only readable, for the
checksums. The changes are applied in revision order, each revision's
checksum updated on the running bytes actually written, and the block is
unmapped (``MADV_DONTNEED``: the process does not keep the checkpoint
resident; dirty pages stay in the page cache and reach the disk later).

Blocks after a tensor's first start on page boundaries of the file, so a
page belongs to one block of the tensor and a folded catch-up of K deltas
dirties it at most once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np

from storage.cancel import StopToken
from storage.format.changes import PAGE, page_runs, page_spans, touched_pages
from storage.format.checkpoint import CheckpointIndex, TensorLocation
from storage.format.codec import Decoder, make_decoder
from storage.format.digests import new_checksum
from storage.errors import ChecksumMismatch
from storage.killpoints import killpoint
from storage.format.mapped import MADV_DONTNEED, MADV_POPULATE_READ, MADV_POPULATE_WRITE, MappedFiles, advise

if TYPE_CHECKING:
    from storage.patch.patcher import PatchStep, TensorPlan


def block_bounds(location: TensorLocation, block_size: int) -> list[tuple[int, int]]:
    """``(offset in the tensor, size)`` of its blocks: cut where the file offset is a multiple of the block size.

    ``block_size`` is rounded up to whole pages.
    """
    size = max(PAGE, -(-block_size // PAGE) * PAGE)
    start, end = location.offset, location.offset + location.nbytes
    if start // size == (end - 1) // size:  # inside one block (most tensors of an MoE checkpoint): no cut
        return [(0, location.nbytes)] if end > start else []
    cuts = [start, *range(start - start % size + size, end, size), end]
    return [(a - start, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]


SMALL = 64 * 2**10  # a range below this is faulted in on touch and dropped in batches, not advised alone
RELEASE_BATCH = 16 * 2**20  # bytes of small ranges a process keeps mapped before dropping them together
RELEASE_GAP = 256 * 2**10  # small ranges this close are dropped by one call
RELEASE_RANGES = 4096  # ... or once this many ranges are waiting (their list stays small)


class _Releases:
    """Small ranges to drop from the process (``MADV_DONTNEED``), batched.

    A ``madvise`` call per tiny tensor costs more than the tensor (every call
    takes the address space's lock, and dropping pages interrupts the other
    threads to flush their TLBs), so ranges below ``SMALL`` are collected
    and dropped together once ``RELEASE_BATCH`` bytes (or ``RELEASE_RANGES``
    ranges) are waiting, sorted
    and merged across gaps under ``RELEASE_GAP``. Dropping a page of a shared
    mapping only unmaps it (its bytes stay in the page cache, dirty or not),
    so a page another thread still uses is simply faulted in again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int, int]] = []  # (mapping id, start, end)
        self._views: dict[int, np.ndarray] = {}
        self._bytes = 0

    def add(self, view: np.ndarray, start: int, length: int) -> None:
        with self._lock:
            self._views.setdefault(id(view), view)
            self._ranges.append((id(view), start, start + length))
            self._bytes += length
            if self._bytes < RELEASE_BATCH and len(self._ranges) < RELEASE_RANGES:
                return
            ranges, self._ranges, self._bytes = self._ranges, [], 0
            views = dict(self._views)
        self._drop(ranges, views)

    def clear(self) -> None:
        with self._lock:
            self._ranges, self._views, self._bytes = [], {}, 0

    @staticmethod
    def _drop(ranges: list[tuple[int, int, int]], views: dict[int, np.ndarray]) -> None:
        ranges.sort()
        key, start, end = ranges[0]
        for k, a, b in ranges[1:]:
            if k == key and a - end <= RELEASE_GAP:
                end = max(end, b)
                continue
            advise(views[key], start, end - start, MADV_DONTNEED)
            key, start, end = k, a, b
        advise(views[key], start, end - start, MADV_DONTNEED)


class Maps:
    """The checkpoint's shards mapped writable; buckets read-only, mapped as they arrive."""

    def __init__(self, folder: Path):
        self.shards = MappedFiles(folder, writable=True)
        self._lock = threading.Lock()
        self._buckets: dict[Path, MappedFiles] = {}
        self._arrays: dict[int, tuple[Path, np.ndarray]] = {}
        self._releases = _Releases()

    def _bucket(self, step: "PatchStep") -> np.ndarray:
        # the steps of one bucket share its Path object: looked up by identity, not by hashing the path per tensor
        known = self._arrays.get(id(step.bucket))
        if known is not None and known[0] is step.bucket:
            return known[1]
        with self._lock:
            files = self._buckets.get(step.bucket.parent)
            if files is None:
                files = self._buckets[step.bucket.parent] = MappedFiles(step.bucket.parent)
        array = files.array(step.bucket.name)
        self._arrays[id(step.bucket)] = (step.bucket, array)  # the Path is kept: its id is not reused
        return array

    def frame(self, step: "PatchStep") -> memoryview:
        view = self._bucket(step)
        if step.end - step.start >= SMALL:
            advise(view, step.start, step.end - step.start, MADV_POPULATE_READ)
        return memoryview(view)[step.start: step.end]

    def release_frame(self, step: "PatchStep") -> None:
        view = self._bucket(step)
        if step.end - step.start >= SMALL:
            advise(view, step.start, step.end - step.start, MADV_DONTNEED)
        else:
            self._releases.add(view, step.start, step.end - step.start)

    def block(self, location: TensorLocation, offset: int, size: int, pages: np.ndarray | bool = True
              ) -> np.ndarray:
        """A view of ``size`` bytes of the tensor from ``offset``, pre-faulted: ``pages`` (a flag per page of the
        block, or True for all, False for none) writable, the rest readable."""
        view = self.shards.array(location.file)
        start = location.offset + offset
        if size < SMALL:  # a few pages: faulting them on touch is cheaper than a call (and dirties the same ones)
            return view[start: start + size]
        if pages is True:
            advise(view, start, size, MADV_POPULATE_WRITE)
        else:
            advise(view, start, size, MADV_POPULATE_READ)
            if pages is not False:
                first_page = start - start % PAGE
                for first, count in page_runs(pages):
                    advise(view, first_page + first * PAGE, count * PAGE, MADV_POPULATE_WRITE)
        return view[start: start + size]

    def release_block(self, location: TensorLocation, offset: int, size: int) -> None:
        if size < SMALL:
            self._releases.add(self.shards.array(location.file), location.offset + offset, size)
        else:
            self.shards.advise(location.file, location.offset + offset, size, MADV_DONTNEED)

    def close(self) -> None:
        """Drop every mapping now (not at garbage collection): a mapping pins its filesystem."""
        self._releases.clear()  # it holds views of the mappings: unmapping drops their pages anyway
        self.shards.close()
        with self._lock:
            buckets, self._buckets = list(self._buckets.values()), {}
            self._arrays = {}
        for files in buckets:
            files.close()


@dataclass
class Progress:
    """How far one tensor got: whole blocks, then steps into the block being patched; pages it wrote."""

    plan: "TensorPlan"
    block_size: int
    bounds: list[tuple[int, int]] = field(default_factory=list)
    decoders: list[Decoder | None] = field(default_factory=list)
    blocks: int = 0
    steps_in_block: int = 0
    pages_written: int = 0
    blocks_unchanged: int = 0

    @property
    def touched(self) -> bool:
        return self.blocks > 0 or self.steps_in_block > 0


def apply_tensor(maps: Maps, state: Progress, target_format: str, progress: Callable[[int], None] | None,
                 halt: StopToken) -> str:
    """Patch one tensor through its plan's steps; returns its checksum in ``target_format``."""
    plan, block_size = state.plan, state.block_size
    location = plan.location
    name = location.name
    state.bounds = block_bounds(location, block_size)
    size_max = max((s for _, s in state.bounds), default=1)
    state.decoders = [
        make_decoder(s.encoding, maps.frame(s), location.nbytes, block_size=size_max, validated=s.validated,
                     **s.context(name))
        for s in plan.steps
    ]
    hashes = [new_checksum(s.checksum_format) for s in plan.steps]
    final_in_own_format = plan.steps[-1].checksum_format == target_format
    final = hashes[-1] if final_in_own_format else new_checksum(target_format)
    for offset, size in state.bounds:
        halt.check(tensor=name, mutation_started=True)
        changes = [decoder.changes(offset, size) for decoder in state.decoders]  # decode: nothing written yet
        head = (location.offset + offset) % PAGE
        pages = touched_pages(changes, head, size)
        block = maps.block(location, offset, size, pages)
        spans = page_spans(pages, head, size)  # a page outside them is only read: a store would dirty it
        for i, (change, h) in enumerate(zip(changes, hashes)):
            if change is not None and spans != []:
                change.apply(block, spans)
            state.steps_in_block = i + 1
            h.update(block)  # the bytes as written: an apply bug cannot go unnoticed
        state.blocks, state.steps_in_block = state.blocks + 1, 0
        if pages is False:
            state.blocks_unchanged += 1
        else:
            state.pages_written += (head + size + PAGE - 1) // PAGE if pages is True else int(pages.sum())
        if not final_in_own_format:
            final.update(block)
        maps.release_block(location, offset, size)
        if progress:
            progress(size * len(state.decoders))
        killpoint("apply.block")
    for decoder in state.decoders:
        decoder.finish()
    for step in plan.steps:
        maps.release_frame(step)
    # only overwrite decoders are needed to undo (they hold the replaced bytes); let the others go
    state.decoders = [d if s.encoding == "overwrite" else None for s, d in zip(plan.steps, state.decoders)]
    for step, h in zip(plan.steps, hashes):
        got = h.hexdigest()
        if got != step.checksum:
            raise ChecksumMismatch(
                f"tensor bytes hash to {got} after applying the delta, the bucket says {step.checksum}",
                mutation_started=True, **step.context(name),
            )
    return final.hexdigest()


def undo(maps: Maps, touched: list[Progress], base: Mapping[str, str], fmt: str, checkpoint: CheckpointIndex,
         log) -> bool:
    """Revert every patched byte, newest step first within each block; True if the base hashes are back.

    XOR steps are undone by applying the same frame again (fresh decoders);
    ``overwrite`` steps restore the bytes their decoder saved before writing.
    """
    try:
        for state in touched:
            plan, name = state.plan, state.plan.location.name
            size_max = max((s for _, s in state.bounds), default=1)
            fresh = [d if s.encoding == "overwrite" else
                     make_decoder(s.encoding, maps.frame(s), plan.location.nbytes, block_size=size_max,
                                  validated=s.validated, **s.context(name))
                     for s, d in zip(plan.steps, state.decoders)]
            last = state.blocks + (1 if state.steps_in_block else 0)
            for b, (offset, size) in enumerate(state.bounds[:last]):
                block = maps.block(plan.location, offset, size)
                depth = len(plan.steps) if b < state.blocks else state.steps_in_block
                for i in reversed(range(depth)):
                    if plan.steps[i].encoding == "overwrite":
                        fresh[i].undo(block, offset)
                    else:
                        fresh[i].apply(block, offset)
        names = [s.plan.location.name for s in touched]
        now = checkpoint.checksums(fmt, names=names, workers=2) if names else {}
        ok = all(now[n] == base.get(n) for n in names)
        if not ok:
            log.error("undo did not restore the base checksums of %s", [n for n in names if now[n] != base.get(n)])
        return ok
    except Exception as exc:  # an undo that cannot finish is reported, and the caller rebuilds instead
        log.error("could not undo the partial apply: %s", exc)
        return False
