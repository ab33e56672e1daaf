"""Commands as printed: a failed refit's ``next:`` line, pasted into a shell, changes exactly that node.

The line names the node (``--node``) and every option the run had, so it
neither falls back to the host name (which would register a phantom node
that every later ``wait`` blocks on) nor to the defaults of the shell it is
pasted in. The test pastes it as a user would: split by the shell's rules
and run as a new process.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from flows.cli import _run_parser, build_params
from flows.cli import main as cli_main
from flows.outcome import refit_command
from tests.support.lab import ROOT_DIR
from storage.catalog.nodes import nodes_url
from storage.settings import InstallerSettings, ObjectStoreSettings, RefitParams, default_node_name
from storage.store.local_store import LocalStore


def records(lab) -> dict[str, dict]:
    folder = Path(nodes_url(lab.catalog, lab.model).removeprefix("file://"))
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def next_line(out: str) -> str:
    """The command of the ``next:`` line: what comes before the explanation in parentheses."""
    line = next(line for line in out.splitlines() if line.startswith("next: "))
    return line[len("next: "):].split("  (")[0]


def test_a_failed_refits_next_line_pasted_as_printed_changes_that_node_and_no_other(flow_lab, capsys):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    bucket = lab.root / "revisions" / "r1" / "bucket-00000.safetensors"
    good = bucket.read_bytes()
    bucket.write_bytes(good[:-64] + bytes(b ^ 0xFF for b in good[-64:]))  # r1's payload is corrupt

    capsys.readouterr()
    code = cli_main(["--node", "gpu-7", "--catalog", lab.catalog, "--model", lab.model, "--cache-dir",
                     str(lab.root / "gpu-7"), "--seed-checkpoint", str(lab.launch), "--only-if-newer"])
    out = capsys.readouterr().out
    assert code == 1 and "status: FAILED" in out
    assert set(records(lab)) == {"gpu-7"} and records(lab)["gpu-7"]["status"] == "FAILED"
    command = next_line(out)
    assert command.startswith("python -m flows.refit ") and "--node gpu-7" in command
    assert "--only-if-newer" in command and f"--cache-dir {lab.root / 'gpu-7'}" in command

    bucket.write_bytes(good)  # "fix the cause above first"
    from prefect.settings import PREFECT_API_URL

    env = {"PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONPATH": str(ROOT_DIR),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin", "PREFECT_HOME": str(lab.root / "home"),
           "HOME": str(lab.root)}
    pasted = subprocess.run(shlex.split(command), capture_output=True, text=True, env=env, cwd=ROOT_DIR,
                            timeout=300)
    assert pasted.returncode == 0, pasted.stdout + pasted.stderr
    assert "status: READY" in pasted.stdout and "version: r1" in pasted.stdout
    assert LocalStore(lab.root / "gpu-7", lab.model).active().version == "r1"  # that node's own store
    assert not (lab.cache / lab.model.replace("/", "--")).exists()  # the default store was never touched
    after = records(lab)
    assert set(after) == {"gpu-7"} and default_node_name() not in after  # no phantom node named after the host
    assert (after["gpu-7"]["status"], after["gpu-7"]["version"]) == ("READY", "r1")


def test_the_repeated_command_carries_every_option_the_run_had_and_no_secret():
    params = RefitParams(
        catalog="s3://bucket/models/org-name/catalog", model="org/name", node="gpu-7", target="r11",
        initial_version="r0", seed_checkpoint="/models/launch dir", cache_dir="/data/cache", cache_max_gb=90,
        verify="full", only_if_newer=True, activate=False, lock_timeout_s=60, apply_workers=3, retries=1,
        retry_delay_s=2, stage_retries=0, stage_retry_delay_s=0.5,
        installer=InstallerSettings(kind="sglang", engine_urls=["http://10.0.0.7:30000", "http://10.0.0.7:30001"],
                                    api_key="s3cret-token"),
        storage=ObjectStoreSettings(endpoint_url="http://10.0.0.2:9000", concurrency=5))
    command = refit_command(params)
    assert "s3cret-token" not in command
    assert "--stage-retr" not in command  # deprecated, no effect: never printed (still parsed)
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "flows.refit"]
    again = build_params(_run_parser().parse_args(argv[3:]))  # what the pasted command runs
    for name in ("catalog", "model", "node", "target", "initial_version", "seed_checkpoint", "cache_dir",
                 "cache_max_gb", "verify", "only_if_newer", "activate", "lock_timeout_s", "apply_workers", "retries",
                 "retry_delay_s"):
        assert getattr(again, name) == getattr(params, name), name
    assert (again.installer.kind, again.installer.engine_urls) == ("sglang", params.installer.engine_urls)
    assert (again.storage.endpoint_url, again.storage.concurrency) == ("http://10.0.0.2:9000", 5)

    plain = refit_command(RefitParams(catalog="file:///srv/catalog", model="org/name", node="gpu-7"))
    assert shlex.split(plain)[3:] == ["--catalog", "file:///srv/catalog", "--model", "org/name", "--node", "gpu-7",
                                      "--cache-dir", str(RefitParams.model_fields["cache_dir"].default),
                                      "--target", "latest"]  # defaults are not repeated


def test_every_flag_of_the_refit_command_is_repeated_when_the_run_had_it():
    from flows.cli import REFIT_FLAGS
    from flows.outcome import NOT_REPEATED, REPEATED_OPTIONS

    assert sorted((f.path, f.option()) for f in REFIT_FLAGS if f.path not in NOT_REPEATED) == sorted(REPEATED_OPTIONS)
    assert {f.path for f in REFIT_FLAGS} >= set(NOT_REPEATED)  # the deprecated flags still parse
