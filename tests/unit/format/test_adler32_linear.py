"""adler32 updated from the changed bytes alone (storage.format.digests): the catch-up's intermediate checksums.

Every value is compared with ``zlib.adler32`` of the bytes themselves: random buffers and change sets, and the
edges (no change, the first and the last byte, every byte, sums that wrap the modulus, one-byte buffers, a
buffer of a length that is not a block's full size).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from storage.format.digests import (
    ADLER_MOD, adler32_add, adler32_changed, adler32_combine, adler32_delta, adler32_of, adler32_sub, new_checksum,
)

LENGTHS = [1, 2, 7, 4096, 5552, 5553, ADLER_MOD - 1, ADLER_MOD, ADLER_MOD + 1, 3 * ADLER_MOD + 17, 2**20 - 4096 + 3]


def _changed(data: np.ndarray, index: np.ndarray, new: np.ndarray) -> int:
    out = data.copy()
    out[index] = new
    return zlib.adler32(out)


def _check(data: np.ndarray, index: np.ndarray, new: np.ndarray) -> None:
    index = np.asarray(index, dtype=np.int64)
    new = np.asarray(new, dtype=np.uint8)
    before = zlib.adler32(data)
    after = _changed(data, index, new)
    assert adler32_changed(before, data.size, index, data[index], new) == after
    delta = adler32_delta(data.size, index, data[index], new)
    assert adler32_add(before, delta) == after
    assert adler32_sub(after, delta) == before


@pytest.mark.parametrize("n", LENGTHS)
def test_random_changes_give_the_adler32_of_the_new_bytes(n):
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n, dtype=np.uint8)
    for count in sorted({0, 1, min(n, 3), n // 50, n // 2, n}):
        index = np.sort(rng.choice(n, count, replace=False))
        _check(data, index, rng.integers(0, 256, count, dtype=np.uint8))


@pytest.mark.parametrize("n", LENGTHS)
def test_changes_at_the_edges_and_sums_that_wrap(n):
    high, low = np.full(n, 255, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    ends = np.unique([0, n - 1])
    _check(high, [], [])  # no change at all
    _check(high, [0], [0])  # the first byte: weighted n times in B
    _check(high, [n - 1], [0])  # the last byte: weighted once
    _check(high, ends, [1] * ends.size)
    _check(low, ends, [255] * ends.size)
    _check(low, np.arange(n), high)  # every byte, the largest increase
    _check(high, np.arange(n), low)  # and the largest decrease
    _check(high, np.arange(n), high)  # changes to the same value: nothing changes


def test_xor_values_at_distinct_positions_as_a_sparse_delta_applies_them():
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 2**20, dtype=np.uint8)
    index = np.sort(rng.choice(data.size, 20_000, replace=False)).astype(np.int64)
    values = rng.integers(1, 256, index.size, dtype=np.uint8)
    _check(data, index, data[index] ^ values)


def test_combine_gives_the_adler32_of_the_concatenation():
    rng = np.random.default_rng(7)
    for n in [0, 1, 5, 5552, ADLER_MOD + 3, 200_000]:
        data = np.concatenate([rng.integers(0, 256, n, dtype=np.uint8), np.full(n // 3, 255, dtype=np.uint8)])
        for cut in sorted({0, 1, data.size // 2, max(0, data.size - 1), data.size}):
            cut = min(cut, data.size)
            first, second = data[:cut], data[cut:]
            assert adler32_combine(zlib.adler32(first), zlib.adler32(second), second.size) == zlib.adler32(data)


def test_a_running_checksum_fed_by_values_and_by_bytes_agrees():
    rng = np.random.default_rng(9)
    blocks = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 1, 70_000, 0, 12_345)]
    fed, combined = new_checksum("adler32"), new_checksum("adler32")
    for i, block in enumerate(blocks):
        fed.update(block)
        if i % 2:
            combined.update(block)
        else:
            combined.combine(adler32_of(block), block.size)
    assert combined.hexdigest() == fed.hexdigest() == f"{zlib.adler32(np.concatenate(blocks)):08x}"
