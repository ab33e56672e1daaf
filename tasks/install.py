"""Stage 7, install: load the verified checkpoint into the engine, inside the installation fence."""

from __future__ import annotations

from dataclasses import dataclass

from storage.errors import InstallError, PoisonedError, ReceiverPoisoned
from storage.killpoints import killpoint
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


def install(rx: Receiver, target: VerifiedTarget) -> InstallReceipt:
    """Install ``target`` with the run's installer (call holding the shared store lock)."""
    return install_checkpoint(rx.store, rx.installer, target, recover_hint=recover_command(rx.params))


def install_checkpoint(store: LocalStore, installer, target: VerifiedTarget, *, recovering: bool = False,
                       recover_hint: str = "python -m flows.refit recover") -> InstallReceipt:
    """Install ``target`` with ``installer``; the fence (shared lock) is the caller's.

    Refuses while the receiver is poisoned (unless this is the recovery),
    re-validates that the prepared checkpoint is still the verified one, and
    marks the receiver poisoned durably — naming the installer and engines a
    recovery must go through — if the engine fails after mutation.
    """
    record = target.checkpoint
    poisoned = store.poisoned()
    if poisoned and not recovering:
        raise ReceiverPoisoned(
            f"the receiver is poisoned since a failed install of {poisoned.version} ({poisoned.reason}); "
            f"run `{recover_hint}` first",
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
    killpoint("install.before")
    try:
        outcome = installer.install(request)
    except PoisonedError as exc:
        store.mark_poisoned(str(exc), record.version, installer.name,
                            tuple(getattr(installer, "engine_urls", ()) or ()))
        raise exc.with_context(revision=record.version)
    except InstallError as exc:
        raise exc.with_context(revision=record.version)
    killpoint("install.after")
    return InstallReceipt(target, installer.name, outcome.detail)


def recover_command(params) -> str:
    """The command that recovers this node, as the operator types it."""
    return (f"python -m flows.refit recover --model {params.model} --cache-dir {params.cache_dir}")


INSTALL = Stage("install", install, retried=False)
