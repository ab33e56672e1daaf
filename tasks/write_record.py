"""Publication stage 4, write record: create the catalog record, last, which makes the revision visible."""

from __future__ import annotations

from storage.catalog.publisher import same_publication
from storage.catalog.records import Revision
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


WRITE_RECORD = Stage("write record", write_record, retried=False)
