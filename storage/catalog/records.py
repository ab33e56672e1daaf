"""The revision catalog: one immutable JSON record per revision (docs/format.md, section 4)."""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from storage.canonical import canonical_json, unique_keys
from storage.format.digests import DIGEST_PATTERN
from storage.durable import atomic_write_json, read_json_file
from storage.errors import (
    CatalogError, ImmutableConflict, InvalidURI, LineageError, ObjectNotFound, PermanentStorageError, RefitError,
)
from storage.objects.store import ObjectStore
from storage.urls import join_url, normalize_url
from storage.settings import VERSION_PATTERN

log = logging.getLogger("canonical_refit.catalog")

SCHEMA = "canonical-refit.revision.v1"
MAX_RECORD_BYTES = 1 * 2**20
MAX_CHAIN = 100_000
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
        try:
            raw = json.loads(raw, object_pairs_hook=unique_keys)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CatalogError(f"record is not valid JSON ({exc})", revision=version, file=file) from None
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


class Catalog:
    """Read and write the revision records of one model under one catalog URL."""

    def __init__(self, store: ObjectStore, url: str, model: str, *, cache_dir: Path | None = None):
        self.store = store
        self.url = normalize_url(url)
        self.model = model
        self.cache_dir = cache_dir
        self._records: dict[str, Revision] = {}
        self.quarantined: dict[str, RefitError] = {}  # malformed records met by ``list``

    def record_url(self, version: str) -> str:
        if not _VERSION_RE.match(version):
            raise CatalogError("invalid version id", revision=version, field="version")
        return join_url(self.url, f"{version}.json")

    def read(self, version: str) -> Revision:
        """One record (memoised: records are immutable)."""
        if version in self._records:
            return self._records[version]
        url = self.record_url(version)
        record = self._read_cached(version, url)
        if record is None:
            try:
                raw = self.store.read_bytes(url, max_size=MAX_RECORD_BYTES)
            except RefitError as exc:  # e.g. an oversized record: name the revision too
                raise exc.with_context(revision=version)
            record = parse_revision(raw, version=version, model=self.model, file=url)
            self._write_cached(version, url, record)
        self._records[version] = record
        return record

    def versions(self) -> list[str]:
        """Version ids of every record in the catalog."""
        names = self.store.list_names(self.url, ".json")
        versions = []
        for name in names:
            stem = name[: -len(".json")]
            if _VERSION_RE.match(stem):
                versions.append(stem)
            else:
                log.warning("ignoring catalog object %s: not a valid version id", join_url(self.url, name))
        return versions

    def list(self) -> list[Revision]:
        """Every valid record, sorted by sequence; malformed ones are quarantined (``self.quarantined``).

        A record that breaks the rules is logged, kept in ``quarantined`` (its
        URL and the error) and left out: it blocks only refits whose lineage
        passes through it, never the others.
        """
        versions = self.versions()

        def read(version: str) -> Revision | RefitError:
            try:
                return self.read(version)
            except (CatalogError, PermanentStorageError) as exc:  # malformed, oversized, gone since listed
                return exc

        with ThreadPoolExecutor(max_workers=self.store.settings.concurrency) as pool:
            outcomes = list(pool.map(read, versions))
        records = []
        for version, outcome in zip(versions, outcomes):
            if isinstance(outcome, RefitError):
                if version not in self.quarantined:
                    log.warning("quarantined catalog record %s: %s", self.record_url(version), outcome)
                self.quarantined[version] = outcome
            else:
                records.append(outcome)
        return sorted(records, key=lambda r: (r.sequence, r.version))

    def latest(self) -> Revision:
        """The valid record with the highest sequence (malformed records are skipped, with a warning)."""
        records = self.list()
        if not records:
            raise self._empty()
        top = records[-1]
        tied = [r.version for r in records if r.sequence == top.sequence]
        if len(tied) > 1:
            raise CatalogError(f"'latest' is ambiguous: records {' and '.join(tied)} share sequence "
                               f"{top.sequence}; remove the one published by mistake",
                               file=self.url, field="sequence")
        return top

    def initial(self, version: str | None = None) -> Revision:
        """Revision 0: ``version`` if given, else the one valid record with sequence 0."""
        if version is not None:
            record = self.read(version)
        else:
            records = self.list()
            if not records:
                raise self._empty()
            zeros = [r for r in records if r.sequence == 0]
            if len(zeros) != 1:
                found = " and ".join(r.version for r in zeros) or "none"
                raise CatalogError(
                    f"the catalog needs exactly one valid sequence-0 (launch) record, found {found}; publish "
                    "the launch revision with --kind initial, or name it with --initial-version",
                    file=self.url, field="sequence",
                )
            record = zeros[0]
        if record.payload_format != "metadata_only" or record.sequence != 0:
            raise CatalogError("the launch revision must be a metadata_only record with sequence 0",
                               revision=record.version, file=self.record_url(record.version), field="payload_format")
        return record

    def resolve(self, target: str) -> Revision:
        """The record of ``target`` ('latest' or a version), with a message that helps when it is missing."""
        if target == "latest":
            return self.latest()
        try:
            return self.read(target)
        except ObjectNotFound:
            records = self.list()
            known = ", ".join(r.version for r in records[-8:]) or "none"
            latest = records[-1].version if records else "none"
            raise CatalogError(f"revision {target} is not in the catalog {self.url} (its latest is {latest}; "
                               f"versions: {known})", revision=target, file=self.record_url(target)) from None

    def _empty(self) -> CatalogError:
        bad = f" ({len(self.quarantined)} malformed record(s) quarantined)" if self.quarantined else ""
        return CatalogError(f"the catalog {self.url} holds no valid revision records for {self.model}{bad}: "
                            "check --catalog and --model, or publish the launch revision first (--kind initial)",
                            file=self.url)

    def lineage(self, target: Revision, local: Mapping[str, str]) -> list[Revision]:
        """Revisions from a starting point to ``target`` (both included), oldest first.

        Walks ``base_version`` back from ``target`` and stops at the first
        revision that is available locally (``local`` maps version to its
        verified digest), a full checkpoint, or the metadata-only launch
        revision. Every link is checked: base digest, layout and sequence.
        """
        chain = [target]
        seen = {target.version}
        current = target
        while True:
            if current.version in local:
                if local[current.version] != current.target_digest:
                    raise LineageError(
                        f"the local checkpoint of {current.version} has digest {local[current.version]} "
                        f"but the catalog says {current.target_digest}: it is not this catalog's revision",
                        revision=current.version, file=self.record_url(current.version), field="target_digest",
                    )
                break
            if current.payload_format != "xor_delta":
                break
            current = self._exact_base(current, seen)
            chain.append(current)
            if len(chain) > MAX_CHAIN:
                raise LineageError(f"replay chain longer than {MAX_CHAIN} revisions", revision=target.version)
        return chain[::-1]

    def _exact_base(self, delta: Revision, seen: set[str]) -> Revision:
        url = self.record_url(delta.version)
        try:
            base = self.read(delta.base_version)
        except ObjectNotFound:
            raise LineageError(f"base revision {delta.base_version!r} is not in the catalog",
                               revision=delta.version, file=url, field="base_version") from None
        if base.version in seen:
            raise LineageError("base_version links form a cycle", revision=delta.version, file=url,
                               field="base_version")
        seen.add(base.version)
        if base.target_digest != delta.base_digest:
            raise LineageError(
                f"base_digest {delta.base_digest} is not the target_digest {base.target_digest} of {base.version}",
                revision=delta.version, file=url, field="base_digest",
            )
        if base.format_digest != delta.format_digest:
            raise LineageError(f"format_digest differs from base {base.version}: an XOR delta cannot change the layout",
                               revision=delta.version, file=url, field="format_digest")
        if base.sequence >= delta.sequence:
            raise LineageError(f"sequence {delta.sequence} does not increase over base {base.version} ({base.sequence})",
                               revision=delta.version, file=url, field="sequence")
        if base.checksum_format != delta.checksum_format and base.payload_format == "xor_delta":
            log.info("checksum format changes from %s to %s at %s", base.checksum_format,
                     delta.checksum_format, delta.version)
        return base

    def claim_sequence(self, sequence: int, version: str, publication: str) -> tuple[str, str | None]:
        """Claim ``sequence`` for ``version`` on behalf of ``publication`` (a token unique to one publisher run):
        a create-only ``sequences/{n}.json``. Returns the holder's (version, publication).

        Two publications can never claim the same sequence: the second
        create-only write finds the first one's claim and gets its holder
        back. A claim is the claimant's only if the publication token is its
        own: a claim left by a publisher that crashed before its record is
        never taken over, so its orphaned payload never meets a later one.
        """
        url = join_url(self.url, f"sequences/{sequence:012d}.json")
        claim = {"model": self.model, "sequence": sequence, "version": version, "publication": publication}
        try:
            self.store.put_immutable(url, canonical_json(claim))
            return version, publication
        except ImmutableConflict:
            raw = self.store.read_bytes(url, max_size=MAX_RECORD_BYTES)
            try:
                found = json.loads(raw)
                holder, token = found.get("version"), found.get("publication")
            except (ValueError, AttributeError):
                holder, token = None, None
            if not isinstance(holder, str) or not isinstance(token, (str, type(None))):
                raise CatalogError("sequence claim is malformed", file=url, field="version") from None
            return holder, token

    def write(self, record: Revision) -> bool:
        """Publish ``record`` create-only; False if the identical record already existed."""
        if record.model != self.model:
            raise CatalogError(f"record belongs to model {record.model!r}, not {self.model!r}",
                               revision=record.version, field="model")
        written = self.store.put_immutable(self.record_url(record.version), canonical_json(record.to_json()))
        self._records[record.version] = record
        return written

    # -- local memo of immutable records ------------------------------------------------------

    def _read_cached(self, version: str, url: str) -> Revision | None:
        if self.cache_dir is None:
            return None
        try:
            cached = read_json_file(self.cache_dir / f"{version}.json")
        except ValueError:  # the memo is written without fsync: after a power loss it may be torn
            return None
        if not isinstance(cached, dict) or cached.get("url") != url or not isinstance(cached.get("record"), dict):
            return None
        try:
            return parse_revision(cached.get("record"), version=version, model=self.model, file=url)
        except CatalogError:
            return None

    def _write_cached(self, version: str, url: str, record: Revision) -> None:
        if self.cache_dir is not None:
            atomic_write_json(self.cache_dir / f"{version}.json", {"url": url, "record": record.to_json()},
                              durable=False)
