"""An error below the command line names settings fields; only the command line renders them as its flags.

A rank of a sharded publication that keeps no copy of its base tensors is refused with the same
``LineageError`` either way: through ``flows.api.publish`` it says ``base_checkpoint=`` and ``kind="full"``
(the keyword arguments the caller passes), through ``python -m flows.publish`` ``--base-checkpoint`` and
``--kind full``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from flows import api
from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint
from storage.errors import LineageError
from tests.support.lab import ROOT_DIR

MODEL = "lab/fields"
SHAPE = ModelShape(vocab=64, hidden=16, intermediate=32, layers=1, shards=1)


@pytest.fixture
def catalog_with_r0(prefect_api, tmp_path):
    """r0 published by rank 0 of 1, and r1's checkpoint, on a machine whose publisher state holds no copy of r0."""
    tensors = random_model(SHAPE, seed=1)
    api.publish(write_checkpoint(tmp_path / "step0", tensors), catalog=f"file://{tmp_path}/catalog", model=MODEL,
                kind="initial", rank=0, world_size=1, publication="p0", state_dir=tmp_path / "state",
                emit_event=False)
    return tmp_path, write_checkpoint(tmp_path / "step1", train_step(tensors, seed=2))


def test_the_python_api_names_the_fields(catalog_with_r0):
    root, step1 = catalog_with_r0
    with pytest.raises(LineageError) as info:
        api.publish(step1, catalog=f"file://{root}/catalog", model=MODEL, kind="delta", rank=0, world_size=1,
                    publication="p1", state_dir=root / "elsewhere", emit_event=False)
    message = str(info.value)
    assert info.value.field == "base_checkpoint"
    assert 'base_checkpoint=' in message and 'kind="full"' in message and "--" not in message


def test_the_command_line_names_the_flags(catalog_with_r0):
    root, step1 = catalog_with_r0
    proc = subprocess.run([sys.executable, "-m", "flows.publish", "--catalog", f"file://{root}/catalog",
                           "--model", MODEL, "--checkpoint", str(step1), "--kind", "delta", "--rank", "0",
                           "--world-size", "1", "--publication", "p1", "--state-dir", str(root / "elsewhere"),
                           "--no-event"], cwd=ROOT_DIR, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    said = [line for line in out.splitlines() if line.startswith("error:")]  # the command's own message
    assert proc.returncode != 0 and len(said) == 1, out[-3000:]
    assert "--base-checkpoint" in said[0] and "--kind full" in said[0], said
    assert "base_checkpoint=" not in said[0] and 'kind="full"' not in said[0], said
