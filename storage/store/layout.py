"""Where things are in a model's local store: its folders and files, the links it removes, its locks.

One folder per model, laid out so a person can inspect it with ``ls`` and
``cat``; every state file is small JSON written atomically and durably
(``storage/durable.py``)::

    state.json            status (READY/UPDATING) of the current prepared checkpoint
    active.json           identity of what the engine runs
    poisoned.json         present while the engine may hold partial weights (and how to re-install)
    full/{v}/             immutable full checkpoints (launch snapshot, full revisions)
    full/{v}.source.json  where a full artifact came from, and its files' identity
    deltas/{v}/           immutable downloaded delta artifacts (index + buckets)
    deltas/{v}.source.json
    materialized/{v}/     the mutable checkpoint reconstructed for a delta revision
    chains/{v}.json       how to rebuild {v}: its full version and deltas
    verified/{v}.json     digests, per-tensor checksums and file identity of a verified checkpoint
    catalog/{v}.json      memo of immutable catalog records
    tmp/                  staging of copies; an update's rollback reserve (cleared on recovery)
    lock                  the fcntl lock file

``StoreLayout`` names these paths, keeps the cache closed (a link planted inside is removed, never
followed), takes the store's locks and reads its records back. It changes no state: every transition is a
method of ``LocalStore`` (``storage/store/local_store.py``), which extends it.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import replace
from pathlib import Path

from storage.durable import folder_identity, remove_tree, temp_name
from storage.errors import StoreError
from storage.store import launch_files
from storage.store.locks import StoreLock
from storage.store.records import ActiveIdentity, Chain, PoisonedMark, StoreState, VerifiedCheckpoint, read_record

log = logging.getLogger("canonical_refit.store")
_FOLDERS = ("full", "deltas", "materialized", "chains", "verified", "flushed", "catalog", "tmp")
_CHECKPOINT_FOLDERS = ("full", "deltas", "materialized")  # folders of folders of files
_ROOT_FILES = ("state.json", "active.json", "poisoned.json", "installing.json", launch_files.RECORD,
               launch_files.FOLDER)  # never links (the installers' ``current`` link is theirs, and kept)


def _unlink_if_link(path: Path) -> int:
    """Remove ``path`` if it is a link (1), else leave it (0): a link in the cache is removed, never followed."""
    try:
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            return 0
        os.unlink(path)
    except FileNotFoundError:
        return 0
    log.warning("removed %s: a link inside the store (the store never follows links)", path)
    return 1


def _entries(folder: Path) -> list[os.DirEntry]:
    """The entries of a real folder (none when it is missing or a link)."""
    try:
        if os.path.islink(folder):
            return []
        with os.scandir(folder) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


class StoreLayout:
    """The paths, links, locks and record reads of one model's local store, in the folder ``root``."""

    root: Path

    def create(self) -> None:
        """Make the store's folders (the first run on a host does this under its lock).

        The cache is closed: a link where the store's folder, one of its folders or one of its state files
        should be is removed (never followed) before anything is created or read through it.
        """
        self.unlink_root_link()
        self.root.mkdir(parents=True, exist_ok=True)
        for name in _ROOT_FILES:
            _unlink_if_link(self.root / name)
        for sub in _FOLDERS:
            path = self.root / sub
            _unlink_if_link(path)
            path.mkdir(exist_ok=True)

    def unlink_root_link(self) -> None:
        """A link where the store's own folder should be is removed: nothing is created or locked through it."""
        _unlink_if_link(self.root)

    def scrub_links(self) -> int:
        """Remove every link planted inside the store's folders (and inside each checkpoint and artifact
        folder), so nothing the store reads, writes, renames or deletes is reached through one; returns how
        many were removed. One ``scandir`` per folder: a link is seen in the entry's type, with no extra call."""
        count = 0
        for sub in _FOLDERS:
            for entry in _entries(self.root / sub):
                if entry.is_symlink():
                    count += _unlink_if_link(Path(entry.path))
                elif sub in _CHECKPOINT_FOLDERS and entry.is_dir(follow_symlinks=False):
                    count += sum(_unlink_if_link(Path(inner.path)) for inner in _entries(Path(entry.path))
                                 if inner.is_symlink())
        launch = self.root / launch_files.FOLDER
        count += sum(_unlink_if_link(Path(e.path)) for e in _entries(launch) if e.is_symlink())
        return count

    def contains(self, path: Path) -> bool:
        """True if ``path`` lies strictly inside the store and no folder between the store and it is a link:
        what the store may delete or rename."""
        path = Path(os.path.normpath(path))
        try:
            relative = path.relative_to(self.root)
        except ValueError:
            return False
        if not relative.parts or ".." in relative.parts:
            return False
        folder = self.root
        for part in relative.parts[:-1]:
            folder = folder / part
            if os.path.islink(folder):
                return False
        return True

    def remove_inside(self, path: Path) -> None:
        """``remove_tree(path)`` for a path inside the store only (a link there is unlinked, not followed)."""
        if not self.contains(path):
            raise StoreError("refusing to remove a path outside the store (or reached through a link)",
                             local_file=str(path))
        remove_tree(path)

    @property
    def exists(self) -> bool:
        return self.root.is_dir()

    def pristine(self) -> bool:
        """True if nothing was ever stored here: only the lock file and empty folders."""
        for entry in os.scandir(self.root):
            if entry.is_dir(follow_symlinks=False):
                if any(os.scandir(entry.path)):
                    return False
            elif entry.name != "lock":
                return False
        return True

    # -- paths --------------------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def active_path(self) -> Path:
        return self.root / "active.json"

    @property
    def poisoned_path(self) -> Path:
        return self.root / "poisoned.json"

    @property
    def catalog_dir(self) -> Path:
        return self.root / "catalog"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    def full_dir(self, version: str) -> Path:
        return self.root / "full" / version

    def delta_dir(self, version: str) -> Path:
        return self.root / "deltas" / version

    def materialized_dir(self, version: str) -> Path:
        return self.root / "materialized" / version

    def _verified_path(self, version: str) -> Path:
        return self.root / "verified" / f"{version}.json"

    def _chain_path(self, version: str) -> Path:
        return self.root / "chains" / f"{version}.json"

    def staging(self, label: str) -> Path:
        """A new folder name under ``tmp/`` that belongs to this process (its creator removes it on failure)."""
        return self.tmp_dir / temp_name(label)

    def relative(self, path: Path) -> str:
        return str(Path(path).relative_to(self.root))

    def absolute(self, relative: str) -> Path:
        return self.root / relative

    # -- locks --------------------------------------------------------------------------

    def exclusive(self, timeout_s: float, what: str = "preparation", stop=None) -> StoreLock:
        self.unlink_root_link()  # the lock file is never created through a link
        return StoreLock(self.root / "lock", exclusive=True, timeout_s=timeout_s, what=what, stop=stop)

    def shared(self, timeout_s: float, what: str = "installation", stop=None) -> StoreLock:
        self.unlink_root_link()
        return StoreLock(self.root / "lock", exclusive=False, timeout_s=timeout_s, what=what, stop=stop)

    def _flushed_path(self, version: str) -> Path:
        return self.root / "flushed" / f"{version}.json"

    # -- reading ------------------------------------------------------------------------

    def state(self) -> StoreState | None:
        return read_record(StoreState, self.state_path)

    def active(self) -> ActiveIdentity | None:
        return read_record(ActiveIdentity, self.active_path)

    def poisoned(self) -> PoisonedMark | None:
        mark = read_record(PoisonedMark, self.poisoned_path)
        return replace(mark, engine_urls=tuple(mark.engine_urls)) if mark is not None else None

    def chain(self, version: str) -> Chain | None:
        chain = read_record(Chain, self._chain_path(version))
        return replace(chain, deltas=tuple(chain.deltas)) if chain is not None else None

    def files_match(self, relative: str, files: dict) -> bool:
        folder = self.absolute(relative)
        try:
            return folder.is_dir() and folder_identity(folder) == files
        except FileNotFoundError:
            return False


class _VerifiedMemo:
    """``read_record(VerifiedCheckpoint, path)``, parsed again only when the file changed.

    A verified record holds a checksum per tensor (at 92k tensors 6 MB of JSON, about 60 ms to parse and
    validate) and one refit reads the same two or three records about twenty times (recovery, inventory,
    current, install, activate, its report). A parsed record is kept while its file's identity (device,
    inode, size, modification and change times to the nanosecond) is unchanged: records are replaced by an
    atomic rename (a new inode), so a rewritten or restored file is parsed again. It lives as long as its
    ``LocalStore`` (one run's) and keeps at most ``MAX`` records.
    """

    MAX = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, tuple[tuple, VerifiedCheckpoint]] = {}  # path -> (identity, record), newest last

    def read(self, path: Path) -> VerifiedCheckpoint | None:
        key = str(path)
        try:
            info = os.stat(path)
        except OSError:
            return read_record(VerifiedCheckpoint, path)  # absent (None) or unreadable (its typed error)
        identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        with self._lock:
            known = self._known.get(key)
        if known is not None and known[0] == identity:
            return known[1]
        record = read_record(VerifiedCheckpoint, path)
        if record is not None:
            with self._lock:
                self._known.pop(key, None)
                self._known[key] = (identity, record)
                while len(self._known) > self.MAX:
                    self._known.pop(next(iter(self._known)))
        return record
