"""Publication stage 1, plan revision: load the target and the exact base, then claim the revision's sequence."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from storage.catalog.kept_base import PublisherCopy
from storage.catalog.publisher import Snapshot, existing_record, next_sequence, snapshot_of, source_label
from storage.catalog.records import Catalog, Revision
from storage.errors import ImmutableConflict, LineageError, RefitError
from storage.format.checkpoint import CheckpointIndex, require_same_layout
from storage.format.tensor_source import MemoryCheckpoint
from storage.runtime.killpoints import killpoint
from tasks.publisher import Publisher
from tasks.stage import Stage

log = logging.getLogger("canonical_refit.publish")


@dataclass(frozen=True)
class Publication:
    """What a run will publish: version, sequence, base and the target's digests."""

    version: str
    sequence: int
    base: Revision | None
    base_snapshot: Snapshot | None
    target: CheckpointIndex | MemoryCheckpoint
    existing: Revision | None


def plan_revision(pub: Publisher, source: MemoryCheckpoint | None = None, keep_base: str = "disk") -> Publication:
    """Load the target (``source``, or the checkpoint folder) and, for a delta, the exact base (checked against
    its record and the target's layout); only then claim the version's sequence.

    Everything that can refuse the input does so before the claim, so a
    refused publication leaves the catalog as it was.
    """
    params, catalog = pub.params, pub.catalog
    sequence, latest = next_sequence(catalog)
    existing = existing_record(catalog, params.version) if params.version else None
    if params.kind == "initial":
        if latest is not None and existing is None:
            raise LineageError(f"the catalog already has revisions (latest {latest.version}): kind=\"initial\" only "
                               'starts an empty catalog; publish this checkpoint as kind="full" or kind="delta"',
                               revision=params.version or "r0", file=catalog.url, field="sequence")
        sequence = 0
    elif latest is None:
        raise LineageError('the catalog is empty: publish the launch revision first (kind="initial")',
                           file=catalog.url)
    if existing is not None:  # a republish (after a crash, or a retry): same version, same sequence
        sequence = existing.sequence
    label = existing.version if existing else params.version or f"r{sequence}"  # the version it will likely get
    target = source if source is not None else CheckpointIndex.open(params.checkpoint, revision=label)
    base, base_snapshot = None, None
    if params.kind == "delta":
        kept = PublisherCopy(params.state_dir, params.model, keep_base=keep_base)
        base = catalog.read(params.base_version) if params.base_version else latest
        if existing is not None:
            base = catalog.read(existing.base_version) if existing.base_version else base
        elif params.base_version is None and params.base_checkpoint is None:
            base = _kept_base_in_catalog(catalog, kept, latest, label)
        if params.base_checkpoint is not None:
            base_snapshot = snapshot_of(params.base_checkpoint, base.checksum_format, workers=params.workers)
            if base_snapshot.target_digest != base.target_digest:
                raise LineageError(f"the base_checkpoint= given hashes to {base_snapshot.target_digest}, not the "
                                   f"target_digest of the base revision {base.version}", revision=label,
                                   file=str(params.base_checkpoint), field="base_checkpoint")
        else:
            base_snapshot = kept.base_for(base, workers=params.workers, publishing=label)
        require_same_layout(base_snapshot.index.layout(), target.layout(), revision=label,
                            file=source_label(target))
    if existing is not None:
        version = existing.version
    else:
        sequence, version = claim_sequence(catalog, sequence, params.version, pub.publication)
    return Publication(version, sequence, base, base_snapshot, target, existing)


def _kept_base_in_catalog(catalog: Catalog, kept: PublisherCopy, latest: Revision, label: str) -> Revision:
    """The base of a delta when none was named: the latest revision, or the revision the publisher's kept copy
    is, if that is an older one of the catalog (a publisher killed after writing its record, before keeping
    its copy: the next delta goes against the copy it has, a valid exact base, instead of failing)."""
    version = kept.kept_version()
    if version is None or version == latest.version:
        return latest
    try:
        base = catalog.read(version)
    except RefitError:
        return latest  # a copy of something the catalog does not hold: base_for names the mismatch
    log.warning("the publisher's kept copy is %s, not the latest revision %s (a publication that did not keep its "
                "copy, e.g. a crashed publisher): publishing %s as a delta against %s", version, latest.version,
                label, version)
    return base


def claim_sequence(catalog: Catalog, sequence: int, version: str | None, publication: str, *,
                   attempts: int = 64) -> tuple[int, str]:
    """Claim the first free sequence from ``sequence`` on (create-only), so no two records ever share one.

    A sequence claimed by another publication is skipped, whatever version it
    names: a live publisher owns it, and a crashed one's claim (and its
    payload) is left behind, never reused. A default version name follows
    the sequence (``r{n}``).
    """
    for candidate in range(sequence, sequence + attempts):
        name = version or f"r{candidate}"
        holder, token = catalog.claim_sequence(candidate, name, publication)
        if token == publication:
            killpoint("publish.claimed", name)
            return candidate, name
        log.info("sequence %d is already claimed by another publication of %s; trying %d", candidate, holder,
                 candidate + 1)
    raise ImmutableConflict(f"sequences {sequence} to {sequence + attempts - 1} are all claimed by other "
                            "publications", file=catalog.url, field="sequence")


PLAN_REVISION = Stage("plan revision", plan_revision)
