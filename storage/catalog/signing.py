"""Signed catalog records (docs/format.md, 4.10): Ed25519 over a record's canonical JSON without its signature.

A publisher with a private key adds one top-level field to each record it
writes, ``"signature": {"alg": "ed25519", "key_id": ..., "sig": ...}``;
readers that do not verify ignore it like any unknown field. A node with
trusted public keys accepts a record only if that field verifies under one
of them (several keys: a rotation). The cryptography is the ``cryptography``
package's; this module only chooses the bytes, the encodings and the errors.

Keys are read from the forms ``cryptography`` loads: PEM (PKCS#8 private,
SubjectPublicKeyInfo public), OpenSSH (``ssh-ed25519 AAAA...`` and its
private key file), or the raw 32 bytes in base64. ``python -m flows.publish
keygen --out DIR`` writes a new pair.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from storage.jsonio.bounded_json import RECORD, load_json, parse_record
from storage.jsonio.canonical import canonical_json
from storage.durable import create_only_write
from storage.errors import SignatureError
from storage.keys import label, load_private_key, load_public_key

__all__ = ["RecordSigner", "RecordVerifier", "signed_bytes", "key_id", "raw_public_key", "load_private_key",
           "load_public_key", "generate", "keygen_main"]

SIGNATURE_FIELD = "signature"
ALGORITHM = "ed25519"


@dataclass(frozen=True, config=ConfigDict(strict=True, extra="ignore"))
class Signature:
    """The ``signature`` object of a signed record (docs/format.md, 4.10). A key it does not know is ignored:
    it is part of a catalog record, which any publisher (a newer one, another implementation) writes."""

    alg: Literal["ed25519"]
    key_id: str
    sig: str
PRIVATE_KEY_FILE = "catalog-signing-key.pem"
PUBLIC_KEY_FILE = "catalog-signing-key.pub.pem"


# -- the signed bytes ---------------------------------------------------------------------------------------


def signed_bytes(document: dict) -> bytes:
    """What is signed: the canonical JSON (3.1) of the record object without its ``signature`` field."""
    return canonical_json({k: v for k, v in document.items() if k != SIGNATURE_FIELD})


def raw_public_key(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    """The first 16 hex digits of the SHA-256 of the raw 32-byte public key."""
    return hashlib.sha256(raw_public_key(key)).hexdigest()[:16]


class RecordSigner:
    """Signs record objects with one private key (the publisher's ``signing_key``)."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.key_id = key_id(key.public_key())

    @classmethod
    def from_file(cls, path: Path | str) -> "RecordSigner":
        return cls(load_private_key(path))

    def sign(self, document: dict) -> dict:
        """``document`` with its ``signature`` field (any earlier one replaced)."""
        sig = self._key.sign(signed_bytes(document))
        unsigned = {k: v for k, v in document.items() if k != SIGNATURE_FIELD}
        return unsigned | {SIGNATURE_FIELD: {"alg": ALGORITHM, "key_id": self.key_id,
                                             "sig": base64.b64encode(sig).decode("ascii")}}


class RecordVerifier:
    """Accepts a record only if it is signed by one of the trusted keys (a node's ``trusted_keys``).

    ``keys`` are keys, or entries of ``trusted_keys`` (paths or inline keys), loaded at the first
    verification: a key that cannot be loaded fails the run's first catalog read with ``SignatureError``.
    """

    def __init__(self, keys: Iterable[Ed25519PublicKey | str]):
        self._entries = list(keys)
        if not self._entries:
            raise ValueError("a verifier needs at least one trusted public key")
        self._keys: dict[str, Ed25519PublicKey] | None = None

    @classmethod
    def from_settings(cls, entries: Iterable[str]) -> "RecordVerifier | None":
        """The verifier of a node's ``trusted_keys``; None when there are none (records are not verified)."""
        entries = list(entries)
        return cls(entries) if entries else None

    @property
    def keys(self) -> dict[str, Ed25519PublicKey]:
        """The trusted keys by key id."""
        if self._keys is None:
            keys = {}
            for entry in self._entries:
                try:
                    key = entry if isinstance(entry, Ed25519PublicKey) else load_public_key(entry)
                except ValueError as exc:
                    raise SignatureError(f"a trusted key cannot be loaded: {exc}", file=label(str(entry)),
                                         field="trusted_keys") from None
                keys[key_id(key)] = key
            self._keys = keys
        return self._keys

    def __call__(self, raw: bytes | str | dict, *, revision: str | None, file: str | None) -> dict:
        """The record object, if its signature verifies under a trusted key; else ``SignatureError``."""
        document = raw
        if not isinstance(document, dict):
            document = load_json(raw, RECORD, error=SignatureError, revision=revision, file=file)
        if not isinstance(document, dict):
            raise SignatureError("record is not a JSON object", revision=revision, file=file)
        signature = document.get(SIGNATURE_FIELD)
        trusted = ", ".join(sorted(self.keys))
        if signature is None:
            raise SignatureError(f"record is not signed; this node accepts only records signed by a trusted key "
                                 f"({trusted})", revision=revision, file=file, field=SIGNATURE_FIELD)
        try:
            signature = parse_record(Signature, signature, error=SignatureError)
        except SignatureError as exc:
            where = SIGNATURE_FIELD if exc.field is None else f"{SIGNATURE_FIELD}.{exc.field}"
            raise SignatureError(f"signature is not an object with alg {ALGORITHM!r}, key_id and sig strings "
                                 f"({exc.reason})", revision=revision, file=file, field=where) from None
        key = self.keys.get(signature.key_id)
        if key is None:
            raise SignatureError(f"record is signed by key {signature.key_id[:64]!r}, which this node does not "
                                 f"trust (trusted: {trusted})", revision=revision, file=file,
                                 field=f"{SIGNATURE_FIELD}.key_id")
        try:
            sig = base64.b64decode(signature.sig, validate=True)
        except (binascii.Error, ValueError):
            sig = b""
        if len(sig) != 64:
            raise SignatureError("signature is not 64 bytes of base64", revision=revision, file=file,
                                 field=f"{SIGNATURE_FIELD}.sig")
        try:
            key.verify(sig, signed_bytes(document))
        except InvalidSignature:
            raise SignatureError(f"signature by key {signature.key_id} does not match the record: it was "
                                 "altered after signing", revision=revision, file=file,
                                 field=SIGNATURE_FIELD) from None
        return document


# -- key pairs --------------------------------------------------------------------------------------------


def generate(out: Path) -> tuple[Path, Path, str]:
    """Write a new key pair into ``out`` (never over an existing file): (private key, public key, key id).

    The private key is PKCS#8 PEM, readable by its owner only; the public key SubjectPublicKeyInfo PEM.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    paths = out / PRIVATE_KEY_FILE, out / PUBLIC_KEY_FILE
    for path in paths:
        if path.exists():
            raise FileExistsError(f"{path} already exists: choose another --out (a key is never overwritten)")
    for path, data, mode in ((paths[0], private, 0o600), (paths[1], public, 0o644)):
        def write(fh, data=data, mode=mode) -> None:
            os.fchmod(fh.fileno(), mode)  # before the secret is written
            fh.write(data)

        if not create_only_write(path, write):
            raise FileExistsError(f"{path} already exists: choose another --out (a key is never overwritten)")
    return paths[0], paths[1], key_id(key.public_key())


def keygen_parser(prog: str = "python -m flows.publish keygen") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Generate an Ed25519 key pair for signed catalog records: the private key for the publisher's "
        "--signing-key, the public key (a file, or the printed inline form) for each node's --trusted-key."))
    parser.add_argument("--out", required=True, help="folder for the two PEM files (created; nothing is overwritten)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def keygen_main(argv: list[str], prog: str = "python -m flows.publish keygen") -> int:
    """Generate a signing key pair; prints where it went, its key id and the public key inline."""
    args = keygen_parser(prog).parse_args(argv)
    try:
        private, public, kid = generate(Path(args.out))
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}) if args.json else f"error: {exc}")
        return 1
    inline = base64.b64encode(raw_public_key(load_public_key(str(public)))).decode("ascii")
    result = {"private_key": str(private), "public_key": str(public), "key_id": kid, "public_key_base64": inline}
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print("\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0
