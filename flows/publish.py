"""The publisher flow: write a revision's payload and catalog record, then announce it.

    python -m flows.publish --catalog file:///tmp/catalog --model org/name \\
        --checkpoint ./step-42 --kind delta

Payload objects are written first and the catalog record last (both
create-only), so no reader ever sees a record whose payload is incomplete.
"""

from __future__ import annotations

import os

os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "canonical_refit")
# stage helpers log from worker threads, outside any run context: keep those lines local
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

from storage.catalog import Catalog, Revision  # noqa: E402
from storage.checkpoint import CheckpointIndex  # noqa: E402
from storage.errors import ImmutableConflict, LineageError, RefitError  # noqa: E402
from storage.objects import ObjectStore  # noqa: E402
from storage.urls import join_url, parent_url  # noqa: E402
from storage.publisher import (  # noqa: E402
    Payload, PublisherCopy, Snapshot, existing_record, make_record, next_sequence, same_publication,
    snapshot_of, stage_delta, stage_full, upload_payload,
)
from storage.settings import PublishParams  # noqa: E402
from tasks.stage import transient_only  # noqa: E402

log = logging.getLogger("canonical_refit.publish")
logging.getLogger("canonical_refit").setLevel(logging.INFO)  # Prefect leaves extra loggers at WARNING
EVENT = "canonical-refit.revision.published"
PAYLOAD_FORMATS = {"initial": "metadata_only", "full": "full_hf_checkpoint", "delta": "xor_delta"}


@dataclass
class PublishResult:
    """What was published, and what it cost."""

    version: str
    sequence: int
    payload_format: str
    record_url: str
    uri: str | None
    target_digest: str
    encoding: str | None = None
    bytes_written: int = 0
    decoded_bytes: int = 0
    encoded_bytes: int = 0
    compression_ratio: float = 0.0
    changed_tensors: int = 0
    files: int = 0
    seconds: float = 0.0
    already_published: bool = False


@dataclass(frozen=True)
class Publication:
    """What a run will publish: version, sequence, base and the target's digests."""

    version: str
    sequence: int
    base: Revision | None
    base_snapshot: Snapshot | None
    target: CheckpointIndex
    existing: Revision | None


def payload_root(params: PublishParams, catalog: Catalog) -> str:
    return params.payload_url or join_url(parent_url(catalog.url), "revisions")


@task(name="plan revision", cache_policy=NO_CACHE)
def plan_revision(params: PublishParams, catalog: Catalog) -> Publication:
    """Pick version and sequence; for a delta, load the exact base (checked against its record)."""
    sequence, latest = next_sequence(catalog)
    if params.kind == "initial":
        sequence = 0
    elif latest is None:
        raise LineageError("the catalog is empty: publish the launch revision first (--kind initial)")
    version = params.version or f"r{sequence}"
    existing = existing_record(catalog, version)
    target = CheckpointIndex.open(params.checkpoint, revision=version)
    base, base_snapshot = None, None
    if params.kind == "delta":
        base = catalog.read(params.base_version) if params.base_version else latest
        if existing is not None:
            base = catalog.read(existing.base_version) if existing.base_version else base
            sequence = existing.sequence
        if params.base_checkpoint is not None:
            base_snapshot = snapshot_of(params.base_checkpoint, base.checksum_format, workers=params.workers)
            if base_snapshot.target_digest != base.target_digest:
                raise LineageError(f"--base-checkpoint hashes to {base_snapshot.target_digest}, not the "
                                   f"target_digest of {base.version}", revision=version,
                                   file=str(params.base_checkpoint))
        else:
            base_snapshot = PublisherCopy(params.state_dir, params.model).base_for(base, workers=params.workers)
    elif existing is not None:
        sequence = existing.sequence
    return Publication(version, sequence, base, base_snapshot, target, existing)


@task(name="encode payload", cache_policy=NO_CACHE)
def encode_payload(params: PublishParams, plan: Publication, staging: Path) -> tuple[Payload | None, Snapshot]:
    """Stage the payload files locally; returns the payload and the target snapshot."""
    if params.kind == "delta":
        payload = stage_delta(
            plan.base_snapshot, plan.target, staging, version=plan.version, base_version=plan.base.version,
            encoding=params.encoding, level=params.zstd_level, bucket_max_bytes=params.bucket_max_bytes,
            workers=params.workers,
        )
        snap = snapshot_of(plan.target.folder, plan.base.checksum_format, workers=params.workers,
                           checksums=payload.checksums)
        return payload, snap
    snap = snapshot_of(plan.target.folder, params.checksum_format, workers=params.workers)
    if params.kind == "initial":
        return None, snap
    return stage_full(snap, staging), snap


@task(name="upload payload", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[1, 4],
      retry_condition_fn=transient_only)  # a conflict or a denied write cannot succeed later
def upload(params: PublishParams, objects: ObjectStore, payload: Payload | None, url: str) -> int:
    return upload_payload(objects, payload, url, workers=params.storage.concurrency) if payload else 0


@task(name="write record", cache_policy=NO_CACHE)
def write_record(catalog: Catalog, record: Revision) -> bool:
    """Create the catalog record (last); an identical earlier publication is accepted as is."""
    try:
        return catalog.write(record)
    except ImmutableConflict:
        existing = catalog.read(record.version)
        if same_publication(existing, record):
            return False
        raise


def emit_published(record: Revision, catalog: Catalog) -> None:
    """Announce the revision: deployments that refit on publication match this event."""
    from prefect.events import emit_event

    emit_event(
        event=EVENT,
        resource={"prefect.resource.id": f"canonical-refit.revision.{record.model}.{record.version}",
                  "prefect.resource.name": f"{record.model} {record.version}"},
        payload={"model": record.model, "version": record.version, "sequence": record.sequence,
                 "catalog": catalog.url},
    )


@flow(name="publish", flow_run_name="publish {params.model} {params.kind}", validate_parameters=True)
def publish(params: PublishParams) -> PublishResult:
    """Publish ``params.checkpoint`` as the launch revision, a full revision or an exact-base delta."""
    started = time.perf_counter()
    objects = ObjectStore(params.storage)
    catalog = Catalog(objects, params.catalog, params.model)
    for prefix in {catalog.url, payload_root(params, catalog)}:  # catalog and payloads may be two buckets
        objects.ensure_conditional_writes(prefix, allow_unconditional=params.allow_unconditional_writes)
    plan = plan_revision(params, catalog)
    url = join_url(payload_root(params, catalog), plan.version)
    with tempfile.TemporaryDirectory(prefix="canonical-refit-publish-") as tmp:
        payload, snap = encode_payload(params, plan, Path(tmp) / plan.version)
        uri = join_url(url, payload.index_name) if payload else None
        record = make_record(params.model, plan.version, plan.sequence, PAYLOAD_FORMATS[params.kind],
                             snap.checksum_format, snap.format_digest, snap.target_digest, base=plan.base, uri=uri)
        if plan.existing is not None and not same_publication(plan.existing, record):
            raise ImmutableConflict("a different revision is already published under this version",
                                    revision=plan.version, file=catalog.record_url(plan.version))
        written = upload(params, objects, payload, url)
        created = write_record(catalog, record)
    if params.emit_event:
        emit_published(record, catalog)
    if params.keep_copy:
        PublisherCopy(params.state_dir, params.model).keep(params.checkpoint, record.version,
                                                           snap.checksum_format, snap.checksums)
    result = PublishResult(
        version=record.version, sequence=record.sequence, payload_format=record.payload_format,
        record_url=catalog.record_url(record.version), uri=record.uri, target_digest=record.target_digest,
        encoding=payload.encoding if payload else None, bytes_written=written,
        decoded_bytes=payload.decoded_bytes if payload else 0, encoded_bytes=payload.encoded_bytes if payload else 0,
        compression_ratio=round(payload.compression_ratio, 3) if payload else 0.0,
        changed_tensors=len(payload.changed) if payload else 0, files=len(payload.files) if payload else 0,
        seconds=round(time.perf_counter() - started, 3), already_published=not created,
    )
    log.info("published %s (seq %d, %s): %d bytes written, %d changed tensor(s), ratio %.2f, %.2fs",
             result.version, result.sequence, result.payload_format, result.bytes_written,
             result.changed_tensors, result.compression_ratio, result.seconds)
    return result


def parse_args(argv: list[str]) -> PublishParams:
    parser = argparse.ArgumentParser(prog="python -m flows.publish", description=(
        "Publish a local safetensors checkpoint as a canonical revision: the launch revision (metadata "
        "only), a full checkpoint, or an XOR delta against the exact previous revision."))
    add = parser.add_argument
    add("--catalog", required=True, help="catalog URL (s3://bucket/prefix, file:///path or a local folder)")
    add("--model", required=True, help="model id, e.g. org/name")
    add("--checkpoint", required=True, help="local folder of the safetensors checkpoint to publish")
    add("--kind", choices=("initial", "full", "delta"), default="delta",
        help="initial: revision 0 describing the launch snapshot; full: a full checkpoint; delta (default)")
    add("--version", help="version id of the new revision (default: r{sequence})")
    add("--payload-url", help="where payload objects go (default: {catalog}/../revisions/{version})")
    add("--base-version", help="revision the delta applies to (default: the latest)")
    add("--base-checkpoint", help="local copy of the base revision (default: the publisher's kept copy)")
    add("--state-dir", help="where the publisher keeps its copy of the last published checkpoint")
    add("--no-keep-copy", action="store_true", help="do not keep a copy of what was published")
    add("--encoding", choices=("xor", "xor_sparse", "overwrite", "auto"),
        help="delta encoding (default xor; auto picks a sparse one for tiny updates)")
    add("--checksum-format", choices=("adler32", "xxh3-128", "blake3"),
        help="per-tensor checksum of initial and full revisions (deltas use their base's); default adler32")
    add("--bucket-mib", type=int, help="decoded MiB per delta bucket (default 256)")
    add("--zstd-level", type=int, help="zstd compression level (default 3)")
    add("--workers", type=int, help="threads encoding tensors (default: cores, max 8)")
    add("--allow-unconditional-writes", action="store_true",
        help="publish even if the object store does not enforce create-only writes")
    add("--no-event", action="store_true", help=f"do not emit the {EVENT} event")
    add("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    given = {
        "catalog": args.catalog, "model": args.model, "checkpoint": args.checkpoint, "kind": args.kind,
        "version": args.version, "payload_url": args.payload_url, "base_version": args.base_version,
        "base_checkpoint": args.base_checkpoint, "state_dir": args.state_dir, "encoding": args.encoding,
        "checksum_format": args.checksum_format, "bucket_max_mib": args.bucket_mib,
        "zstd_level": args.zstd_level, "workers": args.workers,
    }
    params = {k: v for k, v in given.items() if v is not None}
    params.update(keep_copy=not args.no_keep_copy, emit_event=not args.no_event,
                  allow_unconditional_writes=args.allow_unconditional_writes)
    return PublishParams(**params), args.json


def main(argv: list[str] | None = None) -> int:
    params, as_json = parse_args(list(sys.argv[1:] if argv is None else argv))
    state = publish(params, return_state=True)
    value = state.result(raise_on_failure=False)
    if isinstance(value, PublishResult):
        print(json.dumps(asdict(value), sort_keys=True) if as_json else
              "\n".join(f"{k}: {v}" for k, v in asdict(value).items()))
        return 0
    message = str(value) if isinstance(value, RefitError) else f"{state.name}: {state.message}"
    print(json.dumps({"error": message}) if as_json else f"error: {message}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
