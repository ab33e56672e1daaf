"""What every publication stage works with: parameters, object storage, the catalog, a stop token, a ledger."""

from __future__ import annotations

import logging
import uuid
from contextlib import contextmanager
from typing import Iterator

from storage.cancel import StopToken, current_stop
from storage.catalog.records import Catalog
from storage.objects.store import ObjectStore
from storage.settings import PublishParams
from storage.urls import join_url, parent_url
from tasks.stage import Ledger, StageRecord, measuring

log = logging.getLogger("canonical_refit.publish")
PUBLISH_STAGES = ("plan revision", "encode payload", "upload payload", "write record")


class Publisher:
    """One publication's run: what its stages share (no Prefect here)."""

    def __init__(self, params: PublishParams, *, stop: StopToken | None = None):
        self.params = params
        self.objects = ObjectStore.shared(params.storage)
        self.catalog = Catalog(self.objects, params.catalog, params.model)
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

    def stage_retry_policy(self):
        return self.params.stage_retry_policy()

    def close(self) -> None:
        self.stop.close()
