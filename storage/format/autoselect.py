"""``--encoding auto``: measure candidate encodings on a sample of the revision and keep the smallest.

What is smallest depends on the revision: a dense optimizer step (40 % of
bf16 elements changed) compresses best as dense ``xor``; an RL step (about
2 % changed, each by one ulp) as ``xor_sparse``, whose 8-byte positions share
their high bytes with the previous entry and compress to 1.85 % of the
tensor's bytes against 2.4 % for dense ``xor``; ``overwrite`` carries the
target's own bytes, which compress worse than XOR values. So each candidate
(encoding x zstd level) is encoded on the same deterministic sample of the
revision: windows spread evenly over the model's bytes, about a 32nd of
them (8 to 64 MiB). The candidate with the fewest sampled bytes wins; ties go
to the first in ``candidates`` order. The sample depends only on the layout,
so a republish chooses the same.

Only canonical encodings are candidates unless ``extended`` is set: a reader
of the canonical format must be able to apply whatever ``auto`` chooses.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from storage.format.encoding import EXTENDED, OVERWRITE_MAX_TENSOR, Encoder, Setting

SAMPLE_WINDOW = 256 * 2**10
SAMPLE_SHARE = 32  # a 32nd of the model's bytes ...
SAMPLE_MIN, SAMPLE_MAX = 8 * 2**20, 64 * 2**20  # ... within these bounds


@dataclass(frozen=True)
class Choice:
    """What ``auto`` chose, and the sampled frame bytes of every candidate (in the sample's bytes)."""

    setting: Setting
    sampled_bytes: int
    estimates: dict[str, int]

    def ratios(self) -> dict[str, float]:
        """Each candidate's sampled frame bytes over the sampled tensor bytes."""
        return {k: round(v / self.sampled_bytes, 5) if self.sampled_bytes else 0.0 for k, v in self.estimates.items()}


def candidates(level: int, *, extended: bool, largest_tensor: int) -> list[Setting]:
    """Settings ``auto`` measures, in tie-break order: sparse before dense, faster level first."""
    encodings = [*(EXTENDED if extended else ()), "xor_sparse"]
    if largest_tensor <= OVERWRITE_MAX_TENSOR:
        encodings.append("overwrite")
    encodings.append("xor")
    levels = sorted({1, level})
    return [Setting(e, lv) for e in encodings for lv in levels]


def sample_windows(sizes: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """``(tensor, start, length)`` windows spread evenly over the tensors' bytes (in the given order)."""
    total = sum(n for _, n in sizes)
    if not total:
        return []
    if total <= SAMPLE_MIN:  # a small model is measured whole
        return [(name, s, min(SAMPLE_WINDOW, n - s)) for name, n in sizes for s in range(0, n, SAMPLE_WINDOW)]
    budget = min(total, max(SAMPLE_MIN, min(SAMPLE_MAX, total // SAMPLE_SHARE)))
    count = max(1, budget // SAMPLE_WINDOW)
    out, ends, acc = [], [], 0
    for _, n in sizes:
        acc += n
        ends.append(acc)
    bounds = np.array(ends, dtype=np.int64)
    for k in range(count):
        centre = (2 * k + 1) * total // (2 * count)
        i = int(np.searchsorted(bounds, centre, side="right"))
        name, n = sizes[i]
        length = min(n, SAMPLE_WINDOW)
        start = min(max(0, centre - (ends[i] - n) - length // 2), n - length)
        start -= start % 8
        if not out or out[-1][:2] != (name, start):
            out.append((name, start, length))
    return out


def _window(source, start: int, length: int) -> np.ndarray:
    """``length`` bytes of a tensor (an array, or a ``FileSlice`` read into memory) from ``start``."""
    if isinstance(source, np.ndarray):
        return source[start:start + length]
    return source.read(start, start + length, np.empty(length, dtype=np.uint8))


def choose(tensor_pair: Callable[[str], tuple[np.ndarray, np.ndarray]], sizes: list[tuple[str, int]], level: int,
           *, extended: bool, workers: int) -> Choice:
    """Encode the sample in every candidate setting; the smallest total wins."""
    settings = candidates(level, extended=extended, largest_tensor=max((n for _, n in sizes), default=0))
    windows = sample_windows(sizes)
    local = threading.local()

    def measure(window: tuple[str, int, int]) -> list[int]:
        encoder = getattr(local, "encoder", None) or Encoder()
        local.encoder = encoder
        name, start, length = window
        base, target = tensor_pair(name)
        b, t = _window(base, start, length), _window(target, start, length)
        positions, values = encoder.changes(b, t, start=start)
        count = sum(p.size for _, p in positions)
        if not count:
            return [0] * len(settings)
        out = []
        for s in settings:
            if s.encoding == "xor":
                out.append(len(encoder.encode(b, t, s).frame or b""))
            else:
                vals = values
                if s.encoding == "overwrite":
                    vals = [t[p.astype(np.int64) + (at - start)] for at, p in positions]
                out.append(len(encoder._sparse_frame(s, positions, vals, count)))
        return out

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="auto-sample") as pool:
        sizes_per_window = list(pool.map(measure, windows))
    totals = [sum(col) for col in zip(*sizes_per_window)] if sizes_per_window else [0] * len(settings)
    best = min(range(len(settings)), key=lambda i: (totals[i], i))
    return Choice(settings[best], sum(length for _, _, length in windows),
                  {str(s): size for s, size in zip(settings, totals)})
