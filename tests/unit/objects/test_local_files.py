"""``file://`` objects are listed and read without fsspec, answering as fsspec's ``LocalFileSystem`` does.

``storage.objects.localfiles.LocalFiles`` answers the store's reads (size, exists, a folder's entries) through
``os``: compared here with fsspec's answers over every kind of entry a folder can hold (files, folders,
links to each, a dangling link, a FIFO), and through the store's own operations. What it does not answer
itself is fsspec's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fsspec.implementations.local import LocalFileSystem

from storage.errors import ObjectNotFound
from storage.objects.localfiles import LocalFiles
from storage.objects.store import ObjectStore
from tests.support.lab import ROOT_DIR


@pytest.fixture
def folder(tmp_path):
    """A folder with every kind of entry."""
    root = tmp_path / "objects"
    root.mkdir()
    (root / "a.json").write_bytes(b"{}")
    (root / "empty.json").write_bytes(b"")
    (root / "sub").mkdir()
    (root / "sub" / "inner.json").write_bytes(b"[1]")
    (root / "link.json").symlink_to(root / "a.json")
    (root / "dirlink").symlink_to(root / "sub")
    (root / "dangling.json").symlink_to(root / "none")
    os.mkfifo(root / "fifo.json")
    return root


def _entries(listing: list[dict]) -> list[tuple]:
    return sorted((e["name"], e["type"], e["size"]) for e in listing)


def test_listings_sizes_and_existence_are_fsspecs(folder):
    ours, theirs = LocalFiles(), LocalFileSystem()
    paths = [str(folder)] + [str(p) for p in folder.iterdir()] + [str(folder / "sub" / "inner.json"),
                                                                   str(folder / "missing"), str(folder / "a.json/x")]
    for path in paths:
        assert ours.exists(path) == theirs.exists(path), path
        if theirs.exists(path):
            assert ours.size(path) == theirs.size(path), path
            assert _entries(ours.ls(path, detail=True)) == _entries(theirs.ls(path, detail=True)), path
            assert sorted(ours.ls(path, detail=False)) == sorted(theirs.ls(path, detail=False)), path
    for path in (folder / "missing", folder / "dangling.json"):
        with pytest.raises(FileNotFoundError):
            ours.ls(str(path))
        with pytest.raises(FileNotFoundError):
            ours.size(str(path))
    assert ours._strip_protocol(f"file://{folder}/") == theirs._strip_protocol(f"file://{folder}/") == str(folder)
    assert ours._strip_protocol("file:///") == theirs._strip_protocol("file:///") == "/"


def test_the_store_reads_file_urls_through_it_and_hands_the_rest_to_fsspec(folder, tmp_path):
    store = ObjectStore()
    url = f"file://{folder}"
    fs, path = store.locate(f"{url}/a.json")
    assert isinstance(fs, LocalFiles) and ObjectStore.is_local(fs) and path == str(folder / "a.json")
    assert store.list_names(url, ".json") == ["a.json", "dangling.json", "empty.json", "fifo.json", "link.json"]
    assert store.list_names(f"file://{tmp_path}/nothing") == []
    assert store.read_bytes(f"{url}/link.json", max_size=10) == b"{}" and store.size(f"{url}/sub/inner.json") == 3
    assert store.exists(f"{url}/a.json") and not store.exists(f"{url}/dangling.json")
    with pytest.raises(ObjectNotFound):
        store.read_bytes(f"{url}/missing.json", max_size=10)
    fs.pipe_file(str(folder / "piped.json"), b"[]")  # not its own: fsspec's LocalFileSystem's
    assert store.read_bytes(f"{url}/piped.json", max_size=10) == b"[]"
    assert [name for name, _, _ in store.walk(f"{url}/sub")] == ["inner.json"]
    assert ObjectStore.is_local(ObjectStore().locate("memory://x/y")[0]) is False


def test_listing_and_reading_file_urls_imports_no_fsspec(folder):
    code = ("import sys; from storage.objects.store import ObjectStore; s = ObjectStore(); "
            f"u = 'file://{folder}'; print(s.list_names(u, '.json'), s.read_bytes(u + '/a.json', max_size=9), "
            "s.exists(u + '/sub'), s.size(u + '/a.json')); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fsspec', 'asyncio')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT_DIR, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "['a.json', 'dangling.json', 'empty.json', 'fifo.json', 'link.json'] b'{}' True 2", "[]"]
