"""What every publication stage works with: parameters, object storage, the catalog, a stop token, a ledger."""

from __future__ import annotations

import logging
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from storage.runtime.cancel import StopToken, current_stop
from storage.catalog.records import Catalog
from storage.catalog.signing import RecordSigner
from storage.errors import SignatureError
from storage.objects.store import ObjectStore
from storage.settings import PublishParams
from storage.urls import join_url, parent_url
from tasks.stage import Ledger, StageRecord, measuring

log = logging.getLogger("canonical_refit.publish")
PUBLISH_STAGES = ("plan revision", "encode payload", "upload payload", "write record")


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
    model_bytes: int = 0  # the checkpoint's tensor bytes
    bytes_per_s: float = 0.0  # model bytes per second of the whole run
    already_published: bool = False
    attempts: int = 1  # of the upload and record write (retried after transient failures)
    stages: list = field(default_factory=list)  # each stage's name, seconds, bytes, requests, retries, status
    event_delivered: bool | None = None  # the server confirmed the published event; None: no event was due
    event_error: str | None = None  # why the event was not delivered (flows/announce.py)


def signer(params: PublishParams):
    """What signs this publisher's records (``signing_key``), or None: records are unsigned."""
    if params.signing_key is None:
        return None
    try:
        return RecordSigner.from_file(params.signing_key).sign
    except ValueError as exc:
        raise SignatureError(f"the signing key cannot be used: {exc}", file=str(params.signing_key),
                             field="signing_key") from None


class Publisher:
    """One publication's run: what its stages share (no Prefect here)."""

    def __init__(self, params: PublishParams, *, stop: StopToken | None = None):
        self.params = params
        self.objects = ObjectStore.shared(params.storage)
        self.catalog = Catalog(self.objects, params.catalog, params.model, sign=signer(params))
        self.stop = (stop or current_stop.get()).child()
        self.ledger = Ledger(PUBLISH_STAGES, log=log)
        self.publication = uuid.uuid4().hex  # this run's token: its sequence claim and nothing else's

    @property
    def payload_root(self) -> str:
        """Where payload objects go: ``--payload-url``, or ``revisions/`` beside the catalog."""
        return self.params.payload_url or join_url(parent_url(self.catalog.url), "revisions")

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRecord]:
        with measuring(self.ledger.record(name), self.stop) as record:
            yield record

    def close(self) -> None:
        self.stop.close()
