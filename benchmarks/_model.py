"""The benchmark's model and catalog: transformer-shaped bf16 weights and published revisions.

The shape is a decoder-only transformer sized to ``size_bytes``: two large
embedding-like tensors (vocabulary x hidden, 1/8 of the bytes each) among
many medium attention and MLP matrices. Revisions are optimizer steps on fp32
master weights exported to bf16 (``flows.synthetic.RLTrainer``), calibrated
so a given share of the bf16 elements changes by one ulp (an RL step:
``share=0.02``), or a dense step (``share=None``: about 40 % of the elements
change). Publishing goes through the publish flow's own task functions
(``run_publish``) in the flow's order, so no Prefect API is needed to build
the catalog.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from flows.publish import run_publish
from flows.synthetic import ModelShape, RLTrainer, changed_share, random_model, write_checkpoint
from storage.catalog.records import Catalog, Revision
from storage.objects.store import ObjectStore
from storage.settings import PublishParams
from storage.urls import normalize_url

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


def share_label(share: float | None) -> str:
    """``0.02`` -> ``"2%"``; None (a dense step) -> ``"dense"``."""
    return "dense" if share is None else f"{share * 100:g}%"


def parse_share(text: str) -> float | None:
    """``"0.02"`` -> 0.02; ``"dense"`` (or 0) -> None."""
    if text.strip().lower() in ("dense", "none", "0"):
        return None
    value = float(text)
    if not 0 < value < 1:
        raise ValueError(f"a share of changed elements is between 0 and 1 (or 'dense'), not {text!r}")
    return value


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
    share_target: str = ""
    encoding: str | None = None
    encoded_fraction_of_model: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Workspace:
    """Folders of one benchmark run (all under ``root``) and what was published into them."""

    root: Path
    shape: ModelShape
    model: str = MODEL
    revisions: list[RevisionInfo] = field(default_factory=list)
    trainer_state: RLTrainer | None = None  # where the lineage ended: the sweep continues from there
    current: dict | None = None  # the last published revision's bf16 tensors
    last_checkpoint: Path | None = None
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


def build(root: Path, *, size_bytes: int, deltas: int, share: float | None, dense_lr: float, encoding: str,
          bucket_mib: int, zstd_level: int, workers: int, log: Callable[[str], None]) -> Workspace:
    """Write the launch snapshot, publish it as ``r0`` and ``deltas`` deltas ``r1..r{deltas}`` (RL steps of ``share``).

    Keeps the launch snapshot, ``r1`` (the base of the one-delta refits) and
    the last revision (the sweep's first base) on the trainer side: disk
    stays at about four model copies plus the payloads.
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
    trainer = RLTrainer(current, seed=7000)
    log(f"model: {ws.tensor_count} tensors, {ws.model_bytes / 1e6:.1f} MB bf16, largest tensor "
        f"{ws.largest_tensor_bytes / 1e6:.1f} MB, {ws.shape.shards} shards ({time.perf_counter() - started:.1f}s)")
    base = ws.launch
    for k in range(1, deltas + 1):
        version = f"r{k}"
        nxt = trainer.step(share, dense_lr=dense_lr)
        folder = ws.trainer / version
        write_checkpoint(folder, nxt, shards=ws.shape.shards)
        params = publish_params(dict(checkpoint=folder, kind="delta", version=version, base_version=f"r{k - 1}",
                                     base_checkpoint=base, **common), encoding)
        t0 = time.perf_counter()
        published = run_publish(params)
        seconds = time.perf_counter() - t0
        buckets = sorted(ws.delta_folder(version).glob("*.safetensors"))
        info = RevisionInfo(
            version=version, base_version=f"r{k - 1}", changed_tensors=published.changed_tensors,
            decoded_bytes=published.decoded_bytes, encoded_bytes=published.encoded_bytes,
            compression_ratio=published.compression_ratio,
            changed_element_fraction=round(changed_share(current, nxt), 5), buckets=len(buckets),
            largest_bucket_bytes=max((p.stat().st_size for p in buckets), default=0), publish_s=round(seconds, 3),
            share_target=share_label(share), encoding=published.encoding,
            encoded_fraction_of_model=round(published.encoded_bytes / ws.model_bytes, 5),
        )
        ws.revisions.append(info)
        log(f"published {version}: {info.changed_tensors} tensors changed "
            f"({info.changed_element_fraction:.2%} of elements), {info.encoding}, {info.encoded_bytes / 1e6:.1f} MB "
            f"= {info.encoded_fraction_of_model:.2%} of the model in {info.buckets} bucket(s), {seconds:.1f}s")
        if base != ws.launch and base.name != "r1":
            shutil.rmtree(base)  # only r0 (the launch snapshot), r1 and the newest stay on the trainer side
        base, current = folder, nxt
    ws.trainer_state, ws.current, ws.last_checkpoint = trainer, current, base
    return ws


def publish_params(values: dict, encoding: str) -> PublishParams:
    """Publication parameters with ``encoding``; an encoding the settings do not list yet (the opt-in
    ``xor_gaps``) is set after their validation, since ``flows.publish`` hands it to ``stage_delta`` as is."""
    try:
        return PublishParams(**values, encoding=encoding)
    except ValueError:
        return PublishParams(**values).model_copy(update={"encoding": encoding})


@dataclass
class SweepStep:
    """One step of the sweep: a base checkpoint, the step's checkpoint, and how much changed."""

    share: float | None
    label: str
    base: Path
    target: Path
    changed_element_share: float
    changed_byte_share: float


def sweep_steps(ws: Workspace, shares: list[float | None], *, dense_lr: float, log: Callable[[str], None]
                ) -> Iterator[SweepStep]:
    """Continue training from the lineage's end, one step per share; each step's base is the step before.

    A step's folders are removed when the next is asked for (disk: two model copies).
    """
    trainer, current, base = ws.trainer_state, ws.current, ws.last_checkpoint
    folder = ws.scratch / "sweep"
    folder.mkdir(parents=True, exist_ok=True)
    previous: Path | None = None
    for i, share in enumerate(shares):
        t0 = time.perf_counter()
        nxt = trainer.step(share, dense_lr=dense_lr)
        target = write_checkpoint(folder / f"step-{i}", nxt, shards=ws.shape.shards)
        changed_bytes = sum(int(np.count_nonzero(current[n].view(np.uint8) != nxt[n].view(np.uint8)))
                            for n in current)
        step = SweepStep(share, share_label(share), base, target, round(changed_share(current, nxt), 5),
                         round(changed_bytes / ws.model_bytes, 5))
        log(f"sweep step {step.label}: {step.changed_element_share:.2%} of elements, {step.changed_byte_share:.2%} "
            f"of bytes changed ({time.perf_counter() - t0:.1f}s to train and write)")
        yield step
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        previous, base, current = target, target, nxt
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
