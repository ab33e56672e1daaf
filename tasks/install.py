"""Stage 7, install: load the verified checkpoint into the engine, inside the installation fence."""

from __future__ import annotations

from dataclasses import dataclass

from storage.errors import InstallError, PoisonedError, ReceiverPoisoned
from storage.killpoints import killpoint
from tasks.installers import InstallRequest
from tasks.receiver import Receiver
from tasks.stage import stage_task
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


def install(rx: Receiver, target: VerifiedTarget, *, recovering: bool = False) -> InstallReceipt:
    """Install ``target`` with the configured installer (call holding the shared store lock).

    Refuses while the receiver is poisoned (unless this is the recovery),
    re-validates that the prepared checkpoint is still the verified one, and
    marks the receiver poisoned durably if the engine fails after mutation.
    """
    installer, record = rx.installer, target.checkpoint
    poisoned = rx.store.poisoned()
    if poisoned and not recovering:
        raise ReceiverPoisoned(
            f"the receiver is poisoned since a failed install of {poisoned.get('version')} "
            f"({poisoned.get('reason')}); run `python -m flows.refit recover` first",
            revision=record.version, file=str(rx.store.poisoned_path),
        )
    current = rx.store.current()
    if current is None or current.version != record.version or current.files != record.files:
        raise InstallError("the prepared checkpoint changed after verification; nothing was installed",
                           revision=record.version, file=str(target.path))
    active = rx.store.active()
    if (not recovering and active is not None and active.version == record.version
            and active.digest == record.target_digest and installer.is_current(active)):
        return InstallReceipt(target, installer.name, f"{record.version} is already installed", skipped=True)
    request = InstallRequest(rx.store, record.version, record.target_digest, record.format_digest,
                             target.path, record.files)
    killpoint("install.before")
    try:
        outcome = installer.install(request)
    except PoisonedError as exc:
        rx.store.mark_poisoned(str(exc), record.version, installer.name)
        raise exc.with_context(revision=record.version)
    except InstallError as exc:
        raise exc.with_context(revision=record.version)
    killpoint("install.after")
    return InstallReceipt(target, installer.name, outcome.detail)


install_task = stage_task("install", install, read_only=False)


def recover(rx: Receiver) -> InstallReceipt:
    """Re-install the last verified checkpoint and clear the poisoned mark only if that succeeds.

    Tries the prepared target first, then the previously active version; the
    store lock is taken exclusively to repoint ``state.json`` and then held
    shared (the installation fence) while the engine loads.
    """
    from storage.errors import StoreError
    from tasks.activate import record_active

    with rx.store.exclusive(rx.params.lock_timeout_s, "recovery") as lock:
        for action in rx.store.recover():
            rx.ledger.note(f"recovery: {action}")
        active = rx.store.active()
        candidates = [rx.store.current()]
        if active is not None:
            candidates.append(rx.store.verified(active.version))
        record = next((c for c in candidates if c is not None), None)
        if record is None:
            raise StoreError("no verified checkpoint is left to re-install; run a refit to rebuild one, then "
                             "`recover` again", file=str(rx.store.root))
        rx.store.mark_ready(record)
        lock.downgrade()
        with rx.stage("install"):
            receipt = install(rx, VerifiedTarget(record, rx.store.absolute(record.path)), recovering=True)
        with rx.stage("activate"):
            record_active(rx.store, record.version, receipt.installer)
    rx.ledger.note(f"recovered: re-installed {record.version} and cleared the poisoned mark")
    return receipt
