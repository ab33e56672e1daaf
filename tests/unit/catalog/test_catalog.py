"""Catalog records, listing, lineage walks and create-only writes (docs/format.md, sections 4 and 6)."""

from __future__ import annotations

import json
import uuid

import pytest

from storage.catalog.records import Catalog, Revision, parse_revision
from storage.jsonio.canonical import canonical_json
from storage.errors import CatalogError, ImmutableConflict, InvalidURI, LineageError
from storage.objects.store import ObjectStore
from storage.urls import normalize_url

D = {k: "sha256:" + k * 64 for k in "abcdef"}
MODEL = "org/name"


def record(version="r1", **over) -> dict:
    raw = {
        "schema": "canonical-refit.revision.v1", "model": MODEL, "version": version, "sequence": 1,
        "payload_format": "xor_delta", "base_version": "r0", "base_digest": D["a"],
        "target_digest": D["b"], "format_digest": D["c"], "checksum_format": "adler32",
        "uri": "s3://bucket/revisions/r1/delta.safetensors.index.json", "created_at_unix_ms": 1,
    }
    raw.update(over)
    return raw


def initial(version="r0", **over) -> dict:
    fields = dict(sequence=0, payload_format="metadata_only", base_version=None, base_digest=None,
                  uri=None, target_digest=D["a"])
    return record(version, **(fields | over))


def test_valid_records_parse_and_unknown_fields_are_ignored():
    rev = parse_revision(json.dumps(record(extra_field=42)), version="r1", model=MODEL, file="r1.json")
    assert rev.base_version == "r0" and rev.to_json()["schema"] == "canonical-refit.revision.v1"
    assert "extra_field" not in rev.to_json()
    parse_revision(initial(), version="r0", model=MODEL, file="r0.json")


@pytest.mark.parametrize("raw, field", [
    ({k: v for k, v in record().items() if k != "target_digest"}, "target_digest"),
    (record(schema="canonical-refit.revision.v2"), "schema"),
    (record(model=""), "model"),
    (record(sequence=-1), "sequence"),
    (record(sequence="1"), "sequence"),
    (record(sequence=True), "sequence"),
    (record(payload_format="tarball"), "payload_format"),
    (record(base_version=None), "base_version"),
    (record(base_digest=None), "base_digest"),
    (record(uri=None), "uri"),
    (record(target_digest="sha256:ABC"), "target_digest"),
    (record(format_digest="md5:" + "0" * 32), "format_digest"),
    (record(base_digest="sha256:" + "g" * 64), "base_digest"),
    (record(checksum_format="crc32"), "checksum_format"),
    (record(created_at_unix_ms=-5), "created_at_unix_ms"),
    (record(created_at_unix_ms=1.5), "created_at_unix_ms"),
    (record(base_version="r1"), "base_version"),
    (record(sequence=0), "sequence"),
    (record(uri="s3://bucket//x/index.json"), "uri"),
    (record(uri="s3://bucket/x/index.json?versionId=1"), "uri"),
    (initial(uri="s3://bucket/r0/index.json"), "uri"),
    (initial(base_version="r9"), "base_version"),
    (record(payload_format="full_hf_checkpoint", uri=None, base_version=None, base_digest=None), "uri"),
    (record(base_version="../etc"), "base_version"),
])
def test_each_rule_violation_names_the_revision_and_field(raw, field):
    with pytest.raises(CatalogError) as info:
        parse_revision(raw, version=raw.get("version", "r1"), model=MODEL, file="s3://bucket/catalog/r1.json")
    assert info.value.field == field
    assert info.value.revision in ("r1", "r0")
    assert "catalog/r1.json" in str(info.value) and field in str(info.value)


def test_record_stored_under_another_version_is_rejected():
    with pytest.raises(CatalogError, match="stored as r2.json") as info:
        parse_revision(record(), version="r2", model=MODEL, file="r2.json")
    assert info.value.field == "version"


def test_record_of_another_model_is_rejected():
    with pytest.raises(CatalogError, match="belongs to model") as info:
        parse_revision(record(), version="r1", model="org/other", file="r1.json")
    assert info.value.field == "model"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_bad_json_records_are_rejected(raw):
    with pytest.raises(CatalogError, match="JSON"):
        parse_revision(raw, version="r1", model=MODEL, file="r1.json")


@pytest.fixture(params=["file", "memory"])
def catalog(request, tmp_path) -> Catalog:
    url = str(tmp_path / "catalog") if request.param == "file" else f"memory://cat-{uuid.uuid4().hex}/catalog"
    return Catalog(ObjectStore(), url, MODEL)


def _in_storage_of(catalog: Catalog, raw: dict) -> dict:
    """The record with its payload beside the catalog (a record may not point to another kind of storage)."""
    if raw.get("uri") is None:
        return raw
    return {**raw, "uri": f"{catalog.url}/../revisions/{raw['version']}/delta.safetensors.index.json"}


def _put(catalog: Catalog, raw: dict) -> None:
    raw = _in_storage_of(catalog, raw)
    catalog.store.put_immutable(catalog.record_url(raw["version"]), canonical_json(raw))


def test_list_latest_initial_and_lineage(catalog):
    _put(catalog, initial(format_digest=D["a"]))
    _put(catalog, record("r1", base_digest=D["a"], target_digest=D["b"], format_digest=D["a"]))
    _put(catalog, record("r2", sequence=2, base_version="r1", base_digest=D["b"], target_digest=D["c"],
                         format_digest=D["a"]))
    assert [r.version for r in catalog.list()] == ["r0", "r1", "r2"]
    assert catalog.latest().version == "r2" and catalog.initial().version == "r0"
    rows = catalog.lineage(catalog.read("r2"), local={})
    assert [r.version for r in rows] == ["r0", "r1", "r2"]
    assert [r.version for r in catalog.lineage(catalog.read("r2"), local={"r1": D["b"]})] == ["r1", "r2"]


def _r0_with_format(catalog):
    _put(catalog, initial(format_digest=D["a"]))


@pytest.mark.parametrize("bad, field, message", [
    (dict(base_digest=D["f"]), "base_digest", "is not the target_digest"),
    (dict(base_version="r9"), "base_version", "not in the catalog"),
    (dict(format_digest=D["e"]), "format_digest", "cannot change the layout"),
])
def test_broken_links_fail_before_any_download(catalog, bad, field, message):
    _r0_with_format(catalog)
    _put(catalog, record("r1", **({"format_digest": D["a"]} | bad)))
    with pytest.raises(LineageError, match=message) as info:
        catalog.lineage(catalog.read("r1"), local={})
    assert info.value.field == field and info.value.revision == "r1"


def test_sequence_going_backwards_is_a_broken_link(catalog):
    _put(catalog, initial(format_digest=D["a"], sequence=0))
    _put(catalog, record("r5", sequence=5, format_digest=D["a"], target_digest=D["b"]))
    _put(catalog, record("r6", sequence=3, base_version="r5", base_digest=D["b"], format_digest=D["a"]))
    with pytest.raises(LineageError, match="does not increase") as info:
        catalog.lineage(catalog.read("r6"), local={})
    assert info.value.field == "sequence"


def test_local_checkpoint_with_another_digest_is_not_the_exact_base(catalog):
    _r0_with_format(catalog)
    _put(catalog, record("r1", format_digest=D["a"]))
    with pytest.raises(LineageError, match="not this catalog's revision"):
        catalog.lineage(catalog.read("r1"), local={"r0": D["f"]})


def test_latest_is_ambiguous_when_sequences_tie(catalog):
    _put(catalog, initial())
    _put(catalog, record("r1"))
    _put(catalog, record("x1", base_digest=D["a"]))
    with pytest.raises(CatalogError, match="ambiguous"):
        catalog.latest()


def test_invalid_version_ids_never_reach_storage(catalog):
    for bad in ("../r1", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(CatalogError):
            catalog.read(bad)


def test_write_is_create_only_and_idempotent(catalog):
    rev = Revision.model_validate(initial())
    assert catalog.write(rev) is True
    assert catalog.write(rev) is False  # identical re-put is a no-op
    other = Revision.model_validate(initial(target_digest=D["f"]))
    with pytest.raises(ImmutableConflict, match="r0.json"):
        catalog.write(other)
    assert catalog.store.read_bytes(catalog.record_url("r0"), max_size=10_000) == canonical_json(rev.to_json())


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_put_immutable_semantics(tmp_path, scheme):
    store = ObjectStore()
    url = (normalize_url(str(tmp_path / "obj.bin")) if scheme == "file"
           else f"memory://imm-{uuid.uuid4().hex}/obj.bin")
    assert store.put_immutable(url, b"payload") is True
    assert store.put_immutable(url, b"payload") is False
    with pytest.raises(ImmutableConflict, match="obj.bin"):
        store.put_immutable(url, b"PAYLOAD")
    assert store.read_bytes(url, max_size=100) == b"payload"
    local = tmp_path / "src.bin"
    local.write_bytes(b"x" * 1000)
    url2 = url.replace("obj.bin", "file.bin")
    assert store.put_immutable_file(url2, local) is True
    assert store.put_immutable_file(url2, local) is False
    local.write_bytes(b"y" * 1000)
    with pytest.raises(ImmutableConflict):
        store.put_immutable_file(url2, local)


@pytest.mark.parametrize("url", ["s3://bucket//key", "s3://bucket/key?x=1", "s3://bucket/key#frag", "s3:///key",
                                 "s3://b/key"])
def test_invalid_s3_uris_are_rejected_with_the_uri(url):
    with pytest.raises(InvalidURI) as info:
        normalize_url(url)
    assert url in str(info.value)


def _publish(catalog: Catalog, raw: dict, token: str = "t") -> None:
    """What a publisher does: claim the sequence, then write the record (which moves the head hint)."""
    assert catalog.claim_sequence(raw["sequence"], raw["version"], token) == (raw["version"], token)
    catalog.write(Revision.model_validate(_in_storage_of(catalog, raw)))


def _chain(catalog: Catalog, last: int) -> None:
    _publish(catalog, initial(format_digest=D["a"]))
    for n in range(1, last + 1):
        _publish(catalog, record(f"r{n}", sequence=n, payload_format="full_hf_checkpoint", base_version=None,
                                 base_digest=None, format_digest=D["a"]))


def test_latest_and_the_launch_revision_come_from_the_claims_without_a_listing(catalog, monkeypatch):
    _chain(catalog, 6)
    head = json.loads(catalog.store.read_bytes(catalog.head_hint_url, max_size=4096))
    assert (head["version"], head["sequence"]) == ("r6", 6)
    assert catalog.head_hint_url.endswith("/catalog/hints/head.json")  # not a .json directly under the catalog
    assert catalog.versions() == ["r0", "r1", "r2", "r3", "r4", "r5", "r6"]
    fresh = Catalog(catalog.store, catalog.url, MODEL)
    monkeypatch.setattr(fresh.store, "list_names", lambda *a, **k: pytest.fail("listed the catalog"))
    assert fresh.latest().version == "r6" and fresh.initial().version == "r0" and fresh.top_claim == 6
    _publish(catalog, record("r7", sequence=7, payload_format="full_hf_checkpoint", base_version=None,
                             base_digest=None, format_digest=D["a"]))
    assert fresh.latest().version == "r7"  # found above the claim it knew, by a probe


def test_a_node_memo_holds_claims_and_records_and_is_checked_against_the_catalog(tmp_path):
    catalog = Catalog(ObjectStore(), str(tmp_path / "catalog"), MODEL)
    _chain(catalog, 4)
    node = Catalog(ObjectStore(), catalog.url, MODEL, cache_dir=tmp_path / "memo")
    assert node.latest().version == "r4"
    assert (tmp_path / "memo" / "sequences" / f"{4:012d}.json").exists()
    (tmp_path / "catalog" / "hints" / "head.json").write_bytes(b"garbage")  # the node's memo is a start too
    _publish(catalog, record("r5", sequence=5, payload_format="full_hf_checkpoint", base_version=None,
                             base_digest=None, format_digest=D["a"]))
    again = Catalog(ObjectStore(), catalog.url, MODEL, cache_dir=tmp_path / "memo")
    assert again.latest().version == "r5"
    (tmp_path / "memo" / "hints" / "head.json").write_text('{"url": "elsewhere", "sequence": 99}')
    assert Catalog(ObjectStore(), catalog.url, MODEL, cache_dir=tmp_path / "memo").latest().version == "r5"


@pytest.mark.parametrize("error", [MemoryError(), RecursionError("deep"), OSError(5, "I/O error"),
                                   UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), RuntimeError("odd")])
def test_any_error_reading_a_record_quarantines_it_and_latest_goes_past(catalog, monkeypatch, error):
    _chain(catalog, 3)
    fresh = Catalog(catalog.store, catalog.url, MODEL)
    original = fresh.store.read_bytes

    def read_bytes(url, **kw):
        if url.endswith("/r3.json"):
            raise error
        return original(url, **kw)

    monkeypatch.setattr(fresh.store, "read_bytes", read_bytes)
    assert fresh.latest().version == "r2"
    assert isinstance(fresh.quarantined["r3"], CatalogError) and "r3.json" in str(fresh.quarantined["r3"])
    assert [r.version for r in fresh.list()] == ["r0", "r1", "r2"]
    with pytest.raises(CatalogError) as info:
        fresh.read("r3")
    assert info.value.revision == "r3"


def test_a_transient_error_is_not_a_quarantine(catalog, monkeypatch):
    from storage.errors import TransientStorageError

    _chain(catalog, 2)
    fresh = Catalog(catalog.store, catalog.url, MODEL)
    original = fresh.store.read_bytes

    def read_bytes(url, **kw):
        if url.endswith("/r2.json"):
            raise TransientStorageError("connection reset", file=url)
        return original(url, **kw)

    monkeypatch.setattr(fresh.store, "read_bytes", read_bytes)
    with pytest.raises(TransientStorageError):
        fresh.latest()
    assert fresh.quarantined == {}


def test_a_missing_target_is_explained_from_the_newest_claims_without_a_listing(catalog, monkeypatch):
    _chain(catalog, 12)
    fresh = Catalog(catalog.store, catalog.url, MODEL)
    monkeypatch.setattr(fresh.store, "list_names", lambda *a, **k: pytest.fail("listed the catalog"))
    with pytest.raises(CatalogError) as info:
        fresh.resolve("r99")
    assert "latest is r12" in str(info.value) and "versions: r5, r6, r7, r8, r9, r10, r11, r12" in str(info.value)
    assert info.value.revision == "r99"


@pytest.mark.parametrize("uri", ["http://127.0.0.1:9/revisions/r2/delta.safetensors.index.json",
                                 "s3://bucket/revisions/r2/delta.safetensors.index.json"])
def test_a_record_cannot_send_the_node_to_another_kind_of_storage(catalog, uri):
    _chain(catalog, 1)
    raw = record("r2", sequence=2, payload_format="full_hf_checkpoint", base_version=None, base_digest=None,
                 format_digest=D["a"], uri=uri)
    assert catalog.claim_sequence(2, "r2", "t") == ("r2", "t")
    catalog.store.put_immutable(catalog.record_url("r2"), canonical_json(raw))  # as an outsider writes it
    fresh = Catalog(catalog.store, catalog.url, MODEL)
    with pytest.raises(CatalogError) as info:
        fresh.read("r2")
    assert info.value.revision == "r2" and info.value.field == "uri" and "catalog's storage" in str(info.value)
    assert fresh.latest().version == "r1" and "r2" in fresh.quarantined  # skipped, reported, never used


def test_a_publisher_refuses_a_payload_url_in_another_kind_of_storage(tmp_path):
    from pydantic import ValidationError

    from storage.settings import PublishParams

    with pytest.raises(ValidationError, match="payload_url .* not in the catalog's kind of storage"):
        PublishParams(catalog=str(tmp_path / "catalog"), model=MODEL, checkpoint=tmp_path,
                      payload_url="s3://bucket/revisions/r1")
    beside = PublishParams(catalog=str(tmp_path / "catalog"), model=MODEL, checkpoint=tmp_path,
                           payload_url=str(tmp_path / "payload"))
    assert beside.payload_url == str(tmp_path / "payload")


def test_a_named_revision_missing_from_a_catalog_with_no_readable_record_is_a_storage_failure(tmp_path):
    """A catalog whose storage is gone (a file:// mount unmounted) cannot say a revision is not in it: the
    refit of a named target fails on storage (retried by the agent, never counted as a rejection by wait)."""
    from storage.catalog.nodes import STORAGE_FAILURE, CONTENT_FAILURE, failure_kind
    from storage.errors import ObjectNotFound

    present = Catalog(ObjectStore(), str(tmp_path / "catalog"), MODEL)
    present.write(parse_revision(initial(), version="r0", model=MODEL, file="r0.json"))
    with pytest.raises(CatalogError, match="revision r9 is not in the catalog") as refused:
        present.resolve("r9")
    assert failure_kind(refused.value) == CONTENT_FAILURE
    gone = Catalog(ObjectStore(), str(tmp_path / "unmounted"), MODEL)
    with pytest.raises(ObjectNotFound, match="holds no readable record") as missing:
        gone.resolve("r9")
    assert missing.value.revision == "r9"
    assert failure_kind(missing.value) == STORAGE_FAILURE
