"""Index manifests of full checkpoints and XOR deltas (docs/format.md, section 5): strict records parsed
by the one record parser (storage.jsonio.bounded_json.load_record), then checked against the catalog record."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, TypeVar

from pydantic import ConfigDict, field_validator
from pydantic.dataclasses import dataclass as record

from storage.catalog.records import Revision
from storage.format.checkpoint import check_shard_name
from storage.jsonio.bounded_json import INDEX, load_record, parse_record
from storage.format.digests import CHECKSUM_FORMATS
from storage.errors import FormatError, ManifestError
from storage.urls import join_url, parent_url

MAX_INDEX_BYTES = INDEX.max_bytes  # 64 MiB; depth and element bounds: storage.jsonio.bounded_json.INDEX
DELTA_ENCODINGS = ("xor", "xor_sparse", "overwrite", "xor_gaps")  # xor_gaps: opt-in, see storage.format.gaps
DELTA_INDEX_FILE = "delta.safetensors.index.json"
T, M = TypeVar("T"), TypeVar("M")


@dataclass(frozen=True)
class Manifest:
    """A validated index: which tensor lives in which shard or bucket file."""

    revision: Revision
    uri: str
    weight_map: Mapping[str, str]
    checksum_format: str | None
    delta_encoding: str | None = None
    raw: bytes = field(default=b"", repr=False)

    @property
    def is_delta(self) -> bool:
        return self.delta_encoding is not None

    @property
    def version(self) -> str:
        return self.revision.version

    @cached_property
    def _by_file(self) -> dict[str, list[str]]:
        """Each file's tensors, sorted (files in name order): computed once, not once per question."""
        out: dict[str, list[str]] = {}
        for tensor, file in self.weight_map.items():
            out.setdefault(file, []).append(tensor)
        return {f: sorted(out[f]) for f in sorted(out)}

    @property
    def files(self) -> list[str]:
        return list(self._by_file)

    def file_url(self, name: str) -> str:
        """Shard URI: the index URI's parent plus ``/`` plus the file name."""
        return join_url(parent_url(self.uri), name)

    def tensors_of(self, name: str) -> list[str]:
        return list(self._by_file.get(name, ()))


# -- the strict records of the two index kinds --------------------------------------------------------------
# Keys these records do not name are ignored: an index is a catalog object any publisher writes (a standard
# Hugging Face index carries ``metadata.total_size``, other tools add their own keys). A known key of the
# wrong type, or a required one missing, is refused as a ManifestError naming the file, the revision and the
# field: the index's own (``metadata``, ``weight_map.<tensor>``), then, its metadata parsed as a record of its
# own, the metadata's (``delta_encoding``).
_INDEX_RECORD = ConfigDict(strict=True, extra="ignore")


@record(frozen=True, config=_INDEX_RECORD)
class FullIndexMetadata:
    """``metadata`` of a ``model.safetensors.index.json``: ``checksum_format`` may be absent, never null."""

    checksum_format: str | None = None

    @field_validator("checksum_format", mode="before")
    @classmethod
    def _not_null(cls, value):  # runs only when the key is present: present means a format's name
        if value is None:
            raise ValueError("null is not a checksum format (leave the key out for none)")
        return value


@record(frozen=True, config=_INDEX_RECORD)
class FullIndex:
    """A full checkpoint's index: ``metadata`` (optional) and ``weight_map`` ``{tensor: shard file}``."""

    weight_map: dict[str, str]
    metadata: dict = field(default_factory=dict)  # a FullIndexMetadata


@record(frozen=True, config=_INDEX_RECORD)
class DeltaIndexMetadata:
    """``metadata`` of ``delta.safetensors.index.json``: every key required (docs/format.md, section 5)."""

    version: str
    base_version: str
    compression_format: str
    delta_encoding: str
    checksum_format: str


@record(frozen=True, config=_INDEX_RECORD)
class DeltaIndex:
    """A delta's index: ``metadata`` and ``weight_map`` ``{tensor: bucket file}`` (may be empty)."""

    metadata: dict  # a DeltaIndexMetadata
    weight_map: dict[str, str]


def _parse(cls: type[T], metadata_cls: type[M], raw: bytes, revision: Revision, uri: str) -> tuple[T, M]:
    """The bounded JSON of ``raw`` as the strict index record ``cls`` and its metadata as ``metadata_cls``, or a
    ManifestError naming the file, the revision and the field."""
    index = load_record(raw, cls, INDEX, error=ManifestError, revision=revision.version, file=uri)
    return index, parse_record(metadata_cls, index.metadata, error=ManifestError, revision=revision.version,
                               file=uri)


def _weight_map(weight_map: dict[str, str], revision: Revision, uri: str, *, allow_empty: bool) -> dict[str, str]:
    if not weight_map and not allow_empty:
        raise ManifestError("weight_map of a full checkpoint is empty", revision=revision.version, file=uri,
                            field="weight_map")
    for tensor, name in weight_map.items():
        if not tensor:
            raise ManifestError("weight_map has an empty tensor name", revision=revision.version, file=uri)
        check_shard_name(name, revision=revision.version, file=uri, tensor=tensor)
    return weight_map


def parse_full_manifest(raw: bytes, revision: Revision) -> Manifest:
    """A standard ``model.safetensors.index.json``; ``checksum_format`` in its metadata is optional."""
    uri = revision.uri
    index, metadata = _parse(FullIndex, FullIndexMetadata, raw, revision, uri)
    checksum_format = metadata.checksum_format
    if checksum_format is not None and checksum_format not in CHECKSUM_FORMATS:
        raise ManifestError(f"unsupported checksum format {checksum_format!r} (supported: "
                            f"{', '.join(CHECKSUM_FORMATS)})", revision=revision.version, file=uri,
                            field="checksum_format")
    weight_map = _weight_map(index.weight_map, revision, uri, allow_empty=False)
    return Manifest(revision, uri, weight_map, checksum_format, None, raw)


def parse_delta_manifest(raw: bytes, revision: Revision) -> Manifest:
    """A delta index whose metadata must agree with the catalog record, field by field."""
    uri = revision.uri
    index, metadata = _parse(DeltaIndex, DeltaIndexMetadata, raw, revision, uri)

    def need(name: str, expected=None, allowed=None) -> str:
        got = getattr(metadata, name)
        if expected is not None and got != expected:
            raise ManifestError(f"delta metadata {name} is {got!r}, the catalog says {expected!r}",
                                revision=revision.version, file=uri, field=name)
        if allowed is not None and got not in allowed:
            raise ManifestError(f"unsupported {name} {got!r} (supported: {', '.join(allowed)})",
                                revision=revision.version, file=uri, field=name)
        return got

    need("version", revision.version)
    need("base_version", revision.base_version)
    need("compression_format", allowed=("zstd",))
    encoding = need("delta_encoding", allowed=DELTA_ENCODINGS)
    checksum_format = need("checksum_format", allowed=CHECKSUM_FORMATS)
    need("checksum_format", revision.checksum_format)
    weight_map = _weight_map(index.weight_map, revision, uri, allow_empty=True)
    return Manifest(revision, uri, weight_map, checksum_format, encoding, raw)


def parse_manifest(raw: bytes, revision: Revision) -> Manifest:
    """Dispatch on the record's payload format."""
    if revision.payload_format == "xor_delta":
        return parse_delta_manifest(raw, revision)
    if revision.payload_format == "full_hf_checkpoint":
        return parse_full_manifest(raw, revision)
    raise FormatError("a metadata_only revision has no manifest", revision=revision.version)


def require_same_tensors(manifest: Manifest, layout: Mapping[str, object]) -> None:
    """A full revision's index must map exactly the local checkpoint's tensors."""
    for tensor in sorted(set(manifest.weight_map) ^ set(layout)):
        where = ("is in the index but not in the local checkpoint" if tensor in manifest.weight_map
                 else "of the local checkpoint is missing from the index")
        raise ManifestError(f"tensor {where}", revision=manifest.version, file=manifest.uri, tensor=tensor)


def require_known_tensors(manifest: Manifest, layout: Mapping[str, object]) -> None:
    """Every tensor a delta names must exist in the local checkpoint."""
    for tensor in manifest.weight_map:
        if tensor not in layout:
            raise ManifestError("delta names a tensor the local checkpoint does not have",
                                revision=manifest.version, file=manifest.uri, tensor=tensor)
