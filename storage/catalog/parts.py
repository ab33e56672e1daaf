"""A revision published by several trainer ranks at once: the plan rank 0 writes, the part every rank writes.

All of it lives in object storage, under the publication's own prefix
``{catalog}/publications/{publication}/`` (``publication`` is an id the ranks
share: the trainer broadcasts it), every object written create-only:

    plan.json          rank 0: version, sequence, kind, base, checksum format, encoding, world size, payload URL
    part-{rank}.json   each rank: its tensors' layout and checksums, its payload files and their sizes

Every rank uploads the payload objects of the tensors it holds under the
plan's payload URL (file names carry the rank, so they never collide). Rank 0
then merges the parts (``merge_parts``): every tensor exactly once, the
layout of the base for a delta, every file there with its size; only then
does it write the index and, last, the catalog record (docs/format.md, 4.8).
Until that record exists nothing is visible: a rank that dies leaves a plan,
parts and objects that no record references.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as strict_dataclass

from storage.jsonio.bounded_json import PART, RECORD, load_record
from storage.jsonio.canonical import canonical_json
from storage.errors import CatalogError, ObjectNotFound
from storage.format.digests import format_digest, snapshot_digest
from storage.objects.store import ObjectStore
from storage.urls import join_url

PLAN_SCHEMA = "canonical-refit.publication-plan.v1"
PART_SCHEMA = "canonical-refit.publication-part.v1"
MAX_PART_BYTES = PART.max_bytes  # 64 MiB; a plan is a RECORD (1 MiB): storage.jsonio.bounded_json
# The ranks of one publication run this program: a key a rank does not know refuses the plan or part (the
# publication fails naming it) rather than being silently dropped.
STRICT = ConfigDict(strict=True, extra="forbid")
Layout = Annotated[tuple[str, Annotated[tuple[int, ...], Field(strict=False)]], Field(strict=False)]


@strict_dataclass(frozen=True, config=STRICT)
class PublicationPlan:
    """What every rank publishes into: the revision's identity, its base and how it is encoded."""

    publication: str
    version: str
    sequence: int
    kind: str  # initial, full or delta
    world_size: int
    checksum_format: str
    payload_url: str | None  # None for the launch revision (no payload)
    base_version: str | None = None
    base_digest: str | None = None
    encoding: str | None = None  # a named encoding: every rank's frames are read with the index's one
    level: int | None = None
    schema: str = PLAN_SCHEMA


@strict_dataclass(frozen=True, config=STRICT)
class PublicationPart:
    """One rank's share: the layout and checksum of each of its tensors, and the payload files it uploaded."""

    rank: int
    layout: dict[str, Layout]  # name -> [dtype, shape]
    checksums: dict[str, str]  # name -> checksum of the target tensor (changed or not)
    weight_map: dict[str, str] = field(default_factory=dict)  # name -> file (changed tensors of a delta; all of a full)
    files: dict[str, int] = field(default_factory=dict)  # file -> size in bytes
    decoded_bytes: int = 0
    encoded_bytes: int = 0
    base_checksums: dict[str, str] = field(default_factory=dict)  # a delta's: checksums in the base it encoded against
    schema: str = PART_SCHEMA


def publication_url(catalog_url: str, publication: str) -> str:
    return join_url(catalog_url, "publications", publication)


def write_plan(objects: ObjectStore, catalog_url: str, plan: PublicationPlan) -> None:
    objects.put_immutable(join_url(publication_url(catalog_url, plan.publication), "plan.json"),
                          canonical_json(asdict(plan)))


def read_plan(objects: ObjectStore, catalog_url: str, publication: str) -> PublicationPlan | None:
    """The plan of ``publication``, or None while rank 0 has not written it."""
    url = join_url(publication_url(catalog_url, publication), "plan.json")
    try:
        data = objects.read_bytes(url, max_size=RECORD.max_bytes)
    except ObjectNotFound:
        return None
    plan = load_record(data, PublicationPlan, RECORD, error=CatalogError, file=url)
    if plan.schema != PLAN_SCHEMA or plan.publication != publication:
        raise CatalogError("the publication plan is for another schema or publication", file=url, field="schema")
    return plan


def part_name(rank: int) -> str:
    return f"part-{rank:05d}.json"


def write_part(objects: ObjectStore, catalog_url: str, publication: str, part: PublicationPart) -> None:
    objects.put_immutable(join_url(publication_url(catalog_url, publication), part_name(part.rank)),
                          canonical_json(asdict(part)))


def read_parts(objects: ObjectStore, catalog_url: str, plan: PublicationPlan) -> dict[int, PublicationPart]:
    """The parts written so far, by rank."""
    base = publication_url(catalog_url, plan.publication)
    parts = {}
    for name in objects.list_names(base, ".json"):
        if not name.startswith("part-"):
            continue
        url = join_url(base, name)
        part = load_record(objects.read_bytes(url, max_size=MAX_PART_BYTES), PublicationPart, PART,
                           error=CatalogError, revision=plan.version, file=url)
        if part.schema != PART_SCHEMA or name != part_name(part.rank) or not 0 <= part.rank < plan.world_size:
            raise CatalogError("a publication part names another rank or schema", revision=plan.version, file=url)
        parts[part.rank] = part
    return parts


@dataclass(frozen=True)
class Merged:
    """The revision the parts make together: what a single publisher would have written for the same tensors."""

    layout: dict  # name -> (dtype, shape)
    checksums: dict
    weight_map: dict
    format_digest: str
    target_digest: str
    decoded_bytes: int
    encoded_bytes: int
    files: dict


def merge_parts(plan: PublicationPlan, parts: dict[int, PublicationPart], *, base_format_digest: str | None,
                sizes: dict[str, int]) -> Merged:
    """Every tensor of every part exactly once, the base's layout for a delta, every payload file uploaded with
    the size its part recorded (``sizes``: what the store holds under the payload URL); else ``CatalogError``
    naming the revision, the rank and the tensor or file."""
    missing = sorted(set(range(plan.world_size)) - set(parts))
    if missing:
        raise CatalogError(f"ranks {missing} of {plan.world_size} wrote no part", revision=plan.version)
    layout, checksums, weight_map, files, owner = {}, {}, {}, {}, {}
    for rank in sorted(parts):
        part = parts[rank]
        if set(part.layout) != set(part.checksums):
            raise CatalogError(f"rank {rank}'s part lists layouts and checksums of different tensors",
                               revision=plan.version)
        for name, (dtype, shape) in part.layout.items():
            if name in owner:
                raise CatalogError(f"tensor published by ranks {owner[name]} and {rank}", revision=plan.version,
                                   tensor=name)
            owner[name] = rank
            layout[name] = (dtype, tuple(shape))
            checksums[name] = part.checksums[name]
        for name, file in part.weight_map.items():
            if owner.get(name) != rank:
                raise CatalogError(f"rank {rank}'s weight map names a tensor it does not hold", revision=plan.version,
                                   tensor=name)
            if file not in part.files:
                raise CatalogError(f"rank {rank} maps the tensor to a file it did not upload", revision=plan.version,
                                   tensor=name, file=file)
            weight_map[name] = file
        for file, size in part.files.items():
            if file in files:
                raise CatalogError("payload file uploaded by two ranks", revision=plan.version, file=file)
            if sizes.get(file) != size:
                raise CatalogError(f"rank {rank}'s payload file is {sizes.get(file)} bytes in the store, its part "
                                   f"says {size}", revision=plan.version, file=file)
            files[file] = size
    if not layout:
        raise CatalogError("the parts hold no tensor", revision=plan.version)
    digest = format_digest((name, dtype, shape) for name, (dtype, shape) in layout.items())
    if base_format_digest is not None and digest != base_format_digest:
        raise CatalogError(f"the ranks' tensors together have format digest {digest}, the base {plan.base_version} "
                           f"{base_format_digest}: a tensor is missing, extra or of another shape",
                           revision=plan.version, field="format_digest")
    return Merged(layout, checksums, dict(sorted(weight_map.items())), digest,
                  snapshot_digest(plan.checksum_format, digest, checksums),
                  sum(p.decoded_bytes for p in parts.values()), sum(p.encoded_bytes for p in parts.values()), files)
