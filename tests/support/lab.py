"""A test lab: tiny models, a publisher and a receiver over one catalog.

Expected bytes are tracked independently of the code under test: the lab
keeps every published revision's tensors in memory and computes expected
digests with a from-scratch implementation of docs/format.md, section 3.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint
from storage.urls import normalize_url
from storage.settings import InstallerSettings, PublishParams, RefitParams

MODEL = "lab/tiny"
ROOT_DIR = Path(__file__).resolve().parents[2]


def tiny_shape() -> ModelShape:
    return ModelShape(vocab=512, hidden=64, intermediate=160, layers=2, shards=2)


def independent_digest(tensors: dict[str, np.ndarray]) -> tuple[str, str]:
    """(format digest, snapshot digest) of bf16 tensors, written from the spec alone."""
    layout = sorted(({"name": n, "dtype": "BF16", "shape": list(a.shape)} for n, a in tensors.items()),
                    key=lambda e: e["name"])
    fmt = "sha256:" + hashlib.sha256(json.dumps(layout, sort_keys=True, separators=(",", ":"))
                                     .encode()).hexdigest()
    sums = {n: f"{zlib.adler32(a.tobytes(), 1) & 0xffffffff:08x}" for n, a in tensors.items()}
    body = {"checksum_format": "adler32", "format_digest": fmt, "tensors": sums}
    snap = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                                      .encode()).hexdigest()
    return fmt, snap


def read_checkpoint(folder: Path) -> dict[str, np.ndarray]:
    """Tensors of a checkpoint folder as uint16 bit patterns, read with the safetensors library."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            out[name] = tensor.view(torch.int16).numpy().view(np.uint16)
    return out


def tree_hash(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (to prove nothing changed)."""
    out = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and path.name != "lock":
            out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@dataclass
class Lab:
    root: Path
    shape: ModelShape
    model: str = MODEL
    revisions: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    step: int = 0

    def __post_init__(self):
        self.root = Path(self.root)
        self.catalog_dir = self.root / "catalog"
        self.catalog = normalize_url(str(self.catalog_dir))
        self.cache = self.root / "cache"
        self.launch = self.root / "launch"
        self.trainer = self.root / "trainer"
        self.current = random_model(self.shape, seed=1234)

    # -- publishing ----------------------------------------------------------------------------
    #
    # A test's world is built with the product's plain runbooks (``run_publish``, ``run_refit``: what the flows
    # run); ``flow=True`` runs the Prefect flow itself, for the tests about the flow. A plain refit's state is
    # the one the flow would end in (``flows.outcome.final_state`` of the same result).

    def params(self, checkpoint: Path, kind: str, **kw) -> PublishParams:
        return PublishParams(catalog=self.catalog, model=self.model, checkpoint=checkpoint, kind=kind,
                             state_dir=self.root / "publisher", emit_event=kw.pop("emit_event", False), **kw)

    def write(self, tensors, name: str) -> Path:
        folder = self.trainer / name
        write_checkpoint(folder, tensors, shards=self.shape.shards)
        return folder

    def publish(self, kind: str, tensors=None, *, version: str | None = None, flow: bool = False, **kw):
        """Publish ``tensors`` (default: the next training step): the publication runbook, or the flow."""
        from flows.publish import publish, run_publish

        if tensors is None:
            tensors = self.current if kind == "initial" else self.next_step()
        self.step += 1
        folder = self.write(tensors, f"step-{self.step}")
        if kind == "initial":
            write_checkpoint(self.launch, tensors, shards=self.shape.shards)
        params = self.params(folder, kind, version=version, **kw)
        result = publish(params) if flow else run_publish(params)
        self.revisions[result.version] = tensors
        self.current = tensors
        return result

    def next_step(self, **kw) -> dict[str, np.ndarray]:
        return train_step(self.current, seed=1000 + self.step, **kw)

    def expected(self, version: str) -> dict[str, np.ndarray]:
        return self.revisions[version]

    # -- receiving -------------------------------------------------------------------------------

    def refit_params(self, **kw) -> RefitParams:
        installer = kw.pop("installer", None) or InstallerSettings(kind="none")
        base = dict(catalog=self.catalog, model=self.model, seed_checkpoint=str(self.launch),
                    cache_dir=self.cache, installer=installer, apply_workers=2, lock_timeout_s=30)
        base.update(kw)
        return RefitParams(**base)

    def refit(self, *, flow: bool = False, **kw):
        """Refit (the runbook, or with ``flow`` the Prefect flow); returns (final state, RefitResult)."""
        from flows.outcome import final_state
        from flows.refit import refit, run_refit
        from flows.report import result_of, watching

        if not flow:
            result = run_refit(self.refit_params(**kw))
            return final_state(result), result
        with watching() as watch:
            state = refit(self.refit_params(**kw), return_state=True)
        return state, result_of(state, watch)

    def run(self, installer=None, stop=None, **kw):
        """Run the refit runbook without Prefect (what the flow runs), with any installer; the RefitResult."""
        from flows.refit import run_refit

        return run_refit(self.refit_params(**kw), installer=installer, stop=stop)

    @property
    def store_root(self) -> Path:
        return self.cache / self.model.replace("/", "--")

    def assert_checkpoint(self, folder: Path, version: str) -> None:
        """The checkpoint in ``folder`` holds exactly the tensors of ``version``."""
        got = read_checkpoint(folder)
        want = self.expected(version)
        assert sorted(got) == sorted(want)
        for name, array in want.items():
            assert got[name].tobytes() == array.tobytes(), name
