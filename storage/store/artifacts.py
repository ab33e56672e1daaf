"""The immutable artifact cache: downloaded full checkpoints and delta buckets.

Each artifact folder (``full/{v}/`` or ``deltas/{v}/``) has a sibling
``{v}.source.json`` naming its source identity (the index URI and the SHA-256
of the index bytes) and the identity (size, mtime) of every file that was
completely downloaded and size-checked. A folder whose source differs is
wiped before reuse; a file whose identity changed is downloaded again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import asdict, field
from pathlib import Path

import numpy as np
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from storage.durable import atomic_write_bytes, atomic_write_json, file_identity, remove_tree
from storage.errors import StoreError
from storage.jsonio.bounded_json import STORE_RECORD, read_record
from storage.store.local_store import LocalStore
from storage.store.records import Files

log = logging.getLogger("canonical_refit.store")

FULL, DELTA = "full", "deltas"
DELTA_INDEX_NAME = "index.json"
FULL_INDEX_NAME = "model.safetensors.index.json"

# -- download bounds (docs/format.md, "Download bounds") ------------------------------------------------------

HEADER_SLACK = 2**20  # header bytes allowed on top of what its tensors need (metadata, whitespace)
HEADER_PER_TENSOR = 512  # a tensor's entry and checksum beside its name (escaped twice: 12 bytes a name byte)
FRAME_SLACK = 2**16  # bytes allowed on top of a frame's decoded size and 1/128 of it (frame and block headers)


def header_bound(names) -> int:
    """Most bytes a safetensors file's length prefix and header may take for tensors ``names``."""
    from storage.format.safetensors import MAX_HEADER_BYTES

    names = list(names)
    need = HEADER_SLACK + HEADER_PER_TENSOR * len(names) + 12 * len("".join(names).encode("utf-8"))
    return 8 + min(MAX_HEADER_BYTES, need)


def decoded_bound(encoding: str | None, size: int) -> int:
    """Most bytes a valid record of ``encoding`` decodes to, for a tensor of ``size`` bytes (count <= size)."""
    per, fixed = _DECODED.get(encoding or "xor", (1, 0))
    return fixed + per * size


_DECODED = {"xor_sparse": (9, 8), "overwrite": (5, 4), "xor_gaps": (10, 8)}  # bytes a record takes per byte, fixed


def frame_bound(decoded: int) -> int:
    """Most bytes a zstd frame decoding to ``decoded`` bytes may take: above libzstd's ZSTD_COMPRESSBOUND
    (n + n/256 + at most 64 bytes), with room for a streaming encoder's extra block headers."""
    return decoded + decoded // 128 + FRAME_SLACK


def bucket_bound(encoding: str | None, sizes: dict[str, int]) -> int:
    """Most bytes a delta bucket holding frames for tensors of these byte ``sizes`` may have."""
    per, fixed = _DECODED.get(encoding or "xor", (1, 0))
    decoded = fixed + per * np.fromiter(sizes.values(), np.int64, len(sizes))  # ``decoded_bound`` of each, at once
    frames = int((decoded + decoded // 128).sum()) + FRAME_SLACK * len(sizes)  # ``frame_bound`` of each
    return header_bound(sizes) + frames


def shard_bound(sizes: dict[str, int]) -> int:
    """Most bytes a full shard holding tensors of these byte ``sizes`` may have (its header is not known yet)."""
    return header_bound(sizes) + sum(sizes.values())


@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class SourceRecord:
    """Contents of ``full/{v}.source.json`` and ``deltas/{v}.source.json``. Strict, no unknown key (the store's
    own cache record): a refused one is a source that differs, so its folder is wiped and downloaded again."""

    uri: str  # the index URL, or ``seed:{absolute path}`` for a seeded launch snapshot
    index_sha256: str | None
    files: Files = field(default_factory=dict)  # completely downloaded and checked files: name -> [size, mtime_ns]


def read_source(path: Path) -> SourceRecord | None:
    """The source record at ``path``, or None if there is none; ``StoreError`` naming it if it is refused."""
    return read_record(path, SourceRecord, STORE_RECORD, error=StoreError, missing_ok=True,
                       hint="; the artifact's folder is wiped and downloaded again")


@contextmanager
def _typed(what: str, version: str, path: Path):
    """A local write that fails (ENOSPC on a full disk, EIO) is a ``StoreError`` naming the path."""
    try:
        yield
    except OSError as exc:
        raise StoreError(f"could not {what} ({exc})", revision=version, file=str(path)) from exc


class ArtifactCache:
    """Source-checked artifact folders of one local store."""

    def __init__(self, store: LocalStore):
        self.store = store
        self._lock = threading.Lock()

    def folder(self, kind: str, version: str) -> Path:
        return self.store.root / kind / version

    def _source_path(self, kind: str, version: str) -> Path:
        return self.store.root / kind / f"{version}.source.json"

    def source(self, kind: str, version: str) -> SourceRecord | None:
        """The folder's source record; None if there is none or it is refused (logged: the folder is then
        wiped by ``open``)."""
        try:
            return read_source(self._source_path(kind, version))
        except StoreError as exc:
            log.warning("%s", exc)
            return None

    def matches(self, kind: str, version: str, uri: str, index: bytes | None) -> bool:
        """True if the cached folder of ``version`` came from this very source (URI and index bytes)."""
        source = self.source(kind, version)
        index_sha = hashlib.sha256(index).hexdigest() if index is not None else None
        return source is not None and source.uri == uri and source.index_sha256 == index_sha

    def open(self, kind: str, version: str, uri: str, index: bytes | None) -> Path:
        """The folder for ``version`` from ``uri``; anything cached from another source is wiped.

        ``index`` (the manifest bytes) is part of the source identity and is
        stored in the folder under its standard name.
        """
        index_sha = hashlib.sha256(index).hexdigest() if index is not None else None
        folder = self.folder(kind, version)
        with self._lock, _typed("prepare the artifact folder", version, folder):
            for path in (folder, self._source_path(kind, version)):  # links are removed, never written through
                if os.path.islink(path):
                    log.warning("removed %s: a link inside the store (the store never follows links)", path)
                    os.unlink(path)
            if not self.matches(kind, version, uri, index):
                remove_tree(folder)
                self._source_path(kind, version).unlink(missing_ok=True)
                atomic_write_json(self._source_path(kind, version),
                                  {"uri": uri, "index_sha256": index_sha, "files": {}})
            folder.mkdir(parents=True, exist_ok=True)
            if index is not None:
                name = FULL_INDEX_NAME if kind == FULL else DELTA_INDEX_NAME
                path = folder / name
                if os.path.islink(path):
                    os.unlink(path)
                if not path.exists() or path.read_bytes() != index:
                    atomic_write_bytes(path, index)
        return folder

    def complete_files(self, kind: str, version: str) -> set[str]:
        """Files of ``version`` that were fully downloaded and have not changed since."""
        source = self.source(kind, version)
        folder, out = self.folder(kind, version), set()
        for name, recorded in (source.files if source is not None else {}).items():
            try:
                if file_identity(folder / name) == recorded:
                    out.add(name)
            except FileNotFoundError:
                pass
        return out

    def record(self, kind: str, version: str, name: str) -> None:
        """Note that ``name`` is complete (after its size and header were checked)."""
        with self._lock, _typed("record the downloaded file", version, self._source_path(kind, version)):
            source = self.source(kind, version)
            files = dict(source.files) if source is not None else {}
            files[name] = file_identity(self.folder(kind, version) / name)
            atomic_write_json(self._source_path(kind, version),
                              (asdict(source) if source is not None else {}) | {"files": files})

    def discard(self, kind: str, version: str, name: str) -> Path:
        """Drop a file that failed validation, and its record, so the next run downloads it again."""
        path = self.folder(kind, version) / name
        with self._lock:
            source = self.source(kind, version)
            if source is not None and name in source.files:
                files = {k: v for k, v in source.files.items() if k != name}
                atomic_write_json(self._source_path(kind, version), asdict(source) | {"files": files})
            path.unlink(missing_ok=True)
        return path

    def record_seed(self, version: str, seed_path: Path) -> None:
        """Source identity of a launch snapshot copied into ``full/{version}``."""
        folder = self.folder(FULL, version)
        files = {p.name: file_identity(p) for p in sorted(folder.iterdir()) if p.is_file()}
        atomic_write_json(self._source_path(FULL, version),
                          {"uri": f"seed:{Path(seed_path).resolve()}", "index_sha256": None, "files": files})

