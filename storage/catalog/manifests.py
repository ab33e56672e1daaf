"""Index manifests of full checkpoints and XOR deltas (docs/format.md, section 5), validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

from storage.catalog.records import Revision
from storage.format.checkpoint import check_shard_name
from storage.jsonio.bounded_json import INDEX, load_json
from storage.format.digests import CHECKSUM_FORMATS
from storage.errors import FormatError, ManifestError
from storage.urls import join_url, parent_url

MAX_INDEX_BYTES = INDEX.max_bytes  # 64 MiB; depth and element bounds: storage.jsonio.bounded_json.INDEX
DELTA_ENCODINGS = ("xor", "xor_sparse", "overwrite", "xor_gaps")  # xor_gaps: opt-in, see storage.format.gaps
DELTA_INDEX_FILE = "delta.safetensors.index.json"


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


def _load(raw: bytes, revision: Revision, uri: str) -> dict:
    return load_json(raw, INDEX, error=ManifestError, expect=dict, revision=revision.version, file=uri)


def _weight_map(value: dict, revision: Revision, uri: str, *, allow_empty: bool) -> dict[str, str]:
    weight_map = value.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ManifestError("index has no weight_map object", revision=revision.version, file=uri, field="weight_map")
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
    value = _load(raw, revision, uri)
    metadata = value.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ManifestError("index metadata is not an object", revision=revision.version, file=uri, field="metadata")
    checksum_format = metadata.get("checksum_format")
    if "checksum_format" in metadata and checksum_format not in CHECKSUM_FORMATS:  # null included
        raise ManifestError(f"unsupported checksum format {checksum_format!r} (supported: "
                            f"{', '.join(CHECKSUM_FORMATS)})", revision=revision.version, file=uri,
                            field="checksum_format")
    weight_map = _weight_map(value, revision, uri, allow_empty=False)
    return Manifest(revision, uri, weight_map, checksum_format, None, raw)


def parse_delta_manifest(raw: bytes, revision: Revision) -> Manifest:
    """A delta index whose metadata must agree with the catalog record, field by field."""
    uri = revision.uri
    value = _load(raw, revision, uri)
    metadata = value.get("metadata")
    if not isinstance(metadata, dict):
        raise ManifestError("delta index has no metadata object", revision=revision.version, file=uri,
                            field="metadata")

    def need(name: str, expected=None, allowed=None) -> str:
        if name not in metadata:
            raise ManifestError(f"delta metadata is missing {name!r}", revision=revision.version, file=uri, field=name)
        got = metadata[name]
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
    weight_map = _weight_map(value, revision, uri, allow_empty=True)
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
