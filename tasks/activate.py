"""Stage 8, activate: record the installed identity in active.json."""

from __future__ import annotations

from storage.store.local_store import ActiveIdentity
from tasks.install import InstallReceipt
from tasks.receiver import Receiver
from tasks.stage import Stage


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
    return rx.store.activate(record.version, receipt.installer)


# once the engine runs the new weights, recording it must not be skipped by an interrupt
ACTIVATE = Stage("activate", activate, interruptible=False)
