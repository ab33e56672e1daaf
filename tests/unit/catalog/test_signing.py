"""Signed catalog records (docs/format.md, 4.10): a publisher with an Ed25519 key signs every record it writes;
a node with trusted public keys refuses, before a payload byte is downloaded, any record that is unsigned,
signed by another key or altered after signing, and 'latest' skips such a record instead of being jammed by it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.support.lab import ROOT_DIR, independent_digest, write_checkpoint
from tests.support.s3_support import s3, s3_lab  # noqa: F401  (s3 is a fixture)
from flows import api
from storage.jsonio.canonical import canonical_json
from storage.catalog import signing
from storage.catalog.records import parse_revision
from storage.errors import CatalogError, SignatureError
from storage.store.local_store import LocalStore
from testbed.s3proxy import Faults


def keygen(out: Path) -> tuple[Path, Path]:
    """A key pair through the product's own command."""
    done = subprocess.run([sys.executable, "-m", "flows.publish", "keygen", "--out", str(out), "--json"],
                          capture_output=True, text=True, cwd=ROOT_DIR, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout)
    return Path(found["private_key"]), Path(found["public_key"])


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Three key pairs: the trainer's, the next one (a rotation), and an outsider's."""
    root = tmp_path_factory.mktemp("keys")
    return {name: keygen(root / name) for name in ("trainer", "next", "outsider")}


def refit(lab, *trusted: Path | str, target: str = "latest", cache: Path | None = None, **settings):
    """``flows.api.refit`` of the lab's node, trusting ``trusted`` (the RefitResult, never raising)."""
    return api.refit(catalog=lab.catalog, model=lab.model, target=target, cache_dir=cache or lab.cache,
                     seed_checkpoint=lab.launch, installer={"kind": "none"}, apply_workers=2, lock_timeout_s=30,
                     trusted_keys=[str(k) for k in trusted], check=False, **settings)


def record_path(lab, version: str) -> Path:
    return lab.catalog_dir / f"{version}.json"


def assert_refused(lab, result, version: str, why: str) -> None:
    """Failed with ``SignatureError`` naming the revision and its record file, nothing of it downloaded,
    the installed version unchanged (r1)."""
    assert result.status == "FAILED" and result.exit_code == 1, result.error
    assert isinstance(result.exception, SignatureError), result.error
    assert result.exception.revision == version and result.exception.file.endswith(f"/{version}.json")
    assert why in result.error, result.error
    assert [s["name"] for s in result.stages] == ["resolve catalog"]  # refused before any download
    store = lab.store_root
    assert not (store / "deltas" / version).exists() and not (store / "full" / version).exists()
    assert LocalStore(lab.cache, lab.model).active().version == "r1"


# -- the signing module ----------------------------------------------------------------------------------


def test_sign_verify_round_trip_and_the_signed_bytes(keys, tmp_path):
    private, public = keys["trainer"]
    signer = signing.RecordSigner.from_file(private)
    record = {"schema": "canonical-refit.revision.v1", "version": "r1", "sequence": 1, "uri": "s3://b/k",
              "extra": {"b": 1, "a": "é"}}
    signed = signer.sign(record)
    assert {k: v for k, v in signed.items() if k != "signature"} == record
    sig = signed["signature"]
    assert sig["alg"] == "ed25519" and len(base64.b64decode(sig["sig"])) == 64
    # the signed bytes: the canonical JSON of the record without its signature field, as another reader computes
    assert signing.signed_bytes(signed) == canonical_json(record) == json.dumps(
        record, sort_keys=True, separators=(",", ":")).encode()
    key = serialization.load_pem_public_key(public.read_bytes())
    key.verify(base64.b64decode(sig["sig"]), canonical_json(record))  # cryptography's own check, no ours
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert sig["key_id"] == hashlib.sha256(raw).hexdigest()[:16] == signer.key_id

    # every form of the public key is the same key: the file, inline PEM, inline raw base64, OpenSSH
    inline = base64.b64encode(raw).decode()
    ssh = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    for entry in (str(public), public.read_text(), inline, ssh):
        verifier = signing.RecordVerifier([entry])
        assert verifier(canonical_json(signed), revision="r1", file="r1.json") == signed
        assert verifier(json.dumps(signed, indent=2).encode(), revision="r1", file="r1.json") == signed
    # a private key given as its raw 32 bytes in base64 signs the same
    seed = tmp_path / "seed.b64"
    seed.write_text(base64.b64encode(serialization.load_pem_private_key(private.read_bytes(), None).private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())).decode())
    assert signing.RecordSigner.from_file(seed).sign(record) == signed  # Ed25519 is deterministic

    verifier = signing.RecordVerifier([str(public)])
    cases = {
        "unsigned": (record, "not signed"),
        "a field changed": (signed | {"sequence": 2}, "altered after signing"),
        "a field added": (signed | {"note": "x"}, "altered after signing"),
        "another key": (signing.RecordSigner(Ed25519PrivateKey.generate()).sign(record), "does not trust"),
        "another key claiming this key's id": (
            signing.RecordSigner(Ed25519PrivateKey.generate()).sign(record) | {"signature": dict(
                signing.RecordSigner(Ed25519PrivateKey.generate()).sign(record)["signature"],
                key_id=sig["key_id"])}, "altered after signing"),
        "sig not base64": (signed | {"signature": sig | {"sig": "%%%"}}, "64 bytes"),
        "another algorithm": (signed | {"signature": sig | {"alg": "rsa"}}, "alg"),
        "signature not an object": (signed | {"signature": "yes"}, "alg"),
    }
    for name, (document, why) in cases.items():
        with pytest.raises(SignatureError, match=why) as caught:
            verifier(canonical_json(document), revision="r1", file="s3://b/catalog/r1.json")
        assert caught.value.revision == "r1" and caught.value.file == "s3://b/catalog/r1.json", name


def test_the_worked_example_of_the_format_specification():
    """docs/format.md 4.10's example: r0 of 4.2 signed with the all-zero test seed."""
    doc = (ROOT_DIR / "docs" / "format.md").read_text()
    section = doc[doc.index("### 4.2 Fields"):doc.index("### 4.3")]
    r0 = json.loads(next(line for line in section.splitlines() if line.startswith('{"base_digest":null')))
    key = Ed25519PrivateKey.from_private_bytes(bytes(32))
    signature = signing.RecordSigner(key).sign(r0)["signature"]
    spec = doc[doc.index("### 4.10"):doc.index("## 5. Payloads")]
    assert f'"signature": {json.dumps(signature, separators=(",", ":"))}' in spec
    public = base64.b64encode(key.public_key().public_bytes(serialization.Encoding.Raw,
                                                            serialization.PublicFormat.Raw)).decode()
    assert f"`{public}`" in spec
    key.public_key().verify(base64.b64decode(signature["sig"]), json.dumps(
        r0, sort_keys=True, separators=(",", ":")).encode("utf-8"))  # the bytes the section says are signed


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path):
    private, public = keygen(tmp_path / "k")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    pem = private.read_bytes()
    again = subprocess.run([sys.executable, "-m", "flows.publish", "keygen", "--out", str(tmp_path / "k")],
                           capture_output=True, text=True, cwd=ROOT_DIR, timeout=120)
    assert again.returncode == 1 and "already exists" in again.stdout
    assert private.read_bytes() == pem
    signing.RecordVerifier([str(public)])(signing.RecordSigner.from_file(private).sign({"a": 1}), revision="r",
                                          file="f")


# -- publish and refit ---------------------------------------------------------------------------------------


@pytest.fixture
def cli_env(prefect_api, tmp_path):
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith("CANONICAL_REFIT_")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_HOME=str(tmp_path / "prefect-home"),
               PYTHONPATH=str(ROOT_DIR))
    return env


def test_a_signed_chain_installs_byte_exact_and_an_unsigned_record_is_refused(flow_lab, keys, cli_env):
    lab = flow_lab
    private, public = keys["trainer"]
    # the launch revision through the command line's --signing-key, the deltas through the runbook
    folder = lab.write(lab.current, "launch-source")
    write_checkpoint(lab.launch, lab.current, shards=lab.shape.shards)
    out = subprocess.run([sys.executable, "-m", "flows.publish", "--catalog", lab.catalog, "--model", lab.model,
                          "--checkpoint", str(folder), "--kind", "initial", "--state-dir", str(lab.root / "publisher"),
                          "--no-event", "--signing-key", str(private), "--json"],
                         capture_output=True, text=True, env=cli_env, cwd=ROOT_DIR, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    lab.revisions["r0"] = lab.current
    lab.publish("delta", signing_key=private)
    kid = signing.RecordSigner.from_file(private).key_id
    for version in ("r0", "r1"):
        stored = json.loads(record_path(lab, version).read_bytes())
        assert stored["signature"]["key_id"] == kid
        # a reader without keys (and ModelExpress's) sees the twelve fields, the signature ignored
        record = parse_revision(record_path(lab, version).read_bytes(), version=version, model=lab.model, file="f")
        assert canonical_json(record.to_json()) == signing.signed_bytes(stored)

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model,
                               "--cache-dir", str(lab.cache), "--seed-checkpoint", str(lab.launch), "--json",
                               "--trusted-key", str(public), *args],
                              capture_output=True, text=True, env=cli_env, cwd=ROOT_DIR, timeout=300)
        return done, json.loads(done.stdout.strip().splitlines()[-1])

    done, result = cli("--target", "r1")
    assert done.returncode == 0 and result["status"] == "READY", result["error"]
    lab.assert_checkpoint(Path(result["checkpoint_path"]), "r1")

    # r2, replaced before the node met it by the same record without its signature: refused, naming it,
    # before anything is fetched (a record the node verified once is memoised, signature and all)
    lab.publish("delta", signing_key=private)
    good = record_path(lab, "r2").read_bytes()
    unsigned = json.loads(good)
    del unsigned["signature"]
    record_path(lab, "r2").write_bytes(canonical_json(unsigned))
    done, result = cli("--target", "r2")
    assert done.returncode == 1 and result["status"] == "FAILED"
    assert result["error_detail"]["type"] == "SignatureError" and result["error_detail"]["revision"] == "r2"
    assert result["error_detail"]["file"].endswith("/r2.json") and "not signed" in result["error"]
    assert [s["name"] for s in result["stages"]] == ["resolve catalog"]
    assert result["installed_version"] == "r1" and not (lab.store_root / "deltas" / "r2").exists()

    # the signed record back: installed, byte-exact (nothing of the refusal was remembered)
    record_path(lab, "r2").write_bytes(good)
    done, result = cli("--target", "r2")
    assert done.returncode == 0 and result["status"] == "READY", result["error"]
    assert result["target_digest"] == independent_digest(lab.expected("r2"))[1]
    lab.assert_checkpoint(Path(result["checkpoint_path"]), "r2")


def test_full_revisions_and_sharded_publications_are_signed(keys, tmp_path):
    """Rank 0 signs the record of a revision two ranks publish (threads, ``flows.api.publish``); a full one too."""
    from flows.synthetic import random_model, train_step
    from tests.support.lab import read_checkpoint, tiny_shape

    private, public = keys["trainer"]
    catalog, model, shape = f"file://{tmp_path}/catalog", "lab/signed", tiny_shape()
    steps = [random_model(shape, seed=5)]
    steps += [train_step(steps[0], seed=6), train_step(train_step(steps[0], seed=6), seed=7)]
    launch = write_checkpoint(tmp_path / "launch", steps[0], shards=shape.shards)

    def by_ranks(tensors: dict, kind: str, publication: str) -> None:
        names, errors = sorted(tensors), []
        folders = [write_checkpoint(tmp_path / publication / f"rank{r}", {n: tensors[n] for n in names[r::2]},
                                    shards=1) for r in range(2)]

        def rank(r: int) -> None:
            try:
                api.publish(folders[r], catalog=catalog, model=model, kind=kind, rank=r, world_size=2,
                            publication=publication, state_dir=tmp_path / "state", emit_event=False,
                            part_timeout_s=60, signing_key=private)
            except Exception as exc:  # the assertion below shows it
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [], errors

    by_ranks(steps[0], "initial", "p0")
    by_ranks(steps[1], "delta", "p1")
    api.publish(write_checkpoint(tmp_path / "step2", steps[2], shards=shape.shards), catalog=catalog, model=model,
                kind="full", state_dir=tmp_path / "single", emit_event=False, signing_key=private)
    kid = signing.RecordSigner.from_file(private).key_id
    for version in ("r0", "r1", "r2"):
        assert json.loads((tmp_path / "catalog" / f"{version}.json").read_bytes())["signature"]["key_id"] == kid
    for version, want, lineage in (("r1", steps[1], ["r0", "r1"]), ("r2", steps[2], ["r2"])):
        result = api.refit(catalog=catalog, model=model, target=version, cache_dir=tmp_path / "node",
                           seed_checkpoint=launch, installer={"kind": "none"}, trusted_keys=[str(public)])
        assert result.status == "READY" and result.lineage == lineage, result.error
        got = read_checkpoint(Path(result.checkpoint_path))
        assert sorted(got) == sorted(want) and all(got[n].tobytes() == want[n].tobytes() for n in want)


@pytest.fixture
def signed_at_r1(lab, keys):
    """r0, r1 signed by the trainer's key, the node installed r1 (trusting that key); then r2, signed too."""
    private, public = keys["trainer"]
    for kind in ("initial", "delta"):
        lab.publish(kind, signing_key=private)
    result = refit(lab, public, target="r1")
    assert result.status == "READY", result.error
    lab.publish("delta", signing_key=private)
    return lab


def _unsigned(record: dict, keys) -> dict:
    return {k: v for k, v in record.items() if k != "signature"}


def _resigned_by_the_outsider(record: dict, keys) -> dict:
    return signing.RecordSigner.from_file(keys["outsider"][0]).sign(record)


def _digest_changed(record: dict, keys) -> dict:
    return record | {"target_digest": "sha256:" + "0" * 64}


def _uri_changed(record: dict, keys) -> dict:
    return record | {"uri": record["uri"].replace("/revisions/r2/", "/revisions/r1/")}


@pytest.mark.parametrize("tamper, why", [
    (_unsigned, "not signed"),
    (_resigned_by_the_outsider, "does not trust"),
    (_digest_changed, "altered after signing"),
    (_uri_changed, "altered after signing"),
], ids=["unsigned", "re-signed by another key", "target_digest altered", "uri altered"])
def test_a_record_the_trainer_did_not_sign_is_refused_before_any_download(signed_at_r1, keys, tamper, why):
    lab = signed_at_r1
    public = keys["trainer"][1]
    good = record_path(lab, "r2").read_bytes()
    record_path(lab, "r2").write_bytes(canonical_json(tamper(json.loads(good), keys)))
    assert_refused(lab, refit(lab, public, target="r2"), "r2", why)
    # still refused the second time (the memo never holds an unverified record), then the good one installs
    assert_refused(lab, refit(lab, public, target="r2"), "r2", why)
    record_path(lab, "r2").write_bytes(good)
    result = refit(lab, public, target="r2")
    assert result.status == "READY", result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")


def test_every_record_of_the_chain_is_verified(lab, keys, tmp_path, caplog):
    """A fresh node reaching r2 from the launch snapshot verifies r0, r1 and r2: an unsigned base is refused."""
    private, public = keys["trainer"]
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind, signing_key=private)
    good = record_path(lab, "r1").read_bytes()
    record_path(lab, "r1").write_bytes(canonical_json(_unsigned(json.loads(good), keys)))
    result = refit(lab, public, target="r2", cache=tmp_path / "fresh")
    assert result.status == "FAILED" and isinstance(result.exception, SignatureError), result.error
    assert result.exception.revision == "r1" and "not signed" in result.error
    fresh = tmp_path / "fresh" / lab.model.replace("/", "--")
    assert list((fresh / "deltas").iterdir()) == [] and list((fresh / "full").iterdir()) == []  # nothing fetched
    assert list((fresh / "verified").iterdir()) == []
    # (each case on a node that never met the good records: one it verified is memoised with its signature)
    # the launch record is verified too
    record_path(lab, "r1").write_bytes(good)
    launch = record_path(lab, "r0").read_bytes()
    record_path(lab, "r0").write_bytes(canonical_json(_resigned_by_the_outsider(json.loads(launch), keys)))
    result = refit(lab, public, target="r2", cache=tmp_path / "fresh-2", initial_version="r0")  # named: read
    assert result.status == "FAILED" and isinstance(result.exception, SignatureError), result.error
    assert result.exception.revision == "r0" and "does not trust" in result.error
    with caplog.at_level(logging.WARNING, logger="canonical_refit.catalog"):
        result = refit(lab, public, target="r2", cache=tmp_path / "fresh-2")  # found by its claim: named
    assert result.status == "FAILED" and isinstance(result.exception, SignatureError), result.error
    assert result.exception.revision == "r0" and "does not trust" in result.error and result.lineage == []
    assert any("r0.json" in r.getMessage() and "does not trust" in r.getMessage() for r in caplog.records)
    record_path(lab, "r0").write_bytes(launch)
    result = refit(lab, public, target="r2", cache=tmp_path / "fresh-2")
    assert result.status == "READY" and result.lineage == ["r0", "r1", "r2"], result.error


def test_key_rotation_accepts_both_keys_and_dropping_the_old_one_takes_effect(signed_at_r1, keys):
    lab = signed_at_r1
    old, new = keys["trainer"][1], keys["next"][1]
    lab.publish("delta", signing_key=keys["next"][0])  # r3: the trainer switched to the new key
    assert refit(lab, old, target="r3").exception.revision == "r3"  # a node that has only the old key refuses it
    inline = base64.b64encode(serialization.load_pem_public_key(new.read_bytes()).public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()
    result = refit(lab, old, inline)  # both keys (the new one inline): r1 -> r2 (old key) -> r3 (new key)
    assert result.status == "READY" and result.version == "r3" and result.lineage == ["r1", "r2", "r3"], result.error
    lab.assert_checkpoint(Path(result.checkpoint_path), "r3")
    # the old key dropped: the records it signed are refused, though this node read (and memoised) them
    # before; the launch record r0 is one of them (docs/format.md 4.10: retiring the key that signed the
    # launch revision means a new catalog)
    result = refit(lab, new, target="r3", initial_version="r0")
    assert result.status == "FAILED" and isinstance(result.exception, SignatureError), result.error
    assert result.exception.revision == "r0" and "does not trust" in result.error
    assert LocalStore(lab.cache, lab.model).active().version == "r3"


def test_unsigned_junk_with_a_higher_sequence_does_not_jam_latest(signed_at_r1, keys, monkeypatch):
    lab = signed_at_r1
    public = keys["trainer"][1]
    lab.publish("delta")  # r3: published without the key (a publisher that has the bucket, not the key)
    assert "signature" not in json.loads(record_path(lab, "r3").read_bytes())
    monkeypatch.setenv("CANONICAL_REFIT_TRUSTED_KEYS", json.dumps([str(public)]))  # the keys from the environment
    result = api.refit(catalog=lab.catalog, model=lab.model, cache_dir=lab.cache, seed_checkpoint=lab.launch,
                       installer={"kind": "none"}, apply_workers=2, lock_timeout_s=30)
    assert result.status == "READY" and result.version == "r2", result.error  # the newest record it can verify
    lab.assert_checkpoint(Path(result.checkpoint_path), "r2")
    assert any("r3" in note and "not signed" in note for note in result.notes), result.notes
    assert not (lab.store_root / "deltas" / "r3").exists()
    monkeypatch.delenv("CANONICAL_REFIT_TRUSTED_KEYS")
    result = refit(lab, target="latest")  # a node without keys takes it, as before
    assert result.status == "READY" and result.version == "r3", result.error


def test_a_key_that_cannot_be_read_is_refused_when_the_settings_are_built(lab, keys, tmp_path):
    lab.publish("initial", signing_key=keys["trainer"][0])
    bad = tmp_path / "not-a-key.pem"
    bad.write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ValueError, match="not an Ed25519 public key"):
        refit(lab, bad)
    with pytest.raises(ValueError, match="neither a readable public key file .* nor an inline key"):
        refit(lab, tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="not an Ed25519 public key"):  # a private key is not a trusted key
        refit(lab, keys["trainer"][0])
    with pytest.raises(ValueError, match="not an unencrypted Ed25519 private key"):
        lab.publish("delta", signing_key=bad)
    assert sorted(p.name for p in lab.catalog_dir.glob("*.json")) == ["r0.json"]  # nothing was published
    assert not lab.cache.exists()


def test_over_s3_a_refused_record_fetches_no_payload_object(prefect_api, s3, keys, tmp_path):
    lab = s3_lab(tmp_path, s3, "signed")
    private, public = keys["trainer"]
    lab.publish("initial", signing_key=private, storage=s3.settings())
    lab.publish("delta", signing_key=private, storage=s3.settings())
    lab.publish("delta", storage=s3.settings())  # r2, unsigned
    with s3.proxy(Faults()) as proxy:
        def run(target):
            return api.refit(catalog=lab.catalog, model=lab.model, target=target, cache_dir=lab.cache,
                             seed_checkpoint=lab.launch, installer={"kind": "none"}, apply_workers=2,
                             lock_timeout_s=30, trusted_keys=[str(public)], storage=s3.settings(proxy.url),
                             check=False)

        result = run("r2")
        assert result.status == "FAILED" and isinstance(result.exception, SignatureError), result.error
        assert result.exception.revision == "r2" and result.exception.file.endswith("/catalog/r2.json")
        assert proxy.requests("/revisions/") == []  # not one payload request
        result = run("latest")
        assert result.status == "READY" and result.version == "r1", result.error
        assert not [r for r in proxy.requests("/revisions/r2/")]
    lab.assert_checkpoint(Path(result.checkpoint_path), "r1")
