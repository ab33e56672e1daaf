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
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import BinaryIO, Iterable, Mapping

import numpy as np

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
    spans = _checked_spans(raw, data_size)
    if spans is not None:  # every entry well formed and laid out in order: a table over the parsed entries
        return SafetensorsHeader(header_len, metadata, HeaderTensors(raw, *spans), data_size)
    return SafetensorsHeader(header_len, metadata, _tensor_infos(raw, data_size, fail), data_size)


_FIELDS = tuple(map(itemgetter, ("dtype", "shape", "data_offsets")))


def _checked_spans(raw: dict, data_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(starts, ends)`` of the entries of ``raw`` when every one is well formed (exactly dtype, shape and
    data_offsets; a known dtype, non-negative int dimensions, two int offsets in order inside the data section,
    the byte size ``product(shape) * dtype size``), laid out one after the other (no overlap) and the last one
    ending the data section; None otherwise (``_tensor_infos`` then finds and names the problem). Checked for the
    whole header in a few passes in C and array operations, not a loop of Python per tensor."""
    entries = list(raw.values())
    n = len(entries)
    if not n or "" in raw or set(map(type, entries)) != {dict} or set(map(len, entries)) != {3}:
        return None
    try:  # three keys, each of these three: exactly these
        dtypes, shapes, offsets = (list(map(get, entries)) for get in _FIELDS)
    except KeyError:
        return None
    if set(map(type, dtypes)) != {str} or not set(dtypes) <= DTYPE_SIZES.keys() \
            or set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}:
        return None
    flat = list(chain.from_iterable(offsets))
    dims = list(chain.from_iterable(shapes))
    if set(map(type, flat)) != {int} or dims and (set(map(type, dims)) != {int} or min(dims) < 0):
        return None
    try:
        spans = np.array(flat, dtype=np.int64)
        counts = np.array(dims if set(map(len, shapes)) == {1} else list(map(math.prod, shapes)), dtype=np.int64)
    except OverflowError:
        return None
    starts, ends = spans[0::2], spans[1::2]
    if int(starts.min()) < 0 or bool((ends < starts).any()) or int(ends[-1]) != data_size \
            or bool((starts[1:] < ends[:-1]).any()) or int(counts.max()) > data_size:
        return None
    kinds = set(dtypes)
    width = DTYPE_SIZES[dtypes[0]] if len(kinds) == 1 else np.array([DTYPE_SIZES[d] for d in dtypes], np.int64)
    if not np.array_equal(counts * width, ends - starts):
        return None
    return starts, ends


class HeaderTensors(Mapping):
    """A validated header's tensors (name -> ``TensorInfo``) over its parsed JSON entries: a ``TensorInfo`` is
    made when one is asked for (a bucket of 100k tensors is checked from its columns without making any).
    ``starts`` and ``ends`` hold every tensor's offsets in the data section, in the header's order."""

    __slots__ = ("_entries", "starts", "ends")

    def __init__(self, entries: dict, starts: np.ndarray, ends: np.ndarray) -> None:
        self._entries, self.starts, self.ends = entries, starts, ends

    def __getitem__(self, name: str) -> TensorInfo:
        entry = self._entries[name]
        start, end = entry["data_offsets"]
        info = object.__new__(TensorInfo)
        _info_dict(info).update(name=name, dtype=entry["dtype"], shape=tuple(entry["shape"]), start=start, end=end)
        return info

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def keys(self):
        return self._entries.keys()

    def dtypes(self) -> list[str]:
        return list(map(_FIELDS[0], self._entries.values()))

    def shapes(self) -> list[list[int]]:
        return list(map(_FIELDS[1], self._entries.values()))


def _tensor_infos(raw: dict, data_size: int, fail) -> dict[str, TensorInfo]:
    """The tensors of a header ``_checked_spans`` did not take, one by one: raises naming what is wrong."""
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
    return tensors


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
