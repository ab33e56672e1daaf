"""Ed25519 keys of signed catalog records (docs/format.md, 4.10): reading the forms ``cryptography`` loads.

Cross-cutting, so that the settings can refuse a key they cannot read when
they are built; the signing and verifying itself is ``storage/catalog/signing.py``.
Private keys: PEM (PKCS#8, unencrypted), OpenSSH, or the raw 32-byte seed in
base64, from a file. Public keys: PEM (SubjectPublicKeyInfo), ``ssh-ed25519
AAAA...``, or the raw 32 bytes in base64, from a file or inline.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_MAX_KEY_FILE = 64 * 1024


def label(entry: str) -> str:
    """An entry of ``trusted_keys`` as an error names it (an inline PEM shortened)."""
    return entry if len(entry) <= 200 and "\n" not in entry else entry[:40] + "..."


def _read_key_file(path: Path) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read(_MAX_KEY_FILE + 1)
    if len(data) > _MAX_KEY_FILE:
        raise ValueError(f"{path} is over {_MAX_KEY_FILE} bytes: not a key file")
    return data


def _raw32(text: bytes) -> bytes | None:
    try:
        raw = base64.b64decode(b"".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


def load_private_key(path: Path | str) -> Ed25519PrivateKey:
    """An Ed25519 private key from a file: PEM (PKCS#8), OpenSSH, or the raw 32-byte seed in base64."""
    path = Path(path)
    try:
        data = _read_key_file(path)
    except OSError as exc:
        raise ValueError(f"cannot read the signing key {path}: {exc.strerror or exc}") from None
    try:
        if data.lstrip().startswith(b"-----BEGIN OPENSSH PRIVATE KEY"):
            key = serialization.load_ssh_private_key(data, password=None)
        elif data.lstrip().startswith(b"-----BEGIN"):
            key = serialization.load_pem_private_key(data, password=None)
        elif (raw := _raw32(data)) is not None:
            key = Ed25519PrivateKey.from_private_bytes(raw)
        else:
            raise ValueError("neither PEM, OpenSSH nor 32 bytes of base64")
    except (ValueError, TypeError) as exc:  # TypeError: an encrypted key (no password is taken)
        raise ValueError(f"{path} is not an unencrypted Ed25519 private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


def load_public_key(entry: str | Path) -> Ed25519PublicKey:
    """An Ed25519 public key from a file path, or inline: PEM, ``ssh-ed25519 AAAA...``, or 32 bytes of base64."""
    text = str(entry).strip()
    if not text:
        raise ValueError("an empty trusted key")
    inline = text.startswith("-----BEGIN") or text.startswith("ssh-ed25519 ") or _raw32(text.encode()) is not None
    if inline:
        data, where = text.encode(), "inline key"
    else:
        try:
            data, where = _read_key_file(Path(text).expanduser()), text
        except OSError as exc:
            raise ValueError(f"{label(text)!r} is neither a readable public key file ({exc.strerror or exc}) nor "
                             "an inline key (PEM, 'ssh-ed25519 ...' or 32 bytes of base64)") from None
    stripped = data.strip()
    try:
        if stripped.startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(stripped)
        elif stripped.startswith(b"ssh-ed25519 "):
            key = serialization.load_ssh_public_key(stripped)
        elif (raw := _raw32(stripped)) is not None:
            key = Ed25519PublicKey.from_public_bytes(raw)
        else:
            raise ValueError("neither PEM, 'ssh-ed25519 ...' nor 32 bytes of base64")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where} is not an Ed25519 public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{where} holds a {type(key).__name__}, not an Ed25519 public key")
    return key
