"""Publication stage 3, upload payload: put the staged files create-only (the index last)."""

from __future__ import annotations

from dataclasses import dataclass

from storage.catalog.publisher import Payload, upload_payload
from tasks.publisher import Publisher
from tasks.stage import Stage


@dataclass(frozen=True)
class Uploaded:
    bytes: int


def upload(pub: Publisher, payload: Payload | None, url: str) -> Uploaded:
    """Put the staged payload create-only (a retry accepts what an earlier attempt put)."""
    return Uploaded(upload_payload(pub.objects, payload, url, workers=pub.params.storage.concurrency)
                    if payload else 0)


UPLOAD_PAYLOAD = Stage("upload payload", upload)  # create-only: a publication retry completes a partial upload
