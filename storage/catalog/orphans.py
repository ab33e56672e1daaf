"""Payloads no record references: what a publisher that crashed before its record left behind.

A revision becomes visible only by its catalog record, written last; a
publication that never wrote it leaves payload objects that nothing
references (docs/format.md, section 4.7). They never block a later
publication (it takes another sequence, and another prefix if it reuses the
name) and are reclaimed by deleting them. This finds them: every folder
under the payload root that no valid record's ``uri`` points into, and whose
newest object is older than a grace period (a live publication's objects are
young: never count them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from storage.catalog.records import Catalog, quarantinable
from storage.errors import RefitError
from storage.objects.store import ObjectStore
from storage.urls import join_url


@dataclass(frozen=True)
class Orphan:
    """One unreferenced payload folder: its URL, objects, bytes and the age of its newest object."""

    url: str
    objects: int
    bytes: int
    age_s: float


def referenced_folders(catalog: Catalog) -> set[str]:
    """The payload folders (URLs) the catalog's records point into."""
    folders = set()
    for version in catalog.versions():
        try:
            record = catalog.read(version)
        except RefitError as exc:
            if not quarantinable(exc):
                raise
            continue  # an unusable (quarantined) record references nothing a receiver would use
        if record.uri:
            folders.add(record.uri.rsplit("/", 1)[0])
    return folders


def find_orphans(objects: ObjectStore, catalog: Catalog, payload_root: str, *,
                 older_than_s: float = 24 * 3600.0) -> list[Orphan]:
    """Payload folders under ``payload_root`` that no record references and nothing wrote for ``older_than_s``,
    then the coordination folders sharded publications left (``stale_publications``)."""
    referenced = referenced_folders(catalog)
    payloads = [o for o in _folders(objects, payload_root, older_than_s) if o.url not in referenced]
    return payloads + stale_publications(objects, catalog, older_than_s=older_than_s)


def stale_publications(objects: ObjectStore, catalog: Catalog, *, older_than_s: float) -> list[Orphan]:
    """Coordination folders of sharded publications (``{catalog}/publications/{id}/``, docs/format.md 4.8) that
    nothing wrote for ``older_than_s``: a committed publication's rank 0 removes its own, so these are what a
    dead publication, or a rank 0 that died after its record, left. Nothing reads them once a publication ended."""
    return _folders(objects, join_url(catalog.url, "publications"), older_than_s)


def _folders(objects: ObjectStore, root: str, older_than_s: float) -> list[Orphan]:
    """Each folder directly under ``root`` whose newest object is at least ``older_than_s`` old, by name."""
    folders: dict[str, list[tuple[int, float]]] = {}
    for name, size, mtime in objects.walk(root):
        if "/" in name:
            folders.setdefault(name.split("/", 1)[0], []).append((size, mtime))
    now = time.time()
    out = []
    for folder, entries in sorted(folders.items()):
        age = now - max(mtime for _, mtime in entries)
        if age >= older_than_s:
            out.append(Orphan(join_url(root, folder), len(entries), sum(size for size, _ in entries), round(age, 1)))
    return out
