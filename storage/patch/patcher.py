"""Patch a mutable mmap-backed checkpoint with a replay chain of delta buckets.

``bucket_steps`` checks one bucket (header, metadata, checksums, each frame's
structure and declared size: nothing is decompressed) before any of its bytes
are used; ``plan_patches`` does it for every bucket of a chain and groups the
frames into one ``TensorPlan`` per changed tensor. ``apply_patches`` streams each
tensor once (``storage.patch.applier``): each record is decoded once, and
validated as it is (a sparse record whole, before its tensor changes; a dense
frame block by block); for every bounded block it folds the block through the
tensor's K decoders in revision order, updating each revision's checksum on
the running value, and writes only the pages some revision changes. Plans may
arrive while buckets are still downloading (``PlanSource``). If anything fails,
the bytes already patched are undone in place (``undo_to``): XOR deltas are
their own inverse, and overwritten bytes were saved.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

from storage.patch.applier import SMALL, Maps, Progress, apply_tensor, apply_tiny, is_tiny, undo
from storage.runtime.cancel import StopToken
from storage.format.checkpoint import CheckpointIndex, TensorLocation
from storage.errors import Cancelled, CodecError, RefitError
from storage.catalog.manifests import Manifest
from storage.patch.buckets import PatchStep, TensorPlan, bucket_steps, tensor_plan  # noqa: F401  (re-exported)
from storage.runtime.gc_pause import gc_paused

log = logging.getLogger("canonical_refit.patcher")
BLOCK_SIZE = 4 * 2**20  # per tensor block: few madvise calls; the block and its scratch stay in the L3 cache
MIN_FOLD_BLOCK = 2**20
TINY_BATCH = 512  # tensors an apply worker takes at once: tiny ones are patched together (applier.apply_tiny)
TINY_BYTES = 2**18  # ... in groups of at most this many bytes (its index arrays take 8 bytes a byte, a few times)


class PlanSource(Protocol):
    """Where ``apply_patches`` gets its work: tensor names up front, each plan when it is ready."""

    def names(self) -> list[str]: ...

    def take(self) -> str | None:
        """The next tensor to patch (a ready one, largest first; may block); None when all are taken."""

    def take_many(self, limit: int, small: int) -> list[str]:
        """The tensors ``take`` would hand out next, in that order: one, and if it is under ``small`` bytes the
        ready ones after it while they are too, up to ``limit`` (blocks only for the first); [] when all are
        taken. Optional: ``take`` is used without it."""

    def plan(self, name: str) -> TensorPlan:
        """The plan of a taken tensor, its buckets checked (``bucket_steps``)."""

    def cancel(self) -> None:
        """Stop waiting: another tensor failed."""

    def prepare(self) -> None:
        """Check what can be checked before the store changes (may block for the first download)."""

    def total_bytes(self) -> int:
        """Tensor bytes times steps: what progress counts to."""


class StaticPlans:
    """Plans that are all known before applying starts (every bucket already fetched)."""

    def __init__(self, plans: Sequence[TensorPlan]):
        self._plans = {p.location.name: p for p in plans}
        self._queue = sorted(self._plans, key=lambda n: (-self._plans[n].location.nbytes, n), reverse=True)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self._plans)

    def count(self) -> int:
        return len(self._plans)

    def take(self) -> str | None:
        with self._lock:
            return self._queue.pop() if self._queue else None

    def take_many(self, limit: int, small: int) -> list[str]:
        with self._lock:
            queue, plans = self._queue, self._plans
            taken: list[str] = []
            while queue and len(taken) < limit:
                if taken and plans[queue[-1]].location.nbytes >= small or \
                        len(taken) == 1 and plans[taken[0]].location.nbytes >= small:
                    break
                taken.append(queue.pop())
            return taken

    def plan(self, name: str) -> TensorPlan:
        return self._plans[name]

    def cancel(self) -> None:
        pass

    def prepare(self) -> None:
        pass  # every bucket was checked when the plans were made

    def total_bytes(self) -> int:
        return sum(p.location.nbytes * len(p.steps) for p in self._plans.values())


def plan_patches(
    deltas: Sequence[Manifest], folders: Mapping[str, Path], checkpoint: Mapping[str, TensorLocation], *,
    workers: int = 1,
) -> list[TensorPlan]:
    """Check the buckets of ``deltas`` (oldest first) and group their frames per tensor, largest first.

    ``folders`` maps each delta version to its artifact folder; ``checkpoint``
    is the layout the deltas apply to; ``workers`` threads check each
    bucket's frames (``bucket_steps``). Raises a ``FormatError`` naming revision, bucket and
    tensor on the first problem (in bucket and tensor name order); nothing changes. A record's
    content is validated as it is applied (``apply_patches``).
    """
    steps: dict[str, list[PatchStep]] = {}
    for manifest in deltas:
        for bucket in manifest.files:
            for tensor, step in bucket_steps(manifest, bucket, folders[manifest.version] / bucket,
                                             checkpoint, workers=workers).items():
                steps.setdefault(tensor, []).append(step)
    plans = [TensorPlan(checkpoint[name], tuple(s)) for name, s in steps.items()]
    plans.sort(key=lambda p: (-p.location.nbytes, p.location.name))
    return plans


def apply_patches(
    checkpoint: CheckpointIndex,
    source: PlanSource | Sequence[TensorPlan],
    *,
    target_checksum_format: str,
    workers: int,
    block_size: int | None = None,
    progress: Callable[[int], None] | None = None,
    undo_to: Mapping[str, str] | None = None,
    undo_format: str | None = None,
    stop: StopToken | None = None,
    stats: dict | None = None,
) -> dict[str, str]:
    """Apply every plan in place to ``checkpoint``; returns each patched tensor's final checksum.

    Each record is decoded once and validated as it is (a bad one raises
    ``CodecError``); every step's checksum is checked on the running value (a
    mismatch raises ``ChecksumMismatch``); both name the revision, bucket and
    tensor, and may come after other tensors were patched. ``stop`` (the
    run's token) is checked between blocks. However the pass ends — an error
    in any worker, the run stopped, or an exception in the calling thread —
    every worker is stopped and joined before anything else happens, and the
    first real error is the one raised (not a worker's "stopped because
    another tensor failed"). Then, if ``undo_to`` (the base's verified
    checksums, format ``undo_format``) is given, the bytes already patched are
    reverted in place (a tensor stopped mid-way too) and every touched tensor is
    re-hashed against it; then the same error is raised, with ``undone = True``
    when the checkpoint holds the base again, ``False`` when it could not be
    proven (the caller rebuilds).

    A page no step changes is never written (it stays clean); ``stats``, if
    given, receives ``pages_written`` (pages mapped writable, hence dirtied),
    ``blocks`` and ``blocks_unchanged``.
    """
    if isinstance(source, (list, tuple)):
        source = StaticPlans(source)
    count = getattr(source, "count", None)  # optional: the number of tensors without listing them in order
    if not (count() if count is not None else len(source.names())):
        return {}
    halt = stop.child() if stop is not None else StopToken()  # stopped by the run, or by a failed worker
    maps = Maps(checkpoint.folder)
    run = _ApplyRun(maps, source, halt, target_checksum_format, block_size, progress)
    threads = [threading.Thread(target=run.worker, name=f"apply-{i}") for i in range(max(1, workers))]
    try:
        try:
            for thread in threads:
                thread.start()
        finally:
            _join_all(threads, on_interrupt=run.fail)
        if run.failures:
            raise _first_error(run.failures)
        return run.results  # dirty pages reach the disk later (storage/store/flush.py): not on the critical path
    except BaseException as exc:
        error = _mark_mutated(exc)
        if undo_to is not None:
            error.undone = undo(maps, [p for p in run.progresses if p.touched], undo_to,
                                undo_format or target_checksum_format, checkpoint, log)
        raise error
    finally:
        halt.close()
        maps.close()
        if stats is not None:
            progresses = run.progresses
            stats.update(pages_written=sum(p.pages_written for p in progresses),
                         blocks=sum(p.blocks for p in progresses),
                         blocks_unchanged=sum(p.blocks_unchanged for p in progresses))


class _ApplyRun:
    """What the workers of one ``apply_patches`` pass share, and what each of them does.

    ``worker`` is each thread's body: it takes tensors from the source (tiny
    ones in batches) and patches them until the source is empty or ``halt``
    stops; ``fail`` records an error first, then stops the others.
    ``progresses`` (every tensor started, for the undo and the stats),
    ``results`` (each patched tensor's final checksum) and ``failures`` are
    guarded by ``lock``.
    """

    def __init__(self, maps: Maps, source: PlanSource, halt: StopToken, target_checksum_format: str,
                 block_size: int | None, progress: Callable[[int], None] | None):
        self.maps = maps
        self.source = source
        self.halt = halt
        self.target_checksum_format = target_checksum_format
        self.block_size = block_size
        self.progress = progress
        self.progresses: list[Progress] = []
        self.lock = threading.Lock()
        self.failures: list[BaseException] = []
        self.results: dict[str, str] = {}
        self.take_many = getattr(source, "take_many", None)

    def worker(self) -> None:
        try:
            with gc_paused():  # a plan, a Progress and decoded bytes a tensor: no cycles to collect
                self.work()
        except BaseException as exc:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        with self.lock:  # recorded before the others are told to stop, so it is the first error seen
            self.failures.append(exc)
        self.halt.stop(f"tensor failed: {exc}")
        self.source.cancel()  # workers still waiting for a download give up

    def work(self) -> None:
        halt, source, take_many = self.halt, self.source, self.take_many
        if take_many is None:
            while not halt.stopped and (name := source.take()) is not None:
                self.batch([name])
        else:
            while not halt.stopped and (names := take_many(TINY_BATCH, SMALL)):
                self.batch(names)
        halt.check()

    def batch(self, names: list[str]) -> None:
        # folding K deltas keeps K scratch blocks live: the block shrinks so they still fit in cache
        # a tiny group is handed over with its names, bytes times steps (progress) and one-step plans, counted here
        small: list[Progress] = []
        small_names: list[str] = []
        plan_of = self.source.plan
        block_size = self.block_size
        held = work = ones = 0
        for name in names:
            plan = plan_of(name)
            k = len(plan.steps)
            size = block_size or max(MIN_FOLD_BLOCK, BLOCK_SIZE // k)
            state = Progress(plan, size)
            if is_tiny(plan, size):
                location = plan.location
                n = location.nbytes
                if held + n > TINY_BYTES and small:
                    self.tiny(small, small_names, work, ones)
                    small, small_names, held, work, ones = [], [], 0, 0, 0
                small.append(state)
                small_names.append(location.name)
                held += n
                work += n * k
                ones += k == 1
                continue
            if small:
                self.tiny(small, small_names, work, ones)
                small, small_names, held, work, ones = [], [], 0, 0, 0
            self.one(state)
        if small:
            self.tiny(small, small_names, work, ones)

    def one(self, state: Progress) -> None:
        with self.lock:
            self.progresses.append(state)
        digest = apply_tensor(self.maps, state, self.target_checksum_format, self.progress, self.halt)
        with self.lock:
            self.results[state.plan.location.name] = digest

    def tiny(self, states: list[Progress], names: list[str], work: int, ones: int) -> None:
        # a batch of tiny tensors (``names``; ``work``: their bytes times steps; ``ones``: how many have one step):
        # one hand-over of their records, one progress call, one results update
        maps, fmt, halt = self.maps, self.target_checksum_format, self.halt
        with self.lock:
            self.progresses.extend(states)
        digests = apply_tiny(maps, states, fmt, halt, lambda state: apply_tensor(maps, state, fmt, None, halt),
                             single=ones == len(states))
        if self.progress:
            self.progress(work)
        with self.lock:
            self.results.update(zip(names, digests))


def _join_all(threads: list[threading.Thread], *, on_interrupt: Callable[[BaseException], None]) -> None:
    """Join every started thread, even if the calling thread is interrupted while waiting (told first)."""
    for thread in threads:
        while thread.ident is not None:
            try:
                thread.join()
                break
            except BaseException as exc:  # e.g. KeyboardInterrupt: stop the workers, keep waiting for them
                on_interrupt(exc)


def _first_error(failures: list[BaseException]) -> BaseException:
    """The error that stopped the pass: a stop caused by another failure never hides that failure."""
    for exc in failures:
        if not isinstance(exc, Cancelled):
            return exc
    return failures[0]


def _mark_mutated(exc: BaseException) -> BaseException:
    """Errors of the pass carry ``mutation_started``; an interrupt stays an interrupt."""
    if isinstance(exc, RefitError):
        exc.mutation_started = True
        return exc
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not bad input
        return exc
    wrapped = CodecError(f"apply failed: {type(exc).__name__}: {exc}", mutation_started=True)
    wrapped.__cause__ = exc
    return wrapped
