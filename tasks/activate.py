"""Stage 8, activate: record the installed identity in active.json."""

from __future__ import annotations

from storage.errors import InstallError
from storage.killpoints import killpoint
from storage.local_store import ActiveIdentity, LocalStore, now_ms
from tasks.install import InstallReceipt
from tasks.receiver import Receiver
from tasks.stage import stage_task


def activate(rx: Receiver, receipt: InstallReceipt) -> ActiveIdentity:
    """Record what the engine now runs and clear a poisoned mark; a no-op for a skipped install.

    A skipped install keeps ``active.json`` only if it still names these very
    files: after a crash the same version may have been rebuilt into new files.
    """
    record = receipt.target.checkpoint
    if receipt.skipped:
        active = rx.store.active()
        if active is not None and (active.path, active.files) == (record.path, record.files):
            return active
    return record_active(rx.store, record.version, receipt.installer)


def record_active(store: LocalStore, version: str, installer: str) -> ActiveIdentity:
    """Write ``active.json`` for the verified checkpoint ``version`` that the engine has loaded."""
    record = store.verified(version)
    if record is None:
        raise InstallError("cannot activate: the checkpoint is no longer verified and intact", revision=version)
    identity = ActiveIdentity(
        version=record.version, digest=record.target_digest, format_digest=record.format_digest,
        files=record.files, path=record.path, installer=installer, installed_at_unix_ms=now_ms(),
    )
    store.write_active(identity)
    killpoint("activate.written")
    store.clear_poisoned()
    return identity


activate_task = stage_task("activate", activate, read_only=False)
