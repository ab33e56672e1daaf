"""A checkpoint held in memory: a trainer's tensors, published without writing them to disk first.

``memory_checkpoint`` takes a mapping (or an iterator of ``(name, tensor)``
pairs) of CPU tensors — NumPy arrays, or torch tensors, bf16 included — and
views each one as bytes without copying it. ``MemoryCheckpoint`` then answers
what the publisher asks of a ``CheckpointIndex`` (tensor locations, headers,
layout, digests), so a revision published from memory goes through the same
stages and gives the same bytes as one published from a folder.

Its layout is the Hugging Face single-file one, as ``write_checkpoint(...,
shards=1)`` writes it: one shard ``model.safetensors``, tensors in name order,
``__metadata__`` ``{"format": "pt"}`` (docs/format.md, section 5.2).

Tensors are never copied behind the caller's back: a tensor on another device,
a non-contiguous one or one in big-endian byte order is refused, naming it.
torch is imported only by code that was handed a torch tensor.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from storage.format.checkpoint import TensorLocation, TensorTable
from storage.format.digests import new_checksum
from storage.errors import FormatError
from storage.format.safetensors import encode_header, parse_header, write_safetensors

MEMORY_SHARD = "model.safetensors"
MEMORY_METADATA = {"format": "pt"}
HASH_BLOCK = 8 * 2**20

# NumPy dtype names; bfloat16 and the float8 names are ml_dtypes' (NumPy itself has no bf16)
NUMPY_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "int32": "I32", "uint32": "U32", "float32": "F32", "int64": "I64", "uint64": "U64", "float64": "F64",
    "complex64": "C64", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}
TORCH_DTYPES = {
    "torch.bool": "BOOL", "torch.uint8": "U8", "torch.int8": "I8", "torch.int16": "I16", "torch.uint16": "U16",
    "torch.float16": "F16", "torch.bfloat16": "BF16", "torch.int32": "I32", "torch.uint32": "U32",
    "torch.float32": "F32", "torch.int64": "I64", "torch.uint64": "U64", "torch.float64": "F64",
    "torch.complex64": "C64", "torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2",
    "torch.float8_e8m0fnu": "F8_E8M0",
}


class MemoryCheckpoint(TensorTable):
    """Tensors in memory as one safetensors shard would hold them (``CheckpointIndex``'s questions, answered)."""

    folder = None  # nothing on disk; errors name the revision and tensor

    def __init__(self, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
                 shapes: Mapping[str, tuple[int, ...]], *, revision: str | None = None):
        names = sorted(arrays)
        if not names:
            raise FormatError("no tensors to publish", revision=revision)
        self._arrays = {n: arrays[n] for n in names}
        raw, _ = encode_header(((n, dtypes[n], shapes[n], arrays[n].size) for n in names), MEMORY_METADATA)
        data = sum(a.size for a in self._arrays.values())
        header = parse_header(raw[8:], len(raw) - 8, len(raw) + data, file=MEMORY_SHARD, revision=revision)
        self.headers = {MEMORY_SHARD: header}
        self.tensors = {t.name: TensorLocation(t.name, MEMORY_SHARD, header.data_offset + t.start, t.nbytes,
                                               t.dtype, t.shape) for t in header.tensors.values()}

    def array(self, name: str) -> np.ndarray:
        """The tensor's bytes: a 1-D ``uint8`` view of the caller's memory."""
        return self._arrays[name]

    def tensor(self, location: TensorLocation) -> np.ndarray:
        """What ``storage.format.encoding.Encoder`` reads (as a folder's ``FileSlice``)."""
        return self._arrays[location.name]

    def close(self) -> None:
        pass

    def checksums(self, checksum_format: str, *, names: list[str] | None = None, workers: int = 4) -> dict[str, str]:
        """Checksum of every tensor (or of ``names``), in parallel, largest first."""
        wanted = sorted(names if names is not None else self.tensors, key=lambda n: -self.tensors[n].nbytes)

        def one(name: str) -> tuple[str, str]:
            h, view = new_checksum(checksum_format), self._arrays[name]
            for start in range(0, view.size, HASH_BLOCK):
                h.update(view[start:start + HASH_BLOCK])
            if view.size == 0:
                h.update(b"")
            return name, h.hexdigest()

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return dict(pool.map(one, wanted))

    def copy(self, *, reuse: "MemoryCheckpoint | None" = None, workers: int = 4) -> "MemoryCheckpoint":
        """A copy that owns its bytes (a kept base must not move when the trainer's tensors do), copied by
        ``workers`` threads, largest tensor first.

        ``reuse``: an earlier copy, given up by its owner, whose buffers are
        overwritten when every tensor's dtype and shape match (fresh pages
        cost a page fault each: a copy into new memory runs at a tenth of a
        copy into memory already touched).
        """
        same = reuse is not None and reuse._arrays.keys() == self._arrays.keys() and all(
            reuse._arrays[n].dtype == a.dtype and reuse._arrays[n].shape == a.shape for n, a in self._arrays.items())
        arrays = reuse._arrays if same else {n: np.empty_like(a) for n, a in self._arrays.items()}

        def one(name: str) -> None:
            np.copyto(arrays[name], self._arrays[name])

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            list(pool.map(one, sorted(arrays, key=lambda n: -arrays[n].nbytes)))
        kept = object.__new__(MemoryCheckpoint)
        kept._arrays = arrays
        kept.headers, kept.tensors = self.headers, self.tensors
        return kept

    def write(self, folder: Path) -> Path:
        """Write the shard into ``folder`` (the layout the module docstring describes)."""
        path = Path(folder) / MEMORY_SHARD
        with open(path, "wb") as fh:
            write_safetensors(fh, [(t.name, t.dtype, t.shape, self._arrays[t.name])
                                   for t in sorted(self.tensors.values(), key=lambda t: t.offset)],
                              MEMORY_METADATA)
            fh.flush()
            os.fsync(fh.fileno())
        return path


def memory_checkpoint(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], *,
                      revision: str | None = None) -> MemoryCheckpoint:
    """A ``MemoryCheckpoint`` of ``{name: tensor}`` or ``(name, tensor)`` pairs (NumPy arrays or torch tensors).

    Raises ``FormatError`` naming the tensor for anything that cannot be
    published without a copy or a guess: not an array, another device, not
    contiguous, big-endian, a dtype safetensors has no name for, a repeated
    name.
    """
    pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise FormatError(f"expected (name, tensor) pairs, got {type(item).__name__}", revision=revision)
        name, value = item
        if not isinstance(name, str) or not name:
            raise FormatError(f"tensor name {name!r} is not a non-empty string", revision=revision)
        if name in arrays:
            raise FormatError("tensor is given twice", revision=revision, tensor=name)
        arrays[name], dtypes[name], shapes[name] = as_bytes(name, value, revision=revision)
    return MemoryCheckpoint(arrays, dtypes, shapes, revision=revision)


def as_bytes(name: str, value: Any, *, revision: str | None = None) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """``(1-D uint8 view, safetensors dtype, shape)`` of one tensor, sharing its memory."""
    def refuse(why: str) -> FormatError:
        return FormatError(why, revision=revision, tensor=name)

    if type(value).__module__.startswith("torch"):
        return _torch_bytes(value, refuse)
    if not isinstance(value, np.ndarray):
        raise refuse(f"a {type(value).__name__} is not a tensor (expected a NumPy array or a torch tensor)")
    dtype = NUMPY_DTYPES.get(value.dtype.name)
    if dtype is None:
        raise refuse(f"dtype {value.dtype} has no safetensors name")
    if value.dtype.byteorder == ">" or (value.dtype.byteorder == "=" and np.little_endian is False):
        raise refuse("array is big-endian; safetensors stores little-endian bytes")
    if not value.flags.c_contiguous:
        raise refuse("array is not C-contiguous; pass np.ascontiguousarray(array) (publish never copies a "
                     "tensor behind your back)")
    return value.reshape(-1).view(np.uint8), dtype, tuple(int(d) for d in value.shape)


def _torch_bytes(tensor: Any, refuse) -> tuple[np.ndarray, str, tuple[int, ...]]:
    import torch  # only reached with a torch tensor in hand

    if not isinstance(tensor, torch.Tensor):
        raise refuse(f"a {type(tensor).__name__} is not a tensor")
    if tensor.device.type != "cpu":
        raise refuse(f"tensor is on {tensor.device}, not the CPU; pass tensor.cpu()")
    if tensor.layout != torch.strided:
        raise refuse(f"tensor layout {tensor.layout} is not dense")
    dtype = TORCH_DTYPES.get(str(tensor.dtype))
    if dtype is None:
        raise refuse(f"dtype {tensor.dtype} has no safetensors name")
    if not tensor.is_contiguous():
        raise refuse("tensor is not contiguous; pass tensor.contiguous() (publish never copies a tensor "
                     "behind your back)")
    flat = tensor.detach().reshape(-1)  # a view of a contiguous tensor
    raw = flat.view(torch.uint8)  # bf16 and the float8s have no NumPy dtype: their bytes do
    return raw.numpy(), dtype, tuple(int(d) for d in tensor.shape)
