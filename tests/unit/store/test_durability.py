"""Durability off the critical path: READY without waiting for the disk, and never trusting what a restart lost.

A refit records its patched checkpoint ``flushed=False`` with the boot it
was verified in, and writes the pages back in the background. A simulated
restart (another boot identity) with a byte of an unflushed checkpoint
changed behind the file's back must be detected and rebuilt, never installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import tests.support.crash_support as cs
from tests.support.lab import independent_digest
from storage.store.flush import wait_for_flushes
from storage.store.local_store import LocalStore


def _verified(lab, version: str) -> dict:
    return json.loads((lab.store_root / "verified" / f"{version}.json").read_text())


def _as_if_power_failed_before_the_flush(lab, version: str) -> None:
    path = lab.store_root / "verified" / f"{version}.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps(record | {"flushed": False}))
    (lab.store_root / "flushed" / f"{version}.json").unlink(missing_ok=True)  # the mark never came


def _flip_a_byte_keeping_identity(folder: Path) -> None:
    shard = sorted(folder.glob("*.safetensors"))[0]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as before: identity cannot tell


def _r1_lost_in_a_power_failure(lab, monkeypatch, tmp_path, kinds) -> cs.RecordingEngine:
    """Publish ``kinds``, refit to r1 on boot a, then a power failure before r1's write-back with a byte of it
    changed behind its files' back; the machine comes back as boot b. The engine the refits install into."""
    monkeypatch.setenv("CANONICAL_REFIT_BOOT_ID", "boot-a")
    for kind in kinds:
        lab.publish(kind)
    engine = cs.RecordingEngine(tmp_path / "engine.json")
    assert lab.run(engine, target="r1").status == "READY"
    wait_for_flushes(60)
    _as_if_power_failed_before_the_flush(lab, "r1")
    _flip_a_byte_keeping_identity(lab.store_root / "materialized" / "r1")
    monkeypatch.setenv("CANONICAL_REFIT_BOOT_ID", "boot-b")  # the machine restarted
    return engine


def test_a_patched_checkpoint_is_ready_before_its_pages_are_on_disk_then_marked_flushed(flow_lab, monkeypatch):
    lab = flow_lab
    monkeypatch.setenv("CANONICAL_REFIT_BOOT_ID", "boot-a")
    for kind in ("initial", "delta"):
        lab.publish(kind)
    result = lab.run(target="r1")
    assert result.status == "READY"
    wait_for_flushes(60)
    record = _verified(lab, "r1")
    assert record["boot_id"] == "boot-a" and record["flushed"] is False  # READY before the disk had it ...
    mark = json.loads((lab.store_root / "flushed" / "r1.json").read_text())
    assert mark["files"] == record["files"]  # ... and marked once written back
    assert LocalStore(lab.cache, lab.model).verified("r1").flushed is True


def test_the_flushed_mark_is_recorded_while_another_process_holds_the_store(flow_lab, monkeypatch):
    """The write-back's mark needs no lock: a busy store (another run preparing) does not lose it."""
    lab = flow_lab
    monkeypatch.setenv("CANONICAL_REFIT_BOOT_ID", "boot-a")
    for kind in ("initial", "delta"):
        lab.publish(kind)
    store = LocalStore(lab.cache, lab.model)
    result = lab.run(target="r1")
    wait_for_flushes(60)
    (lab.store_root / "flushed" / "r1.json").unlink()
    holder = store.exclusive(5, "another refit").acquire()  # as a second receiver preparing would
    try:
        from storage.store.flush import flush_in_background

        record = json.loads((lab.store_root / "verified" / "r1.json").read_text())
        thread = flush_in_background(store, store.verified("r1", check_files=False))
        thread.join(60)
        assert not thread.is_alive() and record["flushed"] is False
        assert (lab.store_root / "flushed" / "r1.json").is_file()
    finally:
        holder.release()
    assert result.status == "READY" and store.verified("r1").flushed is True


def test_an_unflushed_checkpoint_changed_across_a_restart_is_rebuilt_never_installed(flow_lab, monkeypatch, tmp_path):
    lab = flow_lab
    engine = _r1_lost_in_a_power_failure(lab, monkeypatch, tmp_path, ("initial", "delta", "delta"))
    result = lab.run(engine, target="r1")
    assert result.status == "READY", result.error
    assert any("forgot r1" in note and "restart" in note for note in result.notes), result.notes
    assert result.target_digest == independent_digest(lab.expected("r1"))[1]
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")
    loads = engine.loads()
    assert loads and all(load["bytes"] == independent_digest(lab.expected(load["version"]))[1] for load in loads)
    assert lab.run(engine, target="r2").status == "READY"


def test_an_unflushed_checkpoint_intact_across_a_restart_is_re_verified_and_reused(flow_lab, monkeypatch):
    lab = flow_lab
    monkeypatch.setenv("CANONICAL_REFIT_BOOT_ID", "boot-a")
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    assert lab.run(target="r1").status == "READY"
    wait_for_flushes(60)
    _as_if_power_failed_before_the_flush(lab, "r1")
    monkeypatch.setenv("CANONICAL_REFIT_BOOT_ID", "boot-b")
    result = lab.run(target="r2")
    assert result.status == "READY"
    assert any("re-verified r1 after a restart" in note for note in result.notes), result.notes
    assert result.lineage == ["r1", "r2"]  # the re-verified checkpoint was the starting point
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")


def test_after_a_power_loss_the_deployments_refit_does_not_skip_a_version_the_store_lost(flow_lab, monkeypatch,
                                                                                         tmp_path):
    """Recovery forgets the unflushed r1; the next `--target latest --only-if-newer` rebuilds and re-installs it
    instead of skipping "r1 is not newer than the installed r1", and says why in its notes."""
    lab = flow_lab
    engine = _r1_lost_in_a_power_failure(lab, monkeypatch, tmp_path, ("initial", "delta"))
    result = lab.run(engine, target="latest", only_if_newer=True)
    assert result.status == "READY", result.error
    assert any("forgot r1" in note for note in result.notes), result.notes  # the recovery note is kept
    assert any("no longer holds its verified checkpoint" in note for note in result.notes), result.notes
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")
    assert engine.loads()[-1]["bytes"] == independent_digest(lab.expected("r1"))[1]
    assert lab.run(engine, target="latest", only_if_newer=True).status == "SKIPPED"


def test_a_flushed_mark_half_written_by_a_killed_process_is_swept_by_recovery(flow_lab):
    """A write-back killed while writing its mark leaves ``flushed/.r1.json.<its token>.tmp``: recovery removes
    it (the crash harness found one left behind), and the mark's own file is untouched."""
    lab = flow_lab
    for kind in ("initial", "delta"):
        lab.publish(kind)
    assert lab.run(target="r1").status == "READY"
    wait_for_flushes(60)
    flushed = lab.store_root / "flushed"
    leftover = flushed / ".r1.json.0a1b2cx3d4e5f.tmp"  # another process's token
    leftover.write_text("{")
    store = LocalStore(lab.cache, lab.model)
    holder = store.exclusive(5, "recovery").acquire()
    try:
        done = store.recover()
    finally:
        holder.release()
    assert not leftover.exists() and (flushed / "r1.json").is_file()
    assert any("temporary file" in line for line in done), done


def _flip_a_byte_of_tensor_keeping_identity(folder: Path, tensor: str) -> None:
    """Flip one byte in the middle of ``tensor``'s bytes (size and mtime kept)."""
    import struct

    for shard in sorted(folder.glob("*.safetensors")):
        data = bytearray(shard.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        entry = json.loads(data[8:8 + n]).get(tensor)
        if entry is None:
            continue
        start, end = entry["data_offsets"]
        st = shard.stat()
        data[8 + n + (start + end) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        return
    raise AssertionError(f"{tensor} is in no shard of {folder}")


def test_the_first_deltas_unsynced_copy_is_rebuilt_if_a_restart_lost_it(lab, monkeypatch, tmp_path):
    """The copy of full/r0 that the first delta patches is not fsynced (docs/format.md 7.2, one copy of the
    model): its record says unflushed, like the patched pages. A byte of a tensor the delta did not change
    (a copied page, never patched) lost across a restart before the write-back is found and rebuilt; the
    seed, its weights hard-linked, was fsynced and stays trusted."""
    monkeypatch.setenv("CANONICAL_REFIT_BOOT_ID", "boot-a")
    lab.publish("initial")
    frozen = "model.embed_tokens.weight"
    lab.publish("delta", lab.next_step(skip=(frozen,)))
    engine = cs.RecordingEngine(tmp_path / "engine.json")
    assert lab.run(engine, target="r1").status == "READY"
    wait_for_flushes(60)
    assert _verified(lab, "r0")["flushed"] is True and _verified(lab, "r0")["boot_id"] == "boot-a"
    _as_if_power_failed_before_the_flush(lab, "r1")
    _flip_a_byte_of_tensor_keeping_identity(lab.store_root / "materialized" / "r1", frozen)
    monkeypatch.setenv("CANONICAL_REFIT_BOOT_ID", "boot-b")
    result = lab.run(engine, target="r1")
    assert result.status == "READY", result.error
    assert any("forgot r1" in note and "restart" in note for note in result.notes), result.notes
    assert not any("forgot r0" in note for note in result.notes), result.notes
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")
    assert all(load["bytes"] == independent_digest(lab.expected(load["version"]))[1] for load in engine.loads())
