"""What the operator does next: every failure ends in a state the next command, as printed, gets out of.

The catalog's malformed records are quarantined, not contagious; sequences
are claimed so two publications never share one; seeding sizes what it
copies; messages say what happened and what to do, in one line, and the
hints they print are commands that work as printed.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from flows.cli import main as cli_main
from tests.support.lab import ROOT_DIR, Lab, independent_digest, tiny_shape
from storage.catalog.records import Catalog
from storage.errors import CapacityError, LineageError
from storage.store.local_store import LocalStore
from storage.objects.store import ObjectStore


def run_cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli_main(list(args))
    return code, capsys.readouterr().out


def refit_args(lab: Lab, *extra: str) -> list[str]:
    return ["--catalog", lab.catalog, "--model", lab.model, "--cache-dir", str(lab.cache),
            "--seed-checkpoint", str(lab.launch), *extra]


# -- the catalog --------------------------------------------------------------------------------------------


def test_a_malformed_record_blocks_only_the_lineages_that_pass_through_it(flow_lab):
    lab = flow_lab
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    record = json.loads((lab.catalog_dir / "r2.json").read_text())
    record["payload_format"] = "xor_delta_v9"
    (lab.catalog_dir / "r2.json").write_text(json.dumps(record))
    state, result = lab.refit(target="r1")  # a fresh node: the launch revision is still found
    assert state.name == "Ready", result.error
    assert any("r2" in note and "malformed" in note for note in result.notes)
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")
    # 'latest' skips the malformed record with a warning (documented in docs/format.md)
    state, result = lab.refit(cache_dir=lab.root / "other-cache")
    assert state.name == "Ready" and result.version == "r1"
    state, result = lab.refit(target="r2")  # the lineage through it fails, naming it
    assert state.name == "Failed" and result.error_detail["revision"] == "r2"
    assert result.error_detail["field"] == "payload_format"


def test_messages_for_a_wrong_catalog_a_missing_target_and_a_wrong_model(flow_lab, capsys):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    code, out = run_cli(capsys, *refit_args(lab, "--target", "r9"))
    assert code == 1
    assert "revision r9 is not in the catalog" in out and "latest is r1" in out
    wrong = Lab(lab.root / "typo", shape=lab.shape)
    code, out = run_cli(capsys, "--catalog", wrong.catalog, "--model", lab.model, "--cache-dir", str(lab.cache))
    assert code == 1 and "holds no valid revision records" in out and "check --catalog" in out
    code, out = run_cli(capsys, "--catalog", lab.catalog, "--model", "someone/else", "--cache-dir",
                        str(lab.root / "fresh"), "--seed-checkpoint", str(lab.launch))
    assert code == 1 and "someone/else" in out
    assert not (lab.root / "fresh" / "someone--else").exists()  # a failed first run leaves no store behind


def test_two_publications_never_share_a_sequence(flow_lab):
    from flows.publish import run_publish

    lab = flow_lab
    lab.publish("initial")
    steps = [lab.next_step(), lab.next_step(fraction=0.3)]
    folders = [lab.write(tensors, f"concurrent-{i}") for i, tensors in enumerate(steps)]
    results, errors = [], []

    def publish(i: int) -> None:
        try:
            results.append(run_publish(lab.params(folders[i], "delta", version=f"branch{i}", base_version="r0",
                                                  base_checkpoint=lab.launch, keep_copy=False)))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(r.sequence for r in results) == [1, 2]
    catalog = Catalog(ObjectStore(), lab.catalog, lab.model)
    assert catalog.latest().sequence == 2  # never ambiguous
    with pytest.raises(LineageError, match='kind="initial" only starts an empty catalog'):
        lab.publish("initial", lab.current, version="again")


def test_a_claimed_sequence_is_skipped_and_an_identical_republish_keeps_its_own(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    catalog = Catalog(ObjectStore(), lab.catalog, lab.model)
    assert catalog.claim_sequence(1, "someone-else", "their-token") == ("someone-else", "their-token")  # first
    result = lab.publish("delta", version="mine")
    assert result.sequence == 2
    again = lab.publish("delta", lab.revisions["mine"], version="mine", base_version="r0",
                        base_checkpoint=lab.launch)
    assert again.sequence == 2 and again.already_published


# -- seeding -----------------------------------------------------------------------------------------------


def _hub_snapshot(lab: Lab) -> Path:
    """The launch snapshot laid out like a Hugging Face hub cache: snapshot files are links to blobs."""
    blobs, snapshot = lab.root / "hub" / "blobs", lab.root / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(lab.launch.iterdir())):
        blob = blobs / f"blob{i}"
        blob.write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


def test_a_hub_snapshot_of_symlinks_is_sized_and_copied_by_what_the_links_point_to(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    snapshot = _hub_snapshot(lab)
    real = sum(p.stat().st_size for p in snapshot.iterdir())
    state, result = lab.refit(seed_checkpoint=str(snapshot), cache_max_gb=real / 2 / 1e9,
                              seed_links=False)  # copied: counted at the blobs' sizes (a link writes nothing)
    assert state.name == "Failed" and result.error_detail["type"] == CapacityError.__name__
    assert not (lab.store_root / "full" / "r0").exists()
    state, result = lab.refit(seed_checkpoint=str(snapshot))
    assert state.name == "Ready", result.error
    copied = lab.store_root / "full" / "r0"
    assert all(p.is_file() and not p.is_symlink() for p in copied.iterdir())
    assert sum(p.stat().st_size for p in copied.glob("*.safetensors")) == sum(
        p.stat().st_size for p in snapshot.glob("*.safetensors"))
    assert json.loads((lab.store_root / "chains" / "r0.json").read_text())["full_version"] == "r0"


def test_a_missing_seed_prints_one_clear_line(flow_lab):
    lab = flow_lab
    lab.publish("initial")
    from prefect.settings import PREFECT_API_URL

    env = {"PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONPATH": str(ROOT_DIR), "PATH": "/usr/bin:/bin",
           "PREFECT_HOME": str(lab.root / "home"), "HOME": str(lab.root)}
    argv = [sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model, "--cache-dir",
            str(lab.cache), "--seed-checkpoint", str(lab.root / "no-such-folder")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT_DIR, timeout=300)
    assert done.returncode == 1
    assert "is not a folder" in done.stdout and "no-such-folder" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


# -- the outcome as printed ------------------------------------------------------------------------------


def test_failed_and_skipped_and_deferred_outcomes_say_what_is_installed_and_what_to_do(flow_lab, capsys):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    code, out = run_cli(capsys, *refit_args(lab, "--no-activate"))
    assert code == 0 and "prepared (not yet active): r1" in out
    hint = next(line for line in out.splitlines() if line.startswith("next: "))[len("next: "):]
    assert "activate" in hint
    code, out = run_cli(capsys, *shlex.split(hint)[3:])  # the printed command, as printed
    assert code == 0 and LocalStore(lab.cache, lab.model).active().version == "r1"

    code, out = run_cli(capsys, *refit_args(lab, "--only-if-newer", "--target", "r0"))
    assert code == 0 and "skipped: r0 (sequence 0) is not newer than the installed r1" in out

    code, out = run_cli(capsys, *refit_args(lab, "--target", "r9"))
    assert code == 1 and "installed version (unchanged): r1" in out and "version: r1" not in out.replace(
        "installed version (unchanged): r1", "")

    code, out = run_cli(capsys, "activate", "--model", lab.model, "--cache-dir", str(lab.cache), "--version", "r0")
    assert code == 1 and "the prepared checkpoint is r1" in out

    code, out = run_cli(capsys, "recover", "--model", lab.model, "--cache-dir", str(lab.cache))
    assert code == 0 and "not poisoned: nothing to re-install" in out and "cleared" not in out


def test_a_poisoned_runs_hint_is_the_recovery_command_and_it_goes_through_the_recorded_installer(flow_lab, capsys):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    assert lab.refit()[0].name == "Ready"
    store = LocalStore(lab.cache, lab.model)
    store.mark_poisoned("test: an engine died mid-load", "r1", "sglang", ("http://127.0.0.1:9",))
    lab.publish("delta")
    state, result = lab.refit()
    assert state.name == "Poisoned" and result.status == "POISONED"
    assert result.next_step.startswith("python -m flows.refit recover")
    command = shlex.split(result.next_step.split("  (")[0])[3:]
    code, out = run_cli(capsys, *command)  # as printed: re-installs through sglang at the recorded URL
    assert code == 3 and "127.0.0.1:9" in out  # that engine is unreachable: still poisoned, and it says where
    assert store.poisoned() is not None
    code, out = run_cli(capsys, *command, "--installer", "none")  # another installer: refused ...
    assert code == 3 and "--override-installer" in out and store.poisoned() is not None
    code, out = run_cli(capsys, *command, "--installer", "none", "--override-installer")  # ... unless told
    assert code == 0 and store.poisoned() is None and store.active().installer == "none"


@pytest.mark.parametrize("content", ["{not json", '["a", "list"]', '{"status": "READY"}'])
def test_a_malformed_state_file_is_a_store_error_naming_it(flow_lab, content):
    lab = flow_lab
    lab.publish("initial")
    assert lab.refit()[0].name == "Ready"
    state_file = lab.store_root / "state.json"
    state_file.write_text(content)
    state, result = lab.refit()
    assert state.name == "Failed" and result.error_detail["type"] == "StoreError"
    assert result.error_detail["local_file"] == str(state_file) and "move it away" in result.error


def test_the_declared_s3fs_floor_has_create_only_puts():
    """Create-only puts (If-None-Match) arrived in s3fs 2024.12.0: an older floor would let a publisher
    silently overwrite published objects on a fresh install."""
    import inspect
    import re as regex

    import s3fs

    pyproject = (ROOT_DIR / "pyproject.toml").read_text()
    floors = dict(regex.findall(r'"(s3fs|fsspec)>=([0-9.]+)"', pyproject))
    assert tuple(map(int, floors["s3fs"].split("."))) >= (2024, 12, 0)
    assert tuple(map(int, floors["fsspec"].split("."))) >= (2024, 12, 0)
    assert "mode" in inspect.signature(s3fs.S3FileSystem._pipe_file).parameters  # what we rely on


def test_nothing_is_printed_as_none(flow_lab, capsys):
    """A node with nothing installed, and a launch revision with no payload: words, not ``None``."""
    from flows.publish import main as publish_main

    lab = flow_lab
    folder = lab.write(lab.current, "launch-print")
    capsys.readouterr()
    code = publish_main(["--catalog", lab.catalog, "--model", lab.model, "--checkpoint", str(folder), "--kind",
                         "initial", "--state-dir", str(lab.root / "publisher"), "--no-event"])
    out = capsys.readouterr().out
    assert code == 0 and "version: r0" in out and "None" not in out and "uri:" not in out
    code, out = run_cli(capsys, *refit_args(lab, "--target", "r9"))
    assert code == 1 and "installed version (unchanged): none (nothing was installed yet)" in out
    assert "None" not in out
