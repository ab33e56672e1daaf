"""The records of the receiver's local store: each state file's contents, and how they are read.

``state.json`` (``StoreState``), ``verified/{v}.json`` (``VerifiedCheckpoint``),
``active.json`` (``ActiveIdentity``), ``poisoned.json`` and ``installing.json``
(``PoisonedMark``) and ``chains/{v}.json`` (``Chain``). Only
``storage.store.local_store`` writes them.

Each is a strict, frozen pydantic dataclass: a value of the wrong JSON type
(``{"version": 3}``) is refused where the file is read, by a ``StoreError``
naming the file and the field, never coerced and never left to fail later.
A key the record does not know is ignored (a newer writer's); a field it
lacks takes its default (an older writer's, docs/format.md section 7).
Checksums are checked to be an object, not entry by entry: a record holds
one per tensor, and their values are compared, never computed with.
"""

from __future__ import annotations

import time
from dataclasses import field
from pathlib import Path
from typing import Annotated, TypeVar

from pydantic import ConfigDict, Field, InstanceOf
from pydantic.dataclasses import dataclass

from storage.jsonio.bounded_json import parse_record
from storage.durable import boot_id, read_json_file
from storage.errors import StoreError
from storage.format.status import READY, UPDATING, StoreStatus  # noqa: F401  (the store's statuses)

T = TypeVar("T")
STRICT = ConfigDict(strict=True, extra="ignore")
FileIdentity = Annotated[list[int], Field(min_length=2, max_length=2)]  # [size, mtime_ns]
Files = dict[str, FileIdentity]
Names = Annotated[tuple[str, ...], Field(strict=False)]  # a JSON array of strings, kept as a tuple


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, config=STRICT)
class StoreState:
    """Contents of ``state.json``: the current prepared checkpoint and whether it is trustworthy."""

    status: StoreStatus
    version: str | None
    files: Files = field(default_factory=dict)
    source: str | None = None  # checkpoint folder, relative to the store root
    previous: str | None = None  # last verified version while UPDATING
    updated_at_unix_ms: int = 0


@dataclass(frozen=True, config=STRICT)
class VerifiedCheckpoint:
    """Contents of ``verified/{v}.json``: what was verified, and how to tell it is unchanged."""

    version: str
    path: str
    sequence: int
    checksum_format: str
    format_digest: str
    target_digest: str
    checksums: InstanceOf[dict]  # tensor name -> checksum (one per tensor: checked to be an object only)
    files: Files
    verified_at_unix_ms: int = 0
    boot_id: str | None = None  # the boot during which it was verified
    flushed: bool = True  # its bytes are known to be on disk (fsynced) — else trusted only in the same boot
    launch_files: str | None = None  # digest of the launch snapshot's non-weight files carried in (launch_files.py)

    @property
    def trusted(self) -> bool:
        """Its bytes may be used without re-hashing: they reached the disk, or the machine has not restarted."""
        return self.flushed or self.boot_id == boot_id()


@dataclass(frozen=True, config=STRICT)
class ActiveIdentity:
    """Contents of ``active.json``: the installed identity."""

    version: str
    digest: str
    format_digest: str
    files: Files
    path: str
    installer: str
    installed_at_unix_ms: int
    launch_files: str | None = None  # digest of the launch snapshot's non-weight files in the checkpoint


@dataclass(frozen=True, config=STRICT)
class PoisonedMark:
    """Contents of ``poisoned.json``: why installs are refused, and the installer to recover through."""

    reason: str
    version: str | None
    installer: str
    engine_urls: Names = ()
    since_unix_ms: int = 0


@dataclass(frozen=True, config=STRICT)
class Chain:
    """Contents of ``chains/{v}.json``: rebuild {v} by copying ``full_version`` and applying ``deltas``."""

    version: str
    full_version: str
    deltas: Names = ()


@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class FlushedMark:
    """Contents of ``flushed/{v}.json``: the file identity whose bytes were written back to disk. Strict, no
    unknown key: a mark vouches for durability, so one this version cannot read whole vouches for nothing."""

    files: Files


def store_folder_name(model: str) -> str:
    return model.replace("/", "--")


def read_record(cls: type[T], path: Path) -> T | None:
    """A state file parsed into the strict record ``cls``; None if absent; ``StoreError`` naming the file (and
    the field) if it is not bounded JSON or not such a record."""
    try:
        raw = read_json_file(path)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"state file is not valid JSON ({exc}); move it away and run `recover`",
                         local_file=str(path)) from None
    except OSError as exc:
        raise StoreError(f"state file cannot be read ({exc})", local_file=str(path)) from exc
    if raw is None:
        return None
    return parse_record(cls, raw, error=StoreError, hint="; move it away and run `recover`", local_file=str(path))
