"""The README's commands run as written: the quick start and "your own model in five minutes".

Each marked block (``<!-- readme-test: NAME -->`` above a ```bash fence) is
run with bash from the repository root, line for line as printed, in a
scratch HOME and PREFECT_HOME. The lines that make a fresh virtual
environment and install into it (``python3 -m venv``, activating it, ``pip
install``) are the ones CI itself runs on a fresh clone (``.ci/run``), which
this test checks; the rest runs with this environment's Python first on PATH.
Every document link in the README and docs/ points to a file of the repository.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab import ROOT_DIR

README = ROOT_DIR / "README.md"
SETUP = re.compile(r"^\s*(python3? -m venv |\. \S*activate|source \S*activate|pip install )")


def block(name: str) -> str:
    text = README.read_text()
    match = re.search(rf"<!-- readme-test: {name} -->\s*```bash\n(.*?)```", text, re.S)
    assert match, f"README has no block marked readme-test: {name}"
    return match.group(1)


def setup_commands(script: str) -> list[str]:
    return [part.strip() for line in script.splitlines() if not line.lstrip().startswith("#")
            for part in line.split("&&") if SETUP.match(part.strip())]


def run_block(name: str, tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    script = block(name)
    lines = [line for line in script.splitlines() if "pytest" not in line]  # the suite itself is CI's to run
    body = "\n".join(" && ".join(p for p in line.split("&&") if not SETUP.match(p.strip())) for line in lines)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path),
           "PREFECT_HOME": str(tmp_path / "prefect"), "LANG": "C.UTF-8", "DO_NOT_TRACK": "1"}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=ROOT_DIR, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_install_lines_are_the_ones_ci_runs():
    ci = (ROOT_DIR / ".ci" / "run").read_text()
    for name in ("quick-start",):
        for command in setup_commands(block(name)):
            if command.startswith("pip install"):
                wanted = command.replace("pip install -e .", "pip install -e '.[test]'")
                assert "pip install -e" in ci and ("'.[test]'" in ci or wanted in ci), command


def test_the_quick_start_runs_as_written(tmp_path):
    done = run_block("quick-start", tmp_path, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "status: READY" in done.stdout
    # a first run on a fresh machine is quiet: no telemetry errors, no traceback, no locked database
    assert "telemetry" not in output.lower() and "Traceback" not in output and "database is locked" not in output


def test_your_own_model_in_five_minutes_runs_as_written(tmp_path):
    done = run_block("own-model", tmp_path, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert '"status": "READY"' in done.stdout or "status: READY" in done.stdout


@pytest.mark.parametrize("doc", [README, *sorted((ROOT_DIR / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_link_points_inside_the_repository(doc):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        assert "://" not in target, f"{doc.name} links outside the repository: {target}"
        assert (doc.parent / target).exists(), f"{doc.name} links to a missing file: {target}"
    assert "SPEC" not in text and "../shared" not in text
    assert not re.search(r"\bissue \d+\b", text), f"{doc.name} speaks of issue numbers"
