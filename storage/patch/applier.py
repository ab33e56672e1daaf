"""Patching one tensor in place, block by block, touching only the pages that change (and undoing it).

For each block, every revision's decoder first says what it changes
(``storage.format.changes``), without writing. The block is then mapped: pages some
revision writes are populated writable in one ``MADV_POPULATE_WRITE`` call
per run of them (on a shared file mapping that marks them dirty, so it is
never used for pages that do not change); the rest only readable, for the
checksums. The changes are applied in revision order, each revision's
checksum kept on the running bytes (``storage.patch.fold``: a catch-up hashes
the block once, over the bytes as written, and derives the earlier revisions'
adler32 from the bytes they changed), and the block is unmapped (``MADV_DONTNEED``: the process does not keep the checkpoint
resident; dirty pages stay in the page cache and reach the disk later).

Blocks after a tensor's first start on page boundaries of the file, so a
page belongs to one block of the tensor and a folded catch-up of K deltas
dirties it at most once.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from storage.runtime.cancel import StopToken
from storage.format.changes import PAGE, DenseChange, page_runs, page_spans, touched_pages
from storage.format.checkpoint import CheckpointIndex, TensorLocation
from storage.format.codec import DENSE_PAGES_RATIO, Decoder, make_decoder
from storage.format.frames import SMALL_FRAME, decode_small
from storage.format.digests import checksum_bytes, new_checksum
from storage.errors import ChecksumMismatch
from storage.runtime.killpoints import killpoint
from storage.patch.fold import fold_block, linear_sums
from storage.patch.tiny import apply_batch
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
        self.add_many([(view, start, length)])

    def add_many(self, ranges: list[tuple[np.ndarray, int, int]]) -> None:
        """``add`` for each ``(view, start, length)``, under one lock (a batch of tiny tensors)."""
        self.add_keyed({id(view): view for view, _, _ in ranges},
                       [(id(view), start, start + length) for view, start, length in ranges])

    def add_keyed(self, views: dict[int, np.ndarray], ranges: list[tuple[int, int, int]]) -> None:
        """``add_many`` of ``(id(view), start, end)`` ranges, ``views`` naming each view by its id."""
        with self._lock:
            for key, view in views.items():
                self._views.setdefault(key, view)
            self._ranges += ranges
            self._bytes += sum(end - start for _, start, end in ranges)
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

    def release_small(self, views: dict[int, np.ndarray], ranges: list[tuple[int, int, int]]) -> None:
        """Drop small ranges (``(id(view), start, end)``, each under ``SMALL``; ``views`` by id) in the next batch."""
        if ranges:
            self._releases.add_keyed(views, ranges)

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


class Progress:
    """How far one tensor got: whole blocks, then steps into the block being patched; pages it wrote.

    A plain class with slots (one is made per tensor: 100k of them in a refit of an MoE checkpoint)."""

    __slots__ = ("plan", "block_size", "bounds", "decoders", "validated", "blocks", "steps_in_block",
                 "pages_written", "blocks_unchanged")

    def __init__(self, plan: "TensorPlan", block_size: int) -> None:
        self.plan, self.block_size = plan, block_size
        # replaced, never changed in place: empty tuples until then (no list a tensor)
        self.bounds: Sequence[tuple[int, int]] = ()
        self.decoders: Sequence[Decoder | None] = ()
        self.validated: Sequence = ()  # each step's record as its decoder validated it (undo decodes without checking)
        self.blocks = self.steps_in_block = self.pages_written = self.blocks_unchanged = 0

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
    decoders: list[Decoder] = []
    try:  # each record validated as it is decoded (a sparse one whole, here): a bad one before the tensor changes
        for s in plan.steps:
            decoders.append(make_decoder(s.encoding, maps.frame(s), location.nbytes, block_size=size_max,
                                         validated=s.validated, **s.context(name)))
    except BaseException:
        for decoder in decoders:  # their decoded records go now, not when the error's traceback does
            decoder.close()
        raise
    state.decoders = decoders
    state.validated = [getattr(d, "validated", s.validated) for s, d in zip(plan.steps, decoders)]
    hashes = [new_checksum(s.checksum_format) for s in plan.steps]
    linear = linear_sums([s.checksum_format for s in plan.steps])
    final_in_own_format = plan.steps[-1].checksum_format == target_format
    final = hashes[-1] if final_in_own_format else new_checksum(target_format)
    for offset, size in state.bounds:
        halt.check(tensor=name, mutation_started=True)
        changes = [decoder.changes(offset, size) for decoder in state.decoders]  # decode: nothing written yet
        head = (location.offset + offset) % PAGE
        pages = touched_pages(changes, head, size)
        block = maps.block(location, offset, size, pages)
        spans = page_spans(pages, head, size)  # a page outside them is only read: a store would dirty it
        fold_block(changes, block, spans, hashes, linear, state)  # each revision's checksum on the running bytes
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


def is_tiny(plan: "TensorPlan", block_size: int) -> bool:
    """A tensor ``apply_tiny`` patches: dense XOR steps only, validated, decoded whole, inside one block and
    under ``SMALL`` (its pages are faulted in on touch: no ``madvise``)."""
    location = plan.location
    n = location.nbytes
    if not 0 < n < SMALL or n > SMALL_FRAME or n > block_size:
        return False
    size = max(PAGE, -(-block_size // PAGE) * PAGE)
    if location.offset // size != (location.offset + n - 1) // size:
        return False
    for step in plan.steps:
        v = step.validated
        if step.encoding != "xor" or v is None or v.encoding != "xor" or v.nbytes != n \
                or v.frame_size != step.end - step.start:
            return False
    return True


def apply_tiny(maps: Maps, states: list[Progress], target_format: str, halt: StopToken,
               fallback: Callable[[Progress], str], *, single: bool | None = None) -> list[str]:
    """Patch a batch of tiny tensors (``is_tiny``), one after the other; returns each one's checksum in
    ``target_format``.

    The same bytes, pages, checksums and errors as ``apply_tensor`` (each step's checksum on the bytes as
    written, a page no step changes never written, ``Progress`` kept for undo), without its per-block
    machinery: each frame is decoded in one call, the tensor's view is a slice of its shard's mapping, and
    the small ranges to drop are handed over once for the batch. ``halt`` is checked once per batch (a batch
    is at most ``TINY_BYTES`` of tensors under ``SMALL``: no more bytes than one block of a large tensor). A
    frame that does not decode cleanly goes through ``fallback`` (``apply_tensor``), which names the problem.
    Tensors of one delta each (``single``: the caller counted) go through ``storage.patch.tiny.apply_batch`` together.
    """
    if states:
        halt.check(tensor=states[0].plan.location.name, mutation_started=True)
    if len(states) > 1 and (all(len(s.plan.steps) == 1 for s in states) if single is None else single):  # steady
        done = apply_batch(maps, states, target_format)
        if done is not None:
            return done
    out: list[str] = []
    releases: list[tuple[int, int, int]] = []  # (id(view), start, end) of the small ranges to drop
    views: dict[int, np.ndarray] = {}
    shards = maps.shards
    try:
        for state in states:
            plan = state.plan
            location = plan.location
            n = location.nbytes
            steps = plan.steps
            changes = []
            for step in steps:
                frame = maps._bucket(step)
                whole = decode_small(frame[step.start: step.end], n)
                if whole is None:
                    break
                changes.append(DenseChange(np.frombuffer(whole, dtype=np.uint8),
                                           step.end - step.start > n * DENSE_PAGES_RATIO))
                views[id(frame)] = frame
                releases.append((id(frame), step.start, step.end))
            if len(changes) != len(steps):
                out.append(fallback(state))
                continue
            state.bounds = [(0, n)]
            state.decoders = [None] * len(steps)  # XOR steps: undo decodes their frames again
            view = shards.array(location.file)
            start = location.offset
            head = start % PAGE
            if len(changes) == 1 and changes[0].all_pages:
                pages = True  # what ``touched_pages`` says of one dense change over every page
            else:
                pages = touched_pages(changes, head, n)
            block = view[start: start + n]
            spans = None if pages is True else page_spans(pages, head, n)
            sums = []
            for i, (change, step) in enumerate(zip(changes, steps)):
                if spans != []:
                    change.apply(block, spans)
                state.steps_in_block = i + 1
                sums.append(checksum_bytes(step.checksum_format, block))
            state.blocks, state.steps_in_block = 1, 0
            if pages is False:
                state.blocks_unchanged = 1
            else:
                state.pages_written = (head + n + PAGE - 1) // PAGE if pages is True else int(pages.sum())
            views[id(view)] = view
            releases.append((id(view), start, start + n))
            killpoint("apply.block")
            for step, got in zip(steps, sums):
                if got != step.checksum:
                    raise ChecksumMismatch(
                        f"tensor bytes hash to {got} after applying the delta, the bucket says {step.checksum}",
                        mutation_started=True, **step.context(location.name),
                    )
            if steps[-1].checksum_format == target_format:
                out.append(sums[-1])
            else:
                out.append(checksum_bytes(target_format, block))
    finally:
        maps.release_small(views, releases)
    return out


def undo(maps: Maps, touched: list[Progress], base: Mapping[str, str], fmt: str, checkpoint: CheckpointIndex,
         log) -> bool:
    """Revert every patched byte, newest step first within each block; True if the base hashes are back.

    XOR steps are undone by applying the same frame again (fresh decoders, told what the apply pass validated);
    ``overwrite`` steps restore the bytes their decoder saved before writing. Only the blocks a step reached
    are reverted: a tensor stopped mid-way (mid-block included) is undone exactly. The kill point
    ``undo.tensor`` follows each reverted tensor (a kill there leaves the rest to the next run's recovery).
    """
    try:
        for state in touched:
            plan, name = state.plan, state.plan.location.name
            size_max = max((s for _, s in state.bounds), default=1)
            checked = state.validated or [s.validated for s in plan.steps]
            fresh = [d if s.encoding == "overwrite" else
                     make_decoder(s.encoding, maps.frame(s), plan.location.nbytes, block_size=size_max,
                                  validated=v, **s.context(name))
                     for s, d, v in zip(plan.steps, state.decoders, checked)]
            last = state.blocks + (1 if state.steps_in_block else 0)
            for b, (offset, size) in enumerate(state.bounds[:last]):
                block = maps.block(plan.location, offset, size)
                depth = len(plan.steps) if b < state.blocks else state.steps_in_block
                for i in reversed(range(depth)):
                    if plan.steps[i].encoding == "overwrite":
                        fresh[i].undo(block, offset)
                    else:
                        fresh[i].apply(block, offset)
            for i, decoder in enumerate(fresh):
                if plan.steps[i].encoding != "overwrite":
                    decoder.close()
            killpoint("undo.tensor")
        names = [s.plan.location.name for s in touched]
        now = checkpoint.checksums(fmt, names=names, workers=2) if names else {}
        ok = all(now[n] == base.get(n) for n in names)
        if not ok:
            log.error("undo did not restore the base checksums of %s", [n for n in names if now[n] != base.get(n)])
        return ok
    except Exception as exc:  # an undo that cannot finish is reported, and the caller rebuilds instead
        log.error("could not undo the partial apply: %s", exc)
        return False
