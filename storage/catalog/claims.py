"""Sequence claims and the head hint (docs/format.md, 4.7 and 4.9): how the newest record is found without listing.

The claims are a dense, create-only namespace; the head hint and this node's memo only say where to
start probing and are checked against the claims, never trusted.
"""

from __future__ import annotations

import logging

from storage.jsonio.bounded_json import RECORD, load_json
from storage.jsonio.canonical import canonical_json
from storage.durable import atomic_write_json, read_json_file
from storage.errors import CatalogError, ImmutableConflict, ObjectNotFound, RefitError, StorageError
from storage.urls import join_url
from storage.catalog.revision import (
    CLAIMS, HEAD_HINT, HEAD_SCHEMA, MAX_HINT_BYTES, MAX_RECORD_BYTES, MAX_SEQUENCE, Revision, _VERSION_RE,
    _unusable, quarantinable,
)

log = logging.getLogger("canonical_refit.catalog")


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
                memo = _claim_fields(raw, self.model, sequence)
                if memo is None:
                    log.warning("ignoring sequence claim %s: not a claim of %s for sequence %d", url, self.model,
                                sequence)
                    return True, None
                self._claim_memo_write(sequence, memo)
            self._claims[sequence] = memo
        return True, self._claims[sequence][0]

    def _read_hint(self) -> int | None:
        """The head hint's sequence, or None if there is none or it is unusable (then only a hint is lost)."""
        url = self.head_hint_url
        self._hint = None
        try:
            found = load_json(self._fetch(url, MAX_HINT_BYTES), RECORD, error=CatalogError, expect=dict, file=url)
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
        sequence = found.get("sequence") if isinstance(found, dict) else None
        if (not isinstance(found, dict) or found.get("model") != self.model or type(sequence) is not int
                or not 0 <= sequence <= MAX_SEQUENCE):
            log.warning("ignoring the catalog's head hint %s: not a head hint of %s", url, self.model)
            return None
        self._hint = sequence
        return sequence

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
            try:
                found = load_json(raw, RECORD, error=CatalogError, expect=dict, file=url)
                holder, token = found.get("version"), found.get("publication")
            except CatalogError:
                holder, token = None, None
            if not isinstance(holder, str) or not isinstance(token, (str, type(None))):
                raise CatalogError("sequence claim is malformed", file=url, field="version") from None
            return holder, token

    def _claim_memo(self, sequence: int) -> tuple[str | None, str | None] | None:
        if self.cache_dir is None:
            return None
        try:
            cached = read_json_file(self.cache_dir / CLAIMS / f"{sequence:012d}.json")
        except Exception:  # torn (written without fsync) or damaged: just missing
            return None
        if (not isinstance(cached, dict) or cached.get("url") != self.claim_url(sequence)
                or not isinstance(cached.get("version"), str)):
            return None
        token = cached.get("publication")
        return cached["version"], token if isinstance(token, str) else None

    def _claim_memo_write(self, sequence: int, claim: tuple[str | None, str | None]) -> None:
        if self.cache_dir is not None and claim[0] is not None:
            atomic_write_json(self.cache_dir / CLAIMS / f"{sequence:012d}.json",
                              {"url": self.claim_url(sequence), "version": claim[0], "publication": claim[1]},
                              durable=False)

    def _memo_top(self) -> int | None:
        """The highest claim this node saw in this catalog (its claim memo holds it), or None."""
        if self.cache_dir is None:
            return None
        try:
            cached = read_json_file(self.cache_dir / HEAD_HINT)
        except Exception:
            return None
        if not isinstance(cached, dict) or cached.get("url") != self.url:
            return None
        sequence = cached.get("sequence")
        if type(sequence) is not int or not 0 <= sequence <= MAX_SEQUENCE or self._claim_memo(sequence) is None:
            return None
        return sequence

    def _memo_top_write(self, sequence: int) -> None:
        if self.cache_dir is None or self._claim_memo(sequence) is None or self._memo_top() == sequence:
            return
        atomic_write_json(self.cache_dir / HEAD_HINT, {"url": self.url, "sequence": sequence}, durable=False)


def _claim_fields(raw: bytes, model: str, sequence: int) -> tuple[str, str | None] | None:
    """(version, publication token) of a claim object, or None if it is not a usable claim of ``sequence``."""
    try:
        found = load_json(raw, RECORD, error=CatalogError, expect=dict)
    except Exception:
        return None
    if not isinstance(found, dict):
        return None
    version, token = found.get("version"), found.get("publication")
    if not isinstance(version, str) or not _VERSION_RE.match(version) or not isinstance(token, (str, type(None))):
        return None
    if found.get("sequence", sequence) != sequence or found.get("model", model) != model:
        return None
    return version, token
