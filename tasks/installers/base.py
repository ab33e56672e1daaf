"""What every installer is: the request it gets, the outcome it returns, and the no-engine installer.

An installer's ``install`` either succeeds, raises ``InstallError`` when it
failed before the engine's weights were touched (the old version stays
active and healthy), or raises ``PoisonedError`` when weights may have been
partially written (the receiver refuses further installs until ``recover``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from storage.store.local_store import ActiveIdentity, LocalStore


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
class EngineReport:
    """What one engine says it runs: its ``version`` (SGLang's ``weight_version``; None: no answer)."""

    url: str
    version: str | None
    detail: str = ""  # the engine's model path, or why it did not answer


def engine_reports(installer) -> tuple[EngineReport, ...]:
    """``installer.observe()``; an installer of the caller's own without it reports no engine."""
    observe = getattr(installer, "observe", None)
    return tuple(observe()) if observe is not None else ()


def confirmed(reports: tuple[EngineReport, ...], version: str) -> bool:
    """Every engine runs ``version`` (an installer with no engine has nothing to disagree)."""
    return all(report.version == version for report in reports)


@dataclass(frozen=True)
class InstallOutcome:
    """What the engine(s) reported."""

    detail: str
    engines: tuple[str, ...] = ()


class Installer(Protocol):
    name: str
    engine_urls: tuple[str, ...]  # recorded with a poisoned mark: recovery goes through the same engines

    def install(self, request: InstallRequest) -> InstallOutcome: ...

    def is_current(self, identity: ActiveIdentity) -> bool:
        """True if the engine already runs ``identity`` (so installing again can be skipped)."""

    def observe(self) -> tuple[EngineReport, ...]:
        """What each engine runs now, as it reports it (the truth a node record and a skip rely on)."""


class NoEngineInstaller:
    """Prepare, verify and activate without an engine: records the installed identity only."""

    name = "none"
    engine_urls: tuple[str, ...] = ()

    def install(self, request: InstallRequest) -> InstallOutcome:
        return InstallOutcome(f"no engine: {request.version} recorded as installed from {request.path}")

    def is_current(self, identity: ActiveIdentity) -> bool:
        return True

    def observe(self) -> tuple[EngineReport, ...]:
        return ()
