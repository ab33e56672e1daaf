"""Installers: how a verified checkpoint gets into an inference engine.

An installer's ``install`` either succeeds, raises ``InstallError`` when it
failed before the engine's weights were touched (the old version stays
active and healthy), or raises ``PoisonedError`` when weights may have been
partially written (the receiver refuses further installs until ``recover``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from storage.local_store import ActiveIdentity, LocalStore
from storage.settings import InstallerSettings


@dataclass(frozen=True)
class InstallRequest:
    """What to install: a verified, READY checkpoint of the local store."""

    store: LocalStore
    version: str
    digest: str
    format_digest: str
    path: Path
    files: dict


@dataclass(frozen=True)
class InstallOutcome:
    """What the engine(s) reported."""

    detail: str
    engines: tuple[str, ...] = ()


class Installer(Protocol):
    name: str

    def install(self, request: InstallRequest) -> InstallOutcome: ...

    def is_current(self, identity: ActiveIdentity) -> bool:
        """True if the engine already runs ``identity`` (so installing again can be skipped)."""


class NoEngineInstaller:
    """Prepare, verify and activate without an engine: records the installed identity only."""

    name = "none"

    def install(self, request: InstallRequest) -> InstallOutcome:
        return InstallOutcome(f"no engine: {request.version} recorded as installed from {request.path}")

    def is_current(self, identity: ActiveIdentity) -> bool:
        return True


def make_installer(settings: InstallerSettings) -> Installer:
    """The installer ``settings.kind`` names."""
    if settings.kind == "none":
        return NoEngineInstaller()
    if settings.kind == "sglang":
        from tasks.installers.sglang import SGLangInstaller

        return SGLangInstaller(settings)
    if settings.kind == "sglang-disk":
        from tasks.installers.sglang import SGLangDiskInstaller

        return SGLangDiskInstaller(settings)
    raise ValueError(f"unknown installer {settings.kind!r}")
