"""The patcher writes only the pages a delta changes; a folded catch-up dirties each page at most once.

Checked two ways: the patcher's own count of pages it mapped writable
(``apply_patches(stats=...)``), and the kernel's: ``write_bytes`` in
``/proc/self/io`` grows by a page each time a clean page of a file becomes
dirty (a store through a shared mapping included), so a page left alone
adds nothing. The kernel accounts a dirtied page by its folio: on a file
system with large folios (ext4 on recent kernels) storing one byte dirties up
to 2 MiB, so the kernel's figure is checked against the folios that hold a
changed page (``dirty_unit`` measures the folio size here), and against the
checkpoint's size, which a full rewrite would dirty. The checkpoint is
fsynced before each pass, so every page starts clean. Results are always
checked byte for byte.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from storage.patch.applier import block_bounds
from storage.format.changes import PAGE, SparseChange, touched_pages
from storage.format.checkpoint import CheckpointIndex, TensorLocation
from storage.format.digests import checksum_bytes
from storage.format.encoding import encode_delta
from storage.patch.patcher import PatchStep, TensorPlan, apply_patches
from storage.format.safetensors import write_safetensors

MiB = 2**20


def dirtied_bytes() -> int | None:
    try:
        with open("/proc/self/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("write_bytes"))
    except (OSError, StopIteration):
        return None


@pytest.fixture(scope="module")
def dirty_unit(tmp_path_factory) -> int:
    """Bytes the kernel counts as written when one byte of a clean, mapped file page changes (its folio)."""
    path = tmp_path_factory.mktemp("probe") / "probe.bin"
    with open(path, "wb") as fh:
        fh.write(np.random.default_rng(0).integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as m:
        before = dirtied_bytes()
        m[4 * MiB + 5] ^= 1
        after = dirtied_bytes()
        m.flush()
    return PAGE if before is None else max(PAGE, after - before)


def kernel_bound(unit: int, *writes: tuple[TensorLocation, object]) -> int:
    """What the kernel may count for writes at ``(tensor, positions)``: each folio holding one, plus two."""
    folios = {(location.offset + int(p)) // unit for location, positions in writes for p in positions}
    return (len(folios) + 2) * unit


def write_checkpoint(folder: Path, tensors: dict[str, np.ndarray]) -> CheckpointIndex:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "model.safetensors", "wb") as fh:
        write_safetensors(fh, [(n, "U8", [a.size], a.tobytes()) for n, a in tensors.items()], {})
        fh.flush()
        os.fsync(fh.fileno())
    return CheckpointIndex.open(folder)


def steps_for(tmp: Path, version: str, encoding: str, base: dict, target: dict, index: CheckpointIndex) -> dict:
    """One revision's frames, one bucket file per tensor (the patcher reads frames by byte range)."""
    out = {}
    for name in base:
        frame = encode_delta(base[name], target[name], encoding)
        bucket = tmp / f"{version}-{name}.bin"
        bucket.write_bytes(frame)
        out[name] = PatchStep(version, encoding, bucket, f"file://{bucket}", 0, len(frame),
                              checksum_bytes("adler32", target[name]), "adler32")
    return out


def apply(index: CheckpointIndex, revisions: list[dict], **kw) -> tuple[dict, int | None]:
    plans = [TensorPlan(index.tensors[n], tuple(r[n] for r in revisions)) for n in revisions[0]]
    stats: dict = {}
    before = dirtied_bytes()
    apply_patches(index, plans, target_checksum_format="adler32", workers=2, stats=stats, **kw)
    after = dirtied_bytes()
    return stats, None if before is None else after - before


def read(index: CheckpointIndex, name: str) -> np.ndarray:
    t = index.tensors[name]
    with open(index.folder / t.file, "rb") as fh:
        fh.seek(t.offset)
        return np.frombuffer(fh.read(t.nbytes), dtype=np.uint8)


def pages_of(location: TensorLocation, positions: np.ndarray) -> set[int]:
    return set(((location.offset + positions) // PAGE).tolist())


@pytest.mark.parametrize("encoding", ["xor_sparse", "xor_gaps", "overwrite", "xor"])
def test_only_pages_with_a_change_are_written(tmp_path, dirty_unit, encoding):
    rng = np.random.default_rng(1)
    base = {"a": rng.integers(0, 256, 29 * MiB + 123, dtype=np.uint8), "b": rng.integers(0, 256, MiB, dtype=np.uint8)}
    target = {n: a.copy() for n, a in base.items()}
    changed_at = np.array([5, 4096 * 3 + 7, 4096 * 3 + 9, 5 * MiB + 1])  # three pages of "a", far apart
    target["a"][changed_at] ^= 0x41
    target["b"][:] ^= 1  # every page of "b"
    index = write_checkpoint(tmp_path / "ckpt", base)
    stats, dirtied = apply(index, [steps_for(tmp_path, "r1", encoding, base, target, index)])
    for name in base:
        assert np.array_equal(read(index, name), target[name])
    loc_a, loc_b = index.tensors["a"], index.tensors["b"]
    expected = len(pages_of(loc_a, changed_at)) + len(pages_of(loc_b, np.arange(loc_b.nbytes)))
    assert stats["pages_written"] == expected
    assert stats["blocks_unchanged"] >= 1  # "a" has whole blocks without a change: read, hashed, never written
    if dirtied is not None:  # the kernel agrees: folios left alone stayed clean, far from a full rewrite
        bound = kernel_bound(dirty_unit, (loc_a, changed_at), (loc_b, range(0, loc_b.nbytes, PAGE)))
        assert dirtied <= bound < (loc_a.nbytes + loc_b.nbytes) / 2, (dirtied, bound, dirty_unit)


def test_a_folded_catch_up_dirties_each_page_at_most_once(tmp_path, dirty_unit):
    rng = np.random.default_rng(2)
    n = 32 * MiB
    revisions = [{"w": rng.integers(0, 256, n, dtype=np.uint8)}]
    touched = set()
    for k in range(4):  # four sparse RL-like steps: different bytes of the same pages change each time
        nxt = revisions[-1]["w"].copy()
        positions = np.sort(rng.choice(n // 8, 2_000, replace=False))  # only the first 4 MiB of the tensor
        nxt[positions] ^= np.uint8(1 << k)
        touched |= set(positions.tolist())
        revisions.append({"w": nxt})
    index = write_checkpoint(tmp_path / "ckpt", revisions[0])
    steps = [steps_for(tmp_path, f"r{k + 1}", "xor_gaps" if k % 2 else "xor_sparse", revisions[k], revisions[k + 1],
                       index) for k in range(4)]
    stats, dirtied = apply(index, steps)
    assert np.array_equal(read(index, "w"), revisions[-1]["w"])
    pages = pages_of(index.tensors["w"], np.array(sorted(touched)))
    assert stats["pages_written"] == len(pages)  # the union, once, not once per revision
    assert stats["blocks_unchanged"] >= 1  # the rest: no revision changes it
    if dirtied is not None:  # four revisions, each folio dirtied once
        bound = kernel_bound(dirty_unit, (index.tensors["w"], sorted(touched)))
        assert dirtied <= bound < n / 2, (dirtied, bound, dirty_unit)


def test_a_dense_frame_with_unchanged_blocks_leaves_them_clean(tmp_path, dirty_unit):
    rng = np.random.default_rng(3)
    base = {"w": rng.integers(0, 256, 16 * MiB, dtype=np.uint8)}
    target = {"w": base["w"].copy()}
    target["w"][: MiB] ^= 0x10  # the first MiB changes densely, the rest not at all
    index = write_checkpoint(tmp_path / "ckpt", base)
    stats, dirtied = apply(index, [steps_for(tmp_path, "r1", "xor", base, target, index)])
    assert np.array_equal(read(index, "w"), target["w"])
    pages = len(pages_of(index.tensors["w"], np.arange(MiB)))
    assert stats["pages_written"] == pages and stats["blocks_unchanged"] >= 2
    if dirtied is not None:
        bound = kernel_bound(dirty_unit, (index.tensors["w"], range(0, MiB, PAGE)))
        assert dirtied <= bound < 16 * MiB / 2, (dirtied, bound, dirty_unit)


@pytest.mark.parametrize("offset, nbytes, block", [(0, 10 * MiB, 4 * MiB), (4093, 10 * MiB, 4 * MiB),
                                                   (100, 5000, 4096), (4096, 8192, 4096), (8, 1, 4096),
                                                   (12345, 3 * MiB, 1_000_000)])
def test_blocks_after_the_first_start_on_page_boundaries_of_the_file(offset, nbytes, block):
    bounds = block_bounds(TensorLocation("t", "f", offset, nbytes, "U8", (nbytes,)), block)
    assert bounds[0][0] == 0 and sum(size for _, size in bounds) == nbytes
    assert all(a + s == b for (a, s), (b, _) in zip(bounds, bounds[1:]))  # contiguous
    for start, size in bounds[1:]:
        assert (offset + start) % PAGE == 0
    rounded = max(PAGE, -(-block // PAGE) * PAGE)
    assert all(size <= rounded for _, size in bounds)


@pytest.mark.parametrize("seed", range(40))
def test_a_sparse_change_flags_exactly_the_pages_of_its_positions(seed):
    rng = np.random.default_rng(seed)
    head = int(rng.integers(0, PAGE)) if seed % 3 else 0
    size = int(rng.integers(1, 40 * PAGE))
    count = int(rng.integers(0, min(size, 3000) + 1))
    index = np.sort(rng.integers(0, size, count)).astype(np.int64)  # repeats too (an overwrite's entries)
    pages = np.zeros((head + size + PAGE - 1) // PAGE, dtype=bool)
    pages[(index + head) // PAGE] = True
    got = touched_pages([SparseChange(index, np.ones(count, dtype=np.uint8))], head, size)
    if pages.all():
        assert got is True
    elif not pages.any():
        assert got is False
    else:
        assert isinstance(got, np.ndarray) and got.tolist() == pages.tolist()
