"""The receiver's local checkpoint store (SPEC section 7).

One folder per model, laid out so a person can inspect it with ``ls`` and
``cat``; every state file is small JSON written atomically and durably::

    state.json            status (READY/UPDATING) of the current prepared checkpoint
    active.json           identity of what the engine runs
    poisoned.json         present while the engine may hold partial weights
    full/{v}/             immutable full checkpoints (launch snapshot, full revisions)
    full/{v}.source.json  where a full artifact came from, and its files' identity
    deltas/{v}/           immutable downloaded delta artifacts (index + buckets)
    deltas/{v}.source.json
    materialized/{v}/     the mutable checkpoint reconstructed for a delta revision
    chains/{v}.json       how to rebuild {v}: its full version and deltas
    verified/{v}.json     digests, per-tensor checksums and file identity of a verified checkpoint
    catalog/{v}.json      memo of immutable catalog records
    tmp/                  staging for downloads and copies (cleared on recovery)
    lock                  the fcntl lock file
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from storage.durable import atomic_write_json, folder_identity, fsync_dir, read_json_file, remove_tree, tree_size
from storage.errors import StoreError
from storage.killpoints import killpoint
from storage.locks import StoreLock

log = logging.getLogger("canonical_refit.store")

READY, UPDATING = "READY", "UPDATING"


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class StoreState:
    """Contents of ``state.json``: the current prepared checkpoint and whether it is trustworthy."""

    status: str
    version: str | None
    files: dict = field(default_factory=dict)
    source: str | None = None  # checkpoint folder, relative to the store root
    previous: str | None = None  # last verified version while UPDATING
    updated_at_unix_ms: int = 0


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """Contents of ``verified/{v}.json``: what was verified, and how to tell it is unchanged."""

    version: str
    path: str
    sequence: int
    checksum_format: str
    format_digest: str
    target_digest: str
    checksums: dict
    files: dict
    verified_at_unix_ms: int = 0


@dataclass(frozen=True)
class ActiveIdentity:
    """Contents of ``active.json``: the installed identity."""

    version: str
    digest: str
    format_digest: str
    files: dict
    path: str
    installer: str
    installed_at_unix_ms: int


@dataclass(frozen=True)
class Chain:
    """Contents of ``chains/{v}.json``: rebuild {v} by copying ``full_version`` and applying ``deltas``."""

    version: str
    full_version: str
    deltas: tuple[str, ...] = ()


def store_folder_name(model: str) -> str:
    return model.replace("/", "--")


class LocalStore:
    """Paths, state records and locks of one model's local store."""

    def __init__(self, cache_dir: Path, model: str, *, quota_bytes: int = 500 * 10**9):
        if quota_bytes <= 0:
            raise StoreError(f"cache quota must be positive, got {quota_bytes} bytes")
        self.model = model
        self.root = Path(cache_dir).expanduser().resolve() / store_folder_name(model)
        self.quota_bytes = quota_bytes
        for sub in ("full", "deltas", "materialized", "chains", "verified", "catalog", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

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

    def relative(self, path: Path) -> str:
        return str(Path(path).relative_to(self.root))

    def absolute(self, relative: str) -> Path:
        return self.root / relative

    # -- locks --------------------------------------------------------------------------

    def exclusive(self, timeout_s: float, what: str = "preparation") -> StoreLock:
        return StoreLock(self.root / "lock", exclusive=True, timeout_s=timeout_s, what=what)

    def shared(self, timeout_s: float, what: str = "installation") -> StoreLock:
        return StoreLock(self.root / "lock", exclusive=False, timeout_s=timeout_s, what=what)

    # -- state.json -----------------------------------------------------------------------

    def state(self) -> StoreState | None:
        raw = read_json_file(self.state_path)
        return StoreState(**raw) if isinstance(raw, dict) else None

    def write_state(self, state: StoreState) -> None:
        try:
            atomic_write_json(self.state_path, asdict(state) | {"updated_at_unix_ms": now_ms()})
        except OSError as exc:  # e.g. ENOSPC: the old state.json is still in place (atomic replace)
            raise StoreError(f"could not write the store state ({exc})", revision=state.version,
                             file=str(self.state_path)) from exc

    def mark_updating(self, version: str, source: Path, previous: str | None) -> None:
        """Durably record that ``source`` is about to change (before its first byte does)."""
        self.write_state(StoreState(UPDATING, version, {}, self.relative(source), previous))
        killpoint("state.updating")

    def mark_ready(self, checkpoint: VerifiedCheckpoint) -> None:
        self.write_state(StoreState(READY, checkpoint.version, checkpoint.files, checkpoint.path))

    # -- verified checkpoints -----------------------------------------------------------------

    def _verified_path(self, version: str) -> Path:
        return self.root / "verified" / f"{version}.json"

    def record_verified(self, checkpoint: VerifiedCheckpoint) -> None:
        atomic_write_json(self._verified_path(checkpoint.version), asdict(checkpoint))

    def forget_verified(self, version: str) -> None:
        path = self._verified_path(version)
        if path.exists():
            path.unlink()
            fsync_dir(path.parent)

    def verified(self, version: str, *, check_files: bool = True) -> VerifiedCheckpoint | None:
        """The verified record of ``version`` if its files are unchanged, else None."""
        raw = read_json_file(self._verified_path(version))
        if not isinstance(raw, dict):
            return None
        try:
            record = VerifiedCheckpoint(**raw)
        except TypeError:
            return None
        if check_files and not self.files_match(record.path, record.files):
            return None
        return record

    def files_match(self, relative: str, files: dict) -> bool:
        folder = self.absolute(relative)
        try:
            return folder.is_dir() and folder_identity(folder) == files
        except FileNotFoundError:
            return False

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

    # -- chains -------------------------------------------------------------------------------

    def write_chain(self, chain: Chain) -> None:
        atomic_write_json(self.root / "chains" / f"{chain.version}.json",
                          {"version": chain.version, "full_version": chain.full_version,
                           "deltas": list(chain.deltas)})

    def chain(self, version: str) -> Chain | None:
        raw = read_json_file(self.root / "chains" / f"{version}.json")
        if not isinstance(raw, dict):
            return None
        return Chain(raw["version"], raw["full_version"], tuple(raw.get("deltas", ())))

    # -- installed identity and poisoning -----------------------------------------------------------

    def active(self) -> ActiveIdentity | None:
        raw = read_json_file(self.active_path)
        return ActiveIdentity(**raw) if isinstance(raw, dict) else None

    def write_active(self, identity: ActiveIdentity) -> None:
        atomic_write_json(self.active_path, asdict(identity))

    def poisoned(self) -> dict | None:
        raw = read_json_file(self.poisoned_path)
        return raw if isinstance(raw, dict) else None

    def mark_poisoned(self, reason: str, version: str | None, installer: str) -> None:
        atomic_write_json(self.poisoned_path, {"reason": reason, "version": version, "installer": installer,
                                               "since_unix_ms": now_ms()})

    def clear_poisoned(self) -> None:
        if self.poisoned_path.exists():
            self.poisoned_path.unlink()
            fsync_dir(self.root)

    # -- recovery -----------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Bring the store back to a trustworthy state; call under the exclusive lock.

        A checkpoint left ``UPDATING`` is discarded (never trusted), verified
        records whose files changed are forgotten, and folders nothing
        vouches for (half-copied, renamed mid-takeover) are removed. The state
        then points at the best verified checkpoint still intact. Returns what
        was done, in words, for the run's log.
        """
        actions: list[str] = []
        remove_tree(self.tmp_dir)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        swept = self._sweep_temp_files()
        if swept:
            actions.append(f"removed {swept} temporary file(s) left by an interrupted write or download")
        state = self.state()
        if state is not None and state.status == UPDATING:
            if state.source:
                remove_tree(self.absolute(state.source))
                if state.version:
                    self.forget_verified(state.version)
            actions.append(f"discarded the half-written checkpoint of {state.version} ({state.source})")
            killpoint("recover.discarded")
        for path in sorted((self.root / "verified").glob("*.json")):
            raw = read_json_file(path)
            record = self.verified(path.stem)
            if record is None and isinstance(raw, dict):
                self.forget_verified(path.stem)
                actions.append(f"forgot {path.stem}: its files changed outside the receiver or are missing")
        trusted = {record.path for record in self.inventory().values()}
        for folder in sorted((self.root / "materialized").iterdir()):
            rel = self.relative(folder)
            if rel not in trusted:
                remove_tree(folder)
                actions.append(f"removed {rel}: no verified record vouches for it")
        self._repoint_state(state)
        return actions

    def _sweep_temp_files(self) -> int:
        """Remove ``.{name}.{id}.tmp`` / ``.part`` files that a killed writer left (exclusive lock held)."""
        folders = [self.root] + [self.root / sub for sub in ("full", "deltas", "verified", "chains", "catalog")]
        folders += [p for sub in ("full", "deltas") for p in (self.root / sub).iterdir() if p.is_dir()]
        count = 0
        for folder in folders:
            for entry in os.scandir(folder):
                if entry.name.startswith(".") and entry.name.endswith((".tmp", ".part")) and entry.is_file():
                    os.unlink(entry.path)
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
            self.mark_ready(candidates[0])
            log.info("store %s: current checkpoint is now %s", self.root, candidates[0].version)
        elif before is not None:
            self.write_state(StoreState(READY, None))

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
        state, active = self.state(), self.active()
        return {
            "store": str(self.root),
            "state": asdict(state) if state else None,
            "active": asdict(active) if active else None,
            "poisoned": self.poisoned(),
            "verified": sorted(self.inventory()),
            "bytes": tree_size(self.root),
            "quota_bytes": self.quota_bytes,
        }

