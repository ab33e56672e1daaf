"""``--encoding auto`` picks, from a sample, the setting that encodes the whole revision smallest."""

from __future__ import annotations

import numpy as np
import pytest

from storage.format.autoselect import SAMPLE_MIN, SAMPLE_WINDOW, candidates, choose, sample_windows
from storage.format.encoding import Encoder

MiB = 2**20


def bf16_step(rng, n_elements: int, share: float) -> tuple[np.ndarray, np.ndarray]:
    """bf16 weights as bytes, and a step that moves ``share`` of the elements by one ulp (an RL step's shape)."""
    base = (rng.standard_normal(n_elements).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    target = base.copy()
    moved = rng.random(n_elements) < share
    target[moved] += np.where(rng.random(int(moved.sum())) < 0.5, 1, -1).astype(np.uint16)
    return base.view(np.uint8), target.view(np.uint8)


def full_sizes(tensors: dict, level: int) -> dict[str, int]:
    """Every candidate setting encoded over the whole revision."""
    encoder, largest = Encoder(), max(b.size for b, _ in tensors.values())
    return {str(s): sum(len(encoder.encode(b, t, s).frame or b"") for b, t in tensors.values())
            for s in candidates(level, extended=False, largest_tensor=largest)}


@pytest.mark.parametrize("share, expect", [(0.02, ("xor_sparse", "overwrite")), (0.45, ("xor",))])
def test_auto_chooses_within_a_few_percent_of_the_smallest_whole_encoding(share, expect):
    rng = np.random.default_rng(7)
    tensors = {f"layer{i}.w": bf16_step(rng, (3 * MiB) // 2 + 1000 * i, share) for i in range(8)}  # 24 MiB
    sizes = [(name, b.size) for name, (b, _) in tensors.items()]
    assert sum(n for _, w, n in sample_windows(sizes)) < sum(n for _, n in sizes)  # a sample, not the whole model
    choice = choose(lambda name: tensors[name], sizes, 3, extended=False, workers=2)
    assert choice.setting.encoding in expect, choice.estimates
    whole = full_sizes(tensors, 3)
    assert whole[str(choice.setting)] <= 1.05 * min(whole.values()), (str(choice.setting), whole)


def test_the_sample_depends_only_on_the_layout():
    sizes = [("a", 40 * MiB), ("b", 3 * MiB), ("c", 90 * MiB)]
    windows = sample_windows(sizes)
    assert windows == sample_windows(list(sizes))
    assert all(0 <= start and start + n <= dict(sizes)[name] for name, start, n in windows)
    sampled = sum(n for _, _, n in windows)
    assert SAMPLE_MIN - SAMPLE_WINDOW <= sampled <= SAMPLE_MIN  # a 32nd of 133 MiB is under the floor: the floor
    assert {name for name, _, _ in windows} >= {"a", "c"}  # spread over the model, not its start
