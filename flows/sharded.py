"""One revision published by several trainer ranks at once, each its own tensors (docs/format.md, 4.8).

    rank r of n:  python -m flows.publish --checkpoint ./shard-r --rank r --world-size n --publication RUN-STEP ...
    in Python:    flows.api.publish(tensors_of_this_rank, rank=r, world_size=n, publication=..., ...)

Every rank encodes and uploads the payload of the tensors it holds, against
its own kept copy of them (``{state_dir}/rank-{r}-of-{n}``), and writes its
part (``storage/catalog/parts.py``). Rank 0 first claims the sequence and
writes the plan every rank follows (version, base, encoding, payload URL);
at the end it merges the parts, checks them (every tensor once, the base's
layout and digest, every file there) and writes the index and, last, the
record: the same record, index metadata and checksums a single publisher
would write for the same tensors. Then every rank keeps its part as its next
base. A rank that dies leaves no record; the others time out with an error,
and the next publication (a new ``publication`` id) goes past it.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from pathlib import Path

from storage.catalog.kept_base import PublisherCopy
from storage.catalog.manifests import DELTA_INDEX_FILE
from storage.catalog.parts import (
    Merged, PublicationPart, PublicationPlan, merge_parts, publication_url, read_parts, read_plan, write_part,
    write_plan,
)
from storage.catalog.publisher import (
    PAYLOAD_FORMATS, choose_setting, delta_index, full_index, make_record, next_sequence, snapshot_of, stage_delta,
    stage_full, upload_payload,
)
from storage.catalog.records import Revision
from storage.errors import CatalogError, LineageError, ObjectNotFound, RefitError
from storage.format.checkpoint import INDEX_FILE, CheckpointIndex, require_same_layout
from storage.format.digests import snapshot_digest
from storage.format.tensor_source import MemoryCheckpoint
from storage.runtime.killpoints import killpoint
from storage.settings import PublishParams
from storage.urls import join_url
from tasks.plan_revision import claim_sequence
from tasks.publisher import Publisher, PublishResult
from tasks.write_record import WRITE_RECORD

log = logging.getLogger("canonical_refit.publish")


def run_publish_part(params: PublishParams, *, source: MemoryCheckpoint | None = None, keep_base: str = "disk",
                     poll_s: float = 0.2):
    """This rank's share of one revision (``params.rank`` of ``params.world_size``, ``params.publication``);
    rank 0 also plans and commits it. Returns the ``PublishResult`` of the whole revision (every rank the same
    version, sequence and digest)."""
    rank, world, publication = params.rank, params.world_size, params.publication  # checked by PublishParams
    started = time.perf_counter()
    pub = Publisher(params)
    pub.publication = publication  # the claim belongs to the publication, whichever rank made it
    try:
        target = source if source is not None else CheckpointIndex.open(params.checkpoint)
        if rank == 0:
            plan, base = _plan(pub, target)
        else:
            plan = _wait(f"the plan of publication {publication}", lambda: read_plan(
                pub.objects, pub.catalog.url, publication), params.part_timeout_s, poll_s, pub)
            base = pub.catalog.read(plan.base_version) if plan.base_version else None
        kept = PublisherCopy(Path(params.state_dir) / f"rank-{rank}-of-{world}", params.model, keep_base=keep_base)
        part, checksums, decoded = _publish_part(pub, plan, base, target, kept)
        if rank == 0:
            merged = _wait("every rank's part", lambda: _merged(pub, plan, base), params.part_timeout_s, poll_s, pub)
            record = _commit(pub, plan, base, merged)
        else:
            record = _wait(f"rank 0 to write the record of {plan.version}", lambda: _record(pub, plan),
                           params.part_timeout_s, poll_s, pub)
        if params.keep_copy:
            kept.keep(target, plan.version, plan.checksum_format, checksums, workers=params.workers)
        delivery = None
        if rank == 0 and params.emit_event:
            from flows.announce import announce
            from flows.prefect_adapter import can_emit_events

            if can_emit_events():
                delivery = announce(record, pub.catalog, budget_s=params.event_delivery_s)
        seconds = time.perf_counter() - started
        return PublishResult(
            version=record.version, sequence=record.sequence, payload_format=record.payload_format,
            record_url=pub.catalog.record_url(record.version), uri=record.uri, target_digest=record.target_digest,
            encoding=plan.encoding, bytes_written=sum(part.files.values()), decoded_bytes=decoded,
            encoded_bytes=part.encoded_bytes, changed_tensors=len(part.weight_map) if plan.kind == "delta" else 0,
            files=len(part.files), seconds=round(seconds, 3), model_bytes=target.nbytes,
            bytes_per_s=round(target.nbytes / seconds, 1) if seconds > 0 else 0.0,
            event_delivered=delivery.delivered if delivery else None, event_error=delivery.error if delivery else None)
    finally:
        pub.close()


def _plan(pub: Publisher, target) -> tuple[PublicationPlan, Revision | None]:
    """Rank 0: the revision's version and sequence (claimed for the publication), its base and its encoding."""
    params, catalog = pub.params, pub.catalog
    sequence, latest = next_sequence(catalog)
    base = None
    if params.kind == "initial":
        if latest is not None:
            raise LineageError(f"the catalog already has revisions (latest {latest.version}): kind initial only "
                               "starts an empty catalog", revision=params.version or "r0", file=catalog.url)
        sequence = 0
    elif latest is None:
        raise LineageError("the catalog is empty: publish the launch revision first (kind initial)",
                           file=catalog.url)
    elif params.kind == "delta":
        base = catalog.read(params.base_version) if params.base_version else latest
    sequence, version = claim_sequence(catalog, sequence, params.version, pub.publication)
    encoding, level = None, None
    if params.kind == "delta":
        encoding, level = params.encoding, params.zstd_level
        if encoding == "auto":  # measured on rank 0's tensors: every rank encodes with the index's one encoding
            kept = PublisherCopy(Path(params.state_dir) / f"rank-0-of-{params.world_size}", params.model)
            snap = kept.kept_snapshot(base.version, base.checksum_format, workers=params.workers)
            if snap is not None:
                setting, _ = choose_setting(snap, target, "auto", level=params.zstd_level, workers=params.workers)
                encoding, level = setting.encoding, setting.level
            else:
                encoding = "xor"
    payload_url = None
    if params.kind != "initial":
        token = hashlib.sha256(pub.publication.encode()).hexdigest()[:12]
        payload_url = join_url(pub.payload_root, f"{version}.{token}")
    plan = PublicationPlan(
        publication=pub.publication, version=version, sequence=sequence, kind=params.kind,
        world_size=params.world_size, checksum_format=base.checksum_format if base else params.checksum_format,
        payload_url=payload_url, base_version=base.version if base else None,
        base_digest=base.target_digest if base else None, encoding=encoding, level=level)
    write_plan(pub.objects, catalog.url, plan)
    killpoint("publish.planned", version)
    return plan, base


def _publish_part(pub: Publisher, plan: PublicationPlan, base: Revision | None, target,
                  kept: PublisherCopy) -> tuple[PublicationPart, dict, int]:
    """Encode and upload this rank's tensors, then write its part. (part, the tensors' checksums, bytes)."""
    params, rank = pub.params, pub.params.rank
    layout = {t.name: [t.dtype, list(t.shape)] for t in target.tensors.values()}
    with tempfile.TemporaryDirectory(prefix="canonical-refit-part-") as tmp:
        staging = Path(tmp) / "payload"
        base_checksums: dict = {}
        if plan.kind == "delta":
            snap = (snapshot_of(params.base_checkpoint, plan.checksum_format, workers=params.workers)
                    if params.base_checkpoint else kept.kept_snapshot(base.version, plan.checksum_format,
                                                                      workers=params.workers))
            if snap is None:
                raise LineageError(f"rank {rank} keeps no copy of its tensors of the base revision {base.version}; "
                                   'pass them as base_checkpoint=, or publish this revision with kind="full"',
                                   revision=plan.version, field="base_checkpoint")
            require_same_layout(snap.index.layout(), target.layout(), revision=plan.version,
                                file=str(params.checkpoint) if source_is_folder(target) else None)
            base_checksums = dict(snap.checksums)
            payload = stage_delta(snap, target, staging, version=plan.version, base_version=base.version,
                                  encoding=plan.encoding, level=plan.level, bucket_max_bytes=params.bucket_max_bytes,
                                  workers=params.workers, bucket_prefix=f"bucket-r{rank:05d}")
            checksums = dict(payload.checksums)
        else:
            snap = snapshot_of(target, plan.checksum_format, workers=params.workers)
            checksums = dict(snap.checksums)
            payload = stage_full(snap, staging, shard_prefix=f"rank{rank:05d}-") if plan.kind == "full" else None
        files, weight_map = {}, {}
        if payload is not None:
            payload.index_name = None  # rank 0 writes the revision's one index
            upload_payload(pub.objects, payload, plan.payload_url, workers=params.storage.concurrency)
            files = {name: (staging / name).stat().st_size for name in payload.files}
            if plan.kind == "delta":
                weight_map = _delta_weight_map(staging, payload.files)
            else:
                weight_map = {t.name: f"rank{rank:05d}-{t.file}" for t in target.tensors.values()}
    killpoint("publish.part_uploaded", plan.version)
    part = PublicationPart(rank=rank, layout=layout, checksums=checksums, weight_map=weight_map, files=files,
                           decoded_bytes=payload.decoded_bytes if payload else 0,
                           encoded_bytes=payload.encoded_bytes if payload else 0, base_checksums=base_checksums)
    write_part(pub.objects, pub.catalog.url, plan.publication, part)
    return part, checksums, target.nbytes


def source_is_folder(target) -> bool:
    return getattr(target, "folder", None) is not None


def _delta_weight_map(folder: Path, files: list[str]) -> dict[str, str]:
    """Which bucket holds each changed tensor (from the buckets' own headers)."""
    from storage.format.safetensors import read_header

    return {name: file for file in files for name in read_header(folder / file).tensors}


def _merged(pub: Publisher, plan: PublicationPlan, base: Revision | None) -> Merged | None:
    """Rank 0: the merged revision once every part is there (None until then); ``CatalogError`` if they are wrong."""
    parts = read_parts(pub.objects, pub.catalog.url, plan)
    if len(parts) < plan.world_size:
        return None
    sizes = {name: size for name, size, _ in pub.objects.walk(plan.payload_url)} if plan.payload_url else {}
    merged = merge_parts(plan, parts, base_format_digest=base.format_digest if base else None, sizes=sizes)
    if base is not None:
        base_checksums = {k: v for p in parts.values() for k, v in (p.base_checksums or {}).items()}
        digest = snapshot_digest(base.checksum_format, base.format_digest, base_checksums)
        if digest != base.target_digest:
            raise CatalogError(f"the ranks' copies of the base {base.version} hash to {digest}, not its "
                               f"target_digest: a rank encoded against another base", revision=plan.version,
                               field="base_digest")
    return merged


def _commit(pub: Publisher, plan: PublicationPlan, base: Revision | None, merged: Merged) -> Revision:
    """Rank 0: the revision's index, then its record (create-only, last): what makes it visible."""
    uri = None
    if plan.kind == "delta":
        uri = join_url(plan.payload_url, DELTA_INDEX_FILE)
        pub.objects.put_immutable(uri, delta_index(plan.version, plan.base_version, plan.encoding,
                                                   plan.checksum_format, merged.weight_map))
    elif plan.kind == "full":  # every tensor is in a shard: the decoded bytes are the model's
        uri = join_url(plan.payload_url, INDEX_FILE)
        pub.objects.put_immutable(uri, full_index(plan.checksum_format, merged.decoded_bytes, merged.weight_map))
    record = make_record(pub.params.model, plan.version, plan.sequence, PAYLOAD_FORMATS[plan.kind],
                         plan.checksum_format, merged.format_digest, merged.target_digest, base=base, uri=uri)
    WRITE_RECORD(pub, record)
    killpoint("publish.recorded", plan.version)
    try:  # every rank read the plan and wrote its part before this: nothing reads them again
        pub.objects.delete_tree(publication_url(pub.catalog.url, plan.publication))
    except RefitError as exc:
        log.warning("could not remove publication %s's coordination files (python -m flows.publish orphans "
                    "lists them): %s", plan.publication, exc)
    log.info("published %s (seq %d, %s) from %d ranks: %d payload files, %d bytes", record.version,
             record.sequence, record.payload_format, plan.world_size, len(merged.files), sum(merged.files.values()))
    return record


def _record(pub: Publisher, plan: PublicationPlan) -> Revision | None:
    try:
        record = pub.catalog.read(plan.version)
    except ObjectNotFound:
        return None
    if record.sequence != plan.sequence:
        raise CatalogError(f"{plan.version} was published as sequence {record.sequence}, not this publication's "
                           f"{plan.sequence}", revision=plan.version, field="sequence")
    return record


def _wait(what: str, check, timeout_s: float, poll_s: float, pub: Publisher):
    """``check()`` until it returns something, or ``CatalogError`` after ``timeout_s``; checked every 10 ms at
    first, then less often, up to every ``poll_s`` (ranks that finish together do not wait a whole poll)."""
    deadline = time.monotonic() + timeout_s
    interval = min(0.01, poll_s)
    while True:
        pub.stop.check()
        try:
            value = check()
        except ObjectNotFound:
            value = None
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise CatalogError(f"timed out after {timeout_s:.0f} s waiting for {what} (a rank died, or was never "
                               "started: nothing was made visible; publish again with a new publication id)",
                               revision=pub.params.version)
        time.sleep(interval)
        interval = min(poll_s, interval * 1.5)


__all__ = ["run_publish_part", "RefitError"]
