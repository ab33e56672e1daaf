"""What a run tells the fleet: this node's status record beside the catalog, and a Prefect event."""

from __future__ import annotations

import logging
import time

from flows.prefect_api import configured_api_url
from flows.report import RefitResult
from storage.catalog.nodes import NodeRecord, write_node_record
from storage.errors import RefitError
from storage.objects.store import ObjectStore
from storage.settings import RefitParams
from storage.store.local_store import LocalStore
from tasks.stage import in_flow_run

log = logging.getLogger("canonical_refit.refit")


NODE_EVENT = "canonical-refit.node.{status}"


def report_node(params: RefitParams, result: RefitResult) -> None:
    """Tell the fleet how this run ended: this node's status record beside the catalog, and an event.

    Best effort: a node whose record cannot be written still did (or did not
    do) its refit; the run's own outcome is what counts, so this never fails it.
    """
    try:
        store = LocalStore(params.cache_dir, params.model, create=False)
        active = store.active() if store.exists else None
    except RefitError:
        active = None
    stages = {s["name"]: s["seconds"] for s in result.stages}
    fetched = next((s["bytes"] for s in result.stages if s["name"] == "fetch buckets"), 0)
    record = NodeRecord(node=params.node, model=params.model, version=active.version if active else None,
                        digest=active.digest if active else None, status=result.status, target=params.target,
                        error=result.error, stages=stages, bytes_fetched=fetched,
                        attempts=max(1, len(result.attempts)), updated_at_unix_ms=int(time.time() * 1000),
                        launch_files=active.launch_files if active else None)
    try:
        write_node_record(ObjectStore.shared(params.storage), params.catalog, record)
    except RefitError as exc:
        log.warning("could not write the status record of node %s: %s", params.node, exc)
    if in_flow_run() or configured_api_url():
        try:
            from prefect.events import emit_event

            emit_event(event=NODE_EVENT.format(status=result.status.lower()),
                       resource={"prefect.resource.id": f"canonical-refit.node.{params.model}.{params.node}",
                                 "prefect.resource.name": params.node},
                       payload=record.to_json())
        except Exception as exc:  # events are a view of the outcome, never part of it
            log.warning("could not emit the node event of %s: %s", params.node, exc)
