"""The records of the receiver's local store: each state file's contents, and how they are read.

``state.json`` (``StoreState``), ``verified/{v}.json`` (``VerifiedCheckpoint``),
``active.json`` (``ActiveIdentity``), ``poisoned.json`` (``PoisonedMark``) and
``chains/{v}.json`` (``Chain``). Only ``storage.store.local_store`` writes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

from storage.durable import boot_id, read_json_file
from storage.errors import StoreError

READY, UPDATING = "READY", "UPDATING"
T = TypeVar("T")


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
    boot_id: str | None = None  # the boot during which it was verified
    flushed: bool = True  # its bytes are known to be on disk (fsynced) — else trusted only in the same boot
    launch_files: str | None = None  # digest of the launch snapshot's non-weight files carried in (launch_files.py)

    @property
    def trusted(self) -> bool:
        """Its bytes may be used without re-hashing: they reached the disk, or the machine has not restarted."""
        return self.flushed or self.boot_id == boot_id()


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
    launch_files: str | None = None  # digest of the launch snapshot's non-weight files in the checkpoint


@dataclass(frozen=True)
class PoisonedMark:
    """Contents of ``poisoned.json``: why installs are refused, and the installer to recover through."""

    reason: str
    version: str | None
    installer: str
    engine_urls: tuple[str, ...] = ()
    since_unix_ms: int = 0


@dataclass(frozen=True)
class Chain:
    """Contents of ``chains/{v}.json``: rebuild {v} by copying ``full_version`` and applying ``deltas``."""

    version: str
    full_version: str
    deltas: tuple[str, ...] = ()


def store_folder_name(model: str) -> str:
    return model.replace("/", "--")


def read_record(cls: type[T], path: Path) -> T | None:
    """A state file parsed into ``cls``; None if absent; ``StoreError`` naming the file if malformed."""
    try:
        raw = read_json_file(path)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"state file is not valid JSON ({exc}); move it away and run `recover`",
                         local_file=str(path)) from None
    except OSError as exc:
        raise StoreError(f"state file cannot be read ({exc})", local_file=str(path)) from exc
    if raw is None:
        return None
    names = {f.name for f in fields(cls)}
    try:
        if not isinstance(raw, dict):
            raise TypeError(f"a JSON {type(raw).__name__}, not an object")
        value = cls(**{k: v for k, v in raw.items() if k in names})
    except TypeError as exc:
        raise StoreError(f"state file does not hold a {cls.__name__} record ({exc}); move it away and run "
                         "`recover`", local_file=str(path)) from None
    return value
