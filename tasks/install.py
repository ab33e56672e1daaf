"""Stage 7, install: load the verified checkpoint into the engine, inside the installation fence."""

from __future__ import annotations

from dataclasses import dataclass

from storage.errors import InstallError, PoisonedError, ReceiverPoisoned
from storage.runtime.killpoints import killpoint
from storage.store.local_store import LocalStore
from tasks.installers import InstallRequest
from tasks.receiver import Receiver
from tasks.stage import Stage
from tasks.verify_digest import VerifiedTarget


@dataclass(frozen=True)
class InstallReceipt:
    """An installed (not yet activated) checkpoint."""

    target: VerifiedTarget
    installer: str
    detail: str
    skipped: bool = False
    bytes: int = 0

    @property
    def summary(self) -> str:
        return self.detail


def install(rx: Receiver, target: VerifiedTarget, recover_hint: str) -> InstallReceipt:
    """Install ``target`` with the run's installer (call holding the shared store lock); ``recover_hint``: the
    command that recovers this node, as printed (``flows.outcome.recover_command``)."""
    return install_checkpoint(rx.store, rx.installer, target, recover_hint=recover_hint)


def install_checkpoint(store: LocalStore, installer, target: VerifiedTarget, *, recovering: bool = False,
                       recover_hint: str | None = None) -> InstallReceipt:
    """Install ``target`` with ``installer``; the fence (shared lock) is the caller's.

    Refuses while the receiver is poisoned (unless this is the recovery; the
    refusal names ``recover_hint``, the command that recovers this node),
    re-validates that the prepared checkpoint is still the verified one, and
    marks the receiver poisoned durably — naming the installer and engines a
    recovery must go through — if the engine fails after mutation.
    """
    record = target.checkpoint
    poisoned = store.poisoned()
    if poisoned and not recovering:
        raise ReceiverPoisoned(
            f"the receiver is poisoned since a failed install of {poisoned.version} ({poisoned.reason}); "
            f"run `{recover_hint or 'recover'}` first",
            revision=record.version, file=str(store.poisoned_path),
        )
    current = store.current()
    if current is None or current.version != record.version or current.files != record.files:
        raise InstallError("the prepared checkpoint changed after verification; nothing was installed",
                           revision=record.version, file=str(target.path))
    active = store.active()
    if (not recovering and active is not None and active.version == record.version
            and active.digest == record.target_digest and installer.is_current(active)):
        return InstallReceipt(target, installer.name, f"{record.version} is already installed", skipped=True)
    request = InstallRequest(store, record.version, record.target_digest, record.format_digest,
                             target.path, record.files)
    engines = tuple(getattr(installer, "engine_urls", ()) or ())
    killpoint("install.before")
    store.fence_install(record.version, installer.name, engines)  # before the first engine is called
    killpoint("install.fenced")
    try:
        outcome = installer.install(request)
    except PoisonedError as exc:
        store.mark_poisoned(str(exc), record.version, installer.name, engines)
        raise exc.with_context(revision=record.version)
    except InstallError as exc:  # refused before any weight was touched: nothing to fence
        store.lift_fence()
        raise exc.with_context(revision=record.version)
    store.lift_fence()  # every engine confirmed (an interrupt inside the install leaves the fence up)
    killpoint("install.after")
    return InstallReceipt(target, installer.name, outcome.detail)


def heal_interrupted_install(rx: Receiver, recover_hint: str) -> None:
    """First thing of a preparation: if a process ended inside an install, re-install through its installer.

    The engines may hold a mix of two versions. The version being installed
    is re-installed from its verified checkpoint (the one the engines may
    have been reading; nothing has touched it since) and activated, before
    recovery or anything else changes the store. Without a verified
    checkpoint left to install, the node is marked poisoned and the error names ``recover_hint`` (the command
    that recovers this node, ``flows.outcome.recover_command``).
    """
    fence = rx.store.fence()
    if fence is None:
        return
    installer = rx.installer
    if (installer.name, tuple(getattr(installer, "engine_urls", ()) or ())) != (fence.installer,
                                                                                tuple(fence.engine_urls)):
        from storage.settings import InstallerSettings
        from tasks.installers import make_installer

        installer = make_installer(InstallerSettings(kind=fence.installer, engine_urls=list(fence.engine_urls)))
    record = rx.store.verified(fence.version)
    if record is None:
        rx.store.mark_poisoned(f"an install of {fence.version} was interrupted and its verified checkpoint is gone",
                               fence.version, fence.installer, fence.engine_urls)
        raise ReceiverPoisoned(f"an install of {fence.version} was interrupted (its process ended inside it) and "
                               f"no verified checkpoint of it is left; run `{recover_hint}`",
                               revision=fence.version, file=str(rx.store.fence_path))
    rx.store.point_at(record)
    receipt = install_checkpoint(rx.store, installer, VerifiedTarget(record, rx.store.absolute(record.path)),
                                 recovering=True)
    rx.store.activate(record.version, receipt.installer)
    rx.ledger.note(f"an install of {fence.version} was interrupted (its process ended inside it): re-installed "
                   f"{record.version} through {receipt.installer} before anything else ({receipt.detail})")


INSTALL = Stage("install", install)
