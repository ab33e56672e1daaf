"""Publication stage 4, write record: create the catalog record, last, which makes the revision visible."""

from __future__ import annotations

from storage.catalog.publisher import same_publication
from storage.catalog.records import Catalog, Revision
from storage.errors import ImmutableConflict
from tasks.publisher import Publisher
from tasks.stage import Stage


def write_record(pub: Publisher, record: Revision) -> bool:
    """Create the catalog record (last); an identical earlier publication is accepted as is."""
    try:
        return pub.catalog.write(record)
    except ImmutableConflict:
        existing = pub.catalog.read(record.version)
        if same_publication(existing, record):
            return False
        raise


WRITE_RECORD = Stage("write record", write_record)

EVENT = "canonical-refit.revision.published"


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
