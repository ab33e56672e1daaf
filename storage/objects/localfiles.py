"""The local filesystem (``file://`` and plain paths) as ``ObjectStore`` reads it, without importing fsspec.

``ObjectStore.locate`` resolves a ``file://`` URL to ``LocalFiles``. What the
store's reads ask of a filesystem (an object's size, whether it exists, the
entries of a folder) it answers through ``os``, as fsspec's
``LocalFileSystem`` answers it: the same entries (a link is listed as
itself, an entry gone meanwhile is left out), the same kinds, sizes and
errors. Everything else (``find``, ``rm``, ``open``, ``pipe_file``...) is
fsspec's ``LocalFileSystem``'s, built on first use. So a command that only
reads local objects (``flows.fleet status`` on a ``file://`` catalog) never
imports fsspec (about 60 ms: asyncio, its compression modules), while every
read of a local object still goes through the store's one code path.
Whole and ranged reads of local files use ``storage.objects.sources``
(``read_regular``, ``open_regular``) for every local filesystem, this one or
another fsspec protocol built on ``LocalFileSystem``.
"""

from __future__ import annotations

import os
import stat


class LocalFiles:
    """The local filesystem: ``size``, ``exists`` and ``ls`` through ``os``; the rest through fsspec's
    ``LocalFileSystem`` (imported on first use)."""

    protocol = ("file", "local")

    def __init__(self):
        self._fsspec = None

    @staticmethod
    def _strip_protocol(url: str) -> str:
        """The path of a normalised ``file://`` URL (``storage.urls.normalize_url``)."""
        return str(url).removeprefix("file://").rstrip("/") or "/"

    def size(self, path: str) -> int:
        """Bytes of the object at ``path`` (a link's target's); ``FileNotFoundError`` if there is none."""
        return os.stat(self._strip_protocol(path)).st_size

    def exists(self, path: str) -> bool:
        """Whether anything is at ``path`` (a link: whether its target is); False on any error."""
        try:
            os.stat(self._strip_protocol(path))
        except Exception:  # as fsspec's exists: an unreadable path is not there
            return False
        return True

    def ls(self, path: str, detail: bool = True) -> list:
        """The entries of the folder ``path`` (a file: itself), each ``{"name", "size", "type"}`` with ``type``
        ``directory``, ``file`` or ``other`` (an entry that is a link is ``other``, with its target's size), or
        their names."""
        path = self._strip_protocol(path)
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            entries = [{"name": path, "size": st.st_size, "type": _kind(st.st_mode)}]
        else:
            entries = []
            with os.scandir(path) as found:
                for entry in found:
                    try:
                        own = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # removed since the listing
                        continue
                    entries.append({"name": entry.path, "size": _target_size(entry, own),
                                    "type": _kind(own.st_mode)})
        return entries if detail else [e["name"] for e in entries]

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_fsspec":
            raise AttributeError(name)
        if self._fsspec is None:
            from fsspec.implementations.local import LocalFileSystem

            self._fsspec = LocalFileSystem()
        return getattr(self._fsspec, name)


def _target_size(entry: os.DirEntry, own: os.stat_result) -> int:
    if not stat.S_ISLNK(own.st_mode):
        return own.st_size
    try:
        return entry.stat(follow_symlinks=True).st_size
    except OSError:
        return 0


def _kind(mode: int) -> str:
    return "directory" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
