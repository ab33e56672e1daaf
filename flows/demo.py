"""The embedded demo: ``python -m flows.refit`` with no arguments.

First run: builds a small random transformer-shaped bf16 model, publishes
revision 0, three deltas, one full revision and one more delta to a local
``file://`` catalog, then refits to the latest revision. Every later run
trains one more step, publishes it as a delta and refits it. Everything lives
in ``./.canonical-refit-demo/`` unless ``CANONICAL_REFIT_DEMO_DIR`` names
another folder; no server and no credentials are needed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint

log = logging.getLogger("canonical_refit.demo")
MODEL = "demo/tiny-transformer"


def demo_dir() -> Path:
    return Path(os.environ.get("CANONICAL_REFIT_DEMO_DIR", ".canonical-refit-demo")).resolve()


def _last_step(steps_file: Path) -> int | None:
    """The last step the demo trainer published (``trainer/steps.json``, ``{"step": n}``), None before the
    first run; a file refused by the strict record parser is a ``FormatError`` naming it."""
    from pydantic import ConfigDict
    from pydantic.dataclasses import dataclass

    from storage.errors import FormatError
    from storage.jsonio.bounded_json import RECORD, read_record

    @dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
    class Steps:  # the demo's own file: an unknown key is refused
        step: int

    hint = f"; delete {steps_file.parent.parent} to start the demo over"
    steps = read_record(steps_file, Steps, RECORD, error=FormatError, hint=hint, missing_ok=True,
                        local_file=str(steps_file))
    return None if steps is None else steps.step


def run_demo() -> int:
    """Publish the next demo revision(s), refit to latest, print the stage table and identity."""
    from flows.publish import publish
    from flows.refit import refit
    from flows.report import READY, print_result, result_of, watching
    from storage.urls import normalize_url
    from storage.settings import InstallerSettings, PublishParams, RefitParams

    root = demo_dir()
    catalog = normalize_url(str(root / "catalog"))
    trainer = root / "trainer"
    steps_file = trainer / "steps.json"
    step = _last_step(steps_file)

    def publish_step(n: int, kind: str, tensors) -> None:
        folder = trainer / f"step-{n}"
        shutil.rmtree(folder, ignore_errors=True)
        write_checkpoint(folder, tensors)
        result = publish(PublishParams(catalog=catalog, model=MODEL, checkpoint=folder, kind=kind,
                                       version=f"r{n}", state_dir=root / "publisher"))
        print(f"published r{n} ({result.payload_format}): {result.bytes_written:,} bytes written, "
              f"{result.changed_tensors} changed tensor(s), compression {result.compression_ratio:.2f}x")
        if n > 0:
            shutil.rmtree(trainer / f"step-{n - 1}", ignore_errors=True)
        steps_file.write_text(json.dumps({"step": n}))

    if step is None:
        shutil.rmtree(root, ignore_errors=True)
        trainer.mkdir(parents=True)
        shape = ModelShape()
        tensors = random_model(shape, seed=0)
        write_checkpoint(root / "launch", tensors)
        print(f"demo model {MODEL}: {len(tensors)} bf16 tensors, {shape.nbytes:,} bytes, in {root}")
        publish_step(0, "initial", tensors)
        for n, kind in ((1, "delta"), (2, "delta"), (3, "delta"), (4, "full"), (5, "delta")):
            tensors = train_step(tensors, seed=n)
            publish_step(n, kind, tensors)
    else:
        from storage.format.checkpoint import CheckpointIndex

        index = CheckpointIndex.open(trainer / f"step-{step}")
        tensors = _load(index)
        publish_step(step + 1, "delta", train_step(tensors, seed=step + 1))
    params = RefitParams(catalog=catalog, model=MODEL, seed_checkpoint=str(root / "launch"),
                         cache_dir=root / "cache", installer=InstallerSettings(kind="none"))
    with watching() as watch:
        state = refit(params, return_state=True)
    result = result_of(state, watch)
    print_result(result)
    print(f"store: {root / 'cache'}  (inspect with: python -m flows.refit status --cache-dir "
          f"{root / 'cache'} --model {MODEL})")
    return 0 if result.status == READY else 1


def _load(index) -> dict:
    import numpy as np

    out = {}
    for name, loc in index.tensors.items():
        with open(index.folder / loc.file, "rb") as fh:
            fh.seek(loc.offset)
            out[name] = np.frombuffer(fh.read(loc.nbytes), dtype=np.uint16).reshape(loc.shape)
    return out
