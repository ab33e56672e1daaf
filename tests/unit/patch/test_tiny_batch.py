"""A steady refit's tiny tensors are patched a batch at a time (storage.patch.tiny, through apply_patches).

Many tiny tensors over several shards, one dense ``xor`` delta of two buckets: the batch path must give the same
bytes as the trainer's, the same final checksums, the same errors (a checksum missed, a frame that does not
decode to its tensor's size, named by revision, bucket and tensor) and undo every tensor of the pass exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from flows.synthetic import to_bf16
from storage.errors import ChecksumMismatch, CodecError
from storage.patch.patcher import apply_patches, plan_patches
from storage.patch.pipeline import Arrivals, ArrivingPlans
from tests.unit.patch.test_pipeline import Chain, checksums_of, rewrite_bucket


def tiny_chain(lab, tmp_path) -> Chain:
    rng = np.random.default_rng(11)
    lab.current = {f"model.layers.{i // 40}.mlp.experts.{i % 40}.w": to_bf16(
        rng.standard_normal(int(rng.integers(1, 2500)), dtype=np.float32)) for i in range(400)}
    return Chain(lab, tmp_path, 1, bucket_bytes=200_000)


def arriving(chain: Chain) -> ArrivingPlans:
    arrivals = Arrivals()
    source = ArrivingPlans(chain.manifests, chain.folders, chain.index.tensors, arrivals, workers=2)
    arrivals.admit()
    for manifest in chain.manifests:
        for name in manifest.files:
            arrivals.arrived(manifest.version, name)
    arrivals.close()
    return source


@pytest.mark.parametrize("workers", [1, 2])
def test_tiny_tensors_are_patched_byte_exact_with_their_checksums(lab, tmp_path, workers):
    chain = tiny_chain(lab, tmp_path)
    assert len(chain.manifests[0].files) >= 2  # frames of two buckets in one batch
    work = chain.work()
    stats: dict = {}
    got = apply_patches(work, arriving(chain), target_checksum_format="adler32", workers=workers, stats=stats)
    assert chain.bytes_of(work) == chain.expected(1)
    assert got == checksums_of(work)
    assert stats["blocks"] == len(chain.index.tensors)
    assert 0 < stats["pages_written"] <= sum((loc.offset % 4096 + loc.nbytes + 4095) // 4096
                                             for loc in chain.index.tensors.values())


def _bucket_and_tensor(chain: Chain, nth: int) -> tuple[str, str]:
    weight_map = chain.manifests[0].weight_map
    name = sorted(weight_map)[nth]
    return weight_map[name], name


def _edit(chain: Chain, bucket: str, tensor: str, *, frame: bytes | None = None, checksum: str | None = None):
    def edit(frames, metadata):
        if frame is not None:
            frames[tensor] = frame
        if checksum is not None:
            metadata[tensor] = checksum
        return frames, metadata

    rewrite_bucket(chain.folders["r1"] / bucket, edit)


def _reject(chain: Chain):
    work = chain.work()
    with pytest.raises((ChecksumMismatch, CodecError)) as info:
        apply_patches(work, plan_patches(chain.manifests, chain.folders, chain.index.tensors),
                      target_checksum_format="adler32", workers=2, undo_to=checksums_of(chain.index),
                      undo_format="adler32")
    return info.value, work


def test_a_checksum_missed_in_a_batch_is_named_and_every_tensor_undone(lab, tmp_path):
    chain = tiny_chain(lab, tmp_path)
    bucket, tensor = _bucket_and_tensor(chain, 123)
    _edit(chain, bucket, tensor, checksum="0badc0de")
    error, work = _reject(chain)
    assert type(error) is ChecksumMismatch and "the bucket says 0badc0de" in str(error)
    assert (error.revision, error.tensor) == ("r1", tensor) and error.file.endswith(bucket)
    assert error.mutation_started and error.undone
    assert chain.bytes_of(work) == chain.expected(0)


def test_a_frame_that_decodes_short_in_a_batch_is_named_and_every_tensor_undone(lab, tmp_path):
    chain = tiny_chain(lab, tmp_path)
    bucket, tensor = _bucket_and_tensor(chain, 57)
    nbytes = chain.index.tensors[tensor].nbytes
    short = zstandard.ZstdCompressor(write_content_size=False).compress(b"\1" * (nbytes - 1))
    _edit(chain, bucket, tensor, frame=short)
    error, work = _reject(chain)
    assert type(error) is CodecError and "decodes to only" in str(error)
    assert (error.revision, error.tensor) == ("r1", tensor) and error.file.endswith(bucket)
    assert error.undone
    assert chain.bytes_of(work) == chain.expected(0)
