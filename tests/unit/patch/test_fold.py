"""A block through several revisions' changes (storage.patch.fold): a catch-up hashes each block once.

Each revision's checksum must still be the adler32 of the running bytes after it, and the bytes exactly those
of the changes applied one after the other, whatever mix of sparse XOR, ``overwrite``, dense and no change the
revisions bring; through ``apply_patches``, a folded catch-up of sparse deltas is byte-exact, and a record whose
values were altered (well formed, so only its checksum can tell) is caught at its own revision and undone.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from storage.errors import ChecksumMismatch
from storage.format.changes import DenseChange, SparseChange
from storage.format.digests import new_checksum
from storage.patch.fold import PIECE, fold_block, linear_sums
from storage.patch.patcher import apply_patches, plan_patches
from tests.unit.patch.test_pipeline import Chain
from tests.unit.patch.test_undo import assert_undone, compress, edit_frame, reject, victim_of


class _State:
    steps_in_block = 0


def _sparse(rng, n: int, count: int, *, overwrite: bool = False) -> SparseChange:
    index = np.sort(rng.choice(n, count, replace=False)).astype(np.int64)
    return SparseChange(index, rng.integers(0, 256, count, dtype=np.uint8), overwrite=overwrite)


def _dense(rng, n: int) -> DenseChange:
    data = np.zeros(n, dtype=np.uint8)
    data[n // 3:] = rng.integers(0, 256, n - n // 3, dtype=np.uint8)
    return DenseChange(data, False)


MIXES = {
    "sparse xor": "sss",
    "sparse xor, five": "sssss",
    "two": "ss",
    "with overwrite": "sos",
    "with no change": "s-s-",
    "dense in the middle": "sds",
    "dense first and last": "dsd",
    "nothing": "---",
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("n", [1, 4096, 10_000, 2**20])
def test_each_revision_sums_the_running_bytes_and_the_bytes_are_applied_in_order(mix, n):
    rng = np.random.default_rng(len(mix) * n)
    kinds = MIXES[mix]
    count = max(1, n // 40)
    changes = [None if k == "-" else _dense(rng, n) if k == "d" else _sparse(rng, n, min(n, count),
                                                                               overwrite=k == "o")
               for k in kinds]
    block = rng.integers(0, 256, n, dtype=np.uint8)
    running = _running(block, changes)  # the bytes after each revision, its changes applied one by one
    head = np.arange(7, dtype=np.uint8)  # a block before this one: the running checksums carry over
    for linear in (True, False):
        hashes = [new_checksum("adler32") for _ in changes]
        for h in hashes:
            h.update(head)
        work, state = block.copy(), _State()
        fold_block(changes, work, None, hashes, linear, state)
        assert state.steps_in_block == len(changes)
        assert work.tobytes() == running[-1]
        assert [h.hexdigest() for h in hashes] == [f"{zlib.adler32(after, zlib.adler32(head)):08x}"
                                                   for after in running]


def _running(block: np.ndarray, changes) -> list[bytes]:
    out, running = [], block.copy()
    for change in changes:
        if change is not None:
            change.apply(running)
        out.append(running.tobytes())
    return out


def test_an_overwrite_still_hands_over_the_bytes_it_replaces():
    rng = np.random.default_rng(3)
    block = rng.integers(0, 256, 8192, dtype=np.uint8)
    first = _sparse(rng, 8192, 100)
    index = np.array([0, 17, 8191], dtype=np.int64)
    saved = []
    change = SparseChange(index, np.array([1, 2, 3], dtype=np.uint8), overwrite=True,
                          on_apply=lambda b, i: saved.append(b[i]))
    replaced = _running(block, [first])[-1]
    fold_block([first, change, None], block, None, [new_checksum("adler32") for _ in range(3)], True, _State())
    assert list(block[index]) == [1, 2, 3]
    assert len(saved) == 1 and saved[0].tobytes() == bytes(np.frombuffer(replaced, dtype=np.uint8)[index])


def test_which_plans_derive_their_sums():
    assert linear_sums(["adler32", "adler32"]) and linear_sums(["adler32"] * 5)
    assert not linear_sums(["adler32"])  # one revision: hashed once anyway
    assert not linear_sums(["adler32", "xxh3-128", "adler32"]) and not linear_sums(["adler32", "blake3"])


@pytest.mark.parametrize("encodings", [{1: "xor_sparse", 2: "xor_sparse", 3: "xor_sparse"},
                                       {1: "xor_sparse", 2: "xor", 3: "overwrite", 4: "xor_sparse"}],
                         ids=["sparse", "mixed"])
@pytest.mark.parametrize("block", [4096, None], ids=["small blocks", "default blocks"])
def test_a_folded_catch_up_is_byte_exact(lab, tmp_path, encodings, block):
    chain = Chain(lab, tmp_path, len(encodings), encodings=encodings)
    work = chain.work()
    got = apply_patches(work, plan_patches(chain.manifests, chain.folders, chain.index.tensors),
                        target_checksum_format="adler32", workers=2, block_size=block)
    final = chain.expected(len(encodings))
    assert chain.bytes_of(work) == final
    assert got == {name: f"{zlib.adler32(final[name]):08x}" for name in got}


def test_an_intermediate_record_with_altered_values_is_caught_at_its_revision_and_undone(lab, tmp_path):
    chain = Chain(lab, tmp_path, 3, encodings={1: "xor_sparse", 2: "xor_sparse", 3: "xor_sparse"})
    tensor, _ = victim_of(chain, 2)

    def alter(raw: bytes) -> bytes:  # the same positions, one value flipped: well formed, wrong bytes
        count = struct.unpack_from("<Q", raw)[0]
        record = bytearray(raw)
        record[8 + 8 * count + count // 2] ^= 0x40
        return compress(bytes(record))

    bucket = edit_frame(chain, 2, tensor, alter)
    error, work, patched = reject(chain, workers=2)
    assert_undone(chain, error, work, patched, ChecksumMismatch, "after applying the delta", revision="r2",
                  bucket=bucket, tensor=tensor)


@pytest.mark.parametrize("fmt", ["adler32", "xxh3-128", "blake3"])
@pytest.mark.parametrize("n", [PIECE, PIECE + 1, 3 * PIECE - 5, 4 * 2**20])
@pytest.mark.parametrize("kind", ["sparse", "dense", "dense in spans"])
def test_one_revision_of_xor_is_hashed_piece_by_piece_as_one_pass_over_the_block(fmt, n, kind):
    rng = np.random.default_rng(n)
    block = rng.integers(0, 256, n, dtype=np.uint8)
    spans = None
    if kind == "sparse":
        index = np.sort(rng.choice(n, n // 50, replace=False)).astype(np.int64)
        index[-1] = n - 1  # the last byte of the last piece changes too
        change = SparseChange(index, rng.integers(1, 256, index.size, dtype=np.uint8))
    else:
        change = _dense(rng, n)
        if kind == "dense in spans":  # only these ranges are written (their pages): the rest keeps its bytes
            spans = [(0, 4096), (PIECE - 100, min(n, PIECE + 5000))]
            spans += [(n - 3, n)] if n - 3 > spans[-1][1] else []
    expected = _running(block, [change])[-1] if spans is None else _in_spans(block, change, spans)
    whole = new_checksum(fmt)
    whole.update(np.frombuffer(expected, dtype=np.uint8))
    h, state = new_checksum(fmt), _State()
    fold_block([change], block, spans, [h], False, state)
    assert block.tobytes() == expected and state.steps_in_block == 1
    assert h.hexdigest() == whole.hexdigest()


def _in_spans(block: np.ndarray, change: DenseChange, spans) -> bytes:
    out = block.copy()
    for a, b in spans:
        out[a:b] ^= change.data[a:b]
    return out.tobytes()


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_a_piece_that_fails_leaves_the_block_as_it_was_and_the_revision_uncounted(kind):
    rng = np.random.default_rng(5)
    n = 3 * PIECE
    block = rng.integers(0, 256, n, dtype=np.uint8)
    before = block.tobytes()
    change = _sparse(rng, n, n // 50) if kind == "sparse" else _dense(rng, n)

    class FailsOnSecondPiece:
        calls = 0

        def update(self, data) -> None:
            self.calls += 1
            if self.calls == 2:
                raise OSError("hash failed")

    state = _State()
    with pytest.raises(OSError, match="hash failed"):
        fold_block([change], block, None, [FailsOnSecondPiece()], False, state)
    assert block.tobytes() == before and state.steps_in_block == 0
