"""The receiver's local checkpoint store, and the one place its state changes.

Its folders and files are listed in ``storage/store/layout.py`` (``StoreLayout``); free disk
space and the rollback reserve are in ``storage/store/capacity.py`` (``StoreCapacity``).

States and the named steps that move between them (``docs/format.md``)::

                    begin_update(v)                       commit_ready(record)
      READY(p) ────────────────────────▶ UPDATING(v, previous=p) ────────────────▶ READY(v)
         ▲  │ point_at(record)                 │        │ release_base(p): a takeover
         │  └──────────▶ READY(q)              │        │ forgets p before renaming it
         │                                     │ put_back(p, folder): undone takeover
         │            recover()                ▼
         └──────────────────────────── discard the half-written folder;
                                         READY at p, the active version, or the best left

      installed identity:  activate(v, installer) ─▶ active.json = v; poisoned mark cleared
      poisoned overlay:    mark_poisoned(v, installer) ─▶ poisoned.json (installs refused
                           until a re-install through that installer succeeds and activates)

Every transition is one of the methods named above; nothing else in the
project writes ``state.json``, ``verified/``, ``chains/``, ``active.json`` or
``poisoned.json``. Transitions that change a checkpoint's state are called
under the exclusive store lock; ``activate`` and ``mark_poisoned`` under the
shared one (the installation fence). A kill at any instant leaves files that
``recover`` turns back into a trustworthy state.

The transitions are this module's methods, in one place, so that nothing else in the project
can change the store's state; where its files are (``StoreLayout``) and how much disk an update
may use (``StoreCapacity``) are the base classes ``LocalStore`` extends, and change no state.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from storage.store import launch_files
from storage.durable import (
    atomic_write_json, boot_id, folder_identity, fsync_dir, fsync_files, is_temp_of_other_process, remove_tree,
    tree_size,
)
from storage.errors import Cancelled, InstallError, Interrupted, RefitError, StoreError
from storage.jsonio import bounded_json
from storage.runtime.killpoints import killpoint
from storage.store.capacity import RESERVE_FLOOR_BYTES, StoreCapacity  # noqa: F401  (re-exported)
from storage.store.layout import (  # noqa: F401  (re-exported: the layout was part of this module)
    _CHECKPOINT_FOLDERS, _FOLDERS, _ROOT_FILES, StoreLayout, _entries, _unlink_if_link, _VerifiedMemo,
)
from storage.store.locks import StoreLock  # noqa: F401  (re-exported)
from storage.store.records import (  # noqa: F401  (the records are part of the store's interface)
    READY, UPDATING, ActiveIdentity, Chain, FlushedMark, PoisonedMark, StoreState, VerifiedCheckpoint, now_ms,
    read_record, store_folder_name,
)

log = logging.getLogger("canonical_refit.store")


def _labelled_files(record: dict) -> dict:
    """A record as ``status`` prints it: each file's identity as ``{"size", "mtime_ns"}`` (on disk, a pair)."""
    files = record.get("files") or {}
    return record | {"files": {name: {"size": size, "mtime_ns": mtime} for name, (size, mtime) in files.items()}}


class LocalStore(StoreCapacity):
    """The records and transitions of one model's local store (its paths and locks: ``StoreLayout``; its
    disk space: ``StoreCapacity``)."""

    def __init__(self, cache_dir: Path, model: str, *, quota_bytes: int = 500 * 10**9, create: bool = True):
        if quota_bytes <= 0:
            raise StoreError(f"cache quota must be positive, got {quota_bytes} bytes")
        self.model = model
        self.root = Path(cache_dir).expanduser().resolve() / store_folder_name(model)
        self.quota_bytes = quota_bytes
        self._verified_memo = _VerifiedMemo()  # records parsed by this store object (one run's)
        if create:
            self.create()

    def verified(self, version: str, *, check_files: bool = True) -> VerifiedCheckpoint | None:
        """The verified record of ``version`` if its files are unchanged and trusted, else None.

        A checkpoint verified before a restart whose bytes were not yet known
        to be on disk is not trusted until ``recover`` has re-hashed it.
        """
        record = self._verified_memo.read(self._verified_path(version))
        if record is None:
            return None
        if not record.flushed and self._flushed_mark(version) == record.files:
            record = replace(record, flushed=True)
        if check_files and (not record.trusted or not self.files_match(record.path, record.files)):
            return None
        return record

    def inventory(self) -> dict[str, VerifiedCheckpoint]:
        """Every verified checkpoint whose files are intact, by version."""
        state = self.state()
        updating = state.source if state is not None and state.status == UPDATING else None
        out = {}
        for path in sorted((self.root / "verified").glob("*.json")):
            record = self.verified(path.stem)
            if record is not None and record.path != updating:
                out[record.version] = record
        return out

    def current(self) -> VerifiedCheckpoint | None:
        """The verified checkpoint ``state.json`` points at, if READY and intact."""
        state = self.state()
        if state is None or state.status != READY or state.version is None:
            return None
        record = self.verified(state.version)
        if record is None or record.path != state.source:
            return None
        return record

    def describe(self) -> dict:
        """Everything ``flows.refit status`` prints."""
        state, active, poisoned = self.state(), self.active(), self.poisoned()
        return {
            "store": str(self.root),
            "state": _labelled_files(asdict(state)) if state else None,
            "active": _labelled_files(asdict(active)) if active else None,
            # False when the installed identity's folder is gone or changed (e.g. a rollback could not rebuild
            # it on a full disk): the engine may still run those weights; the next refit installs a new version
            "active_on_disk": self.files_match(active.path, active.files) if active and active.path else None,
            "disk_free_bytes": self.free_bytes(),
            "poisoned": asdict(poisoned) if poisoned else None,
            "installing": asdict(fence) if (fence := self.fence()) else None,
            "verified": sorted(self.inventory()),
            "launch_files": launch_files.describe(self.root),
            "bytes": tree_size(self.root),
            "quota_bytes": self.quota_bytes,
        }

    # -- transitions of the prepared checkpoint (exclusive lock) ----------------------------------

    def _write_record(self, path: Path, value: dict, *, revision: str | None, what: str) -> None:
        """Replace one small state file atomically; a failed write (ENOSPC, EIO) is a ``StoreError`` naming
        the file, and the old file is still whole (temporary file, fsync, rename)."""
        try:
            atomic_write_json(path, value)
        except OSError as exc:
            raise StoreError(f"could not write {what} ({exc})", revision=revision, file=str(path)) from exc

    def _write_state(self, state: StoreState) -> None:
        try:
            atomic_write_json(self.state_path, asdict(state) | {"updated_at_unix_ms": now_ms()})
        except OSError as exc:  # e.g. ENOSPC: the old state.json is still in place (atomic replace)
            raise StoreError(f"could not write the store state ({exc})", revision=state.version,
                             file=str(self.state_path)) from exc

    def begin_update(self, version: str, folder: Path, previous: str | None) -> None:
        """READY → UPDATING: durably record that ``folder`` is about to change, before its first byte does."""
        self._write_state(StoreState(UPDATING, version, {}, self.relative(folder), previous))
        killpoint("state.updating")

    def release_base(self, version: str) -> None:
        """Inside UPDATING: forget the base about to be taken over by rename (its bytes will change)."""
        self._forget(version)
        killpoint("apply.base_released")

    def commit_ready(self, record: VerifiedCheckpoint, chain: Chain) -> None:
        """UPDATING → READY(v): the verified record and how to rebuild it, then the state, all durable."""
        try:
            self._flushed_path(record.version).unlink(missing_ok=True)  # it vouched for an older record's files
            # the checksums as they are (str -> str), not deep-copied by asdict: a tensor's cost, 100k of them
            atomic_write_json(self._verified_path(record.version),
                              asdict(replace(record, checksums={})) | {"checksums": record.checksums})
            atomic_write_json(self._chain_path(chain.version),
                              {"version": chain.version, "full_version": chain.full_version,
                               "deltas": list(chain.deltas)})
        except OSError as exc:  # e.g. ENOSPC: typed, so the run restores the previous checkpoint
            raise StoreError(f"could not record the verified checkpoint ({exc})", revision=record.version,
                             file=str(self.absolute(record.path)), mutation_started=True) from exc
        killpoint("verify.recorded")
        try:
            self._write_state(StoreState(READY, record.version, record.files, record.path))
        except StoreError as exc:  # still UPDATING over changed bytes: the run rolls back
            exc.mutation_started = True
            raise
        self.release_reserve()  # committed: no rollback can follow

    def mark_flushed(self, record: VerifiedCheckpoint) -> bool:
        """Note that ``record``'s bytes reached the disk (after an fsync of its files); False if it changed since.

        Needs no lock, so a background flush never waits for (or gives up on)
        a busy store: the mark, ``flushed/{v}.json``, names the files'
        identity it vouches for and counts only while the verified record names
        the same one; a takeover that patches the files changes their identity,
        and a new record of the version drops the old mark.
        """
        current = read_record(VerifiedCheckpoint, self._verified_path(record.version))
        if current is None or current.flushed or (current.path, current.files) != (record.path, record.files):
            return False
        if not self.files_match(current.path, current.files):
            return False
        atomic_write_json(self._flushed_path(current.version), {"files": current.files})
        return True

    def _flushed_mark(self, version: str) -> dict | None:
        try:
            mark = bounded_json.read_record(self._flushed_path(version), FlushedMark, bounded_json.STORE_RECORD,
                                            error=StoreError, missing_ok=True, hint="; it vouches for nothing")
        except StoreError as exc:  # torn or hostile: the checkpoint is re-hashed after a restart, as if unflushed
            log.warning("%s", exc)
            return None
        return None if mark is None else mark.files

    def point_at(self, record: VerifiedCheckpoint) -> None:
        """READY → READY(v): make an intact verified checkpoint the current one (no bytes change)."""
        self._write_state(StoreState(READY, record.version, record.files, record.path))

    def put_back(self, base: VerifiedCheckpoint, folder: Path) -> VerifiedCheckpoint:
        """UPDATING → READY(base): a taken-over base whose patched bytes were undone and re-verified.

        Renames ``folder`` back, re-records the base with the files' new
        identity, repoints an installed identity that names those bytes.
        """
        base_path = self.absolute(base.path)
        os.rename(folder, base_path)
        fsync_dir(base_path.parent)
        restored = replace(base, files=folder_identity(base_path), verified_at_unix_ms=now_ms(), boot_id=boot_id(),
                           flushed=False)  # the undone bytes are in the page cache
        self._write_record(self._verified_path(restored.version), asdict(restored), revision=restored.version,
                           what="the verified record of the restored checkpoint")
        self.follow_active(restored)
        self.point_at(restored)
        return restored

    def follow_active(self, record: VerifiedCheckpoint) -> None:
        """If the engine runs ``record``'s bytes, the installed identity must name the files now holding them."""
        active = self.active()
        if active is not None and (active.version, active.digest) == (record.version, record.target_digest):
            self._write_record(self.active_path, asdict(replace(active, path=record.path, files=record.files)),
                               revision=record.version, what="the installed identity")

    def evict(self, version: str, folder: Path) -> None:
        """Remove a cached folder to make room; a checkpoint's verified record goes first."""
        record = self.verified(version, check_files=False)
        if record is not None and record.path == self.relative(folder):
            self._forget(version)
        self.remove_inside(folder)
        (folder.parent / f"{version}.source.json").unlink(missing_ok=True)

    def _forget(self, version: str) -> None:
        path = self._verified_path(version)
        self._flushed_path(version).unlink(missing_ok=True)
        if path.exists():
            path.unlink()
            fsync_dir(path.parent)

    # -- the installed identity (shared lock: the installation fence) --------------------------

    def activate(self, version: str, installer: str) -> ActiveIdentity:
        """Record that the engine now runs the prepared checkpoint ``version``; clear a poisoned mark."""
        record = self.current()
        if record is None or record.version != version:
            prepared = record.version if record is not None else "no verified checkpoint"
            raise InstallError(f"cannot activate {version}: the prepared checkpoint is {prepared}; only the "
                               f"checkpoint the last refit installed can be activated (run a refit to "
                               f"{version} to install it)", revision=version, file=str(self.state_path))
        identity = ActiveIdentity(
            version=record.version, digest=record.target_digest, format_digest=record.format_digest,
            files=record.files, path=record.path, installer=installer, installed_at_unix_ms=now_ms(),
            launch_files=record.launch_files,
        )
        self._write_record(self.active_path, asdict(identity), revision=version, what="the installed identity")
        killpoint("activate.written", version)
        self.clear_poisoned()
        return identity

    def mark_poisoned(self, reason: str, version: str | None, installer: str,
                      engine_urls: tuple[str, ...] = ()) -> PoisonedMark:
        """The engine may hold partial weights: refuse installs until a re-install through ``installer``."""
        mark = PoisonedMark(reason, version, installer, tuple(engine_urls), now_ms())
        self._write_record(self.poisoned_path, asdict(mark) | {"engine_urls": list(mark.engine_urls)},
                           revision=version, what="the poisoned mark")
        self.lift_fence()  # the mark says everything the fence did, and more
        return mark

    # -- the install fence: an install in progress, durably -----------------------------------------

    @property
    def fence_path(self) -> Path:
        return self.root / "installing.json"

    def fence_install(self, version: str, installer: str, engine_urls: tuple[str, ...] = ()) -> PoisonedMark:
        """Before the first engine is called: durably note that ``version`` is being installed (a process killed
        inside the install leaves the engines possibly mixed; the next run re-installs first)."""
        fence = PoisonedMark(f"installing {version}", version, installer, tuple(engine_urls), now_ms())
        self._write_record(self.fence_path, asdict(fence) | {"engine_urls": list(fence.engine_urls)},
                           revision=version, what="the install fence")
        return fence

    def lift_fence(self) -> None:
        """Every engine confirmed (or none was touched): the install is over."""
        if self.fence_path.exists():
            self.fence_path.unlink()
            fsync_dir(self.root)

    def fence(self) -> PoisonedMark | None:
        """The install in progress when its process ended, if any."""
        return read_record(PoisonedMark, self.fence_path)

    def clear_poisoned(self) -> None:
        if self.poisoned_path.exists():
            self.poisoned_path.unlink()
            fsync_dir(self.root)

    # -- recovery -----------------------------------------------------------------------------

    def recover(self, *, workers: int = 4, stop=None,
                progress: Callable[[str, int], Callable[[int], None]] | None = None) -> list[str]:
        """Bring the store back to a trustworthy state; call under the exclusive lock, nothing else running.

        A checkpoint left ``UPDATING`` is discarded (never trusted), verified
        records whose files changed are forgotten, and folders nothing vouches
        for (half-copied, renamed mid-takeover) are removed. Temporary files
        of other processes (a killed writer's) are swept; this process's own
        are not, so a recovery can never pull a file from under a live write
        of its own run. The state then points at the best verified checkpoint
        still intact. Returns what was done, in words, for the run's log.
        Re-hashing a checkpoint after a restart uses ``workers`` threads,
        stops with ``stop`` (the record stays untrusted: the next run re-hashes
        it) and reports to ``progress(label, total)``.
        """
        actions: list[str] = []
        self.release_reserve()  # a recovery is a rollback's first write: its blocks are free again
        self.create()
        links = self.scrub_links()
        if links:
            actions.append(f"removed {links} link(s) found inside the store (links are never followed)")
        for entry in _entries(self.tmp_dir):
            if is_temp_of_other_process(entry.name):
                self.remove_inside(Path(entry.path))
        swept = self._sweep_temp_files()
        if swept:
            actions.append(f"removed {swept} temporary file(s) left by an interrupted write")
        state = self.state()
        if state is not None and state.status == UPDATING:
            if state.source:
                folder = self.absolute(state.source)
                if self.contains(folder):
                    remove_tree(folder)
                else:  # a state file naming a path outside the store: nothing outside is ever deleted
                    log.warning("not removing %s: outside the store", folder)
                if state.version:
                    self._forget(state.version)
            actions.append(f"discarded the half-written checkpoint of {state.version} ({state.source})")
            killpoint("recover.discarded")
        for path in sorted((self.root / "verified").glob("*.json")):
            record = self.verified(path.stem, check_files=False)
            if record is not None and not record.trusted and self.files_match(record.path, record.files):
                actions.append(self._reverify(record, workers=workers, stop=stop, progress=progress))
            if self.verified(path.stem) is None:
                self._forget(path.stem)
                actions.append(f"forgot {path.stem}: its files changed outside the receiver or are missing")
        trusted = {record.path for record in self.inventory().values()}
        for folder in sorted(Path(e.path) for e in _entries(self.root / "materialized")):
            rel = self.relative(folder)
            if rel not in trusted:
                self.remove_inside(folder)
                actions.append(f"removed {rel}: no verified record vouches for it")
        self._repoint_state(state)
        return actions

    def _reverify(self, record: VerifiedCheckpoint, *, workers: int, stop, progress) -> str:
        """A checkpoint verified before a restart, never known to be on disk: re-hash it before trusting it."""
        from storage.format.checkpoint import CheckpointIndex

        folder = self.absolute(record.path)
        try:
            index = CheckpointIndex.open(folder, revision=record.version)
            report = progress(f"reverify {record.version}", index.nbytes) if progress else None
            same = index.checksums(record.checksum_format, workers=workers, progress=report,
                                   stop=stop) == record.checksums
        except (Interrupted, Cancelled):
            raise  # stopped: still untrusted, the next run re-hashes it
        except (OSError, ValueError, RefitError) as exc:
            same = False
            log.warning("could not re-verify %s after a restart: %s", record.version, exc)
        if not same:
            self._forget(record.version)
            return (f"forgot {record.version}: verified before a restart but not yet on disk, and its bytes no "
                    "longer match; it will be rebuilt")
        fsync_files(folder, record.files)
        trusted = replace(record, flushed=True, boot_id=boot_id())
        self._write_record(self._verified_path(record.version), asdict(trusted), revision=record.version,
                           what="the re-verified record")
        return f"re-verified {record.version} after a restart (its bytes were not known to be on disk)"

    def _sweep_temp_files(self) -> int:
        """Remove temporary files a killed writer left (other processes' only)."""
        folders = [self.root] + [self.root / sub for sub in ("full", "deltas", "verified", "flushed", "chains",
                                                             "catalog")]
        folders += [Path(e.path) for sub in ("full", "deltas") for e in _entries(self.root / sub)
                    if e.is_dir(follow_symlinks=False)]
        count = 0
        for folder in folders:
            for entry in _entries(folder):
                if not entry.is_dir(follow_symlinks=False) and is_temp_of_other_process(entry.name):
                    os.unlink(entry.path)  # a link is removed itself, never what it points at
                    count += 1
        return count

    def _repoint_state(self, before: StoreState | None) -> None:
        inventory = self.inventory()
        if before is not None and before.status == READY and before.version in inventory:
            current = inventory[before.version]
            if before.source == current.path and before.files == current.files:
                return
        active = self.active()
        candidates = []
        for name in (before.previous if before else None, active.version if active else None):
            if name in inventory:
                candidates.append(inventory[name])
        if not candidates and inventory:
            candidates = sorted(inventory.values(), key=lambda r: (r.sequence, r.verified_at_unix_ms))[-1:]
        if candidates:
            self.point_at(candidates[0])
            log.info("store %s: current checkpoint is now %s", self.root, candidates[0].version)
        elif before is not None:
            self._write_state(StoreState(READY, None))


