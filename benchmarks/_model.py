"""The benchmark's model and catalog: transformer-shaped bf16 weights and published revisions.

The shape is a decoder-only transformer sized to ``size_bytes``: two large
embedding-like tensors (vocabulary x hidden, 1/8 of the bytes each) among
many medium attention and MLP matrices. Revisions are optimizer-step-like
perturbations (``flows.synthetic.train_step``). Publishing goes through the
publish flow's own task functions (``.fn``) in the flow's order, so no
Prefect API is needed to build the catalog.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from flows.publish import run_publish
from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint
from storage.catalog import Catalog, Revision
from storage.objects import ObjectStore
from storage.urls import normalize_url
from storage.settings import PublishParams

MODEL = "bench/transformer"
LAYERS = 8
MLP_RATIO = 2.6875  # Llama's intermediate/hidden (11008/4096)


def shape_for(size_bytes: int) -> ModelShape:
    """The ``LAYERS``-layer shape whose bf16 size is closest to ``size_bytes`` (hidden a multiple of 64)."""

    def make(h: int) -> ModelShape:
        inter = max(64, int(round(h * MLP_RATIO / 64)) * 64)
        shards = max(2, math.ceil(size_bytes / (512 * 2**20)))
        return ModelShape(vocab=16 * h, hidden=h, intermediate=inter, layers=LAYERS, shards=shards)

    h = 64
    while make(h + 64).nbytes <= size_bytes:
        h += 64
    low, high = make(h), make(h + 64)
    return low if size_bytes - low.nbytes <= high.nbytes - size_bytes else high


@dataclass
class RevisionInfo:
    """One published delta and what it cost to publish."""

    version: str
    base_version: str
    changed_tensors: int
    decoded_bytes: int
    encoded_bytes: int
    compression_ratio: float
    changed_element_fraction: float
    buckets: int
    largest_bucket_bytes: int
    publish_s: float

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Workspace:
    """Folders of one benchmark run (all under ``root``) and what was published into them."""

    root: Path
    shape: ModelShape
    model: str = MODEL
    revisions: list[RevisionInfo] = field(default_factory=list)
    model_bytes: int = 0
    tensor_count: int = 0
    largest_tensor_bytes: int = 0
    checkpoint_file_bytes: int = 0

    @property
    def launch(self) -> Path:
        return self.root / "launch"

    @property
    def trainer(self) -> Path:
        return self.root / "trainer"

    @property
    def catalog_dir(self) -> Path:
        return self.root / "catalog"

    @property
    def catalog(self) -> str:
        return normalize_url(str(self.catalog_dir))

    @property
    def payload_dir(self) -> Path:
        return self.root / "revisions"  # the publisher's default: {catalog}/../revisions/{version}

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def pristine(self) -> Path:
        return self.root / "pristine"

    @property
    def scratch(self) -> Path:
        return self.root / "scratch"

    def checkpoint_of(self, version: str) -> Path:
        return self.launch if version == "r0" else self.trainer / version

    def delta_folder(self, version: str) -> Path:
        return self.payload_dir / version

    def record(self, version: str) -> Revision:
        return Catalog(ObjectStore(), self.catalog, self.model).read(version)

    def info(self, version: str) -> RevisionInfo:
        return next(r for r in self.revisions if r.version == version)

    def model_json(self) -> dict:
        s = self.shape
        return {"bytes": self.model_bytes, "checkpoint_file_bytes": self.checkpoint_file_bytes,
                "tensors": self.tensor_count, "largest_tensor_bytes": self.largest_tensor_bytes,
                "shape": {"vocab": s.vocab, "hidden": s.hidden, "intermediate": s.intermediate,
                          "layers": s.layers, "shards": s.shards}}


def _changed_fraction(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> float:
    changed = sum(int(np.count_nonzero(before[n] != after[n])) for n in before)
    return changed / max(1, sum(a.size for a in before.values()))


def build(root: Path, *, size_bytes: int, deltas: int, fraction: float, lr: float, bucket_mib: int,
          zstd_level: int, workers: int, log: Callable[[str], None]) -> Workspace:
    """Write the launch snapshot, publish it as ``r0`` and ``deltas`` XOR deltas ``r1..r{deltas}``.

    Keeps only the launch snapshot and ``r1`` on the trainer side (disk stays
    at about three model copies plus the payloads).
    """
    ws = Workspace(Path(root), shape_for(size_bytes))
    for folder in (ws.trainer, ws.scratch):
        folder.mkdir(parents=True, exist_ok=True)
    common = dict(catalog=ws.catalog, model=ws.model, state_dir=ws.root / "publisher", keep_copy=False,
                  emit_event=False, bucket_max_mib=bucket_mib, zstd_level=zstd_level, workers=workers)
    started = time.perf_counter()
    current = random_model(ws.shape, seed=20260)
    write_checkpoint(ws.launch, current, shards=ws.shape.shards)
    ws.model_bytes = sum(a.nbytes for a in current.values())
    ws.tensor_count = len(current)
    ws.largest_tensor_bytes = max(a.nbytes for a in current.values())
    ws.checkpoint_file_bytes = sum(p.stat().st_size for p in ws.launch.glob("*.safetensors"))
    run_publish(PublishParams(checkpoint=ws.launch, kind="initial", version="r0", **common))
    log(f"model: {ws.tensor_count} tensors, {ws.model_bytes / 1e6:.1f} MB bf16, largest tensor "
        f"{ws.largest_tensor_bytes / 1e6:.1f} MB, {ws.shape.shards} shards ({time.perf_counter() - started:.1f}s)")
    base = ws.launch
    for k in range(1, deltas + 1):
        version = f"r{k}"
        nxt = train_step(current, seed=7000 + k, fraction=fraction, lr=lr)
        folder = ws.trainer / version
        write_checkpoint(folder, nxt, shards=ws.shape.shards)
        t0 = time.perf_counter()
        published = run_publish(PublishParams(checkpoint=folder, kind="delta", version=version,
                                              base_version=f"r{k - 1}", base_checkpoint=base, **common))
        seconds = time.perf_counter() - t0
        buckets = sorted(ws.delta_folder(version).glob("*.safetensors"))
        info = RevisionInfo(
            version=version, base_version=f"r{k - 1}", changed_tensors=published.changed_tensors,
            decoded_bytes=published.decoded_bytes, encoded_bytes=published.encoded_bytes,
            compression_ratio=published.compression_ratio,
            changed_element_fraction=round(_changed_fraction(current, nxt), 4), buckets=len(buckets),
            largest_bucket_bytes=max((p.stat().st_size for p in buckets), default=0), publish_s=round(seconds, 3),
        )
        ws.revisions.append(info)
        log(f"published {version}: {info.changed_tensors} tensors changed "
            f"({info.changed_element_fraction:.1%} of elements), {info.encoded_bytes / 1e6:.1f} MB in "
            f"{info.buckets} bucket(s), ratio {info.compression_ratio:.2f}, {seconds:.1f}s")
        if base != ws.launch and base.name != "r1":
            shutil.rmtree(base)  # only r0 (the launch snapshot) and r1 stay on the trainer side
        base, current = folder, nxt
    if base != ws.launch and base.name != "r1":
        shutil.rmtree(base)
    return ws
