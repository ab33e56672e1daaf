"""Turn a verified base and cached delta artifacts into a verified target checkpoint.

``materialize`` marks the store ``UPDATING``, takes over (rename) the base's
materialized folder or copies an immutable full checkpoint once (a reflink
where the filesystem can, else each tensor copied as it is patched, so each
page is written once: ``storage.patch.first_copy``; not fsynced: the patched
checkpoint is recorded unflushed and written back after ``READY``), and
patches it in place. ``verify_target`` computes the snapshot digest from the base's
verified checksums plus the checksums computed while patching, checks it
against the catalog, and only then records the checkpoint and marks ``READY``.
``roll_back`` brings the last verified checkpoint back after a failure that
happened once bytes had changed (the run calls it once nothing else runs).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Callable, Mapping, Sequence

from storage.store import launch_files
from storage.runtime.cancel import StopToken
from storage.catalog.records import Revision, parse_revision, record_memo
from storage.format.checkpoint import CheckpointIndex, require_same_layout
from storage.format.digests import snapshot_digest
from storage.durable import (
    CopyReport, boot_id, folder_identity, fsync_dir, remove_tree, tree_size,
)
from storage.errors import (
    CatalogError, ChecksumMismatch, CheckpointMismatch, RefitError, StoreError,
)
from storage.runtime.killpoints import killpoint
from storage.store.artifacts import read_source
from storage.store.local_store import Chain, LocalStore, VerifiedCheckpoint, now_ms
from storage.catalog.manifests import Manifest, parse_delta_manifest
from storage.patch.first_copy import CopyAsPatched, reflinks
from storage.patch.patcher import PlanSource, StaticPlans, apply_patches, plan_patches

log = logging.getLogger("canonical_refit.reconstruct")
_NBYTES = attrgetter("nbytes")


@dataclass(frozen=True)
class Materialized:
    """A patched (not yet verified) checkpoint folder and the checksums computed while patching."""

    version: str
    path: Path
    base: VerifiedCheckpoint
    patched: Mapping[str, str]
    chain: Chain
    copied_bytes: int = 0
    patched_bytes: int = 0
    mutated: bool = True
    placed: CopyReport | None = None  # how the base's copy was made (None: taken over by rename)


def chain_after(store: LocalStore, base: VerifiedCheckpoint, versions: Sequence[str], target: str) -> Chain:
    """How to rebuild ``target``: the base's own chain extended by ``versions``."""
    if base.path.startswith("full/"):
        return Chain(target, base.version, tuple(versions))
    known = store.chain(base.version) or Chain(base.version, base.version, ())
    return Chain(target, known.full_version, known.deltas + tuple(versions))


@dataclass(frozen=True)
class Rollback:
    """What a failed ``materialize`` changed, so the run can put things back once nothing else runs."""

    base: VerifiedCheckpoint
    folder: Path
    takeover: bool
    undone: bool  # a takeover's patched bytes were reverted and re-verified in place


def materialize(
    store: LocalStore,
    base: VerifiedCheckpoint,
    target: Revision,
    deltas: Sequence[Manifest],
    folders: Mapping[str, Path],
    *,
    workers: int,
    source: PlanSource | None = None,
    progress: Callable[[int], Callable[[int], None]] | None = None,
    on_updating: Callable[[], None] | None = None,
    stop: StopToken | None = None,
    check_space: bool = True,
) -> Materialized:
    """Apply ``deltas`` (oldest first) to ``base``, producing ``materialized/{target}``.

    A sequential delta takes the base's materialized folder over by rename; the
    first delta after a full checkpoint copies it once (``copy_base``). ``source`` hands out
    tensor plans (default: every bucket checked up front, before the store
    goes ``UPDATING``; ``ArrivingPlans`` checks buckets as they arrive); each
    record's content is validated as it is applied (``apply_patches``).
    If anything fails once the store is ``UPDATING``, the error carries
    ``mutation_started`` and a ``rollback`` (``Rollback``) that ``roll_back``
    uses — after the caller has stopped everything else — to put the base
    back. ``progress(total)`` returns a callback fed with the bytes patched.
    """
    base_path = store.absolute(base.path)
    base_index = CheckpointIndex.open(base_path, revision=base.version)
    if source is None:
        source = StaticPlans(plan_patches(deltas, folders, base_index.tensors, workers=workers))
    source.prepare()
    chain = chain_after(store, base, [m.version for m in deltas], target.version)
    target_dir = store.materialized_dir(target.version)
    state = store.state()
    takeover = base.path.startswith("materialized/")
    if check_space:  # the disk, before the first in-place change: the copy, the records, the rollback's reserve
        _reserve(store, base, base_path, target, takeover)
    _begin_update(store, target.version, target_dir, state.version if state else None)
    if on_updating:
        on_updating()
    undone = False
    try:
        placed, lazy = _place_base(store, base, base_path, base_index, target_dir, takeover, source, stop=stop)
        source = lazy or source
        killpoint("apply.materialized")
        index = CheckpointIndex(target_dir, base_index.tensors, base_index.headers)
        try:
            patched = apply_patches(index, source, target_checksum_format=target.checksum_format, workers=workers,
                                    progress=progress(source.total_bytes()) if progress else None,
                                    undo_to=base.checksums if takeover else None, undo_format=base.checksum_format,
                                    stop=stop)
            if lazy is not None:
                finish_copy(store, base, target_dir, lazy, placed, workers=workers)
        except BaseException as exc:
            undone = bool(getattr(exc, "undone", False))
            raise
        finally:
            if lazy is not None:
                lazy.close()
    except RefitError as exc:
        exc.mutation_started = True
        exc.rollback = Rollback(base, target_dir, takeover, undone)
        raise
    except OSError as exc:
        error = StoreError(f"local I/O failed while materializing: {exc}", revision=target.version,
                           file=str(target_dir), mutation_started=True)
        error.rollback = Rollback(base, target_dir, takeover, False)
        raise error from exc
    except BaseException as exc:  # an interrupt in the calling thread: still say how to put things back
        exc.rollback = Rollback(base, target_dir, takeover, undone)
        raise
    return Materialized(target.version, target_dir, base, patched, chain, placed.total if placed else 0,
                        sum(map(_NBYTES, map(base_index.tensors.__getitem__, patched))), placed=placed)


def _begin_update(store: LocalStore, version: str, target_dir: Path, previous: str | None) -> None:
    """Mark the store ``UPDATING`` towards ``version``; if that fails, the rollback's reserve is released."""
    try:
        store.begin_update(version, target_dir, previous)
    except BaseException:
        store.release_reserve()  # still READY: no rollback follows
        raise


def _place_base(store: LocalStore, base: VerifiedCheckpoint, base_path: Path, base_index: CheckpointIndex,
                target_dir: Path, takeover: bool, source: PlanSource, *,
                stop: StopToken | None) -> tuple[CopyReport | None, CopyAsPatched | None]:
    """Put the base at ``target_dir`` (inside ``UPDATING``), replacing whatever lies there: a materialized base
    is taken over by rename (``(None, None)``), a full one copied (``copy_base``: its report, and the
    ``CopyAsPatched`` that copies as tensors are taken, if the copy is not complete yet)."""
    remove_tree(target_dir)
    if not takeover:
        return copy_base(store, base, base_index, target_dir, source, stop=stop)
    store.release_base(base.version)
    os.rename(base_path, target_dir)
    fsync_dir(target_dir.parent)
    return None, None


def _reserve(store: LocalStore, base: VerifiedCheckpoint, base_path: Path, target: Revision, takeover: bool) -> None:
    records = store.records_bytes(base)
    store.reserve_rollback(writes=(0 if takeover else tree_size(base_path)) + records, rollback=records,
                           revision=target.version, what=f"materializing {target.version} from {base.version}")


def copy_base(store: LocalStore, base: VerifiedCheckpoint, base_index: CheckpointIndex, target_dir: Path,
              source: PlanSource, *, stop: StopToken | None = None) -> tuple[CopyReport, CopyAsPatched | None]:
    """Lay out the copy of an immutable full checkpoint at ``target_dir`` (through ``tmp/``); inside ``UPDATING``.

    The one copy a fresh node's model gets (its seed links the launch
    snapshot), never a hard link (these files are patched next): a reflink of
    every file where the filesystem can (complete at once); else a
    ``CopyAsPatched`` that wraps ``source`` and copies each tensor as it is
    taken for patching, then the rest (``finish_copy``), so that each page is
    written once. Not fsynced: the patched checkpoint is recorded
    ``flushed=False`` and written back after ``READY`` (``storage.store.flush``),
    like its patched pages, and a crash before ``READY`` discards the folder.
    """
    base_path = store.absolute(base.path)
    report, lazy = CopyReport(), None
    staging = store.staging(f"materialize-{target_dir.name}")
    try:
        if not reflinks(base_path, staging, report):
            remove_tree(staging)
            report = CopyReport()
            lazy = CopyAsPatched(source, base_index, base_path, target_dir, report=report, stop=stop)
            lazy.begin(staging)
        staging.rename(target_dir)
    finally:
        remove_tree(staging)
    fsync_dir(target_dir.parent)
    if lazy is None:
        _log_copy(store, base, target_dir, report, "reflinked")
    else:
        lazy.open()
    return report, lazy


def finish_copy(store: LocalStore, base: VerifiedCheckpoint, target_dir: Path, lazy: CopyAsPatched,
                report: CopyReport, *, workers: int) -> None:
    """After patching: copy what no delta touched, and log how the copy was made (bytes, seconds)."""
    lazy.finish(workers)
    report.seconds = lazy.copy_seconds()
    _log_copy(store, base, target_dir, report, "copied as it was patched")


def _log_copy(store: LocalStore, base: VerifiedCheckpoint, target_dir: Path, report: CopyReport, how: str) -> None:
    log.info("%s %s (%s) into %s: %s", how, base.version, base.path, store.relative(target_dir), report.summary(),
             extra={"copy": report.as_dict() | {"what": "materialize", "version": base.version}})


def roll_back(store: LocalStore, error: BaseException, previous: str | None, *, workers: int,
              rebuild: bool = True) -> str:
    """After a failure with bytes changed (nothing else running): bring the last verified checkpoint back.

    An undone takeover is renamed back (cheap); otherwise the half-written
    folder is discarded and, when ``rebuild``, ``previous`` is rebuilt from the
    cache if it was lost. Returns what happened, in words.
    """
    store.release_reserve()  # the rollback writes from here on: the reserve's blocks are its own
    rollback: Rollback | None = getattr(error, "rollback", None)
    if rollback is not None and rollback.takeover and rollback.undone and rollback.folder.is_dir():
        try:
            store.put_back(rollback.base, rollback.folder)
            store.recover()
            return f"{rollback.base.version} was put back in place and re-verified"
        except (OSError, StoreError) as exc:
            log.error("could not put %s back after a failed apply: %s", rollback.base.version, exc)
    if not rebuild:
        store.recover()
        current = store.current()
        return (f"store is READY at {current.version if current else 'no checkpoint'}; the next run rebuilds "
                f"{previous} if it was lost")
    return restore_previous(store, previous, workers=workers)


def verify_target(
    store: LocalStore,
    target: Revision,
    path: Path,
    *,
    base: VerifiedCheckpoint | None,
    patched: Mapping[str, str],
    chain: Chain,
    full: bool,
    workers: int,
    mutated: bool,
    progress: Callable[[int], None] | None = None,
    stop: StopToken | None = None,
) -> VerifiedCheckpoint:
    """Check coverage, layout and the snapshot digest; then record the checkpoint and mark ``READY``.

    Clean tensors keep the base's verified checksums (when the checksum format
    is the same); only patched tensors were hashed, during the apply pass.
    ``full`` rereads every tensor instead and cross-checks the patched ones.
    """
    context = {"revision": target.version, "file": str(path), "mutation_started": mutated}
    index = CheckpointIndex.open(path, revision=target.version)
    layout_digest = index.format_digest()
    if layout_digest != target.format_digest:
        raise CheckpointMismatch(f"checkpoint layout {layout_digest} differs from the catalog's "
                                 f"{target.format_digest}", field="format_digest", **context)
    fmt = target.checksum_format
    tensors = index.tensors
    checksums: dict[str, str] = {}
    every = len(patched) == len(tensors) and patched.keys() == tensors.keys()  # a step that changed every tensor
    if base is not None and base.checksum_format == fmt and not full and not every:
        kept = base.checksums
        # the base's table is the target's (one set comparison in C): copied whole, not filtered a key at a time
        checksums.update(kept if kept.keys() <= tensors.keys() else {k: v for k, v in kept.items() if k in tensors})
    checksums.update(patched)
    reread = sorted(tensors) if full else sorted(tensors.keys() - checksums.keys())
    if reread:
        fresh = index.checksums(fmt, names=reread, workers=workers, progress=progress, stop=stop)
        for name, value in fresh.items():
            if name in patched and patched[name] != value:
                raise ChecksumMismatch(f"bytes on disk hash to {value}, the apply pass computed {patched[name]}",
                                       tensor=name, **context)
        checksums.update(fresh)
    missing = sorted(tensors.keys() - checksums.keys())
    if missing:
        raise CheckpointMismatch("tensor has no verified checksum", tensor=missing[0], **context)
    digest = snapshot_digest(fmt, layout_digest, checksums)
    if digest != target.target_digest:
        raise ChecksumMismatch(f"checkpoint digest {digest} differs from the catalog's target_digest "
                               f"{target.target_digest}", field="target_digest", **context)
    killpoint("verify.before_ready")
    carried = launch_files.carry_into(store.root, path, revision=target.version)  # config.json, tokenizer, ...
    record = VerifiedCheckpoint(
        version=target.version, path=store.relative(path), sequence=target.sequence, checksum_format=fmt,
        format_digest=layout_digest, target_digest=digest, checksums=checksums,
        files=folder_identity(path), verified_at_unix_ms=now_ms(), boot_id=boot_id(),
        flushed=not mutated,  # patched pages reach the disk in the background (storage/store/flush.py)
        launch_files=carried,
    )
    store.commit_ready(record, chain)
    return record


def verify_full_artifact(
    store: LocalStore,
    manifest: Manifest,
    folder: Path,
    *,
    reference: Mapping[str, tuple] | None,
    workers: int,
    progress: Callable[[int], None] | None = None,
    stop: StopToken | None = None,
) -> VerifiedCheckpoint:
    """Verify a downloaded full revision: layout, declared per-shard checksums, target digest.

    Nothing existing changes: the artifact folder is new and immutable. A
    declared ``checksum_format`` makes every shard's metadata checksum
    mandatory and checked; without one, shard metadata is ignored.
    """
    revision = manifest.revision
    index = CheckpointIndex.open(folder, revision=revision.version)
    if reference is not None:
        require_same_layout(reference, index.layout(), revision=revision.version, file=manifest.uri)
    if index.format_digest() != revision.format_digest:
        raise CheckpointMismatch(f"layout {index.format_digest()} differs from the catalog's "
                                 f"{revision.format_digest}", revision=revision.version, file=manifest.uri,
                                 field="format_digest")
    declared = manifest.checksum_format
    computed = index.checksums(declared or revision.checksum_format, workers=workers, progress=progress, stop=stop)
    if declared:
        for name, location in sorted(index.tensors.items()):
            published = index.headers[location.file].metadata.get(name)
            shard = manifest.file_url(location.file)
            if published is None:
                raise ChecksumMismatch(f"shard metadata has no {declared} checksum for the tensor",
                                       revision=revision.version, file=shard, tensor=name)
            if published != computed[name]:
                raise ChecksumMismatch(f"tensor hashes to {computed[name]}, the shard says {published}",
                                       revision=revision.version, file=shard, tensor=name)
    return verify_target(store, revision, folder, base=None,
                         patched=computed if declared in (None, revision.checksum_format) else {},
                         chain=Chain(revision.version, revision.version, ()), full=False, workers=workers,
                         mutated=False)


def restore_previous(store: LocalStore, previous: str | None, *, workers: int) -> str:
    """After a failure with bytes changed: get the last verified checkpoint back, offline if possible.

    Discards the half-written folder (``recover``); if ``previous`` was taken
    over by rename, rebuilds it from ``chains/{previous}.json`` and cached
    artifacts. Returns what happened, in words.
    """
    store.recover()
    current = store.current()
    if previous is None or (current is not None and current.version == previous):
        return f"store is READY at {current.version if current else 'no checkpoint'}"
    try:
        record = rebuild_offline(store, previous, workers=workers)
    except RefitError as exc:
        store.recover()
        log.warning("could not rebuild %s from the cache: %s", previous, exc)
        return f"could not rebuild {previous} from the cache ({exc}); the next run rebuilds it from the catalog"
    if record is None:
        return f"{previous} is not rebuildable from the cache; the next run rebuilds it from the catalog"
    store.follow_active(record)
    return f"rebuilt {previous} from its lineage in the cache; store is READY at {previous}"


def rebuild_offline(store: LocalStore, version: str, *, workers: int) -> VerifiedCheckpoint | None:
    """Rebuild ``version`` from ``chains/``, cached records and cached artifacts; None if incomplete."""
    chain = store.chain(version)
    if chain is None:
        return None
    full = store.inventory().get(chain.full_version)
    if full is None or not chain.deltas:
        return full if full is not None and full.version == version else None
    manifests, folders = [], {}
    for delta in chain.deltas:
        record = _memo_record(store, delta)
        folder = store.delta_dir(delta)
        try:
            source = read_source(store.root / "deltas" / f"{delta}.source.json")
        except StoreError:  # refused: the artifact is downloaded again, not rebuilt from
            source = None
        raw = (folder / "index.json").read_bytes() if (folder / "index.json").exists() else None
        if record is None or raw is None or source is None or source.uri != record.uri:
            return None
        manifest = parse_delta_manifest(raw, record)
        if set(manifest.files) - set(source.files):
            return None
        manifests.append(manifest)
        folders[delta] = folder
    target = _memo_record(store, version)
    done = materialize(store, full, target, manifests, folders, workers=workers,
                       check_space=False)  # the rollback's rebuild: the discarded folder's blocks and the reserve
    return verify_target(store, target, done.path, base=full, patched=done.patched, chain=done.chain,
                         full=False, workers=workers, mutated=True)


def _memo_record(store: LocalStore, version: str) -> Revision | None:
    memo = record_memo(store.catalog_dir / f"{version}.json")  # None if missing, torn or refused
    if memo is None:
        return None
    try:
        return parse_revision(memo.record, version=version, model=store.model, file=memo.url)
    except CatalogError:
        return None
