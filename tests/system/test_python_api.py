"""docs/python-api.md's RL loop runs as written against an S3 server, and the API runs inside a flow run.

The block marked ``<!-- python-api-test: NAME -->`` above a ```python fence
is run as a script in a fresh process, with only the environment the doc
names: ``CANONICAL_REFIT_EXAMPLE_CATALOG``, ``CANONICAL_REFIT_EXAMPLE_DIR``
and the standard AWS variables.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.support.lab import ROOT_DIR
from tests.support.s3_support import aws_environment, s3  # noqa: F401  (s3 is a fixture)

DOC = ROOT_DIR / "docs" / "python-api.md"


def block(name: str) -> str:
    match = re.search(rf"<!-- python-api-test: {name} -->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/python-api.md has no block marked python-api-test: {name}"
    return match.group(1)


def test_the_rl_loop_runs_as_written_against_s3(tmp_path, s3):  # noqa: F811
    script = tmp_path / "rl_loop.py"
    script.write_text(block("rl-loop"))
    catalog = f"{s3.prefix('python-api')}/catalog"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "DO_NOT_TRACK": "1",
           "PYTHONPATH": str(ROOT_DIR), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "CANONICAL_REFIT_EXAMPLE_CATALOG": catalog, "CANONICAL_REFIT_EXAMPLE_DIR": str(tmp_path / "work"),
           **aws_environment(s3.endpoint)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for step in (1, 2, 3):
        assert f"step {step}: published r{step}: 3 changed tensors" in done.stdout, done.stdout
        assert f"step {step}: READY r{step}" in done.stdout, done.stdout
        assert f"step {step}: reached by node-0" in done.stdout, done.stdout
    assert "'r3'" in done.stdout.splitlines()[-1]
    assert not (tmp_path / "work" / "publisher" / "me--tiny-policy" / "checkpoint").exists()  # keep_base memory


def test_the_overlapped_rl_loop_runs_as_written(tmp_path):
    script = tmp_path / "rl_loop_overlapped.py"
    script.write_text(block("rl-loop-overlapped"))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "DO_NOT_TRACK": "1",
           "PYTHONPATH": str(ROOT_DIR), "PREFECT_HOME": str(tmp_path / "prefect"),
           "CANONICAL_REFIT_EXAMPLE_CATALOG": f"file://{tmp_path}/catalog",
           "CANONICAL_REFIT_EXAMPLE_DIR": str(tmp_path / "work")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for step in (1, 2, 3):
        assert f"step {step}: published r{step} in " in done.stdout, done.stdout
    records = sorted(p.name for p in (tmp_path / "catalog").glob("r*.json"))
    assert records == ["r0.json", "r1.json", "r2.json", "r3.json"]


def test_publish_and_refit_from_inside_a_flow_run(prefect_api, tmp_path):
    from prefect import flow
    from safetensors.torch import save_file

    from flows import api

    weights = {"a.weight": torch.randn(32, 16).to(torch.bfloat16), "b.bias": np.ones(16, dtype=np.float32)}
    launch = tmp_path / "launch"
    launch.mkdir()
    save_file({"a.weight": weights["a.weight"], "b.bias": torch.from_numpy(weights["b.bias"])},
              str(launch / "model.safetensors"))
    common = dict(catalog=f"file://{tmp_path}/catalog", model="me/flow")

    @flow(name="rl-step")
    def rl_step(kind: str) -> tuple[str, str]:
        published = api.publish(weights, kind=kind, state_dir=tmp_path / "publisher", keep_base="memory",
                                emit_event=False, **common)
        result = api.refit(cache_dir=tmp_path / "cache", seed_checkpoint=launch, installer={"kind": "none"},
                           node="node-0", **common)
        return published.version, result.version

    assert rl_step("initial") == ("r0", "r0")
    weights["a.weight"] += 1
    assert rl_step("delta") == ("r1", "r1")
    assert api.status(model="me/flow", cache_dir=tmp_path / "cache")["active"]["version"] == "r1"

    @flow(name="rl-step-too-far")
    def too_far() -> None:
        api.refit(cache_dir=tmp_path / "cache", seed_checkpoint=launch, installer={"kind": "none"}, node="node-0",
                  target="r9", **common)

    from storage.errors import CatalogError

    with pytest.raises(CatalogError) as caught:  # a failed refit inside a flow run: its typed error, result attached
        too_far()
    result = caught.value.result
    assert result.status == "FAILED" and result.exception is caught.value and result.installed_version == "r1"
    assert result.stages and result.stages[0]["name"] == "resolve catalog" and "r9" in result.error


def test_the_documented_install_provides_the_torch_the_example_imports():
    """The RL loop imports torch; the install line the page gives must name an extra of ours that pins it."""
    import tomllib

    install = re.search(r"<!-- python-api-install -->\s*```bash\n(.*?)```", DOC.read_text(), re.S)
    assert install, "docs/python-api.md gives no install line for the example's dependencies"
    extra = re.search(r"pip install -e '\.\[(\w+)\]'", install.group(1)).group(1)
    extras = tomllib.loads((ROOT_DIR / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("torch==") for dep in extras[extra]), extras.get(extra)
    assert "import torch" in block("rl-loop")
