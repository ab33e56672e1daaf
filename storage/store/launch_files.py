"""The launch snapshot's other files: ``config.json``, the tokenizer, the generation config.

An engine restarted on a prepared checkpoint needs more than the weights:
its ``config.json``, tokenizer files and generation config. A revision
carries only tensors, so the store keeps a copy of the launch snapshot's
non-weight files (``launch-files/``, with ``launch-files.json`` naming each
file's size and SHA-256) and carries them into every prepared checkpoint
before it is recorded as verified. Their identity, ``launch_files`` (the
digest below), is part of the verified record, the installed identity and
the node's status record.

``launch_files`` digest: ``"sha256:" + sha256(canonical JSON of {name:
sha256 hex of the file's bytes})`` over every carried file.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from storage.jsonio.bounded_json import STORE_RECORD, read_record
from storage.jsonio.canonical import canonical_json
from storage.durable import atomic_write_json, copy_file, fsync_dir, remove_tree
from storage.errors import StoreError

log = logging.getLogger("canonical_refit.store")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
FOLDER, RECORD = "launch-files", "launch-files.json"


def is_weight_file(name: str) -> bool:
    """Weights and their indexes (``*.safetensors``, ``*.bin``, ``model.safetensors.index.json``, ...)."""
    return name.endswith(WEIGHT_SUFFIXES)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class LaunchFiles:
    """The launch snapshot's non-weight files the store keeps: ``{name: [size, sha256]}`` and their digest.

    Also the strict record of ``launch-files.json`` (``{"version", "files"}``): a field of the wrong type or
    an unknown key is refused; the file is this store's own, and a refused one is only captured again."""

    version: str
    files: dict[str, Annotated[tuple[int, str], Field(strict=False)]]  # a JSON [size, sha256 hex], as a tuple

    @property
    def digest(self) -> str:
        return files_digest({name: sha for name, (_size, sha) in self.files.items()})


def files_digest(hashes: dict[str, str]) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(dict(sorted(hashes.items())))).hexdigest()


def snapshot_folder(seed: str | Path, *, revision: str) -> Path:
    """The launch snapshot folder ``seed`` resolved, and checked: every non-hidden entry in it is a regular
    file (a link to one is followed) or a folder. A FIFO, socket or device is refused without being opened
    (it could block the run), a link loop too; each as a ``StoreError`` naming the file and ``revision``."""
    try:
        folder = Path(seed).expanduser().resolve(strict=True)
    except FileNotFoundError:
        return Path(seed).expanduser().absolute()  # the caller says it is not a folder
    except (OSError, RuntimeError) as exc:  # RuntimeError: Python's word for a link loop
        raise StoreError(f"the launch snapshot folder cannot be resolved: {_why(exc)}", revision=revision,
                         local_file=str(seed)) from None
    if not folder.is_dir():
        return folder
    try:
        with os.scandir(folder) as it:
            entries = [e for e in it if not e.name.startswith(".")]
    except OSError as exc:
        raise StoreError(f"the launch snapshot folder cannot be listed: {_why(exc)}", revision=revision,
                         local_file=str(folder)) from None
    for entry in sorted(entries, key=lambda e: e.name):
        try:
            mode = os.stat(entry.path).st_mode  # through links: what a reader would open
        except FileNotFoundError:
            continue  # a dangling link: read by nothing
        except OSError as exc:
            raise StoreError(f"launch snapshot file cannot be read: {_why(exc)}", revision=revision,
                             local_file=entry.path) from None
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise StoreError(f"launch snapshot file is not a regular file ({_kind(mode)}); refused without "
                             "opening it", revision=revision, local_file=entry.path)
    return folder


def _why(exc: BaseException) -> str:
    if isinstance(exc, RuntimeError) or getattr(exc, "errno", None) == errno.ELOOP:
        return "a symbolic link loop"
    return f"{type(exc).__name__}: {exc}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"mode {mode:o}"


def non_weight_files(folder: Path) -> list[Path]:
    """Regular files directly in ``folder`` (links followed) that are not weights, by name."""
    return sorted(Path(e.path) for e in os.scandir(folder)
                  if e.is_file(follow_symlinks=True) and not e.name.startswith(".") and not is_weight_file(e.name))


def kept(root: Path) -> LaunchFiles | None:
    """The launch files the store at ``root`` keeps, or None (a store seeded before they were kept, or whose
    record is refused: logged, and captured again at the next seed)."""
    launch = read_launch_record(root)
    if launch is None or not all((root / FOLDER / name).is_file() for name in launch.files):
        return None
    return launch


def read_launch_record(root: Path) -> LaunchFiles | None:
    """``launch-files.json`` of the store at ``root`` as its strict record, or None if it is missing or refused
    (torn, hostile: the ``StoreError`` naming the file is logged; the next seed captures the files again)."""
    try:
        return read_record(root / RECORD, LaunchFiles, STORE_RECORD, error=StoreError, missing_ok=True,
                           hint="; the launch snapshot's files are captured again at the next seed")
    except StoreError as exc:
        log.warning("ignoring the store's record of the launch files: %s", exc)
        return None


def capture(root: Path, snapshot: Path, version: str) -> LaunchFiles:
    """Keep a copy of ``snapshot``'s non-weight files in the store at ``root`` (replacing an older copy)."""
    staging = root / f".{FOLDER}.{os.getpid()}"
    remove_tree(staging)
    staging.mkdir(parents=True)
    files = {}
    try:
        for path in non_weight_files(snapshot):
            copy_file(path, staging / path.name)
            files[path.name] = (os.path.getsize(staging / path.name), _sha256(staging / path.name))
        fsync_dir(staging)
        remove_tree(root / FOLDER)
        os.rename(staging, root / FOLDER)
        fsync_dir(root)
        atomic_write_json(root / RECORD, {"version": version, "files": {k: list(v) for k, v in files.items()}})
    except OSError as exc:
        remove_tree(staging)
        raise StoreError(f"could not keep the launch snapshot's non-weight files ({exc})", revision=version,
                         local_file=str(snapshot)) from exc
    return LaunchFiles(version, files)


def carry_into(root: Path, folder: Path, *, revision: str) -> str | None:
    """Put the kept launch files into the checkpoint ``folder`` (each copied only if missing or different);
    their digest, or None when the store keeps none."""
    launch = kept(root)
    if launch is None:
        return None
    try:
        for name, (size, sha) in sorted(launch.files.items()):
            target = folder / name
            if target.is_file() and not target.is_symlink() and os.path.getsize(target) == size \
                    and _sha256(target) == sha:
                continue
            temp = folder / f".{name}.{os.getpid()}.tmp"
            if os.path.islink(temp):  # a predictable name: a link planted there is removed, never written through
                os.unlink(temp)
            copy_file(root / FOLDER / name, temp)
            os.replace(temp, target)
        fsync_dir(folder)
    except OSError as exc:
        raise StoreError(f"could not carry the launch snapshot's non-weight files into the checkpoint ({exc})",
                         revision=revision, local_file=str(folder)) from exc
    return launch.digest


def describe(root: Path) -> dict | None:
    """What ``status`` prints of the kept launch files."""
    launch = kept(root)
    return None if launch is None else {"version": launch.version, "digest": launch.digest,
                                        "files": sorted(launch.files)}

