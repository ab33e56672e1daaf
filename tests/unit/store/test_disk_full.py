"""ENOSPC during seeding, fetching and applying: a clean typed failure, nothing verified lost, then success.

The cache lives on a small tmpfs mounted for the test (the tests run as root,
as CI does); a ballast file takes the free space away and deleting it gives
it back. Failures the disk cannot be steered into (a full disk exactly when
``state.json`` or a verified record is written) are injected into the one
write primitive every state file goes through.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.support.adversarial_support as av
import tests.support.crash_support as cs
import tests.support.crash_trials as ct
from storage import durable
from storage.durable import tree_size
from storage.errors import CapacityError, StoreError
from storage.store.flush import wait_for_flushes
from flows.refit import run_refit
from storage.settings import RefitParams

DISK_BYTES = 8 * 2**20


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    from tests.support.lab import Lab, tiny_shape

    lab = Lab(tmp_path_factory.mktemp("diskfull"), shape=tiny_shape())
    lab.publish("initial")
    lab.publish("delta")
    lab.publish("delta")
    lab.publish("delta")
    return ct.World(lab.root, lab)


class SmallDisk:
    """A tmpfs of ``DISK_BYTES`` (or an ext4 image of 4 x that, loop-mounted); ``fill(free)`` leaves ``free``
    bytes, ``release()`` gives them back."""

    def __init__(self, path: Path, fs: str = "tmpfs"):
        self.path = path
        self.fs = fs
        self.ballast = path / "ballast"
        path.mkdir()
        if fs == "tmpfs":
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0755", "tmpfs", str(path)],
                           check=True, timeout=30)
        else:
            image = path.parent / "disk.ext4"
            with open(image, "wb") as fh:
                fh.truncate(4 * DISK_BYTES)
            subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, timeout=60)
            subprocess.run(["mount", "-o", "loop", str(image), str(path)], check=True, timeout=30)

    def free(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_bavail if self.fs == "tmpfs" else st.f_bfree) * st.f_frsize  # root writes ext4's reserve

    def fill(self, free: int) -> None:
        if self.fs == "tmpfs" or free:
            with open(self.ballast, "ab") as fh:
                fh.write(b"\xff" * max(0, self.free() - free))
            return
        fd = os.open(self.ballast, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # ext4: every block, to ENOSPC
        try:
            size = os.fstat(fd).st_size
            for chunk in (2**24, 2**20, 2**16, 4096):  # allocated at once (no delayed allocation to wait for)
                try:
                    while True:
                        os.posix_fallocate(fd, size, chunk)
                        size += chunk
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
            for chunk in (2**16, 4096, 1):  # whatever is left, written and synced
                try:
                    while True:
                        os.write(fd, b"\xff" * chunk)
                        os.fsync(fd)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
        finally:
            os.close(fd)

    def release(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        import gc

        gc.collect()  # mappings of a failed run may still be referenced by its traceback
        if subprocess.run(["umount", str(self.path)], timeout=30).returncode != 0:
            subprocess.run(["umount", "--lazy", str(self.path)], check=True, timeout=30)


@pytest.fixture
def disk(tmp_path):
    small = SmallDisk(tmp_path / "disk")
    yield small
    small.unmount()


@pytest.fixture(params=["tmpfs", "ext4"])
def any_disk(request, tmp_path):
    """The small disk as tmpfs and as an ext4 image (delayed allocation, journal, blocks reserved for root)."""
    small = SmallDisk(tmp_path / "disk", request.param)
    yield small
    small.unmount()


def refit(world, cache: Path, target: str):
    params = RefitParams(catalog=world.catalog, model=world.lab.model, seed_checkpoint=str(world.lab.launch),
                         cache_dir=cache, target=target, apply_workers=2, lock_timeout_s=30)
    result = run_refit(params, installer=cs.RecordingEngine(cache / "engine.json"))
    assert wait_for_flushes(60)  # its background write-back too, as the command line waits for it before exiting
    return None if result.status == "READY" else result.exception


def store_of(world, cache: Path) -> Path:
    return cache / world.lab.model.replace("/", "--")


def assert_failed_cleanly(world, cache: Path, error, *, revision: str, kept: str | None, before: dict) -> None:
    """A StoreError caused by ENOSPC; ``kept`` still READY, verified, installed; tmp/ empty."""
    assert isinstance(error, StoreError), error
    assert "No space left" in str(error) or "no space left" in str(error), error
    assert error.file, error
    if revision is not None:
        assert error.revision == revision, error
    store = store_of(world, cache)
    assert av.protected(store) == before  # checkpoints, verified records, active.json, state: unchanged
    assert list((store / "tmp").iterdir()) == []
    if kept is not None:
        assert cs.check_after_crash(world, cache) == []
        assert cs.check_recovered(world, cache, kept) == []


def test_enospc_while_seeding(world, disk):
    disk.fill(free=tree_size(world.lab.launch) // 2)
    error = refit(world, disk.path, "r1")
    assert isinstance(error, StoreError) and "No space left" in str(error), error
    assert (error.revision, error.file) == ("r0", str(store_of(world, disk.path) / "full" / "r0"))
    store = store_of(world, disk.path)
    state = json.loads((store / "state.json").read_text())
    assert (state["status"], state["version"]) == ("READY", None)  # not left UPDATING
    assert not (store / "full" / "r0").exists() and list((store / "tmp").iterdir()) == []  # partial copy gone
    assert list((store / "verified").iterdir()) == [] and not (store / "active.json").exists()
    disk.release()
    assert refit(world, disk.path, "r1") is None
    assert cs.check_recovered(world, disk.path, "r1") == []


def test_enospc_while_fetching_keeps_the_installed_version(world, disk):
    assert refit(world, disk.path, "r1") is None
    before = av.protected(store_of(world, disk.path))
    disk.fill(free=16 * 1024)  # less than r2's bucket
    error = refit(world, disk.path, "r2")
    assert_failed_cleanly(world, disk.path, error, revision=None, kept="r1", before=before)
    disk.release()
    assert refit(world, disk.path, "r2") is None
    assert cs.check_recovered(world, disk.path, "r2") == []


def test_too_little_disk_for_the_copy_is_refused_before_any_change(world, disk):
    assert refit(world, disk.path, "r0") is None  # launch snapshot only: the next delta copies it
    store = store_of(world, disk.path)
    before = av.protected(store)
    delta = tree_size(world.lab.catalog_dir.parent / "revisions" / "r1")
    disk.fill(free=delta + 64 * 1024)  # room to download r1, not to copy the checkpoint
    error = refit(world, disk.path, "r1")
    assert isinstance(error, CapacityError) and not error.mutation_started, error
    assert (error.revision, error.file) == ("r1", str(store)), error
    assert error.needed_bytes > tree_size(store / "full" / "r0") and error.free_bytes < error.needed_bytes, error
    assert f"{error.needed_bytes:,} bytes" in str(error) and f"has {error.free_bytes:,}" in str(error), error
    assert av.protected(store) == before and list((store / "tmp").iterdir()) == []  # nothing changed, no reserve
    assert cs.check_recovered(world, disk.path, "r0") == []
    disk.release()
    assert refit(world, disk.path, "r1") is None
    assert cs.check_recovered(world, disk.path, "r1") == []


def test_enospc_while_copying_keeps_the_installed_version(world, disk, monkeypatch):
    assert refit(world, disk.path, "r0") is None
    before = av.protected(store_of(world, disk.path))
    fill_at(monkeypatch, disk, "state.updating")  # after the space check: the disk fills while copying
    error = refit(world, disk.path, "r1")
    assert disk.ballast.exists()
    assert_failed_cleanly(world, disk.path, error, revision="r1", kept="r0", before=before)
    assert error.mutation_started
    monkeypatch.undo()
    disk.release()
    assert refit(world, disk.path, "r1") is None
    assert cs.check_recovered(world, disk.path, "r1") == []


def fill_at(monkeypatch, disk: SmallDisk, point: str) -> None:
    """Take every free byte away the first time the refit reaches kill point ``point`` (in this process)."""
    import storage.patch.applier as applier
    import storage.patch.reconstruct as reconstruct
    import storage.store.local_store as local_store

    for module in (local_store, reconstruct, applier):
        def at(name, version=None, _real=module.killpoint):
            if name == point and not disk.ballast.exists():
                disk.fill(free=0)
            return _real(name, version)

        monkeypatch.setattr(module, "killpoint", at)


def status(world, cache: Path) -> dict:
    """``python -m flows.refit status --json``, the operator's view."""
    done = subprocess.run([sys.executable, "-m", "flows.refit", "status", "--model", world.lab.model, "--cache-dir",
                           str(cache), "--json"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# the in-place steps of a refit that takes the verified r2 folder over (rename) and patches it into r3
IN_PLACE = ("state.updating", "apply.base_released", "apply.materialized", "apply.block", "verify.before_ready",
            "verify.recorded")


@pytest.mark.parametrize("point", IN_PLACE)
def test_full_disk_at_every_in_place_step_keeps_the_installed_version(world, any_disk, monkeypatch, point):
    disk = any_disk
    assert refit(world, disk.path, "r2") is None
    store = store_of(world, disk.path)
    fill_at(monkeypatch, disk, point)
    error = refit(world, disk.path, "r3")
    assert disk.ballast.exists()  # the disk was full from that step on (what is free now, the rollback freed)
    assert isinstance(error, StoreError) and "No space left" in str(error) and error.file, error
    assert error.revision == "r3" and error.mutation_started, error
    monkeypatch.undo()
    # the rollback ran on the reserve: r2 back (renamed or rebuilt), verified, installed, nothing left behind
    assert cs.check_recovered(world, disk.path, "r2") == []
    assert sorted(p.name for p in (store / "materialized").iterdir()) == ["r2"]
    disk.release()
    assert refit(world, disk.path, "r3") is None
    assert cs.check_recovered(world, disk.path, "r3") == []


def test_full_disk_when_r2_is_renamed_for_patching_into_r3(world, any_disk, monkeypatch):
    """The reported failure: the disk fills the moment the verified r2 folder is renamed for patching."""
    disk = any_disk
    assert refit(world, disk.path, "r2") is None
    store = store_of(world, disk.path)
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if Path(src) == store / "materialized" / "r2" and Path(dst) == store / "materialized" / "r3":
            disk.fill(free=0)
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    error = refit(world, disk.path, "r3")
    monkeypatch.undo()
    assert disk.ballast.exists()
    assert isinstance(error, StoreError) and "No space left" in str(error), error
    assert error.revision == "r3" and error.file.startswith(str(store)), error
    seen = status(world, disk.path)  # the truth: READY at r2, whose folder exists, verifies and is installed
    assert (seen["state"]["status"], seen["state"]["version"]) == ("READY", "r2"), seen["state"]
    assert seen["state"]["source"] == "materialized/r2" and seen["verified"] == ["r0", "r2"], seen
    assert (seen["active"]["version"], seen["active"]["path"], seen["active_on_disk"]) == ("r2", "materialized/r2",
                                                                                         True), seen
    assert cs.check_recovered(world, disk.path, "r2") == []
    disk.release()
    assert refit(world, disk.path, "r3") is None
    assert cs.check_recovered(world, disk.path, "r3") == []


def test_an_installed_version_that_cannot_be_rebuilt_is_reported_and_the_next_refit_recovers(world, disk,
                                                                                               monkeypatch):
    """The disk fills at the rename and the rollback cannot rebuild r2 (r1's delta left the cache): the store is
    READY at what verifies, ``status`` says the installed folder is gone, and the next refit needs no help."""
    assert refit(world, disk.path, "r2") is None
    store = store_of(world, disk.path)
    import storage.patch.reconstruct as reconstruct

    def at(name, version=None, _real=reconstruct.killpoint):
        if name == "apply.materialized" and not disk.ballast.exists():
            shutil.rmtree(store / "deltas" / "r1")
            disk.fill(free=0)
        return _real(name, version)

    monkeypatch.setattr(reconstruct, "killpoint", at)
    fill_at_records = _full_when(lambda p, d: p.parent.name == "verified" and p.name == "r3.json")
    monkeypatch.setattr(durable, "atomic_write_bytes", fill_at_records)  # the update fails after patching
    error = refit(world, disk.path, "r3")
    monkeypatch.undo()
    assert isinstance(error, StoreError) and error.revision == "r3" and "No space left" in str(error), error
    assert not (store / "materialized" / "r2").exists()
    assert cs.check_after_crash(world, disk.path) == []  # READY names a folder holding its version's bytes
    seen = status(world, disk.path)
    assert (seen["state"]["status"], seen["state"]["version"], seen["state"]["source"]) == ("READY", "r0", "full/r0")
    assert (seen["active"]["version"], seen["active_on_disk"]) == ("r2", False), seen  # the truth, not a folder
    disk.release()
    assert refit(world, disk.path, "r3") is None
    assert cs.check_recovered(world, disk.path, "r3") == []
    assert status(world, disk.path)["active_on_disk"] is True


def test_too_little_disk_for_the_rollback_reserve_is_refused_before_any_change(world, disk):
    assert refit(world, disk.path, "r2") is None
    store = store_of(world, disk.path)
    before = av.protected(store)
    delta = tree_size(world.lab.catalog_dir.parent / "revisions" / "r3")
    disk.fill(free=delta + 128 * 1024)  # r3's delta fits; the records and the rollback's reserve do not
    error = refit(world, disk.path, "r3")
    assert isinstance(error, CapacityError) and not error.mutation_started, error
    assert (error.revision, error.file) == ("r3", str(store)) and error.free_bytes < error.needed_bytes, error
    assert av.protected(store) == before and list((store / "tmp").iterdir()) == []
    assert cs.check_recovered(world, disk.path, "r2") == []
    disk.release()
    assert refit(world, disk.path, "r3") is None
    assert cs.check_recovered(world, disk.path, "r3") == []


@pytest.mark.parametrize("point", IN_PLACE)
def test_kill_on_a_full_disk_at_every_in_place_step_recovers_exact_bytes(world, disk, point):
    """SIGKILL while the disk is full at an in-place step; recovery on the still-full disk keeps the store truthful
    (typed refusal or success), and once space is back the next refit reaches r3 byte-exact."""
    assert refit(world, disk.path, "r2") is None
    trace = disk.path / "events.log"
    job = world.job(disk.path, "r3", env={"CANONICAL_REFIT_KILLPOINT_GATE": f"{point}:{disk.path / 'never'}"})
    child = world.children.start(job)
    try:
        deadline = time.monotonic() + 120
        while not (trace.exists() and f'"what": "{point}"' in trace.read_text()):
            assert child.exitcode is None and time.monotonic() < deadline, f"the refit never reached {point}"
            time.sleep(0.02)
        disk.fill(free=0)  # held at the point: the disk fills, then the process dies
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    assert cs.check_after_crash(world, disk.path) == []
    error = refit(world, disk.path, "r3")  # recovery, on the full disk
    assert error is None or isinstance(error, StoreError), error
    assert cs.check_after_crash(world, disk.path) == []  # READY names a folder holding its version's bytes
    seen = status(world, disk.path)
    assert seen["state"]["status"] == "READY" and (store_of(world, disk.path) / seen["state"]["source"]).is_dir()
    assert seen["active_on_disk"] is (seen["active"]["path"] == seen["state"]["source"]), seen
    disk.release()
    assert refit(world, disk.path, "r3") is None
    assert cs.check_recovered(world, disk.path, "r3") == []


def _full_when(predicate):
    """An ``atomic_write_bytes`` that raises ENOSPC for the writes ``predicate(path, data)`` picks."""
    real = durable.atomic_write_bytes

    def write(path, data, *, durable=True):
        if predicate(Path(path), data):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data, durable=durable)

    return write


def test_enospc_marking_updating_changes_nothing(world, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    assert refit(world, cache, "r1") is None
    before = av.protected(store_of(world, cache))
    monkeypatch.setattr(durable, "atomic_write_bytes",
                        _full_when(lambda p, d: p.name == "state.json" and b'"UPDATING"' in d))
    error = refit(world, cache, "r2")
    assert_failed_cleanly(world, cache, error, revision="r2", kept="r1", before=before)
    monkeypatch.undo()
    assert refit(world, cache, "r2") is None
    assert cs.check_recovered(world, cache, "r2") == []


def test_enospc_recording_the_verified_target_restores_the_installed_version(world, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    assert refit(world, cache, "r1") is None
    before = av.protected(store_of(world, cache))
    monkeypatch.setattr(durable, "atomic_write_bytes",
                        _full_when(lambda p, d: p.parent.name == "verified" and p.name == "r2.json"))
    error = refit(world, cache, "r2")  # r1 was taken over and patched into r2 before this write
    assert isinstance(error, StoreError) and error.mutation_started, error
    assert error.revision == "r2", error
    monkeypatch.undo()
    store = store_of(world, cache)
    content = {k: v for k, v in av.protected(store).items() if k.startswith("materialized/")}
    assert content == {k: v for k, v in before.items() if k.startswith("materialized/")}  # r1 rebuilt, same bytes
    assert cs.check_recovered(world, cache, "r1") == []  # READY, installed identity names the rebuilt files
    assert refit(world, cache, "r2") is None
    assert cs.check_recovered(world, cache, "r2") == []

