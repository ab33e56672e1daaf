"""Stage 1, resolve catalog: the target record and the replay chain that reaches it."""

from __future__ import annotations

from dataclasses import dataclass

from storage.catalog.records import Revision
from storage.errors import LineageError, RefitError, RollbackRefused
from tasks.installers.base import engine_reports
from tasks.receiver import Receiver
from tasks.stage import Stage


@dataclass(frozen=True)
class ReplayPlan:
    """The target, the launch revision, and the lineage from a starting point to the target.

    ``lineage[0]`` is where reconstruction starts: a checkpoint already
    verified in the local store, a full revision, or the launch revision
    (seeded from the launch snapshot). Every later entry is an exact-base delta.
    """

    target: Revision | None
    initial: Revision | None
    lineage: tuple[Revision, ...]
    root_is_local: bool
    skip: str | None = None  # why there is nothing to do (the target is not newer, nothing is published)
    bytes: int = 0

    @property
    def root(self) -> Revision:
        return self.lineage[0]

    @property
    def deltas(self) -> tuple[Revision, ...]:
        return self.lineage[1:]

    @property
    def summary(self) -> str:
        if self.skip:
            return self.skip
        where = "local checkpoint" if self.root_is_local else self.root.payload_format
        return (f"target {self.target.version}: start from {self.root.version} ({where}), "
                f"replay {len(self.deltas)} delta(s)")


def resolve_catalog(rx: Receiver) -> ReplayPlan:
    """Read the target record and walk its bases back to something we can start from.

    Fails before any download if a link is wrong: a base that is missing, has
    another digest or layout, or a local checkpoint that is not the catalog's.
    """
    params = rx.params
    if params.target == "latest" and params.only_if_newer and rx.catalog.head() is None:
        reason = f"the catalog {rx.catalog.url} has no revisions of {params.model} yet; nothing to do"
        _note_quarantined(rx)
        rx.ledger.note(reason)
        return ReplayPlan(None, None, (), False, skip=reason)
    initial = rx.catalog.initial(params.initial_version)
    target = rx.catalog.resolve(params.target)
    if target.format_digest != initial.format_digest:
        raise LineageError(
            f"format_digest {target.format_digest} differs from the launch revision {initial.version}'s "
            f"{initial.format_digest}: the tensor layout must stay the same",
            revision=target.version, file=rx.catalog.record_url(target.version), field="format_digest",
        )
    active = rx.store.active()
    if params.only_if_newer and active is not None:
        installed = rx.catalog.read(active.version)
        if installed.sequence >= target.sequence:
            drift = installed_drift(rx, active)
            if drift is None:
                reason = (f"{target.version} (sequence {target.sequence}) is not newer than the installed "
                          f"{installed.version} (sequence {installed.sequence}), which every engine runs; "
                          "nothing to do")
                _note_quarantined(rx)
                rx.ledger.note(reason)
                return ReplayPlan(target, initial, (target,), True, skip=reason)
            rx.ledger.note(f"{installed.version} is recorded as installed, but {drift}: installing it again")
            target = installed  # what the node should run, even if the event that woke it was older
    if active is not None and target.version != active.version:
        rollback_checked(rx, active, target)
    local = {version: record.target_digest for version, record in rx.store.inventory().items()}
    lineage = rx.catalog.lineage(target, local)
    root = lineage[0]
    if root.version not in local and root.payload_format == "metadata_only" and root.version != initial.version:
        raise LineageError(
            f"the lineage reaches launch revision {root.version}, but the launch revision is {initial.version}",
            revision=target.version, file=rx.catalog.record_url(root.version), field="base_version",
        )
    rx.ledger.lineage = [r.version for r in lineage]
    if params.target != "latest":  # a few requests: reports an unusable newest record a rollback went past
        try:
            rx.catalog.head()
        except RefitError as exc:
            rx.ledger.note(f"the catalog's latest revision could not be found: {exc}")
    _note_quarantined(rx)
    return ReplayPlan(target, initial, tuple(lineage), root.version in local)


def rollback_checked(rx: Receiver, active, target: Revision) -> None:
    """A target older than the installed revision is a rollback: refused before any download where the
    configuration says so (``rollbacks="refuse"``, a node agent's default), else recorded as one."""
    try:
        installed = rx.catalog.read(active.version)
    except RefitError:
        if rx.params.rollbacks == "refuse":  # cannot tell whether it is one: do not install it
            raise
        return
    if installed.sequence <= target.sequence:
        return
    if rx.params.rollbacks == "refuse":
        raise RollbackRefused(
            f"target {target.version} (sequence {target.sequence}) is older than the installed "
            f"{installed.version} (sequence {installed.sequence}): this node refuses rollbacks from its "
            "control plane (its agent's allow_remote_rollback=True allows them); nothing was downloaded",
            revision=target.version, file=rx.catalog.record_url(target.version), field="target")
    rx.ledger.rollback_from = installed.version
    rx.ledger.note(f"rollback: from the installed {installed.version} (sequence {installed.sequence}) to "
                   f"{target.version} (sequence {target.sequence})")


def _note_quarantined(rx: Receiver) -> None:
    """Each unusable catalog object this run met, in the run's notes (its result and artifacts)."""
    for version, error in sorted(rx.catalog.quarantined.items()):
        rx.ledger.note(f"catalog record {version} is unusable and was skipped (it is not on this lineage): {error}")


def installed_drift(rx: Receiver, active) -> str | None:
    """Why the recorded installed version is not what the node runs, in words; None if it is.

    The store must still hold its verified checkpoint (a restart may have
    lost an unflushed one) and every engine must report it: ``active.json``
    is the record of the last install, the engines are the truth.
    """
    record = rx.store.verified(active.version)
    if record is None or record.files != active.files:
        return f"the store no longer holds its verified checkpoint (the store is at {_current(rx)})"
    reports = engine_reports(rx.installer)
    others = [f"{r.url} reports {r.version!r}" + (f" ({r.detail})" if r.version is None else "")
              for r in reports if r.version != active.version]
    if others:
        return "; ".join(others)
    if not reports and not rx.installer.is_current(active):
        return "the installer does not confirm it"
    return None


def _current(rx: Receiver) -> str:
    current = rx.store.current()
    return current.version if current is not None else "no verified checkpoint"


RESOLVE_CATALOG = Stage("resolve catalog", resolve_catalog)
