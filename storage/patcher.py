"""Patch a mutable mmap-backed checkpoint with a replay chain of delta buckets.

``bucket_steps`` validates one bucket (header, metadata, checksums, frame
structure, sparse records) before any of its bytes are used; ``plan_patches``
does it for every bucket of a chain and groups the frames into one
``TensorPlan`` per changed tensor. ``apply_patches`` streams each tensor once:
for every bounded block it folds the block through the tensor's K decoders in
revision order, updating each revision's checksum on the running value, and
writes the block once. Plans may arrive while buckets are still downloading
(``PlanSource``). If anything fails, the bytes already patched can be undone in
place: XOR deltas are their own inverse, and overwritten bytes were saved.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from storage.checkpoint import CheckpointIndex, TensorLocation
from storage.codec import Decoder, make_decoder
from storage.digests import is_checksum, new_checksum
from storage.errors import ChecksumMismatch, CodecError, FormatError, ManifestError, RefitError
from storage.killpoints import killpoint
from storage.manifests import Manifest
from storage.safetensors import read_header

log = logging.getLogger("canonical_refit.patcher")
BLOCK_SIZE = 2**20  # per tensor block: the block and each decoder's scratch stay in cache
MIN_FOLD_BLOCK = 256 * 2**10
PAGE = mmap.PAGESIZE
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+: fault a range in with one call
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


try:  # libc's madvise through ctypes: unlike mmap.madvise it runs without the GIL
    import ctypes

    _libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
    _libc_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc_madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc: faults happen on first touch
    _libc_madvise = None


def _advise(view: np.ndarray, start: int, length: int, advice: int) -> None:
    """``madvise`` bytes ``[start, start+length)`` of the mapping behind ``view`` (widened to pages).

    POPULATE: one call instead of a page fault per 4 KiB (faults made in-place
    XOR run at under 2 GB/s). DONTNEED on a shared file mapping only unmaps:
    dirty pages stay in the page cache and reach the disk with the final
    fsync, so the process does not hold the whole checkpoint resident. The call
    goes through ctypes so that applier threads do not queue on the GIL while
    the kernel works; a kernel without the advice is simply ignored.
    """
    if length <= 0 or _libc_madvise is None:
        return
    aligned = start - start % PAGE
    _libc_madvise(view.ctypes.data + aligned, min(view.size - aligned, length + start - aligned), advice)


@dataclass(frozen=True)
class PatchStep:
    """One revision's frame for one tensor: where it lies and what it must hash to."""

    revision: str
    encoding: str
    bucket: Path
    bucket_uri: str
    start: int
    end: int
    checksum: str
    checksum_format: str

    def context(self, tensor: str) -> dict:
        return {"revision": self.revision, "file": self.bucket_uri, "tensor": tensor}


@dataclass(frozen=True)
class TensorPlan:
    """Every step to apply to one tensor, oldest revision first."""

    location: TensorLocation
    steps: tuple[PatchStep, ...]


class PlanSource(Protocol):
    """Where ``apply_patches`` gets its work: tensor names up front, each plan when it is ready."""

    def names(self) -> list[str]: ...

    def take(self) -> str | None:
        """The next tensor to patch (a ready one, largest first; may block); None when all are taken."""

    def plan(self, name: str) -> TensorPlan:
        """The plan of a taken tensor, its buckets validated."""

    def cancel(self) -> None:
        """Stop waiting: another tensor failed."""

    def prepare(self) -> None:
        """Validate what can be validated before the store changes (may block for the first download)."""

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

    def take(self) -> str | None:
        with self._lock:
            return self._queue.pop() if self._queue else None

    def plan(self, name: str) -> TensorPlan:
        return self._plans[name]

    def cancel(self) -> None:
        pass

    def prepare(self) -> None:
        pass  # every bucket was validated when the plans were made

    def total_bytes(self) -> int:
        return sum(p.location.nbytes * len(p.steps) for p in self._plans.values())


def plan_patches(
    deltas: Sequence[Manifest], folders: Mapping[str, Path], checkpoint: Mapping[str, TensorLocation]
) -> list[TensorPlan]:
    """Validate the buckets of ``deltas`` (oldest first) and group their frames per tensor, largest first.

    ``folders`` maps each delta version to its artifact folder; ``checkpoint``
    is the layout the deltas apply to. Raises a ``FormatError`` naming revision,
    bucket and tensor on the first problem; nothing changes.
    """
    steps: dict[str, list[PatchStep]] = {}
    for manifest in deltas:
        for bucket in manifest.files:
            for tensor, step in bucket_steps(manifest, bucket, folders[manifest.version] / bucket,
                                             checkpoint).items():
                steps.setdefault(tensor, []).append(step)
    plans = [TensorPlan(checkpoint[name], tuple(s)) for name, s in steps.items()]
    plans.sort(key=lambda p: (-p.location.nbytes, p.location.name))
    return plans


def bucket_steps(manifest: Manifest, bucket: str, path: Path,
                 checkpoint: Mapping[str, TensorLocation]) -> dict[str, PatchStep]:
    """Validate one downloaded bucket completely and return its frame for each tensor."""
    uri = manifest.file_url(bucket)
    version = manifest.version
    header = read_header(path, revision=version, file=uri)
    expected = set(manifest.tensors_of(bucket))
    for name in sorted(set(header.tensors) - expected):
        raise ManifestError("bucket holds a tensor its index does not map to it", revision=version, file=uri,
                            tensor=name)
    if expected and not header.metadata:
        raise ManifestError("bucket has no __metadata__ with target checksums", revision=version, file=uri)
    out = {}
    for name in sorted(expected):
        info = header.tensors.get(name)
        if info is None:
            raise ManifestError("tensor named by the index is missing from its bucket", revision=version,
                                file=uri, tensor=name)
        if name not in checkpoint:
            raise ManifestError("bucket holds a tensor the local checkpoint does not have", revision=version,
                                file=uri, tensor=name)
        if info.dtype != "U8" or len(info.shape) != 1:
            raise ManifestError(f"delta tensor must be 1-D U8, found {info.dtype} {list(info.shape)}",
                                revision=version, file=uri, tensor=name)
        checksum = header.metadata.get(name)
        if checksum is None:
            raise ManifestError("bucket metadata has no checksum for the tensor", revision=version, file=uri,
                                tensor=name)
        if not is_checksum(manifest.checksum_format, checksum):
            raise ManifestError(f"checksum {checksum!r} is not a {manifest.checksum_format} checksum",
                                revision=version, file=uri, tensor=name)
        start = header.data_offset + info.start
        out[name] = PatchStep(version, manifest.delta_encoding, path, uri, start, start + info.nbytes,
                              checksum, manifest.checksum_format)
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    for name, step in out.items():
        # building a decoder validates the frame's structure (a sparse record whole); nothing is applied
        make_decoder(step.encoding, memoryview(m)[step.start:step.end], checkpoint[name].nbytes,
                     block_size=BLOCK_SIZE, **step.context(name)).close()
    return out


class _Maps:
    """Shared mmaps: the checkpoint's shards writable, buckets read-only (opened as they arrive)."""

    def __init__(self, folder: Path, shard_names):
        self._lock = threading.Lock()
        self.shards: dict[str, tuple[mmap.mmap, np.ndarray]] = {}
        self.buckets: dict[Path, np.ndarray] = {}
        for name in shard_names:
            with open(folder / name, "r+b") as fh:
                m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_WRITE)
            self.shards[name] = (m, np.frombuffer(m, dtype=np.uint8))

    def _bucket(self, step: PatchStep) -> np.ndarray:
        with self._lock:
            view = self.buckets.get(step.bucket)
            if view is None:
                with open(step.bucket, "rb") as fh:
                    m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                view = self.buckets[step.bucket] = np.frombuffer(m, dtype=np.uint8)
            return view

    def frame(self, step: PatchStep) -> memoryview:
        view = self._bucket(step)
        _advise(view, step.start, step.end - step.start, MADV_POPULATE_READ)
        return memoryview(view)[step.start : step.end]

    def release_frame(self, step: PatchStep) -> None:
        _advise(self._bucket(step), step.start, step.end - step.start, MADV_DONTNEED)

    def block(self, location: TensorLocation, offset: int, size: int) -> np.ndarray:
        """A writable, pre-faulted view of ``size`` bytes of the tensor from ``offset``."""
        _, array = self.shards[location.file]
        size = min(size, location.nbytes - offset)
        _advise(array, location.offset + offset, size, MADV_POPULATE_WRITE)
        start = location.offset + offset
        return array[start : start + size]

    def release_block(self, location: TensorLocation, offset: int, size: int) -> None:
        _, array = self.shards[location.file]
        _advise(array, location.offset + offset, min(size, location.nbytes - offset), MADV_DONTNEED)

    def flush(self) -> None:
        for m, _array in self.shards.values():
            m.flush()

    def close(self) -> None:
        """Drop every mapping now (not at garbage collection): a mapping pins its filesystem."""
        maps = [m for m, _ in self.shards.values()] + [v.base for v in self.buckets.values()]
        self.shards.clear()
        self.buckets.clear()
        for m in maps:
            try:
                m.close()
            except (BufferError, AttributeError):  # a view is still alive somewhere: the GC closes it
                pass


@dataclass
class _Progress:
    """How far one tensor got: whole blocks, then steps into the block being patched."""

    plan: TensorPlan
    block_size: int
    decoders: list[Decoder] = field(default_factory=list)
    blocks: int = 0
    steps_in_block: int = 0

    @property
    def touched(self) -> bool:
        return self.blocks > 0 or self.steps_in_block > 0


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
) -> dict[str, str]:
    """Apply every plan in place to ``checkpoint``; returns each patched tensor's final checksum.

    Every step's checksum is checked on the running value; a mismatch raises
    ``ChecksumMismatch`` naming the revision, bucket and tensor. On any error,
    if ``undo_to`` (the base's verified checksums, format ``undo_format``) is
    given, the bytes already patched are reverted and re-hashed against it:
    the raised error then has ``undone = True`` when the checkpoint holds the
    base again, ``False`` when it could not be proven (the caller rebuilds).
    """
    if isinstance(source, (list, tuple)):
        source = StaticPlans(source)
    names = source.names()
    if not names:
        return {}
    maps = _Maps(checkpoint.folder, {checkpoint.tensors[n].file for n in names})
    stop = threading.Event()
    progresses: list[_Progress] = []
    lock = threading.Lock()
    failure: list[BaseException] = []

    results: dict[str, str] = {}

    def one(name: str) -> None:
        plan = source.plan(name)
        # folding K deltas keeps K scratch blocks live: shrink the block so they still fit in cache
        size = block_size or max(MIN_FOLD_BLOCK, BLOCK_SIZE // len(plan.steps))
        state = _Progress(plan, size)
        with lock:
            progresses.append(state)
        digest = _apply_tensor(maps, state, target_checksum_format, progress, stop)
        with lock:
            results[name] = digest

    def worker() -> None:
        try:
            while not stop.is_set() and (name := source.take()) is not None:
                one(name)
        except BaseException as exc:
            stop.set()
            source.cancel()  # workers still waiting for a download give up
            with lock:
                failure.append(exc)

    try:
        threads = [threading.Thread(target=worker, name=f"apply-{i}") for i in range(max(1, workers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failure:
            raise failure[0]
        maps.flush()
        return results
    except BaseException as exc:
        error = _mark_mutated(exc)
        if undo_to is not None:
            error.undone = _undo(maps, [p for p in progresses if p.touched], undo_to,
                                 undo_format or target_checksum_format, checkpoint)
        raise error from (exc if error is not exc else None)
    finally:
        maps.close()
        for name in {checkpoint.tensors[n].file for n in names}:
            with open(checkpoint.folder / name, "rb+") as fh:
                os.fsync(fh.fileno())


def _mark_mutated(exc: BaseException) -> RefitError:
    if isinstance(exc, RefitError):
        exc.mutation_started = True
        return exc
    wrapped = CodecError(f"apply failed: {type(exc).__name__}: {exc}", mutation_started=True)
    wrapped.__cause__ = exc
    return wrapped


def _apply_tensor(maps: _Maps, state: _Progress, target_format: str, progress, stop) -> str:
    plan, block_size = state.plan, state.block_size
    location = plan.location
    name = location.name
    state.decoders = [
        make_decoder(s.encoding, maps.frame(s), location.nbytes, block_size=block_size, **s.context(name))
        for s in plan.steps
    ]
    hashes = [new_checksum(s.checksum_format) for s in plan.steps]
    final_in_own_format = plan.steps[-1].checksum_format == target_format
    final = hashes[-1] if final_in_own_format else new_checksum(target_format)
    for offset in range(0, location.nbytes, block_size):
        if stop.is_set():
            raise FormatError("stopped after another tensor failed", tensor=name, mutation_started=True)
        block = maps.block(location, offset, block_size)
        for i, (decoder, h) in enumerate(zip(state.decoders, hashes)):
            decoder.apply(block, offset)
            state.steps_in_block = i + 1
            h.update(block)
        state.blocks, state.steps_in_block = state.blocks + 1, 0
        if not final_in_own_format:
            final.update(block)
        maps.release_block(location, offset, block_size)
        if progress:
            progress(block.size * len(state.decoders))
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


def _undo(maps: _Maps, touched: list[_Progress], base: Mapping[str, str], fmt: str,
          checkpoint: CheckpointIndex) -> bool:
    """Revert every patched byte, newest step first within each block; True if the base hashes are back.

    XOR steps are undone by applying the same frame again (fresh decoders);
    ``overwrite`` steps restore the bytes their decoder saved before writing.
    """
    try:
        for state in touched:
            plan, name, block_size = state.plan, state.plan.location.name, state.block_size
            fresh = [d if s.encoding == "overwrite" else
                     make_decoder(s.encoding, maps.frame(s), plan.location.nbytes, block_size=block_size,
                                  **s.context(name))
                     for s, d in zip(plan.steps, state.decoders)]
            last = state.blocks + (1 if state.steps_in_block else 0)
            for b in range(last):
                offset = b * block_size
                block = maps.block(plan.location, offset, block_size)
                depth = len(plan.steps) if b < state.blocks else state.steps_in_block
                for i in reversed(range(depth)):
                    if plan.steps[i].encoding == "overwrite":
                        fresh[i].undo(block, offset)
                    else:
                        fresh[i].apply(block, offset)
        maps.flush()
        names = [s.plan.location.name for s in touched]
        now = checkpoint.checksums(fmt, names=names, workers=2) if names else {}
        ok = all(now[n] == base.get(n) for n in names)
        if not ok:
            log.error("undo did not restore the base checksums of %s", [n for n in names if now[n] != base.get(n)])
        return ok
    except Exception as exc:  # an undo that cannot finish is reported, and the caller rebuilds instead
        log.error("could not undo the partial apply: %s", exc)
        return False
