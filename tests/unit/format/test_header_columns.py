"""A safetensors header checked for the whole file at once (``HeaderTensors``) says what the one-by-one check says.

``parse_header`` takes a header whose entries are all well formed and laid out in order in a few passes over
its columns; any other goes through the entry-by-entry check. Both must give the same tensors (names, dtypes,
shapes, offsets), and a header the bulk check does not take must still be refused naming the tensor.
"""

from __future__ import annotations

import json
import struct

import pytest

from storage.errors import SafetensorsError
from storage.format.safetensors import HeaderTensors, TensorInfo, parse_bytes


def _file(entries: dict, data_size: int, metadata: dict | None = None) -> bytes:
    header = dict(entries) if metadata is None else {"__metadata__": metadata, **entries}
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + b"\0" * data_size


def _entries(order: list[int]) -> tuple[dict, int]:
    spans, at = [], 0
    shapes = [[3], [2, 5], [], [7, 0], [4]]
    dtypes = ["U8", "BF16", "F32", "I64", "F8_E4M3"]
    for shape, dtype in zip(shapes, dtypes):
        size = {"U8": 1, "BF16": 2, "F32": 4, "I64": 8, "F8_E4M3": 1}[dtype]
        n = size
        for d in shape:
            n *= d
        spans.append((f"t{len(spans)}", dtype, shape, at, at + n))
        at += n
    return {spans[i][0]: {"dtype": spans[i][1], "shape": spans[i][2], "data_offsets": [spans[i][3], spans[i][4]]}
            for i in order}, at


def test_a_header_in_order_and_the_same_header_shuffled_give_the_same_tensors():
    in_order, size = _entries([0, 1, 2, 3, 4])
    shuffled, _ = _entries([3, 0, 4, 2, 1])
    bulk = parse_bytes(_file(in_order, size, {"t0": "x"}), file="a.safetensors")
    one_by_one = parse_bytes(_file(shuffled, size), file="b.safetensors")
    assert isinstance(bulk.tensors, HeaderTensors)
    assert not isinstance(one_by_one.tensors, HeaderTensors)
    assert dict(bulk.tensors) == dict(one_by_one.tensors)
    assert bulk.tensors["t1"] == TensorInfo("t1", "BF16", (2, 5), 3, 23)
    assert bulk.tensors["t2"].nbytes == 4 and bulk.tensors["t3"].shape == (7, 0)
    assert list(bulk.tensors) == ["t0", "t1", "t2", "t3", "t4"] and len(bulk.tensors) == 5
    assert "t4" in bulk.tensors and "t5" not in bulk.tensors and bulk.tensors.get("t5") is None
    assert bulk.tensors.starts.tolist() == [t.start for t in bulk.tensors.values()]
    assert bulk.tensors.ends.tolist() == [t.end for t in bulk.tensors.values()]
    assert bulk.metadata == {"t0": "x"}


@pytest.mark.parametrize("edit, message", [
    (lambda e: e["t2"].update(dtype="F33"), "unknown dtype"),
    (lambda e: e["t1"].update(shape=[2, True]), "not a list of non-negative integers"),
    (lambda e: e["t1"].update(shape=[2, -5]), "not a list of non-negative integers"),
    (lambda e: e["t4"].update(data_offsets=[45, 48.0]), "must be two integers"),
    (lambda e: e["t1"].update(shape=[2, 4]), "does not match shape"),
    (lambda e: e["t3"].update(extra=1), "exactly dtype, shape and data_offsets"),
    (lambda e: e["t3"].update(shape=[7, 2**70]), "does not match shape"),
])
def test_a_header_in_order_with_one_bad_entry_is_refused_naming_it(edit, message):
    entries, size = _entries([0, 1, 2, 3, 4])
    edit(entries)
    with pytest.raises(SafetensorsError, match=message) as info:
        parse_bytes(_file(entries, size), file="c.safetensors")
    assert info.value.tensor in entries and info.value.file == "c.safetensors"


def test_overlapping_or_trailing_bytes_are_refused_either_way():
    entries, size = _entries([0, 1, 2, 3, 4])
    entries["t1"]["data_offsets"] = [2, 22]  # overlaps t0 by one byte, in order otherwise
    with pytest.raises(SafetensorsError, match="overlap"):
        parse_bytes(_file(entries, size), file="d.safetensors")
    entries, size = _entries([0, 1, 2, 3, 4])
    with pytest.raises(SafetensorsError, match="follow the last tensor"):
        parse_bytes(_file(entries, size + 3), file="e.safetensors")
