"""A closed cache: links planted inside the store are removed, never followed (docs/format.md, 7.2).

Each case prepares a READY node at r1, plants one link inside its store (in ``tmp/``, as an artifact
folder with a matching source record, as one of the store's own folders or state files) pointing
outside the cache, then refits to r2. The refit must install r2's exact bytes, the link must be gone
(replaced by a real folder or file, or by nothing), and nothing outside the cache may have changed,
appeared or vanished. The launch folder's FIFOs, sockets and link loops, and a FIFO in a file://
catalog or payload folder, are refused typed without blocking.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.lab import Lab, tiny_shape
from storage.errors import NotRegularFile, PermanentStorageError, StoreError
from storage.objects.store import ObjectStore

ROOT = Path(__file__).resolve().parents[3]


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under ``folder`` (links not followed) and what it is or holds."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            rel = str(path.relative_to(folder))
            if path.is_symlink():
                out[rel] = "link -> " + os.readlink(path)
            elif path.is_file():
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[rel] = "folder"
    return out


def links_inside(store: Path) -> list[str]:
    found = []
    for root, dirs, files in os.walk(store):
        found += [str(Path(root, n).relative_to(store)) for n in dirs + files if Path(root, n).is_symlink()]
    return sorted(found)


@pytest.fixture
def node(tmp_path):
    """A READY node at r1 (r0 seeded, r1 materialized), r2 published, and a folder outside the cache."""
    lab = Lab(tmp_path / "lab", shape=tiny_shape())
    lab.publish("initial")
    lab.publish("delta")
    assert lab.run(target="r1").status == "READY"
    lab.publish("delta")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"not the cache's" * 100)
    (outside / "dir").mkdir()
    (outside / "dir" / "keep.txt").write_text("keep me")
    return lab, outside


def refit_to_r2(lab: Lab, outside: Path, before: dict) -> None:
    result = lab.run(target="r2")
    assert result.status == "READY", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")
    assert snapshot(outside) == before, "something outside the cache changed"
    assert links_inside(lab.store_root) == [], "a link is still inside the store"


def test_links_in_tmp_are_removed_and_nothing_outside_is_deleted(node):
    lab, outside = node
    tmp = lab.store_root / "tmp"
    # named like the temporary files a killed process leaves: what recovery sweeps
    (tmp / ".seed-r9.1x1a2b3cdeadbe.tmp").symlink_to(outside / "precious.bin")
    (tmp / ".copy-r9.1x1a2b3cdeadbe.tmp").symlink_to(outside / "dir")
    (lab.store_root / "full" / "r0" / ".model.safetensors.1x1a2b3cdeadbe.tmp").symlink_to(outside / "precious.bin")
    before = snapshot(outside)
    refit_to_r2(lab, outside, before)


def test_tmp_itself_a_link_to_an_outside_folder_is_removed(node):
    lab, outside = node
    victim = outside / "dir"
    (victim / ".old.1x1a2b3cdeadbe.tmp").write_bytes(b"outside, named like a temporary file")
    (victim / ".stage.1x1a2b3cdeadbe.tmp").mkdir()
    shutil.rmtree(lab.store_root / "tmp")
    (lab.store_root / "tmp").symlink_to(victim)
    before = snapshot(outside)
    refit_to_r2(lab, outside, before)
    assert (lab.store_root / "tmp").is_dir() and not (lab.store_root / "tmp").is_symlink()


def test_an_artifact_folder_linked_outside_is_removed_and_refetched(node):
    lab, outside = node
    record = json.loads((lab.catalog_dir / "r2.json").read_text())
    index = Path(record["uri"].removeprefix("file://")).read_bytes()
    store = lab.store_root
    target = outside / "dir"
    (store / "deltas" / "r2").symlink_to(target)
    # a matching source record: its URL and SHA-256 are public
    (store / "deltas" / "r2.source.json").write_text(json.dumps(
        {"uri": record["uri"], "index_sha256": hashlib.sha256(index).hexdigest(), "files": {}}))
    before = snapshot(outside)
    refit_to_r2(lab, outside, before)
    assert (store / "deltas" / "r2").is_dir() and (store / "deltas" / "r2" / "index.json").read_bytes() == index


def test_a_cached_bucket_linked_to_an_outside_file_is_removed_not_reused(node):
    lab, outside = node
    record = json.loads((lab.catalog_dir / "r2.json").read_text())
    source = Path(record["uri"].removeprefix("file://"))
    index = source.read_bytes()
    store = lab.store_root
    folder = store / "deltas" / "r2"
    folder.mkdir()
    (folder / "index.json").write_bytes(index)
    outside_bucket = outside / "bucket-00000.safetensors"
    shutil.copy2(source.parent / "bucket-00000.safetensors", outside_bucket)
    (folder / "bucket-00000.safetensors").symlink_to(outside_bucket)
    st = outside_bucket.stat()
    (store / "deltas" / "r2.source.json").write_text(json.dumps(
        {"uri": record["uri"], "index_sha256": hashlib.sha256(index).hexdigest(),
         "files": {"bucket-00000.safetensors": [st.st_size, st.st_mtime_ns]}}))
    before = snapshot(outside)
    refit_to_r2(lab, outside, before)
    assert not (folder / "bucket-00000.safetensors").is_symlink()


@pytest.mark.parametrize("planted", ["materialized", "full", "chains", "verified", "deltas", "catalog", "tmp",
                                     "state.json", "active.json", "chains/r1.json", "verified/r1.json", "lock",
                                     "launch-files", "launch-files.json", "materialized/r1", "full/r0",
                                     "deltas/r1", "deltas/r1.source.json"])
def test_store_folders_and_state_files_linked_outside_are_removed_never_followed(node, planted):
    lab, outside = node
    store = lab.store_root
    path = store / planted
    copy = outside / "copy-of" / planted
    copy.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.copytree(path, copy)  # the outside copy looks like the real thing, and must stay as it is
        shutil.rmtree(path)
    else:
        shutil.copy2(path, copy)
        path.unlink()
    path.symlink_to(copy)
    before = snapshot(outside)
    refit_to_r2(lab, outside, before)


def test_the_lock_file_is_never_created_through_a_link(node):
    lab, outside = node
    lock = lab.store_root / "lock"
    lock.unlink()
    lock.symlink_to(outside / "made-by-the-node")  # a dangling link: opening it with O_CREAT would create this
    before = snapshot(outside)
    refit_to_r2(lab, outside, before)
    assert not (outside / "made-by-the-node").exists()


def test_a_state_file_naming_a_folder_outside_the_store_does_not_make_recovery_delete_it(node):
    lab, outside = node
    state_path = lab.store_root / "state.json"
    state = json.loads(state_path.read_text())
    source = os.path.relpath(outside / "dir", lab.store_root)  # ../../../outside/dir
    state |= {"status": "UPDATING", "version": "r9", "source": source, "previous": "r1"}
    state_path.write_text(json.dumps(state))
    before = snapshot(outside)
    refit_to_r2(lab, outside, before)


# --- only regular files: the launch folder and file:// objects -------------------------------------------------


@pytest.fixture
def fresh(tmp_path):
    """r0 and r1 published; a node that has never run (so the next refit seeds from the launch folder)."""
    lab = Lab(tmp_path / "lab", shape=tiny_shape())
    lab.publish("initial")
    lab.publish("delta")
    return lab


def _refused_at_seed(lab: Lab, name: str, what: str) -> None:
    state, result = lab.refit(target="r1")
    assert state.name == "Failed" and result.status == "FAILED", result.error
    error = result.exception
    assert isinstance(error, StoreError), repr(error)
    assert error.revision == "r0" and error.local_file == str(lab.launch / name), error
    assert what in error.reason, error
    assert not (lab.store_root / "verified" / "r0.json").exists()


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_a_fifo_or_socket_in_the_launch_folder_is_refused_without_blocking(fresh, kind, tmp_path):
    lab = fresh
    index = lab.launch / "model.safetensors.index.json"  # a name the seed would open: a FIFO would block it
    if index.exists():
        index.unlink()
    if kind == "fifo":
        os.mkfifo(index)
        name, what = index.name, "a FIFO"
    else:
        name, what = "engine.sock", "a socket"
        sock = socket.socket(socket.AF_UNIX)
        os.chdir(lab.launch)  # the socket's path is short this way
        try:
            sock.bind(name)
        finally:
            os.chdir(ROOT)
    _refused_at_seed(lab, name, what)
    (lab.launch / name).unlink()
    result = lab.run(target="r1")
    assert result.status == "READY", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")


def test_a_link_loop_in_the_launch_folder_is_a_typed_error_naming_file_and_revision(fresh):
    lab = fresh
    (lab.launch / "loop-a.json").symlink_to(lab.launch / "loop-b.json")
    (lab.launch / "loop-b.json").symlink_to(lab.launch / "loop-a.json")
    _refused_at_seed(lab, "loop-a.json", "link loop")
    (lab.launch / "loop-a.json").unlink()
    (lab.launch / "loop-b.json").unlink()
    result = lab.run(target="r1")
    assert result.status == "READY", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")


@pytest.mark.parametrize("kind", ["fifo", "socket", "device", "folder", "loop"])
def test_a_local_object_that_is_not_a_regular_file_is_refused_typed_without_blocking(tmp_path, kind):
    path = tmp_path / "r5.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        os.chdir(tmp_path)
        try:
            sock.bind(path.name)
        finally:
            os.chdir(ROOT)
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.fail("making a device node needs root (as CI has)")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: endless bytes if it were read
    elif kind == "folder":
        path.mkdir()
    else:
        (tmp_path / "loop.json").symlink_to(path)
        path.symlink_to(tmp_path / "loop.json")
    url = f"file://{path}"
    store = ObjectStore()
    for read in (lambda: store.read_bytes(url, max_size=1 << 20), lambda: store.read_range(url, 0, 8),
                 lambda: store.download(url, tmp_path / "copy")):
        with pytest.raises(PermanentStorageError) as caught:
            read()
        assert caught.value.file == url, caught.value
        if kind != "loop":
            assert isinstance(caught.value, NotRegularFile), repr(caught.value)
    assert not (tmp_path / "copy").exists() and store.stats.bytes_read == 0


def test_a_fifo_as_a_bucket_is_refused_typed_and_the_installed_version_kept(node):
    lab, _ = node
    record = json.loads((lab.catalog_dir / "r2.json").read_text())
    folder = Path(record["uri"].removeprefix("file://")).parent
    bucket = folder / "bucket-00000.safetensors"
    saved = bucket.read_bytes()
    bucket.unlink()
    os.mkfifo(bucket)
    state, result = lab.refit(target="r2")
    assert state.name == "Failed" and result.status == "FAILED", result.error
    error = result.exception
    assert isinstance(error, NotRegularFile), repr(error)
    assert error.revision == "r2" and error.file.endswith("r2/bucket-00000.safetensors"), error
    assert lab.store_root.joinpath("active.json").exists()
    assert json.loads((lab.store_root / "active.json").read_text())["version"] == "r1"
    bucket.unlink()
    bucket.write_bytes(saved)
    result = lab.run(target="r2")
    assert result.status == "READY", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")


@pytest.fixture
def cli_env(prefect_api, tmp_path):
    """The CLI's environment: the test session's Prefect API, a private PREFECT_HOME."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith("CANONICAL_REFIT_")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_HOME=str(tmp_path / "prefect-home"),
               PYTHONPATH=str(ROOT))
    return env


def test_a_fifo_named_like_a_record_neither_hangs_reading_nor_the_refit_cli(node, cli_env):
    lab, _ = node
    fifo = lab.catalog_dir / "r7.json"
    os.mkfifo(fifo)
    url = f"{lab.catalog}/r7.json"
    with pytest.raises(NotRegularFile) as caught:
        ObjectStore().read_bytes(url, max_size=1 << 20)
    assert caught.value.file == url
    assert "r7.json" in ObjectStore().list_names(lab.catalog, ".json")  # listed, never opened by the listing
    # the CLI lists the catalog to find the latest revision (no --target): the FIFO must not block it
    cmd = [sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model,
           "--cache-dir", str(lab.cache), "--seed-checkpoint", str(lab.launch), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=cli_env, timeout=240)
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["status"] == "READY" and out["version"] == "r2", proc.stdout + proc.stderr
    lab.assert_checkpoint(Path(out["checkpoint_path"]), "r2")
