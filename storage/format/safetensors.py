"""Strict safetensors headers: validated up front, before any data is touched.

The reader checks what the safetensors library checks and a little more: the
header length is bounded and inside the file, the header is UTF-8 JSON with no
duplicate keys, every dtype is known, every shape is a list of non-negative
ints, ``data_offsets`` are ordered, inside the data section and do not
overlap, nothing follows the last tensor, and each tensor's byte size is ``product(shape) * dtype size``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Mapping

from storage.jsonio.bounded_json import HEADER, load_json
from storage.errors import SafetensorsError
from storage.runtime.gc_pause import gc_paused_call

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own bound
_TENSOR_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; offsets are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _info_dict(info: TensorInfo) -> dict:
    """The attribute dictionary of a ``TensorInfo`` made with ``object.__new__`` (filled without the frozen
    dataclass's per-field ``object.__setattr__``: a header of 100k tensors makes 100k of them)."""
    return info.__dict__


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: its length, metadata and tensors."""

    header_len: int
    metadata: Mapping[str, str]
    tensors: Mapping[str, TensorInfo]
    data_size: int

    @property
    def data_offset(self) -> int:
        return 8 + self.header_len


def header_length(first8: bytes, file_size: int, *, file: str, revision: str | None = None) -> int:
    """Validate the 8-byte length prefix against the file size and the global bound."""
    if file_size < 8 or len(first8) < 8:
        raise SafetensorsError(f"file is {file_size} bytes, too short for a safetensors header",
                               file=file, revision=revision)
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit",
                               file=file, revision=revision)
    if 8 + n > file_size:
        raise SafetensorsError(f"header length {n} runs past the end of the {file_size}-byte file",
                               file=file, revision=revision)
    return n


@gc_paused_call  # objects a tensor, none in a cycle: the collector has nothing to find here
def parse_header(
    header_bytes: bytes, header_len: int, file_size: int, *, file: str, revision: str | None = None
) -> SafetensorsHeader:
    """Parse and validate the JSON header (the ``header_len`` bytes after the prefix)."""

    def fail(message: str, tensor: str | None = None) -> SafetensorsError:
        return SafetensorsError(message, file=file, revision=revision, tensor=tensor)

    raw = load_json(header_bytes, HEADER, error=SafetensorsError, expect=dict, file=file, revision=revision)
    metadata = raw.pop("__metadata__", None) or {}
    # keys and values strings (JSON makes plain ``str``): two passes in C, not a Python test per entry
    if not isinstance(metadata, dict) or not set(map(type, metadata)) <= {str} \
            or not set(map(type, metadata.values())) <= {str}:
        raise fail("__metadata__ must map strings to strings")
    data_size = file_size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    sizes, keys, new, info_dict = DTYPE_SIZES, _TENSOR_KEYS, object.__new__, _info_dict
    end_so_far, in_order = 0, True  # entries laid out one after the other need no sort to show they never overlap
    for name, entry in raw.items():
        # the well-formed entry, checked inline (a tensor's cost is a few dictionary lookups, not calls);
        # anything else goes through ``_tensor_info``, which names what is wrong
        if type(entry) is dict and name and entry.keys() == keys:
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if type(dtype) is str and type(shape) is list and type(offsets) is list and len(offsets) == 2:
                start, end = offsets
                if type(start) is int and type(end) is int and 0 <= start <= end <= data_size:
                    count = 1
                    for d in shape:
                        if type(d) is not int or d < 0:
                            break
                        count *= d
                    else:
                        width = sizes.get(dtype)
                        if width is not None and count * width == end - start:
                            info = new(TensorInfo)
                            info_dict(info).update(name=name, dtype=dtype, shape=tuple(shape), start=start, end=end)
                            tensors[name] = info
                            if start < end_so_far:
                                in_order = False
                            end_so_far = end
                            continue
        info = tensors[name] = _tensor_info(name, entry, data_size, fail)
        in_order = False
    if in_order:
        last = end_so_far
    else:
        spans = sorted((t.start, t.end, t.name) for t in tensors.values())
        for prev, cur in zip(spans, spans[1:]):
            if cur[0] < prev[1]:
                raise fail(f"data_offsets of {cur[2]!r} overlap those of {prev[2]!r}", tensor=cur[2])
        last = max((end for _, end, _ in spans), default=0)
    if last != data_size:  # nothing may follow the last tensor (what the safetensors library checks too)
        raise fail(f"{data_size - last} byte(s) follow the last tensor's end at {last} in the "
                   f"{data_size}-byte data section")
    return SafetensorsHeader(header_len, metadata, tensors, data_size)


def _tensor_info(name: str, entry: object, data_size: int, fail) -> TensorInfo:
    if not name:
        raise fail("tensor with an empty name")
    if not isinstance(entry, dict) or set(entry) != _TENSOR_KEYS:
        raise fail("tensor entry must have exactly dtype, shape and data_offsets", tensor=name)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise fail(f"unknown dtype {dtype!r}", tensor=name)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise fail(f"shape {shape!r} is not a list of non-negative integers", tensor=name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
    ):
        raise fail(f"data_offsets {offsets!r} must be two integers", tensor=name)
    start, end = offsets
    if not 0 <= start <= end:
        raise fail(f"data_offsets {offsets} are not in order", tensor=name)
    if end > data_size:
        raise fail(f"data_offsets {offsets} run past the {data_size}-byte data section", tensor=name)
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]  # Python ints: no overflow
    if nbytes != end - start:
        raise fail(
            f"byte size {end - start} does not match shape {shape} of {dtype} ({nbytes} bytes)",
            tensor=name,
        )
    return TensorInfo(name, dtype, tuple(shape), start, end)


def parse_bytes(data: bytes, *, file: str, revision: str | None = None) -> SafetensorsHeader:
    """Header of a whole safetensors file held in memory."""
    n = header_length(data[:8], len(data), file=file, revision=revision)
    return parse_header(bytes(data[8 : 8 + n]), n, len(data), file=file, revision=revision)


def read_header(path: Path, *, revision: str | None = None, file: str | None = None,
                remember: bool = False) -> SafetensorsHeader:
    """Header of a local safetensors file; the length is checked before it is read.

    ``remember``: keep the parsed header for the next ``read_header`` of the same file, which takes it (a
    refit checks a downloaded bucket's header when it arrives, and validates the bucket from it just after:
    one parse of a 100k-tensor header, not two). A remembered header is used only while the file's identity
    (device, inode, size, modification and change times to the nanosecond) is unchanged and the same
    ``file`` label names it, and at most ``_REMEMBER_MAX`` (of ``_REMEMBER_TENSORS`` tensors together) are kept.
    """
    label = file or str(path)
    with open(path, "rb") as fh:
        info = os.fstat(fh.fileno())
        size = info.st_size
        key = (str(path), label, revision, info.st_dev, info.st_ino, size, info.st_mtime_ns, info.st_ctime_ns)
        with _REMEMBERED_LOCK:
            known = _REMEMBERED.pop(key, None)
        if known is not None:
            return known
        n = header_length(fh.read(8), size, file=label, revision=revision)
        header_bytes = fh.read(n)
    header = parse_header(header_bytes, n, size, file=label, revision=revision)
    if remember:
        with _REMEMBERED_LOCK:
            _REMEMBERED[key] = header
            while len(_REMEMBERED) > _REMEMBER_MAX or len(_REMEMBERED) > 1 and \
                    sum(len(h.tensors) for h in _REMEMBERED.values()) > _REMEMBER_TENSORS:
                _REMEMBERED.pop(next(iter(_REMEMBERED)))
    return header


_REMEMBERED: dict[tuple, SafetensorsHeader] = {}  # oldest first
_REMEMBERED_LOCK = threading.Lock()
_REMEMBER_MAX = 64  # headers
_REMEMBER_TENSORS = 1 << 20  # and their tensors (the newest header is always kept)


def encode_header(
    tensors: Iterable[tuple[str, str, Iterable[int], int]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes (length prefix included, padded to 8) for tensors laid out in order.

    ``tensors`` yields ``(name, dtype, shape, nbytes)``; returns the header and
    each tensor's ``(start, end)`` in the data section.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    spans, offset = [], 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans.append((offset, offset + nbytes))
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, spans


def write_safetensors(
    fh: BinaryIO,
    tensors: list[tuple[str, str, Iterable[int], object]],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write a safetensors file; ``tensors`` holds ``(name, dtype, shape, buffer)``. Returns bytes."""
    views = [(name, dtype, shape, memoryview(buf).cast("B")) for name, dtype, shape, buf in tensors]
    header, _ = encode_header(((n, d, s, v.nbytes) for n, d, s, v in views), metadata)
    fh.write(header)
    for *_, view in views:
        fh.write(view)
    return len(header) + sum(v.nbytes for *_, v in views)
