"""Sequence claims and the head hint (docs/format.md, 4.7 and 4.9): how the newest record is found without listing.

The claims are a dense, create-only namespace; the head hint and this node's memo only say where to
start probing and are checked against the claims, never trusted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, TypeVar

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from storage.jsonio.bounded_json import RECORD, STORE_RECORD, load_record, read_record
from storage.jsonio.canonical import canonical_json
from storage.durable import atomic_write_json
from storage.errors import CatalogError, ImmutableConflict, ObjectNotFound, RefitError, StorageError, StoreError
from storage.urls import join_url
from storage.catalog.revision import (
    CLAIMS, HEAD_HINT, HEAD_SCHEMA, MAX_HINT_BYTES, MAX_RECORD_BYTES, MAX_SEQUENCE, Revision, _VERSION_RE,
    _unusable, quarantinable,
)

log = logging.getLogger("canonical_refit.catalog")
T = TypeVar("T")
# Catalog objects (claims, the head hint) are written by any publisher, this project's or another
# implementation's, newer or older: a key a node does not know is ignored. The node's own memos are this
# program's alone: a key it does not know refuses the memo (a hint, so it is only re-read from the catalog).
CATALOG_OBJECT = ConfigDict(strict=True, extra="ignore")
OWN_MEMO = ConfigDict(strict=True, extra="forbid")
Sequence = Annotated[int, Field(ge=0, le=MAX_SEQUENCE)]


@dataclass(frozen=True, config=CATALOG_OBJECT)
class SequenceClaim:
    """A claim object ``{catalog}/sequences/{n:012d}.json`` (docs/format.md, 4.7). ``publication`` is missing
    from claims written before it existed; ``model`` and ``sequence``, when present, must be the reader's."""

    version: str
    publication: str | None = None
    model: str | None = None
    sequence: int | None = None


@dataclass(frozen=True, config=CATALOG_OBJECT)
class HeadHint:
    """The head hint ``{catalog}/hints/head.json`` (4.9): a hint, never truth; refused, it is ignored."""

    model: str
    sequence: Sequence
    schema: str | None = None
    version: str | None = None


@dataclass(frozen=True, config=OWN_MEMO)
class ClaimMemo:
    """This node's memo of a claim, ``catalog/sequences/{n:012d}.json`` under its store."""

    url: str
    version: str
    publication: str | None = None


@dataclass(frozen=True, config=OWN_MEMO)
class HeadMemo:
    """This node's memo of the highest claim it saw, ``catalog/hints/head.json`` under its store."""

    url: str
    sequence: Sequence


def read_memo(path: Path, cls: type[T]) -> T | None:
    """A memo of this node (``cls``), or None if it is missing or refused: memos are hints, written without
    fsync (torn after a power loss), and a refused one (logged) is only read again from the catalog."""
    try:
        return read_record(path, cls, STORE_RECORD, error=StoreError, missing_ok=True)
    except StoreError as exc:
        log.info("ignoring the catalog memo: %s", exc)
        return None


class SequenceClaims:
    """The claim and hint half of ``Catalog`` (storage/catalog/records.py): probing, claiming, memos."""

    def claim_url(self, sequence: int) -> str:
        return join_url(self.url, f"{CLAIMS}/{sequence:012d}.json")

    @property
    def head_hint_url(self) -> str:
        return join_url(self.url, HEAD_HINT)

    def _top(self) -> int | None:
        """The highest claimed sequence, or None if there is no claim at all.

        Claims are dense from the first one up (each publisher claims the
        first free sequence above the newest claim), so existence is
        monotone: start from a claim known to exist (this instance's last
        answer, the head hint once its claim is seen, or the node's memo),
        gallop upward to a missing one and bisect. With a right hint that is
        one probe; a wrong one costs O(log N) probes and is corrected.
        """
        lo: int | None = self.top_claim
        hi: int | None = None
        if lo is None:
            hint, memo = self._read_hint(), self._memo_top()
            if hint is not None and (memo is None or hint > memo):
                if self._claim(hint)[0]:  # read, not probed: the walk down starts with it
                    lo = hint
                else:
                    hi = hint
            if lo is None and memo is not None and (hi is None or memo < hi):
                lo = memo
            if lo is None:
                if hi == 0 or not self._claim(0)[0]:
                    return None
                lo = 0
        if hi is None:
            step = 1
            while True:
                probe = min(lo + step, MAX_SEQUENCE + 1)
                if probe > MAX_SEQUENCE or not self._claim_exists(probe):
                    hi = probe
                    break
                lo, step = probe, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._claim_exists(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _claim_exists(self, sequence: int) -> bool:
        if sequence in self._claims or self._claim_memo(sequence) is not None:
            return True
        return self.store.exists(self.claim_url(sequence))

    def _claim(self, sequence: int) -> tuple[bool, str | None]:
        """(whether claim ``sequence`` exists, the version it names or None if unusable)."""
        if sequence not in self._claims:
            memo = self._claim_memo(sequence)
            if memo is None:
                url = self.claim_url(sequence)
                try:
                    raw = self._fetch(url, MAX_RECORD_BYTES)
                except ObjectNotFound:
                    return False, None
                except RefitError as exc:
                    if not quarantinable(exc):
                        raise
                    log.warning("ignoring sequence claim %s: %s", url, exc)
                    return True, None
                try:
                    memo = _claim_fields(raw, self.model, sequence, url)
                except CatalogError as exc:
                    log.warning("ignoring sequence claim %s: %s", url, exc)
                    return True, None
                self._claim_memo_write(sequence, memo)
            self._claims[sequence] = memo
        return True, self._claims[sequence][0]

    def _read_hint(self) -> int | None:
        """The head hint's sequence, or None if there is none or it is unusable (then only a hint is lost)."""
        url = self.head_hint_url
        self._hint = None
        try:
            found = load_record(self._fetch(url, MAX_HINT_BYTES), HeadHint, RECORD, error=CatalogError, file=url)
        except ObjectNotFound:
            return None
        except RefitError as exc:
            if not quarantinable(exc):
                raise
            log.warning("ignoring the catalog's head hint %s: %s", url, exc)
            return None
        except Exception as exc:
            log.warning("ignoring the catalog's head hint %s: %s", url, _unusable(exc, None, url))
            return None
        if found.model != self.model:
            log.warning("ignoring the catalog's head hint %s: not a head hint of %s", url, self.model)
            return None
        self._hint = found.sequence
        return found.sequence

    def _put_hint(self, record: Revision) -> None:
        """Point the head hint at ``record`` (best effort: the hint only saves readers probes)."""
        body = canonical_json({"schema": HEAD_SCHEMA, "model": self.model, "sequence": record.sequence,
                               "version": record.version})
        try:
            self.store.put_replace(self.head_hint_url, body)
            self._hint = record.sequence
        except (StorageError, OSError) as exc:
            log.warning("could not update the catalog's head hint %s (readers find the newest record without "
                        "it): %s", self.head_hint_url, exc)

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
            found = load_record(raw, SequenceClaim, RECORD, error=CatalogError, file=url)
            return found.version, found.publication

    def _claim_memo(self, sequence: int) -> tuple[str | None, str | None] | None:
        if self.cache_dir is None:
            return None
        memo = read_memo(self.cache_dir / CLAIMS / f"{sequence:012d}.json", ClaimMemo)
        if memo is None or memo.url != self.claim_url(sequence):
            return None
        return memo.version, memo.publication

    def _claim_memo_write(self, sequence: int, claim: tuple[str | None, str | None]) -> None:
        if self.cache_dir is not None and claim[0] is not None:
            atomic_write_json(self.cache_dir / CLAIMS / f"{sequence:012d}.json",
                              {"url": self.claim_url(sequence), "version": claim[0], "publication": claim[1]},
                              durable=False)

    def _memo_top(self) -> int | None:
        """The highest claim this node saw in this catalog (its claim memo holds it), or None."""
        if self.cache_dir is None:
            return None
        memo = read_memo(self.cache_dir / HEAD_HINT, HeadMemo)
        if memo is None or memo.url != self.url or self._claim_memo(memo.sequence) is None:
            return None
        return memo.sequence

    def _memo_top_write(self, sequence: int) -> None:
        if self.cache_dir is None or self._claim_memo(sequence) is None or self._memo_top() == sequence:
            return
        atomic_write_json(self.cache_dir / HEAD_HINT, {"url": self.url, "sequence": sequence}, durable=False)


def _claim_fields(raw: bytes, model: str, sequence: int, url: str) -> tuple[str, str | None]:
    """(version, publication token) of a claim object; ``CatalogError`` naming it unless it is a usable claim
    of ``sequence``."""
    found = load_record(raw, SequenceClaim, RECORD, error=CatalogError, file=url)
    if not _VERSION_RE.match(found.version):
        raise CatalogError("sequence claim names an invalid version id", file=url, field="version")
    if found.sequence not in (None, sequence) or found.model not in (None, model):
        raise CatalogError(f"not a claim of {model} for sequence {sequence}", file=url,
                           field="model" if found.sequence in (None, sequence) else "sequence")
    return found.version, found.publication
