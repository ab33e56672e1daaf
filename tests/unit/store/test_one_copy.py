"""One copy: a fresh node writes its model once, and nothing verified is put at risk for it (docs/format.md, 7.2).

The seed hard-links the launch snapshot's weight files into ``full/r0`` (the
store never writes a ``full/`` file); the first delta copies that folder once
(reflink, else ``copy_file_range``) and patches the copy. Measured through the
refit runbook in a fresh process (``python -m benchmarks.one_copy --child``, the benchmark's own child): the
bytes that process wrote (``write_bytes`` of ``/proc/self/io``) against the
model's bytes; then the failure and kill -9 paths of that first refit.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import subprocess
import sys

import pytest

import tests.support.crash_support as cs
import tests.support.crash_trials as ct
from flows.synthetic import ModelShape
from tests.support.lab import Lab
from storage import durable
from storage.durable import CopyReport, copy_tree_files
from storage.store.local_store import LocalStore

SHAPE = ModelShape(vocab=2048, hidden=512, intermediate=1376, layers=2, shards=2)  # about 16 MB of bf16


ROOT = Path(__file__).resolve().parents[3]


def first_refit(params: dict, scratch: Path, *, env: dict | None = None) -> dict:
    """One refit in a fresh interpreter, run as the benchmark's child command (a test runs a benchmark as a
    command, never imports it): its status, the process's ``write_bytes`` over the refit, its copy records."""
    scratch.mkdir(parents=True, exist_ok=True)
    spec, out = scratch / "refit.spec.json", scratch / "refit.out.json"
    spec.write_text(json.dumps({"params": params}, default=str))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CANONICAL_REFIT_", "PREFECT_"))}
    done = subprocess.run([sys.executable, "-m", "benchmarks.one_copy", "--child", str(spec), str(out)], cwd=ROOT,
                          env=base | (env or {}), capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0 and out.exists(), done.stderr[-3000:]
    return json.loads(out.read_text())


def _weights(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def _published(root: Path) -> Lab:
    lab = Lab(root, shape=SHAPE)
    lab.publish("initial")
    lab.publish("delta", lab.next_step(fraction=0.02))  # an RL-sized step: 2 % of the elements move
    return lab


def _params(lab: Lab, **kw) -> dict:
    return {"catalog": lab.catalog, "model": lab.model, "seed_checkpoint": str(lab.launch),
            "cache_dir": str(lab.cache), "target": "r1", "apply_workers": 2, "lock_timeout_s": 60,
            "installer": {"kind": "none"}} | kw


def test_a_fresh_node_writes_its_model_once_and_ends_ready_byte_exact(tmp_path):
    lab = _published(tmp_path / "lab")
    launch = _hashes(lab.launch)
    model_bytes = sum(p.stat().st_size for p in _weights(lab.launch))
    run = first_refit(_params(lab), tmp_path / "job")
    assert run["status"] == "READY" and run["version"] == "r1", run["error"]
    assert run["write_bytes"] <= 1.1 * model_bytes, (run["write_bytes"], model_bytes, run["copies"])
    lab.assert_checkpoint(Path(run["checkpoint_path"]), "r1")  # the safetensors library, against what was published
    store = LocalStore(lab.cache, lab.model)
    assert store.state().status == "READY" and store.current().version == "r1"
    assert store.current().path == "materialized/r1"
    # the seed linked the weights (no bytes written); the first delta copied them once (never a link: patched)
    seed, copy = ({c["what"]: c for c in run["copies"]}[k] for k in ("seed", "materialize"))
    assert seed["linked"] >= model_bytes and seed["written"] < 0.01 * model_bytes, seed  # weights, their index
    assert copy["linked"] == 0 and copy["bytes"] >= model_bytes, copy
    for path in _weights(lab.launch):
        assert os.stat(store.full_dir("r0") / path.name).st_ino == path.stat().st_ino  # full/r0 shares the bytes
        assert os.stat(store.materialized_dir("r1") / path.name).st_ino != path.stat().st_ino
    assert not os.path.samefile(store.full_dir("r0") / "config.json", lab.launch / "config.json")  # copied
    assert _hashes(lab.launch) == launch  # the launch folder was never written
    lab.assert_checkpoint(store.full_dir("r0"), "r0")
    assert store.verified("r0") is not None and store.verified("r0").flushed


def test_a_fresh_node_catching_up_over_several_deltas_still_writes_once(tmp_path):
    """Three deltas folded into the first copy (each tensor copied once, then patched by every step)."""
    lab = _published(tmp_path / "lab")
    for _ in range(2):
        lab.publish("delta", lab.next_step(fraction=0.02))
    model_bytes = sum(p.stat().st_size for p in _weights(lab.launch))
    run = first_refit(_params(lab, target="r3"), tmp_path / "job")
    assert run["status"] == "READY" and run["version"] == "r3", run["error"]
    assert run["write_bytes"] <= 1.15 * model_bytes, (run["write_bytes"], model_bytes)  # three deltas downloaded
    lab.assert_checkpoint(Path(run["checkpoint_path"]), "r3")
    assert LocalStore(lab.cache, lab.model).current().version == "r3"


def test_the_fallback_copies_where_the_seed_may_not_link_and_says_so(tmp_path):
    lab = _published(tmp_path / "lab")
    model_bytes = sum(p.stat().st_size for p in _weights(lab.launch))
    run = first_refit(_params(lab), tmp_path / "job", env={"CANONICAL_REFIT_SEED_LINKS": "0"})
    assert run["status"] == "READY", run["error"]
    lab.assert_checkpoint(Path(run["checkpoint_path"]), "r1")
    seed = next(c for c in run["copies"] if c["what"] == "seed")
    assert seed["linked"] == 0 and seed["written"] >= model_bytes, seed  # counted as written
    assert run["write_bytes"] >= 1.9 * model_bytes  # two copies: what the links save
    assert any("copy_file_range" in note or "buffered" in note for note in run["notes"] if "seeded r0" in note)


def test_a_refused_link_falls_back_to_a_counted_copy(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.safetensors").write_bytes(os.urandom(3 << 20))
    (src / "config.json").write_bytes(b"{}")

    def refuse(*_args, **_kw):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(durable.os, "link", refuse)
    report = CopyReport()
    placed = copy_tree_files(src, tmp_path / "dst", link=lambda name: name.endswith(".safetensors"),
                             report=report)
    assert placed == (3 << 20) + 2 and report.linked == 0 and report.written + report.reflinked == placed
    assert report.files == 2 and (tmp_path / "dst" / "a.safetensors").read_bytes() == (src / "a.safetensors").read_bytes()
    assert not os.path.samefile(tmp_path / "dst" / "a.safetensors", src / "a.safetensors")


def test_a_verified_seed_survives_a_failed_first_refit(tmp_path):
    """The first delta is rejected after patching began: the copy is discarded, full/r0 (links to the launch
    folder) and the launch folder are untouched, READY at r0; the next refit gets r1 exactly."""
    from tests.system.test_receiver import first_bucket, rewrite_bucket

    lab = _published(tmp_path / "lab")
    launch = _hashes(lab.launch)
    bucket = first_bucket(lab, "r1")
    good = bucket.read_bytes()

    def corrupt(frames, metadata):
        metadata[sorted(frames)[0]] = "0badc0de"  # a target checksum no patched tensor can meet
        return frames, metadata

    rewrite_bucket(bucket, corrupt)
    state, result = lab.refit()
    assert state.name == "Failed" and result.error_detail["type"] == "ChecksumMismatch", result.error
    store = LocalStore(lab.cache, lab.model)
    assert store.state().status == "READY" and store.current().version == "r0"
    assert store.current().path == "full/r0" and not store.materialized_dir("r1").exists()
    lab.assert_checkpoint(store.full_dir("r0"), "r0")
    assert _hashes(lab.launch) == launch
    for path in _weights(lab.launch):
        assert os.path.samefile(store.full_dir("r0") / path.name, path)
    bucket.write_bytes(good)
    state, result = lab.refit()
    assert state.name == "Ready", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")
    assert _hashes(lab.launch) == launch


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-copy-crash")
    return ct.World(root, _published(root / "lab"))


@pytest.mark.parametrize("kill", ["point:state.updating:1", "point:seed.copied:1", "point:state.updating:2",
                                  "point:apply.materialized:1", "point:apply.block:1", "point:verify.before_ready:1",
                                  "random:0.6"])
def test_kill_9_during_the_seed_or_the_first_copy_recovers(world, tmp_path, kill):
    launch = _hashes(world.lab.launch)
    trial = ct.run_trial(world, ct.Trial(ct.SCENARIOS[0], kill, "r1"), tmp_path / "store")
    assert trial.violations == [], json.dumps(trial.violations, indent=1)
    if kill.startswith("point:"):
        assert trial.crashed and trial.reached == kill.split(":")[1], (trial.crashed, trial.reached)
    assert _hashes(world.lab.launch) == launch  # a kill anywhere never reaches the launch folder's bytes
    store = tmp_path / "store" / world.lab.model.replace("/", "--")
    for path in _weights(world.lab.launch):
        assert os.path.samefile(store / "full" / "r0" / path.name, path)
    assert cs.check_recovered(world, tmp_path / "store", "r1") == []


def test_the_benchmark_command_reports_both_goals(tmp_path):
    """``python -m benchmarks.one_copy`` at a tiny size: every run byte-exact, the bytes goal judged per run."""
    import subprocess
    import sys

    out = tmp_path / "one_copy.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.one_copy", "--size-mb", "8", "--repeat", "1",
                           "--workdir", str(tmp_path), "--json", str(out)], cwd=Path(__file__).resolve().parents[3],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["label"] for r in result["runs"]] == ["links", "copy"]
    assert result["goals"]["byte_exact"] is True
    links, copy = result["runs"]
    assert links["written_over_model"] <= 1.1 < copy["written_over_model"], (links, copy)
    assert "goal: bytes written" in done.stdout and "goal: placement throughput" in done.stdout
