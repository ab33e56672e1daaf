"""A batch of tiny one-step XOR tensors patched with a few array operations, not a loop of calls per tensor.

``apply_batch`` is ``storage.patch.applier.apply_tiny``'s path for the tensors
of a steady refit (one dense ``xor`` frame each, inside one block, under
``SMALL``): the frames of one bucket are decoded by one
``multi_decompress_to_buffer`` call (each frame still exactly one zstd frame
decoding to exactly its tensor's bytes: zstd checks the size each frame
declares, which ``check_frame`` matched to the tensor); only the bytes the
delta changes (its nonzero bytes) are located in their shards and XORed there,
through one gather and one scatter a shard (so a page no byte of the delta
changes is never written, and a byte it leaves alone costs one look at its
decoded value); each tensor's bytes as written are then hashed where they lie
(one call a tensor). The same bytes, checksums, errors and undo record as the
loop (``Progress`` marks every tensor of the batch patched once the scatter is
done); a batch whose frames do not all decode cleanly is left to the loop,
which names the problem.
"""

from __future__ import annotations

import threading
from operator import attrgetter

import numpy as np
import zstandard

from storage.errors import ChecksumMismatch
from storage.format.changes import PAGE
from storage.format.digests import checksum_bytes, checksum_ranges
from storage.runtime.killpoints import killpoint

_START, _END, _NBYTES, _OFFSET, _FILE, _FORMAT = (
    attrgetter(a) for a in ("start", "end", "nbytes", "offset", "file", "checksum_format"))
_BUCKET = attrgetter("bucket")
_PAGE_BITS = PAGE.bit_length() - 1
_THREAD = threading.local()
_NO_DECODER = (None,)  # each tensor's one XOR step (shared: never changed in place)


def _dctx() -> zstandard.ZstdDecompressor:
    dctx = getattr(_THREAD, "dctx", None)
    if dctx is None:
        dctx = _THREAD.dctx = zstandard.ZstdDecompressor()
    return dctx


def _groups(keys: list) -> list[np.ndarray]:
    """The positions of each distinct key (ints or strings), each group in order, groups by first appearance."""
    if keys.count(keys[0]) == len(keys):  # one key (the common case): counted in C
        return [np.arange(len(keys), dtype=np.int64)]
    at: dict = {}
    for i, k in enumerate(keys):
        have = at.get(k)
        if have is None:
            at[k] = [i]
        else:
            have.append(i)
    return [np.array(ids, dtype=np.int64) for ids in at.values()]


def _decode(frames: list[np.ndarray], bounds: list[tuple[int, int]], starts: np.ndarray, ends: np.ndarray,
            sizes: np.ndarray) -> np.ndarray | None:
    """Every frame ``frames[g][starts[i]:ends[i]]`` (``i`` in ``range(*bounds[g])``: each bucket's frames
    consecutive) decoded, concatenated in order: one call for each bucket; None if some frame does not decode
    to exactly ``sizes[i]`` bytes."""
    dctx = _dctx()
    parts = []
    for frame, (a, b) in zip(frames, bounds):
        segments = np.empty((b - a, 2), dtype=np.uint64)
        segments[:, 0], segments[:, 1] = starts[a:b], ends[a:b] - starts[a:b]
        try:
            buffer = zstandard.BufferWithSegments(frame, segments.tobytes())
            decoded = dctx.multi_decompress_to_buffer(buffer, decompressed_sizes=sizes[a:b].astype(np.uint64).tobytes())
        except (zstandard.ZstdError, ValueError):
            return None
        parts.append(b"".join(decoded))
    data = np.frombuffer(parts[0] if len(parts) == 1 else b"".join(parts), dtype=np.uint8)
    return data if data.size == int(sizes.sum()) else None


def apply_batch(maps, states: list, target_format: str) -> list[str] | None:
    """Patch ``states`` (tiny, one validated dense ``xor`` step each); each one's checksum in ``target_format``.

    Returns None, having written nothing, when a frame does not decode to exactly its tensor's bytes (the
    caller's loop then finds and names it). Raises ``ChecksumMismatch`` for the first tensor (in order) whose
    bytes as written do not hash to its step's checksum, every tensor of the batch then marked patched.
    Works on the bytes that change only (their positions in the batch, then in the shards): a byte the delta
    leaves alone costs a look at its decoded value, nothing more; each tensor is then hashed where it lies.
    """
    count = len(states)
    plans = [s.plan for s in states]
    steps = [p.steps[0] for p in plans]
    order = _groups(list(map(id, map(_BUCKET, steps))))  # one bucket's steps share its Path
    if len(order) > 1:  # each bucket's tensors together (one decode call a bucket), the results put back after
        perm = np.concatenate(order).tolist()
        states, plans, steps = ([values[i] for i in perm] for values in (states, plans, steps))
    locations = [p.location for p in plans]
    sizes = np.array(list(map(_NBYTES, locations)), dtype=np.int64)
    firsts = np.zeros(count, dtype=np.int64)
    np.cumsum(sizes[:-1], out=firsts[1:])
    starts = np.array(list(map(_START, steps)), dtype=np.int64)
    ends = np.array(list(map(_END, steps)), dtype=np.int64)
    cuts = np.cumsum([0] + [ids.size for ids in order]).tolist()
    bounds = list(zip(cuts[:-1], cuts[1:]))
    frames = [maps._bucket(steps[a]) for a, _ in bounds]
    decoded = _decode(frames, bounds, starts, ends, sizes)
    if decoded is None:
        return None
    offsets = np.array(list(map(_OFFSET, locations)), dtype=np.int64)
    files = list(map(_FILE, locations))
    moved = np.flatnonzero(decoded)  # the bytes that change, in batch order: untouched pages stay clean
    owner = np.repeat(np.arange(count, dtype=np.int64), sizes)[moved]  # each one's tensor: no search a byte
    at = moved + (offsets - firsts)[owner]  # where each lies in its shard
    change = decoded[moved]
    shards = _groups(files)
    views, by_file = {}, {}
    releases: list[tuple[int, int, int]] = []
    by_shard = [None] if len(shards) == 1 else _split(np.array(_group_of(shards, count))[owner], len(shards))
    for ids, some in zip(shards, by_shard):
        view = by_file[files[int(ids[0])]] = maps.shards.array(files[int(ids[0])])
        views[id(view)] = view
        where, what = (at, change) if some is None else (at[some], change[some])
        view[where] ^= what
        releases += _merged(id(view), offsets[ids], offsets[ids] + sizes[ids])
    pages = np.zeros(count, dtype=np.int64)
    if moved.size:  # pages written, per tensor: distinct (tensor, page) among the changed bytes (in order)
        key = (owner << 44) | (at >> _PAGE_BITS)
        fresh = np.ones(key.size, dtype=bool)
        np.not_equal(key[1:], key[:-1], out=fresh[1:])
        pages = np.bincount(owner[fresh], minlength=count)
    sizes_of = sizes.tolist()
    for state, n, size in zip(states, pages.tolist(), sizes_of):  # steps_in_block stays 0: the block is done
        state.bounds, state.decoders = [(0, size)], _NO_DECODER  # undo decodes the frame again
        state.blocks, state.pages_written, state.blocks_unchanged = 1, n, 0 if n else 1
    for frame, (a, b) in zip(frames, bounds):
        views[id(frame)] = frame
        releases += _merged(id(frame), starts[a:b], ends[a:b])
    for _ in range(count):
        killpoint("apply.block")
    try:
        got, final = _sums(by_file, steps, files, offsets.tolist(), sizes_of, target_format)
    finally:
        maps.release_small(views, releases)
    if len(order) > 1:  # back in the caller's order: the first mismatch named is the first in that order
        got, final, steps, locations = (_unpermute(perm, values) for values in (got, final, steps, locations))
    for step, value, location in zip(steps, got, locations):
        if value != step.checksum:
            raise ChecksumMismatch(
                f"tensor bytes hash to {value} after applying the delta, the bucket says {step.checksum}",
                mutation_started=True, **step.context(location.name))
    return final


def _unpermute(perm: list[int], values: list) -> list:
    out = [None] * len(values)
    for i, value in zip(perm, values):
        out[i] = value
    return out


def _group_of(groups: list[np.ndarray], count: int) -> list[int]:
    """The group number of each of ``count`` positions."""
    out = [0] * count
    for g, ids in enumerate(groups):
        for i in ids.tolist():
            out[i] = g
    return out


def _split(group: np.ndarray, n: int) -> list[np.ndarray]:
    """The positions of each group number ``0..n-1`` in ``group``, each in order."""
    order = np.argsort(group, kind="stable")
    return np.split(order, np.cumsum(np.bincount(group, minlength=n))[:-1])


def _sums(by_file: dict, steps: list, files: list[str], offsets: list[int], sizes: list[int],
          target_format: str) -> tuple[list[str], list[str]]:
    """Each tensor's bytes as written, read where they lie (``by_file``: each shard's mapping), hashed in its
    step's checksum format, and in ``target_format``."""
    formats = list(map(_FORMAT, steps))
    if len(by_file) == 1 and formats.count(formats[0]) == len(formats):  # one shard, one format: a call a tensor
        fmt, mv = formats[0], memoryview(next(iter(by_file.values())))
        got = checksum_ranges(fmt, mv, offsets, sizes)
        return got, got if fmt == target_format else checksum_ranges(target_format, mv, offsets, sizes)
    mapped = {file: memoryview(view) for file, view in by_file.items()}
    got, final = [], []
    for fmt, file, start, n in zip(formats, files, offsets, sizes):
        data = mapped[file][start: start + n]
        value = checksum_bytes(fmt, data)
        got.append(value)
        final.append(value if fmt == target_format else checksum_bytes(target_format, data))
    return got, final


def _merged(key: int, starts: np.ndarray, ends: np.ndarray, gap: int = 256 * 2**10) -> list[tuple[int, int, int]]:
    """``(key, start, end)`` ranges covering ``[starts[i], ends[i])``, merged across gaps under ``gap``."""
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    cut = np.flatnonzero(starts[1:] - ends[:-1] > gap) + 1
    firsts = np.concatenate(([0], cut))
    lasts = np.concatenate((cut - 1, [starts.size - 1]))
    return [(key, a, b) for a, b in zip(starts[firsts].tolist(), ends[lasts].tolist())]
