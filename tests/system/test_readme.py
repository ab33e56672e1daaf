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

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.lab import ROOT_DIR

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


def user_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A user's shell: this environment's Python first on PATH, a scratch HOME and PREFECT_HOME."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path),
            "PREFECT_HOME": str(tmp_path / "prefect"), "LANG": "C.UTF-8", "DO_NOT_TRACK": "1", **extra}


def run_block(name: str, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    script = block(name)
    lines = [line for line in script.splitlines() if "pytest" not in line]  # the suite itself is CI's to run
    body = "\n".join(" && ".join(p for p in line.split("&&") if not SETUP.match(p.strip())) for line in lines)
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
    """On a fresh machine, as a user runs it: the command starts the local Prefect server, says so, and leaves
    it for the next command; the documented command stops it."""
    env = user_env(tmp_path)
    done = run_block("quick-start", env, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "status: READY" in done.stdout
    # a first run on a fresh machine is quiet: no telemetry errors, no traceback, no locked database
    assert "telemetry" not in output.lower() and "Traceback" not in output and "database is locked" not in output
    assert "started a local Prefect server" in done.stderr and "python -m flows.local_server stop" in done.stderr
    stop = subprocess.run([sys.executable, "-m", "flows.local_server", "stop"], cwd=ROOT_DIR, env=env,
                          capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0 and "stopped the local Prefect server" in stop.stdout, stop.stdout + stop.stderr


def test_your_own_model_in_five_minutes_runs_as_written(prefect_api, tmp_path):
    """In a scratch folder of its own (``MY_MODEL``), with the session's PREFECT_HOME: its commands use the
    session's local server, as a user's commands use the one the first of them started."""
    env = user_env(tmp_path, PREFECT_HOME=os.environ["PREFECT_HOME"], MY_MODEL=str(tmp_path / "my-model"))
    done = run_block("own-model", env, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert '"status": "READY"' in done.stdout or "status: READY" in done.stdout
    assert "using the local Prefect server" in done.stderr
    assert (tmp_path / "my-model" / "catalog" / "r1.json").is_file()


@pytest.mark.parametrize("doc", [README, *sorted((ROOT_DIR / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_link_points_inside_the_repository(doc):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        assert "://" not in target, f"{doc.name} links outside the repository: {target}"
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT_DIR) and path.exists(), f"{doc.name} links to a file not in the repository: {target}"
    for named in set(re.findall(r"[\w./-]*\w\.md\b", text)):  # every document it names is the repository's own
        assert any((base / named).resolve().is_relative_to(ROOT_DIR) and (base / named).exists()
                   for base in (doc.parent, ROOT_DIR, ROOT_DIR / "docs")), f"{doc.name} names {named}, not in the repository"
    assert not re.search(r"\bissue \d+\b", text), f"{doc.name} speaks of issue numbers"


def test_the_docs_say_what_a_new_user_must_know_one_way():
    """Prefect's database setting under one name; the bucket to create first; what a receiver writes."""
    texts = {p.name: p.read_text() for p in [README, *sorted((ROOT_DIR / "docs").glob("*.md"))]}
    assert not [name for name, text in texts.items() if "PREFECT_API_DATABASE_CONNECTION_URL" in text]
    storage = texts["object-storage.md"]
    assert "aws s3 mb s3://my-bucket" in storage and "neither side creates it" in storage
    receiver = storage[storage.index("Receiver:"):storage.index("```json", storage.index("Receiver:"))]
    assert "s3:PutObject" in receiver and "nodes/" in receiver and "No write permission" not in receiver
    assert "catalog/.canonical-refit-probe/" in storage


FLEET_DOCS = ("README.md", "docs/fleet.md", "docs/operations.md")


def _documented_commands(module: str) -> list[tuple[str, list[str]]]:
    """Every ``python -m MODULE ...`` line of the fleet's documented bash blocks (continuations joined)."""
    import shlex

    found = []
    for doc in FLEET_DOCS:
        for body in re.findall(r"```bash\n(.*?)```", (ROOT_DIR / doc).read_text(), re.S):
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith(f"python -m {module} ") and "$(" not in line and " ... " not in line:
                    found.append((doc, shlex.split(line)[3:]))
    return found


def _with_keys_of_our_own(argv: list[str], keys: dict[str, str]) -> list[str]:
    """``argv`` with the key files it names (the user's, e.g. /etc/refit/...) replaced by keys made here."""
    out = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if arg in keys:
            out[i + 1] = keys[arg]
    return out


def test_every_documented_fleet_command_parses_as_printed(tmp_path):
    """The fleet's commands in the README and docs are accepted as printed (a flag that argparse would refuse,
    such as a value starting with '-', fails here, not on a user's host)."""
    from deployments.serve import parse_args as serve_args
    from flows.fleet import FleetParams, FLEET_FLAGS_BY_COMMAND, _parser as fleet_parser
    from flows.options import build, given
    from flows.publish import parse_args as publish_args
    from storage.catalog.signing import keygen_main

    assert keygen_main(["--out", str(tmp_path)]) == 0
    keys = {"--trusted-key": str(tmp_path / "catalog-signing-key.pub.pem"),
            "--signing-key": str(tmp_path / "catalog-signing-key.pem")}
    serves, fleets, publishes = ([(doc, _with_keys_of_our_own(argv, keys)) for doc, argv in _documented_commands(m)]
                                 for m in ("deployments.serve", "flows.fleet", "flows.publish"))
    assert len(serves) >= 3 and len(fleets) >= 4 and len(publishes) >= 2, (serves, fleets, publishes)
    for doc, argv in serves:
        params, settings, _ = serve_args(argv)
        if "--node" in argv:
            assert settings.suffix_for(params.node) == "-" + argv[argv.index("--node") + 1], (doc, argv)
    for doc, argv in fleets:
        args = fleet_parser().parse_args(argv)
        build(FleetParams, given(args, FLEET_FLAGS_BY_COMMAND[args.command]))
    for doc, argv in publishes:
        if argv[:1] == ["keygen"]:
            from storage.catalog.signing import keygen_parser

            keygen_parser().parse_args(argv[1:])
        else:
            publish_args(argv)


def _troubleshooting_commands(symptom: str) -> list[str]:
    """The commands in backticks of the README's troubleshooting row for ``symptom``."""
    row = next(line for line in README.read_text().splitlines() if line.startswith("|") and symptom in line)
    return [c for c in re.findall(r"`(python -m [^`]+)`", row)]


def test_publishing_past_a_revision_that_is_bad_in_storage_works_as_the_readme_says(prefect_api, tmp_path):
    """r1's bucket is corrupt in storage: refits through it fail; each of the README's two commands publishes a
    revision whose lineage avoids it, and a node refits to it exactly."""
    from tests.support.deployments_support import flip_tensor_byte
    from flows.publish import run_publish
    from flows.refit import run_refit
    from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint
    from tests.support.lab import independent_digest
    from storage.settings import InstallerSettings, PublishParams, RefitParams

    my_model = tmp_path / "my-model"
    steps = [random_model(ModelShape(), seed=0)]
    steps += [train_step(steps[0], seed=1), train_step(train_step(steps[0], seed=1), seed=2)]
    for i, tensors in enumerate(steps):
        write_checkpoint(my_model / f"step-{i}", tensors)
    catalog = f"file://{my_model}/catalog"
    for i, kind in ((0, "initial"), (1, "delta")):
        run_publish(PublishParams(catalog=catalog, model="me/tiny", checkpoint=my_model / f"step-{i}", kind=kind,
                                  state_dir=my_model / "publisher", emit_event=False))
    bucket = my_model / "revisions" / "r1" / "bucket-00000.safetensors"
    from storage.format.safetensors import read_header

    flip_tensor_byte(bucket, sorted(read_header(bucket).tensors)[0])

    def refit(target: str, cache: str):
        return run_refit(RefitParams(catalog=catalog, model="me/tiny", seed_checkpoint=str(my_model / "step-0"),
                                     cache_dir=my_model / cache, target=target, apply_workers=2,
                                     installer=InstallerSettings(kind="none")))

    assert refit("r1", "cache-bad").status == "FAILED"
    commands = [c for c in _troubleshooting_commands("the local copy … was discarded") if "flows.publish" in c]
    assert len(commands) == 2 and "--kind full" in commands[0] and "--base-version r0" in commands[1]
    env = user_env(tmp_path, PREFECT_HOME=os.environ["PREFECT_HOME"], MY_MODEL=str(my_model))
    for n, command in enumerate(commands):
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=ROOT_DIR, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        result = refit("latest", f"cache-{n}")
        assert result.status == "READY", result.error
        assert "r1" not in result.lineage and result.target_digest == independent_digest(steps[2])[1]
