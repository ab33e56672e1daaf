"""The catalog's other records are strict too: memos, claims, the head hint and the publisher's kept base.

Each is a strict pydantic dataclass read through ``storage.jsonio.bounded_json``
(``load_record``/``read_record``): a value of the wrong JSON type, a missing
key or (for the program's own files) an unknown key is refused with the
room's typed error naming the file and the field. Files exactly as today's
code writes them still parse. Hints stay hints (docs/format.md, 4.9): a
refused memo or head hint is ignored, and the catalog still answers from its
claims and records; the node's memo of a record is written again.
"""

from __future__ import annotations

import json
import logging

import pytest
from tests.support.logs import emitted

from storage.catalog.claims import ClaimMemo, HeadHint, HeadMemo, SequenceClaim
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from storage.catalog import signing
from storage.catalog.kept_base import KeptRecord, PublisherCopy
from storage.catalog.parts import PublicationPart, PublicationPlan, read_parts, read_plan, write_part, write_plan
from storage.catalog.records import Catalog, RecordMemo, Revision
from storage.errors import CatalogError, SignatureError, StoreError
from storage.jsonio.bounded_json import RECORD, STORE_RECORD, load_record, read_record
from storage.jsonio.canonical import canonical_json
from storage.objects.store import ObjectStore

MODEL = "org/name"
DIGEST = "sha256:" + "a" * 64


def _record(version: str, sequence: int) -> dict:
    first = sequence == 0
    return {"schema": "canonical-refit.revision.v1", "model": MODEL, "version": version, "sequence": sequence,
            "payload_format": "metadata_only" if first else "full_hf_checkpoint", "base_version": None,
            "base_digest": None, "target_digest": DIGEST, "format_digest": DIGEST, "checksum_format": "adler32",
            "uri": None, "created_at_unix_ms": 1}


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    """r0 .. r3, each claimed then written, as a publisher does (the head hint names r3)."""
    catalog = Catalog(ObjectStore(), str(tmp_path / "catalog"), MODEL)
    for n in range(4):
        raw = _record(f"r{n}", n)
        if n:
            raw["uri"] = f"{catalog.url}/payload/r{n}/model.safetensors.index.json"
        assert catalog.claim_sequence(n, f"r{n}", "token") == (f"r{n}", "token")
        catalog.write(Revision.model_validate(raw))
    return catalog


def _node(catalog: Catalog, tmp_path) -> Catalog:
    return Catalog(ObjectStore(), catalog.url, MODEL, cache_dir=tmp_path / "memo")


def test_memos_claims_and_the_head_hint_as_written_today_parse(catalog, tmp_path):
    assert _node(catalog, tmp_path).latest().version == "r3"
    memo = tmp_path / "memo"
    url = catalog.url
    written = {  # what today's code writes, literally
        memo / "r3.json": {"record": _record("r3", 3) | {"uri": f"{url}/payload/r3/model.safetensors.index.json"},
                           "url": f"{url}/r3.json"},
        memo / "sequences" / "000000000003.json": {"publication": "token", "url": f"{url}/sequences/000000000003.json",
                                                    "version": "r3"},
        memo / "hints" / "head.json": {"sequence": 3, "url": url},
    }
    for path, literal in written.items():
        assert json.loads(path.read_text()) == literal
    assert read_record(memo / "r3.json", RecordMemo, STORE_RECORD).record["version"] == "r3"
    assert read_record(memo / "sequences" / "000000000003.json", ClaimMemo, STORE_RECORD) == \
        ClaimMemo(url=f"{url}/sequences/000000000003.json", version="r3", publication="token")
    assert read_record(memo / "hints" / "head.json", HeadMemo, STORE_RECORD) == HeadMemo(url=url, sequence=3)
    hint = canonical_json({"model": MODEL, "schema": "canonical-refit.catalog-head.v1", "sequence": 3,
                           "version": "r3"})
    assert (tmp_path / "catalog" / "hints" / "head.json").read_bytes() == hint
    assert load_record(hint, HeadHint, RECORD) == HeadHint(model=MODEL, sequence=3,
                                                           schema="canonical-refit.catalog-head.v1", version="r3")
    claim = canonical_json({"model": MODEL, "publication": "token", "sequence": 3, "version": "r3"})
    assert (tmp_path / "catalog" / "sequences" / "000000000003.json").read_bytes() == claim
    assert load_record(claim, SequenceClaim, RECORD) == SequenceClaim("r3", "token", MODEL, 3)
    # a claim written before ``publication`` existed, a hint before ``schema``: older writers' files
    assert load_record(b'{"version": "r3"}', SequenceClaim, RECORD).publication is None
    assert load_record(b'{"model": "org/name", "sequence": 3}', HeadHint, RECORD).schema is None


# (memo, its model, contents, the field refused)
BAD_MEMOS = [
    ("r3.json", RecordMemo, {"url": 3, "record": {}}, "url"),
    ("r3.json", RecordMemo, {"url": "x"}, "record"),
    ("r3.json", RecordMemo, {"url": "x", "record": ["r3"]}, "record"),
    ("r3.json", RecordMemo, {"url": "x", "record": {}, "signed": True}, "signed"),
    ("sequences/000000000003.json", ClaimMemo, {"url": "x", "version": 3}, "version"),
    ("sequences/000000000003.json", ClaimMemo, {"url": "x", "version": "r3", "token": "t"}, "token"),
    ("hints/head.json", HeadMemo, {"url": "x", "sequence": "3"}, "sequence"),
    ("hints/head.json", HeadMemo, {"url": "x", "sequence": -1}, "sequence"),
    ("hints/head.json", HeadMemo, {"sequence": 3}, "url"),
]


@pytest.mark.parametrize("name, cls, contents, field", BAD_MEMOS)
def test_a_malformed_memo_is_refused_by_its_model_and_the_catalog_still_answers(catalog, tmp_path, name, cls,
                                                                               contents, field):
    assert _node(catalog, tmp_path).latest().version == "r3"  # the node's memo is written
    path = tmp_path / "memo" / name
    path.write_text(json.dumps(contents))
    with pytest.raises(StoreError) as caught:
        read_record(path, cls, STORE_RECORD, error=StoreError)
    assert caught.value.local_file == str(path) and caught.value.field == field and str(path) in str(caught.value)
    node = _node(catalog, tmp_path)
    assert node.latest().version == "r3" and node.initial().version == "r0" and node.quarantined == {}
    if name == "r3.json":  # read again from the catalog, the memo is written again
        assert read_record(path, RecordMemo, STORE_RECORD).url == f"{catalog.url}/r3.json"


@pytest.mark.parametrize("hint, field", [
    ({"model": MODEL, "sequence": "3"}, "sequence"),
    ({"model": MODEL, "sequence": 3.0}, "sequence"),
    ({"sequence": 3}, "model"),
    ({"model": MODEL, "sequence": 3, "schema": 1}, "schema"),
    ({"model": MODEL, "sequence": 10**12}, "sequence"),
])
def test_a_malformed_head_hint_is_refused_and_ignored(catalog, tmp_path, hint, field):
    path = tmp_path / "catalog" / "hints" / "head.json"
    path.write_bytes(canonical_json(hint))
    with pytest.raises(CatalogError) as caught:
        load_record(path.read_bytes(), HeadHint, RECORD, error=CatalogError, file=catalog.head_hint_url)
    assert caught.value.file == catalog.head_hint_url and caught.value.field == field
    with emitted("canonical_refit.catalog", logging.WARNING) as logged:
        fresh = Catalog(ObjectStore(), catalog.url, MODEL)
        assert fresh.latest().version == "r3" and fresh.quarantined == {}
    assert f"ignoring the catalog's head hint {catalog.head_hint_url}" in _text(logged) and field in _text(logged)


def test_a_head_hint_with_a_newer_writers_key_is_still_used(catalog):
    """The head hint and the claims are catalog objects any publisher writes: unknown keys are ignored."""
    hint = {"model": MODEL, "schema": "canonical-refit.catalog-head.v1", "sequence": 3, "version": "r3",
            "written_by": "a newer publisher"}
    assert load_record(canonical_json(hint), HeadHint, RECORD).sequence == 3
    claim = {"model": MODEL, "sequence": 3, "version": "r3", "publication": "t", "host": "trainer-0"}
    assert load_record(canonical_json(claim), SequenceClaim, RECORD).version == "r3"


@pytest.mark.parametrize("claim, field", [
    ({"model": MODEL, "sequence": 3, "version": 3, "publication": "token"}, "version"),
    ({"model": MODEL, "sequence": 3, "publication": "token"}, "version"),
    ({"model": MODEL, "sequence": "3", "version": "r3", "publication": "token"}, "sequence"),
    ({"model": MODEL, "sequence": 3, "version": "r3", "publication": 7}, "publication"),
    ({"model": "org/other", "sequence": 3, "version": "r3", "publication": "token"}, "model"),
])
def test_a_malformed_claim_is_skipped_by_readers_and_refused_to_a_publisher(catalog, tmp_path, claim,
                                                                           field):
    path = tmp_path / "catalog" / "sequences" / "000000000003.json"
    url = catalog.claim_url(3)
    path.write_bytes(canonical_json(claim))
    with emitted("canonical_refit.catalog", logging.WARNING) as logged:
        assert Catalog(ObjectStore(), catalog.url, MODEL).latest().version == "r2"  # claim 3 names no record
    assert f"ignoring sequence claim {url}" in _text(logged) and f"field {field!r}" in _text(logged)
    if field != "model":  # the publisher's create-only write meets it: the typed error names the claim
        with pytest.raises(CatalogError) as caught:
            Catalog(ObjectStore(), catalog.url, MODEL).claim_sequence(3, "r9", "another")
        assert caught.value.file == url and caught.value.field == field


LAST = {"checksum_format": "adler32", "checksums": {"w": "00000001"}, "files": {"model.safetensors": [10, 123]},
        "folder": "checkpoints/r1.123", "version": "r1"}


def test_the_kept_bases_record_as_written_today_parses(tmp_path):
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"0123456789")
    kept = PublisherCopy(tmp_path / "state", MODEL)
    kept.keep(source, "r1", "adler32", {"w": "00000001"})
    written = json.loads(kept.record_path.read_text())
    assert sorted(written) == sorted(LAST) and written["folder"].startswith("checkpoints/r1.")
    assert kept.last() == KeptRecord(**written) and kept.kept_version() == "r1"
    kept.record_path.write_text(json.dumps(LAST))
    assert kept.last() == KeptRecord("r1", "adler32", {"w": "00000001"}, {"model.safetensors": [10, 123]},
                                     "checkpoints/r1.123")
    kept.record_path.write_text(json.dumps({"version": "r1"}))  # a copy kept before copies were versioned
    assert kept.last().folder is None and kept.checkpoint == kept.root / "checkpoint"


@pytest.mark.parametrize("contents, field", [
    (LAST | {"version": 3}, "version"),
    ({k: v for k, v in LAST.items() if k != "version"}, "version"),
    (LAST | {"files": {"model.safetensors": "10"}}, "files.model.safetensors"),
    (LAST | {"checksums": {"w": 1}}, "checksums.w"),
    (LAST | {"kept_at": 5}, "kept_at"),
    (["r1"], None),
])
def test_a_malformed_kept_base_record_is_refused_naming_it(tmp_path, contents, field):
    kept = PublisherCopy(tmp_path / "state", MODEL)
    kept.record_path.parent.mkdir(parents=True)
    kept.record_path.write_text(json.dumps(contents))
    with pytest.raises(StoreError) as caught:
        kept.kept_version()
    error = caught.value
    assert error.local_file == str(kept.record_path) and error.field == field
    assert "base_checkpoint=" in str(error) and 'kind="full"' in str(error)



PLAN = {"base_digest": None, "base_version": None, "checksum_format": "adler32", "encoding": None, "kind": "full",
        "level": None, "payload_url": "s3://bucket/payload/r1.0123456789ab", "publication": "pub-1",
        "schema": "canonical-refit.publication-plan.v1", "sequence": 1, "version": "r1", "world_size": 2}
PART = {"base_checksums": {}, "checksums": {"w": "00000001"}, "decoded_bytes": 8, "encoded_bytes": 8,
        "files": {"rank00001-model.safetensors": 100}, "layout": {"w": ["F32", [2]]}, "rank": 1,
        "schema": "canonical-refit.publication-part.v1", "weight_map": {"w": "rank00001-model.safetensors"}}


def test_a_publication_plan_and_part_as_written_today_parse(tmp_path):
    objects, url = ObjectStore(), f"file://{tmp_path}/catalog"
    write_plan(objects, url, PublicationPlan(**PLAN))
    write_part(objects, url, "pub-1", PublicationPart(**PART))
    folder = tmp_path / "catalog" / "publications" / "pub-1"
    assert json.loads((folder / "plan.json").read_text()) == PLAN
    assert json.loads((folder / "part-00001.json").read_text()) == PART
    plan = read_plan(objects, url, "pub-1")
    assert plan == PublicationPlan(**PLAN)
    assert read_parts(objects, url, plan)[1].layout == {"w": ("F32", (2,))}


@pytest.mark.parametrize("name, contents, field", [
    ("plan.json", PLAN | {"sequence": "1"}, "sequence"),
    ("plan.json", PLAN | {"world_size": None}, "world_size"),
    ("plan.json", {k: v for k, v in PLAN.items() if k != "kind"}, "kind"),
    ("plan.json", PLAN | {"trainer": "t0"}, "trainer"),
    ("part-00001.json", PART | {"layout": {"w": ["F32", ["2"]]}}, "layout.w.1.0"),
    ("part-00001.json", PART | {"files": {"rank00001-model.safetensors": 1.5}}, "files.rank00001-model.safetensors"),
    ("part-00001.json", PART | {"checksums": {"w": 1}}, "checksums.w"),
    ("part-00001.json", PART | {"uploaded_at": 1}, "uploaded_at"),
])
def test_a_malformed_plan_or_part_is_refused_naming_it(tmp_path, name, contents, field):
    objects, url = ObjectStore(), f"file://{tmp_path}/catalog"
    folder = tmp_path / "catalog" / "publications" / "pub-1"
    folder.mkdir(parents=True)
    (folder / "plan.json").write_bytes(canonical_json(PLAN))
    (folder / name).write_bytes(canonical_json(contents))
    with pytest.raises(CatalogError) as caught:
        read_parts(objects, url, read_plan(objects, url, "pub-1"))
    assert caught.value.file == f"{url}/publications/pub-1/{name}" and caught.value.field == field


@pytest.mark.parametrize("change, field", [
    ({"key_id": 7}, "signature.key_id"),
    ({"sig": None}, "signature.sig"),
    ({"alg": "rsa"}, "signature.alg"),
])
def test_a_malformed_signature_object_is_refused_naming_the_record_and_the_field(change, field):
    record = _record("r0", 0)
    signed = signing.RecordSigner(Ed25519PrivateKey.generate()).sign(record)
    verifier = signing.RecordVerifier([Ed25519PrivateKey.generate().public_key()])
    document = signed | {"signature": signed["signature"] | change}
    with pytest.raises(SignatureError) as caught:
        verifier(canonical_json(document), revision="r0", file="s3://b/catalog/r0.json")
    assert (caught.value.file, caught.value.field) == ("s3://b/catalog/r0.json", field)
    newer = signed | {"signature": signed["signature"] | {"made_by": "a newer publisher"}}  # ignored: not trusted
    with pytest.raises(SignatureError, match="does not trust"):
        verifier(canonical_json(newer), revision="r0", file="s3://b/catalog/r0.json")

def _text(records: list[logging.LogRecord]) -> str:
    return "\n".join(record.getMessage() for record in records)
