"""The lab's trainer: a synthetic model's launch snapshot and its training steps, published in this process.

``Trainer`` writes a transformer-shaped bf16 checkpoint (``flows.synthetic``)
as the launch snapshot, makes each next step dense (every element moves) or
RL-like (a share of the elements flips by one ulp), and publishes it with
``flows.publish.run_publish`` from this (warm) process, so the trainer's own
start-up is not counted; the published event reaches whatever
``PREFECT_API_URL`` names.
"""

from __future__ import annotations

import time
from pathlib import Path


class Trainer:
    """A synthetic model's launch snapshot and its training steps, published with ``flows.publish.run_publish``
    in this (warm) process; the event reaches whatever ``PREFECT_API_URL`` names."""

    def __init__(self, root: Path, catalog: str, model: str, *, shape=None, share: float | None = None,
                 endpoint: str | None = None, seed: int = 7):
        from flows.synthetic import ModelShape, RLTrainer, random_model, write_checkpoint

        self.root, self.catalog, self.model, self.endpoint = Path(root), catalog, model, endpoint
        self.shape = shape or ModelShape(vocab=512, hidden=64, intermediate=160, layers=2, shards=2)
        self.share = share
        self.launch = self.root / "launch"
        self.state_dir = self.root / "publisher"
        self.steps = 0
        tensors = random_model(self.shape, seed=seed)
        write_checkpoint(self.launch, tensors, shards=self.shape.shards)
        self.current = tensors
        self.rl = RLTrainer(tensors, seed=seed)
        self._write = write_checkpoint

    def checkpoint(self) -> Path:
        """The next training step's checkpoint folder (the launch snapshot for step 0)."""
        from flows.synthetic import train_step

        if self.steps == 0:
            folder = self.launch
        else:
            if self.share:  # RL-like: a share of the bf16 elements flips by one ulp
                self.current = self.rl.step(self.share)
            else:  # dense: every element moves
                self.current = train_step(self.current, seed=100 + self.steps)
            folder = self._write(self.root / f"step-{self.steps}", self.current, shards=self.shape.shards)
        self.steps += 1
        return folder

    def params(self, folder: Path, kind: str, **extra):
        from storage.settings import ObjectStoreSettings, PublishParams

        storage = ObjectStoreSettings(endpoint_url=self.endpoint, region="us-east-1") if self.endpoint else None
        values = dict(catalog=self.catalog, model=self.model, checkpoint=folder, kind=kind, state_dir=self.state_dir,
                      **extra)
        if storage is not None:
            values["storage"] = storage
        return PublishParams(**values)

    def publish(self, kind: str = "delta", **extra):
        """Publish the next step (``initial`` first); returns (PublishResult, seconds the call took)."""
        from flows.publish import run_publish

        params = self.params(self.checkpoint(), kind, **extra)
        started = time.time()
        result = run_publish(params)
        return result, started
