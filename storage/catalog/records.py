"""The revision catalog: one immutable JSON record per revision (docs/format.md, section 4)."""

from __future__ import annotations

import codecs
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

from pydantic import InstanceOf
from pydantic.dataclasses import dataclass

from storage.jsonio.canonical import canonical_json
from storage.durable import atomic_write_json
from storage.errors import CatalogError, LineageError, ObjectNotFound, RefitError
from storage.objects.store import ObjectStore
from storage.urls import join_url, normalize_url, storage_kind
from storage.catalog.claims import OWN_MEMO, SequenceClaims, read_memo
from storage.catalog.revision import (  # noqa: F401  (CLAIMS ... SCHEMA re-exported: their home before the split)
    CLAIMS, HEAD_HINT, HEAD_SCHEMA, MAX_CHAIN, MAX_HINT_BYTES, MAX_RECORD_BYTES, MAX_SEQUENCE, SCHEMA, Revision,
    _VERSION_RE, _unusable, parse_revision, quarantinable,
)

log = logging.getLogger("canonical_refit.catalog")


@dataclass(frozen=True, config=OWN_MEMO)
class RecordMemo:
    """This node's memo of a catalog record, ``catalog/{v}.json`` under its store: the record's URL and the
    object as read (signed or not), revalidated on every read (``parse_revision``, the signature)."""

    url: str
    record: InstanceOf[dict]


def record_memo(path: Path) -> RecordMemo | None:
    """The memo at ``path``, or None if it is missing or refused (a hint: then read again from the catalog)."""
    return read_memo(path, RecordMemo)


class Catalog(SequenceClaims):
    """Read and write the revision records of one model under one catalog URL.

    ``latest`` and the launch revision are found without listing the catalog
    (docs/format.md, 4.9): the sequence claims are a dense, create-only
    namespace, so the newest claim is found by probing claims upward from the
    head hint (or this node's memo), and only its record is read. Hints are
    checked against the claims and records, never trusted; a catalog without
    claims (written by an older publisher) is listed as before.
    """

    def __init__(self, store: ObjectStore, url: str, model: str, *, cache_dir: Path | None = None, verify=None,
                 sign=None):
        self.store = store
        self.url = normalize_url(url)
        self.model = model
        self.cache_dir = cache_dir
        # signed records (storage/catalog/signing.py, docs/format.md 4.10): ``verify(raw, revision=, file=)`` returns
        # the record object or raises ``SignatureError`` before a record is accepted; ``sign(obj)`` adds the signature
        self.verify, self.sign = verify, sign
        self._records: dict[str, Revision] = {}
        self.quarantined: dict[str, RefitError] = {}  # unusable records met while resolving or listing
        self._claims: dict[int, tuple[str | None, str | None]] = {}  # claims seen: sequence -> (version, token)
        self._hint: int | None = None  # the head hint's sequence when it was last read
        self.top_claim: int | None = None  # the highest claimed sequence found by the last ``head``

    def record_url(self, version: str) -> str:
        if not _VERSION_RE.match(version):
            raise CatalogError("invalid version id", revision=version, field="version")
        return join_url(self.url, f"{version}.json")



    def read(self, version: str) -> Revision:
        """One record (memoised: records are immutable). Whatever is wrong with the object, the error is a
        ``CatalogError`` (or a storage error) naming it."""
        if version in self._records:
            return self._records[version]
        url = self.record_url(version)
        try:
            record = self._read_cached(version, url)
        except Exception:  # a damaged memo is a missing one
            record = None
        if record is None:
            raw = self._fetch(url, MAX_RECORD_BYTES, revision=version)
            try:
                raw.decode("utf-8")  # UTF-8 only: json would sniff UTF-16/32 (and a BOM) and accept them
                if raw.startswith(codecs.BOM_UTF8):
                    raise CatalogError("record starts with a byte order mark: UTF-8 without one only",
                                       revision=version, file=url)
                record = parse_revision(raw, version=version, model=self.model, file=url)
                signed = None if self.verify is None else self.verify(raw, revision=version, file=url)
            except RefitError:
                raise
            except Exception as exc:  # RecursionError, MemoryError, UnicodeError...: the object's fault
                raise _unusable(exc, version, url) from None
            self._write_cached(version, url, record, signed)
        self._same_storage(record, url)
        self._records[version] = record
        return record

    def _same_storage(self, record: Revision, url: str) -> None:
        """A record's payload lives in the catalog's own kind of storage: a record cannot send the node to
        another protocol (an ``http://`` host, a local path under an ``s3://`` catalog) with its settings."""
        if record.uri is not None and storage_kind(record.uri) != storage_kind(self.url):
            raise CatalogError(f"payload uri {record.uri!r} is not in the catalog's storage "
                               f"({storage_kind(self.url)}://)", revision=record.version, file=url, field="uri")

    def _fetch(self, url: str, max_size: int, *, revision: str | None = None) -> bytes:
        """An object's bytes. On a local filesystem only a regular file is opened (a FIFO would block)."""
        try:
            fs, path = self.store.locate(url)
            if ObjectStore.is_local(fs):
                try:
                    mode = os.stat(path).st_mode
                except FileNotFoundError:
                    raise ObjectNotFound("no such object", file=url) from None
                if not stat.S_ISREG(mode):
                    raise CatalogError("not a regular file (a FIFO, device, socket or folder): refused unread",
                                       revision=revision, file=url)
            return self.store.read_bytes(url, max_size=max_size)
        except RefitError as exc:  # e.g. an oversized record: name the revision too
            raise exc.with_context(revision=revision)
        except Exception as exc:
            raise _unusable(exc, revision, url) from None

    def versions(self) -> list[str]:
        """Version ids of every record in the catalog (one listing; nothing is read)."""
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
        """Every valid record, sorted by sequence; unusable ones are quarantined (``self.quarantined``).

        Reads every record (each once per node, with a memo): only for what
        needs them all (a catalog without claims, an error message, orphans).
        A record that cannot be read, parsed or validated, whatever the
        error, is logged, kept in ``quarantined`` (its URL and the error) and
        left out: it blocks only refits whose lineage passes through it.
        """
        versions = self.versions()

        def read(version: str) -> Revision | RefitError:
            try:
                return self.read(version)
            except RefitError as exc:  # malformed, oversized, not a file, gone since listed
                if not quarantinable(exc):
                    raise
                return exc

        with ThreadPoolExecutor(max_workers=self.store.settings.concurrency) as pool:
            outcomes = list(pool.map(read, versions))
        records = []
        for version, outcome in zip(versions, outcomes):
            if isinstance(outcome, RefitError):
                self._quarantine(version, outcome)
            else:
                records.append(outcome)
        return sorted(records, key=lambda r: (r.sequence, r.version))

    def _quarantine(self, version: str, error: RefitError) -> None:
        if version not in self.quarantined:
            log.warning("quarantined catalog record %s: %s", join_url(self.url, f"{version}.json"), error)
        self.quarantined[version] = error

    def latest(self) -> Revision:
        """The valid record with the highest sequence (unusable records are skipped, with a warning)."""
        record = self.head()
        if record is None:
            raise self._empty()
        return record

    def head(self, *, repair_hint: bool = False) -> Revision | None:
        """The newest valid record, or None if the catalog holds none; O(1) requests for a catalog with claims.

        Finds the highest claimed sequence (``_top``), then walks down the
        claims to the first whose record exists and is valid: a claim whose
        record never came (a crashed publication) is skipped, an unusable
        record quarantined. A catalog without claims is listed. With
        ``repair_hint`` (publishers only: receivers never write to the
        catalog) a head hint that does not name the result is rewritten.
        """
        top = self._top()
        self.top_claim = top
        if top is None:
            return self._listed_head()
        for sequence in range(top, -1, -1):
            exists, holder = self._claim(sequence)
            if not exists:  # below the claimed range: records written before claims existed
                return self._listed_head()
            if holder is None:
                continue
            record = self._usable(holder)
            if record is None:
                continue
            if record.sequence != sequence:
                log.warning("catalog record %s has sequence %d, but claim %s names it: skipped",
                            self.record_url(holder), record.sequence, self.claim_url(sequence))
                continue
            if repair_hint and self._hint != record.sequence:
                self._put_hint(record)
            self._memo_top_write(top)
            return record
        return self._listed_head()  # every claim is a crashed publication's: the records say

    def _usable(self, version: str) -> Revision | None:
        """The record of ``version``, or None if it does not exist (yet) or is unusable (then quarantined)."""
        try:
            return self.read(version)
        except ObjectNotFound:
            return None
        except RefitError as exc:
            if not quarantinable(exc):
                raise
            self._quarantine(version, exc)
            return None

    def _listed_head(self) -> Revision | None:
        """``latest`` by listing and reading every record (a catalog without claims)."""
        records = self.list()
        if not records:
            return None
        top = records[-1]
        tied = [r.version for r in records if r.sequence == top.sequence]
        if len(tied) > 1:
            raise CatalogError(f"'latest' is ambiguous: records {' and '.join(tied)} share sequence "
                               f"{top.sequence}; remove the one published by mistake",
                               file=self.url, field="sequence")
        return top

    # -- finding the newest claim -----------------------------------------------------------------






    def initial(self, version: str | None = None) -> Revision:
        """Revision 0: ``version`` if given, else the record sequence 0's claim names (or, in a catalog without
        claims, the one valid record with sequence 0)."""
        if version is not None:
            record = self.read(version)
        else:
            record = self._claimed_initial()
        if record is None:
            records = self.list()
            if not records:
                raise self._empty()
            zeros = [r for r in records if r.sequence == 0]
            if len(zeros) != 1:
                found = " and ".join(r.version for r in zeros) or "none"
                raise CatalogError(
                    f"the catalog needs exactly one valid sequence-0 (launch) record, found {found}; publish "
                    'the launch revision with kind="initial", or name it with initial_version=',
                    file=self.url, field="sequence",
                )
            record = zeros[0]
        if record.payload_format != "metadata_only" or record.sequence != 0:
            raise CatalogError("the launch revision must be a metadata_only record with sequence 0",
                               revision=record.version, file=self.record_url(record.version), field="payload_format")
        return record

    def _claimed_initial(self) -> Revision | None:
        exists, holder = self._claim(0)
        if not exists or holder is None:
            return None
        record = self._usable(holder)
        if record is None and holder in self.quarantined:
            # the launch record exists but cannot be used (malformed, unsigned...): say why, naming it
            raise self.quarantined[holder]
        return record if record is not None and record.sequence == 0 else None

    def resolve(self, target: str) -> Revision:
        """The record of ``target`` ('latest' or a version), with a message that helps when it is missing."""
        if target == "latest":
            return self.latest()
        try:
            return self.read(target)
        except ObjectNotFound:
            records = self._recent(8)
            if not records:  # nothing readable at all: the catalog's storage is gone or out, no revision refused
                raise ObjectNotFound(f"revision {target} is not in the catalog {self.url}, which holds no readable "
                                     "record (is its storage available?)", revision=target,
                                     file=self.record_url(target)) from None
            known = ", ".join(r.version for r in records) or "none"
            latest = records[-1].version if records else "none"
            raise CatalogError(f"revision {target} is not in the catalog {self.url} (its latest is {latest}; "
                               f"versions: {known})", revision=target, file=self.record_url(target)) from None

    def _recent(self, count: int) -> list[Revision]:
        """Some of the newest valid records, oldest first (for a message): the claims below ``latest`` (at most
        ``4 * count`` of them read), or a catalog without claims listed."""
        head = self.head()
        if head is None or self.top_claim is None:
            return self.list()[-count:]
        out = [head]
        for sequence in range(head.sequence - 1, max(-1, head.sequence - 1 - 4 * count), -1):
            exists, holder = self._claim(sequence)
            if not exists or len(out) >= count:
                break
            record = self._usable(holder) if holder is not None else None
            if record is not None and record.sequence == sequence:
                out.append(record)
        return out[::-1]

    def _empty(self) -> CatalogError:
        bad = f" ({len(self.quarantined)} malformed record(s) quarantined)" if self.quarantined else ""
        return CatalogError(f"the catalog {self.url} holds no valid revision records for {self.model}{bad}: "
                            'check catalog= and model=, or publish the launch revision first (kind="initial")',
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


    def write(self, record: Revision) -> bool:
        """Publish ``record`` create-only; False if the identical record already existed. A new record then
        becomes the head hint."""
        if record.model != self.model:
            raise CatalogError(f"record belongs to model {record.model!r}, not {self.model!r}",
                               revision=record.version, field="model")
        body = record.to_json() if self.sign is None else self.sign(record.to_json())
        written = self.store.put_immutable(self.record_url(record.version), canonical_json(body))
        self._records[record.version] = record
        if written:
            self._put_hint(record)
        return written

    # -- local memo of immutable records ------------------------------------------------------

    def _read_cached(self, version: str, url: str) -> Revision | None:
        if self.cache_dir is None:
            return None
        memo = record_memo(self.cache_dir / f"{version}.json")  # written without fsync: torn after a power loss
        if memo is None or memo.url != url:
            return None
        try:
            record = parse_revision(memo.record, version=version, model=self.model, file=url)
            if self.verify is not None:  # the memo keeps the signed object: checked again, so a key change counts
                self.verify(memo.record, revision=version, file=url)
            return record
        except CatalogError:
            return None

    def _write_cached(self, version: str, url: str, record: Revision, signed: dict | None = None) -> None:
        if self.cache_dir is not None:
            atomic_write_json(self.cache_dir / f"{version}.json",
                              {"url": url, "record": record.to_json() if signed is None else signed}, durable=False)

    # -- local memo of claims and of the newest claim seen (hints: checked against the catalog) ----------
