"""Reopening a checkpoint folder whose files did not change reads nothing again; any change is seen.

``CheckpointIndex.open`` remembers what a folder parsed to with the identity of each file it read (inode, size,
times): a shard rewritten, replaced, added (no index file) or an index rewritten must be read and checked again.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from storage.errors import SafetensorsError
from storage.format.checkpoint import INDEX_FILE, CheckpointIndex
from storage.format.safetensors import write_safetensors


def _shard(path, tensors: dict[str, int]) -> None:
    with open(path, "wb") as fh:
        write_safetensors(fh, [(name, "U8", [n], np.zeros(n, np.uint8)) for name, n in tensors.items()])


def _layout(folder) -> dict:
    return {name: (t.file, t.nbytes) for name, t in CheckpointIndex.open(folder).tensors.items()}


def test_a_shard_rewritten_or_replaced_is_read_again(tmp_path):
    _shard(tmp_path / "a.safetensors", {"x": 4, "y": 8})
    _shard(tmp_path / "b.safetensors", {"z": 2})
    assert _layout(tmp_path) == _layout(tmp_path) == {"x": ("a.safetensors", 4), "y": ("a.safetensors", 8),
                                                      "z": ("b.safetensors", 2)}
    _shard(tmp_path / "a.safetensors", {"x": 4, "y": 9})  # rewritten in place
    assert _layout(tmp_path)["y"] == ("a.safetensors", 9)
    _shard(tmp_path / "new.tmp", {"x": 5})
    os.replace(tmp_path / "new.tmp", tmp_path / "a.safetensors")  # replaced by another file
    assert _layout(tmp_path) == {"x": ("a.safetensors", 5), "z": ("b.safetensors", 2)}
    _shard(tmp_path / "c.safetensors", {"w": 1})  # a shard added (no index: every *.safetensors counts)
    assert _layout(tmp_path)["w"] == ("c.safetensors", 1)
    (tmp_path / "c.safetensors").write_bytes(b"\xff" * 3)  # now broken: refused, not remembered
    with pytest.raises(SafetensorsError):
        CheckpointIndex.open(tmp_path)


def test_an_index_rewritten_is_read_again(tmp_path):
    _shard(tmp_path / "a.safetensors", {"x": 4})
    _shard(tmp_path / "b.safetensors", {"y": 4})
    index = tmp_path / INDEX_FILE
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    assert set(_layout(tmp_path)) == {"x", "y"}
    assert set(_layout(tmp_path)) == {"x", "y"}
    index.write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": "b.safetensors"}}))
    with pytest.raises(SafetensorsError, match="index maps"):
        CheckpointIndex.open(tmp_path)
