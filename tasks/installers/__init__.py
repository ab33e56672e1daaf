"""Installers: how a verified checkpoint gets into an inference engine.

An installer's ``install`` either succeeds, raises ``InstallError`` when it
failed before the engine's weights were touched (the old version stays
active and healthy), or raises ``PoisonedError`` when weights may have been
partially written (the receiver refuses further installs until ``recover``).
"""

from __future__ import annotations

from storage.settings import InstallerSettings
from tasks.installers.base import InstallOutcome, InstallRequest, Installer, NoEngineInstaller

__all__ = ["InstallOutcome", "InstallRequest", "Installer", "NoEngineInstaller", "make_installer"]


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
