"""The download of a local or in-memory object: one plain copy into a temporary file, then a rename.

A ``file://`` object must be a regular file and exactly the bytes its size
announced are copied (never more than ``max_size``); other protocols built on
the local filesystem, and ``memory://``, go through ``fs.get_file``. The copy
runs under the store's retried ``call``; ``dest`` appears whole or not at all.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable

from storage.durable import copy_bytes, fsync_dir, fsync_files, temp_name
from storage.errors import PermanentStorageError, TransientStorageError
from storage.objects.budget import Requester
from storage.objects.classify import local_call, local_error
from storage.objects.sources import LocalSource, open_regular


def copy_object(store: Requester, source: LocalSource, url: str, dest: Path, *, check: Callable[[], None],
                report: Callable[[int], None], expected_size: int | None, max_size: int | None) -> int:
    """Copy ``source`` into ``dest`` through a temporary file and a rename; returns its size in bytes."""
    fs, path = source.fs, source.path
    tmp = dest.with_name(temp_name(dest.name))
    local_call("creating the download's temporary file", tmp, url, tmp.write_bytes, b"")

    def fetch() -> int:
        check()
        if source.local:
            return _copy_regular(path, tmp, url, expected_size, max_size)
        expected = int(fs.size(path)) if expected_size is None else expected_size
        if max_size is not None and expected > max_size:
            raise PermanentStorageError(f"object is {expected} bytes, more than the {max_size} allowed", file=url)
        try:
            fs.get_file(path, str(tmp))
        except OSError as exc:
            if str(tmp) in (getattr(exc, "filename", None), getattr(exc, "filename2", None)):
                raise local_error(exc, tmp, url, "copying the object") from exc
            raise
        got = local_call("checking the download", tmp, url, os.path.getsize, tmp)
        if got != expected:
            raise TransientStorageError(f"download returned {got} bytes, the object has {expected}", file=url)
        return expected

    try:
        size = store.call("download", url, fetch, check=check)
        local_call("syncing the download", tmp, url, fsync_files, tmp.parent, [tmp.name])
        local_call("moving the download into place", dest, url, os.replace, tmp, dest)
        local_call("syncing the download's folder", dest.parent, url, fsync_dir, dest.parent)
    finally:
        tmp.unlink(missing_ok=True)
    store.stats.add(bytes_read=size)
    report(size)
    return size


def _copy_regular(path: str, tmp: Path, url: str, expected_size: int | None, max_size: int | None) -> int:
    """Copy exactly the announced bytes of a local regular file into ``tmp`` (never more than ``max_size``)."""
    fd = open_regular(path, url)
    try:
        size = os.fstat(fd).st_size
        if max_size is not None and size > max_size:
            raise PermanentStorageError(f"object is {size} bytes, more than the {max_size} allowed; "
                                        "not downloaded", file=url)
        if expected_size is not None and size != expected_size:
            raise TransientStorageError(f"the object has {size} bytes, {expected_size} were expected", file=url)
        with os.fdopen(os.dup(fd), "rb") as fin:
            try:
                out = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                raise local_error(exc, tmp, url, "copying the object") from exc
            with os.fdopen(out, "wb") as fout:
                try:
                    copy_bytes(fin, fout, size, stop=None)
                except OSError as exc:
                    if exc.errno == errno.EIO and os.fstat(fd).st_size < size:  # shrank while copied
                        raise TransientStorageError(f"the object shrank while it was copied ({exc})",
                                                    file=url) from exc
                    raise local_error(exc, tmp, url, "copying the object") from exc
        if os.fstat(fd).st_size != size:  # grew (or shrank) while copied: what was copied is not the object
            raise TransientStorageError(f"the object changed size while it was copied (from {size} bytes)",
                                        file=url)
    finally:
        os.close(fd)
    return size
