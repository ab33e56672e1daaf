"""Publication stage 2, encode payload: stage the revision's payload files locally (deterministic bytes)."""

from __future__ import annotations

from pathlib import Path

from storage.catalog.publisher import Payload, Snapshot, snapshot_of, stage_delta, stage_full
from tasks.plan_revision import Publication
from tasks.publisher import Publisher
from tasks.stage import Stage


def encode_payload(pub: Publisher, plan: Publication, staging: Path) -> tuple[Payload | None, Snapshot]:
    """Stage the payload files locally; returns the payload and the target snapshot."""
    params = pub.params
    if params.kind == "delta":
        payload = stage_delta(
            plan.base_snapshot, plan.target, staging, version=plan.version, base_version=plan.base.version,
            encoding=params.encoding, level=params.zstd_level, bucket_max_bytes=params.bucket_max_bytes,
            workers=params.workers,
        )
        snap = snapshot_of(plan.target, plan.base.checksum_format, workers=params.workers,
                           checksums=payload.checksums)
        return payload, snap
    snap = snapshot_of(plan.target, params.checksum_format, workers=params.workers)
    if params.kind == "initial":
        return None, snap
    return stage_full(snap, staging), snap


ENCODE_PAYLOAD = Stage("encode payload", encode_payload)
