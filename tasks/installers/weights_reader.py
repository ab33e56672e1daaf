"""The prepared checkpoint's tensors for an engine's load, read ahead by threads (``parallel_weights``).

The in-engine loader (``tasks.installers.sglang_loader``) hands these to
SGLang's ``load_weights_and_postprocess`` in place of SGLang's own readers:
the same tensors in the same order, views of private mappings of the files,
with the next chunks faulted in by ``READ_THREADS`` threads ahead of the
engine's copy (``python -m benchmarks.install`` measures the install pause
against a plain copy of the same bytes).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from storage.errors import FormatError
from storage.format.checkpoint import CheckpointIndex, TensorLocation
from storage.format.mapped import MADV_POPULATE_READ, advise

READ_THREADS = max(1, min(8, os.cpu_count() or 1))  # per TP rank; SGLang's own threaded reader uses 8
READ_CHUNK = 16 * 2**20  # one thread's share of a large tensor
READ_AHEAD = 2  # chunks queued per thread: how far the reader runs ahead of the consumer
READ_NICE = 19  # where cores are short, the threads give way to the consumer's copy


def parallel_weights(folder: Path, threads: int = READ_THREADS) -> Iterator[tuple[str, object]]:
    """Every tensor of the checkpoint in ``folder``, as ``(name, torch tensor)``, read ahead by ``threads`` threads.

    The shards and tensors are ``CheckpointIndex.open``'s (the index's shards,
    else every ``*.safetensors``), validated here, before anything is read;
    tensors come in SGLang's order, shard by shard, by name. Each tensor is a view of a private
    (copy-on-write) mapping of its shard, as SGLang's own safetensors readers
    yield them: the reader copies nothing and reuses nothing, so a consumer
    may hold a tensor as long as it likes and need not copy it synchronously;
    a write to it stays in this process. A tensor shows its file's bytes:
    a file rewritten in place while tensors are held shows through, which is
    why the loader holds the store's shared lock while it loads.

    The threads fault the next ``threads * READ_AHEAD`` chunks of at most
    ``READ_CHUNK`` bytes into the mappings (``MADV_POPULATE_READ``, without
    the GIL; from the disk when they are not cached), so the consumer's copy
    finds its pages mapped. That is all they do: memory ahead of the consumer
    is bounded and is page cache, never a copy; a tensor is yielded without
    waiting for them (its pages fault in on access either way), and they run
    at ``READ_NICE``, so where the consumer's copy already keeps every core
    busy (a CPU model) they neither delay it nor compete with it.
    """
    index = CheckpointIndex.open(Path(folder))
    tensors = sorted(index.tensors.values(), key=lambda t: (t.file, t.name))
    for t in tensors:
        _torch_dtype(t)  # a dtype this torch lacks fails here, before any weight changes
    return _read_ahead(index.folder, tensors, max(1, int(threads)))


def _read_ahead(folder: Path, tensors: list[TensorLocation], threads: int) -> Iterator[tuple[str, object]]:
    """Yield the tensors with their chunks faulted in ahead; the generator owns its threads on every path."""
    chunks = iter([(k, t.file, start, min(t.offset + t.nbytes, start + READ_CHUNK)) for k, t in enumerate(tensors)
                   for start in range(t.offset, t.offset + t.nbytes, READ_CHUNK)])
    last_use = {t.file: k for k, t in enumerate(tensors)}
    maps: dict[str, mmap.mmap] = {}
    arrays: dict[str, np.ndarray] = {}

    def mapped(file: str) -> mmap.mmap:
        if file not in maps:
            with open(folder / file, "rb") as fh:  # the mapping outlives the descriptor
                maps[file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            arrays[file] = np.frombuffer(maps[file], dtype=np.uint8)
        return maps[file]

    queued: deque[tuple[int, object]] = deque()  # (tensor, its chunk's future), in order
    consumer = -1  # the tensor last yielded
    pool = ThreadPoolExecutor(threads, thread_name_prefix="canonical-refit-read", initializer=_lower_priority)

    def queue_next() -> None:
        for k, file, start, end in chunks:
            if k > consumer:  # behind the consumer, reading ahead is moot
                mapped(file)
                queued.append((k, pool.submit(advise, arrays[file], start, end - start, MADV_POPULATE_READ)))
                return

    try:
        for _ in range(threads * READ_AHEAD):
            queue_next()
        for k, t in enumerate(tensors):
            consumer = k
            while queued and queued[0][0] <= k:  # what has not started, the consumer faults in itself
                queued.popleft()[1].cancel()
                queue_next()
            tensor = _tensor_view(mapped(t.file), t)
            if last_use[t.file] == k:  # the tensors now keep the mapping alive, and nothing else does
                del maps[t.file], arrays[t.file]
            yield t.name, tensor
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _lower_priority() -> None:
    """Lower this reader thread's priority (Linux keeps one per thread; elsewhere the call would name a process)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READ_NICE)
        except OSError:
            pass


_TORCH_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
                 "F8_E8M0": "float8_e8m0fnu", "I16": "int16", "U16": "uint16", "F16": "float16",
                 "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64",
                 "U64": "uint64", "F64": "float64", "C64": "complex64"}


def _torch_dtype(t: TensorLocation):
    import torch

    dtype = getattr(torch, _TORCH_DTYPES[t.dtype], None)
    if dtype is None:
        raise FormatError(f"torch {torch.__version__} has no dtype for {t.dtype}", file=t.file, tensor=t.name)
    return dtype


def _tensor_view(mapping: mmap.mmap, t: TensorLocation):
    """``t`` as a tensor over ``mapping`` (a copy only where the file leaves it misaligned for its dtype)."""
    import torch

    dtype = _torch_dtype(t)
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=dtype)
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=t.nbytes, offset=t.offset)
    if t.offset % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(t.shape)
