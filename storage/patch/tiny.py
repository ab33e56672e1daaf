"""A batch of tiny one-step XOR tensors patched with a few array operations, not a loop of calls per tensor.

``apply_batch`` is ``storage.patch.applier.apply_tiny``'s path for the tensors
of a steady refit (one dense ``xor`` frame each, inside one block, under
``SMALL``): the frames of consecutive tensors of one bucket are decoded by
one ``multi_decompress_to_buffer`` call (each frame still exactly one zstd
frame decoding to exactly its tensor's bytes: zstd checks the size each frame
declares, which ``check_frame`` matched to the tensor); the tensors of one
shard are read, XORed and written through one gather and one scatter of the
bytes that change (so a page no byte of the delta changes is never written);
the bytes as written are read back and each tensor's adler32 computed for the
whole batch at once (other checksum formats: one call a tensor). The same
bytes, checksums, errors and undo record as the loop (``Progress`` marks
every tensor of the batch patched once the scatter is done); a batch whose
frames do not all decode cleanly is left to the loop, which names the problem.
"""

from __future__ import annotations

import threading
from operator import attrgetter

import numpy as np
import zstandard

from storage.errors import ChecksumMismatch
from storage.format.changes import PAGE
from storage.format.digests import checksum_bytes
from storage.runtime.killpoints import killpoint

_ADLER = 65521
_START, _END, _NBYTES, _OFFSET, _FILE = (attrgetter(a) for a in ("start", "end", "nbytes", "offset", "file"))
_PAGE_BITS = PAGE.bit_length() - 1
_THREAD = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    dctx = getattr(_THREAD, "dctx", None)
    if dctx is None:
        dctx = _THREAD.dctx = zstandard.ZstdDecompressor()
    return dctx


def _groups(keys: list) -> list[np.ndarray]:
    """The positions of each distinct key (ints or strings), each group in order, groups by first appearance."""
    if all(k == keys[0] for k in keys):
        return [np.arange(len(keys), dtype=np.int64)]
    at: dict = {}
    for i, k in enumerate(keys):
        have = at.get(k)
        if have is None:
            at[k] = [i]
        else:
            have.append(i)
    return [np.array(ids, dtype=np.int64) for ids in at.values()]


def _spread(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Every byte position of the ranges ``[starts[i], starts[i] + sizes[i])``, in order."""
    before = np.zeros(sizes.size, dtype=np.int64)
    np.cumsum(sizes[:-1], out=before[1:])
    return np.repeat(starts - before, sizes) + np.arange(int(before[-1] + sizes[-1]), dtype=np.int64)


def _decode(frames: list[np.ndarray], groups: list[np.ndarray], starts: np.ndarray, ends: np.ndarray,
            sizes: np.ndarray, firsts: np.ndarray) -> np.ndarray | None:
    """Every frame ``frames[g][starts[i]:ends[i]]`` decoded, concatenated in order (one call for each group
    of one bucket); None if some frame does not decode to exactly ``sizes[i]`` bytes."""
    dctx = _dctx()
    out = None if len(groups) == 1 else np.empty(int(sizes.sum()), dtype=np.uint8)
    for frame, ids in zip(frames, groups):
        segments = np.empty((ids.size, 2), dtype=np.uint64)
        segments[:, 0], segments[:, 1] = starts[ids], ends[ids] - starts[ids]
        try:
            buffer = zstandard.BufferWithSegments(frame, segments.tobytes())
            decoded = dctx.multi_decompress_to_buffer(buffer, decompressed_sizes=sizes[ids].astype(np.uint64).tobytes())
        except (zstandard.ZstdError, ValueError):
            return None
        data = np.frombuffer(b"".join(decoded), dtype=np.uint8)
        if data.size != int(sizes[ids].sum()):
            return None
        if out is None:
            return data
        out[_spread(firsts[ids], sizes[ids])] = data
    return out


def _adler32(data: np.ndarray, firsts: np.ndarray, sizes: np.ndarray) -> list[str]:
    """adler32 of each tensor (``sizes[i]`` bytes from ``firsts[i]`` of ``data``, in order, none empty)."""
    d = data.astype(np.int64)
    position = np.arange(data.size, dtype=np.int64) - np.repeat(firsts, sizes)
    s = np.add.reduceat(d, firsts)
    w = np.add.reduceat(d * position, firsts)
    a = (1 + s) % _ADLER
    b = (sizes + sizes * s - w) % _ADLER
    return [f"{v:08x}" for v in ((b << 16) | a).tolist()]


def apply_batch(maps, states: list, target_format: str) -> list[str] | None:
    """Patch ``states`` (tiny, one validated dense ``xor`` step each); each one's checksum in ``target_format``.

    Returns None, having written nothing, when a frame does not decode to exactly its tensor's bytes (the
    caller's loop then finds and names it). Raises ``ChecksumMismatch`` for the first tensor (in order) whose
    bytes as written do not hash to its step's checksum, every tensor of the batch then marked patched.
    """
    plans = [s.plan for s in states]
    steps = [p.steps[0] for p in plans]
    locations = [p.location for p in plans]
    count = len(states)
    sizes = np.array(list(map(_NBYTES, locations)), dtype=np.int64)
    firsts = np.zeros(count, dtype=np.int64)
    np.cumsum(sizes[:-1], out=firsts[1:])
    starts = np.array(list(map(_START, steps)), dtype=np.int64)
    ends = np.array(list(map(_END, steps)), dtype=np.int64)
    frame_groups = _groups([id(s.bucket) for s in steps])  # one bucket's steps share its Path
    frames = [maps._bucket(steps[int(ids[0])]) for ids in frame_groups]
    decoded = _decode(frames, frame_groups, starts, ends, sizes, firsts)
    if decoded is None:
        return None
    offsets = np.array(list(map(_OFFSET, locations)), dtype=np.int64)
    written = np.empty_like(decoded)
    pages = np.zeros(count, dtype=np.int64)
    releases: list[tuple[int, int, int]] = []
    views = {}
    for ids in _groups(list(map(_FILE, locations))):
        view = maps.shards.array(locations[int(ids[0])].file)
        views[id(view)] = view
        size = sizes[ids]
        source = _spread(firsts[ids], size) if len(ids) < count else np.arange(decoded.size, dtype=np.int64)
        where = _spread(offsets[ids], size)
        change = decoded[source]
        moved = np.flatnonzero(change)  # only the bytes that change are stored: untouched pages stay clean
        at = where[moved]
        view[at] = view[at] ^ change[moved]
        written[source] = view[where]  # the bytes as written: an apply bug cannot go unnoticed
        if moved.size:  # pages written, per tensor: distinct (tensor, page) among the changed bytes
            owner = np.repeat(ids, size)[moved]
            key = (owner << 44) | (at >> _PAGE_BITS)
            fresh = np.ones(key.size, dtype=bool)
            np.not_equal(key[1:], key[:-1], out=fresh[1:])
            pages += np.bincount(owner[fresh], minlength=count)
        releases += _merged(id(view), offsets[ids], offsets[ids] + size)
    for state, n, location in zip(states, pages.tolist(), locations):
        state.bounds, state.decoders = [(0, location.nbytes)], [None]  # undo decodes the frame again
        state.blocks, state.steps_in_block, state.pages_written = 1, 0, n
        state.blocks_unchanged = 0 if n else 1
    for frame, ids in zip(frames, frame_groups):
        views[id(frame)] = frame
        releases += _merged(id(frame), starts[ids], ends[ids])
    maps.release_small(views, releases)
    for _ in range(count):
        killpoint("apply.block")
    fmt = steps[0].checksum_format
    uniform = all(s.checksum_format == fmt for s in steps)
    if uniform and fmt == "adler32":
        sums = _adler32(written, firsts, sizes)
    else:
        sums = [checksum_bytes(s.checksum_format, written[f: f + n])
                for s, f, n in zip(steps, firsts.tolist(), sizes.tolist())]
    for step, got, location in zip(steps, sums, locations):
        if got != step.checksum:
            raise ChecksumMismatch(
                f"tensor bytes hash to {got} after applying the delta, the bucket says {step.checksum}",
                mutation_started=True, **step.context(location.name))
    if uniform and fmt == target_format:
        return sums
    return [got if s.checksum_format == target_format else checksum_bytes(target_format, written[f: f + n])
            for s, got, f, n in zip(steps, sums, firsts.tolist(), sizes.tolist())]


def _merged(key: int, starts: np.ndarray, ends: np.ndarray, gap: int = 256 * 2**10) -> list[tuple[int, int, int]]:
    """``(key, start, end)`` ranges covering ``[starts[i], ends[i])``, merged across gaps under ``gap``."""
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    cut = np.flatnonzero(starts[1:] - ends[:-1] > gap) + 1
    firsts = np.concatenate(([0], cut))
    lasts = np.concatenate((cut - 1, [starts.size - 1]))
    return [(key, a, b) for a, b in zip(starts[firsts].tolist(), ends[lasts].tolist())]
