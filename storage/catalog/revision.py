"""One revision record: its model, its field rules, and which errors quarantine an object (docs/format.md, section 4)."""

from __future__ import annotations

import logging
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from storage.jsonio.bounded_json import RECORD, load_json
from storage.errors import Cancelled, CatalogError, Interrupted, InvalidURI, RefitError
from storage.format.digests import DIGEST_PATTERN
from storage.urls import normalize_url
from storage.settings import VERSION_PATTERN

log = logging.getLogger("canonical_refit.catalog")

SCHEMA = "canonical-refit.revision.v1"
MAX_RECORD_BYTES = 1 * 2**20
MAX_CHAIN = 100_000
CLAIMS = "sequences"  # {catalog}/sequences/{n:012d}.json: create-only sequence claims (docs/format.md, 4.7)
HEAD_HINT = "hints/head.json"  # {catalog}/hints/head.json: where the newest record probably is (4.9)
HEAD_SCHEMA = "canonical-refit.catalog-head.v1"
MAX_HINT_BYTES = 4096
MAX_SEQUENCE = 10**12 - 1  # claims are named with 12 digits
_VERSION_RE = re.compile(VERSION_PATTERN)


class Revision(BaseModel):
    """One catalog record. Construction enforces every rule of docs/format.md, section 4."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True, populate_by_name=True)

    schema_: Literal["canonical-refit.revision.v1"] = Field(alias="schema")
    model: str = Field(min_length=1)
    version: str = Field(pattern=VERSION_PATTERN)
    sequence: int = Field(ge=0)
    payload_format: Literal["metadata_only", "full_hf_checkpoint", "xor_delta"]
    base_version: str | None = Field(pattern=VERSION_PATTERN)
    base_digest: str | None
    target_digest: str
    format_digest: str
    checksum_format: Literal["adler32", "xxh3-128", "blake3"]
    uri: str | None
    created_at_unix_ms: int = Field(ge=0)

    @field_validator("target_digest", "format_digest", "base_digest")
    @classmethod
    def _digest_form(cls, value: str | None) -> str | None:
        if value is not None and not DIGEST_PATTERN.match(value):
            raise ValueError("must be 'sha256:' followed by 64 lowercase hex digits")
        return value

    @field_validator("uri")
    @classmethod
    def _uri_form(cls, value: str | None) -> str | None:
        if value is not None:
            if "://" not in value:
                raise ValueError("must be an absolute URL (s3://..., file://...), not a relative path")
            try:
                normalize_url(value)
            except InvalidURI as exc:
                raise ValueError(exc.reason) from None
        return value

    @model_validator(mode="after")
    def _payload_rules(self) -> "Revision":
        delta = self.payload_format == "xor_delta"
        if delta:
            for name in ("base_version", "base_digest", "uri"):
                if getattr(self, name) is None:
                    raise _FieldRule(name, f"is required for payload_format {self.payload_format!r}")
            if self.base_version == self.version:
                raise _FieldRule("base_version", "equals the revision's own version")
            if self.sequence == 0:
                raise _FieldRule("sequence", "a delta cannot be sequence 0")
        else:
            for name in ("base_version", "base_digest"):
                if getattr(self, name) is not None:
                    raise _FieldRule(name, f"must be null for payload_format {self.payload_format!r}")
        if self.payload_format == "metadata_only" and self.uri is not None:
            raise _FieldRule("uri", "must be null for a metadata_only revision")
        if (self.payload_format == "metadata_only") != (self.sequence == 0):
            raise _FieldRule("sequence", "is 0 exactly for the metadata_only launch revision")
        if self.payload_format == "full_hf_checkpoint" and self.uri is None:
            raise _FieldRule("uri", "is required for a full_hf_checkpoint revision")
        return self

    def to_json(self) -> dict:
        return self.model_dump(by_alias=True)

    def describe(self) -> str:
        base = f" on {self.base_version}" if self.base_version else ""
        return f"{self.version} (seq {self.sequence}, {self.payload_format}{base})"


class _FieldRule(ValueError):
    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field} {message}")


def parse_revision(raw: bytes | str | dict, *, version: str | None, model: str | None, file: str) -> Revision:
    """Validate one record; errors name the revision, the file and the field."""
    if not isinstance(raw, dict):
        raw = load_json(raw, RECORD, error=CatalogError, expect=dict, revision=version, file=file)
    if not isinstance(raw, dict):
        raise CatalogError(f"record is a JSON {type(raw).__name__}, not an object", revision=version, file=file)
    try:
        record = Revision.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"]
        ctx_error = (first.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _FieldRule):
            field, message = ctx_error.field, str(ctx_error)
        raise CatalogError(f"invalid record: {message}", revision=version or raw.get("version"),
                           file=file, field=field) from None
    if version is not None and record.version != version:
        raise CatalogError(f"record says version {record.version!r} but is stored as {version}.json",
                           revision=version, file=file, field="version")
    if model is not None and record.model != model:
        raise CatalogError(f"record belongs to model {record.model!r}, not {model!r}",
                           revision=record.version, file=file, field="model")
    return record


def quarantinable(exc: BaseException) -> bool:
    """True for an error about a catalog object itself (unreadable, unparsable, invalid, refused): the object is
    skipped and quarantined. A transient storage error, a stop request or a non-``Exception`` (Ctrl-C)
    propagates: they say nothing about the object."""
    if isinstance(exc, (Cancelled, Interrupted)):
        return False
    if isinstance(exc, RefitError):
        return not exc.transient
    return isinstance(exc, Exception)


def _unusable(exc: BaseException, revision: str | None, url: str) -> CatalogError:
    """Any error met reading or parsing an object (RecursionError, MemoryError, UnicodeError, OSError...) as a
    ``CatalogError`` naming the object."""
    detail = str(exc)[:200] or type(exc).__name__
    return CatalogError(f"catalog object cannot be read or parsed ({type(exc).__name__}: {detail})",
                        revision=revision, file=url)
