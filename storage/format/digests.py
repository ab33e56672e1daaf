"""Per-tensor checksums, format digests and snapshot digests (docs/format.md, section 3)."""

from __future__ import annotations

import hashlib
import re
import zlib
from typing import Iterable, Mapping, Protocol

from storage.jsonio.canonical import canonical_json
from storage.errors import FormatError
from storage.runtime.gc_pause import gc_paused

CHECKSUM_FORMATS = ("adler32", "xxh3-128", "blake3")
CHECKSUM_HEX_LENGTH = {"adler32": 8, "xxh3-128": 32, "blake3": 64}
DIGEST_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Checksum(Protocol):
    """Incremental checksum: feed buffers in order, then read the hex digest."""

    def update(self, data) -> None: ...
    def hexdigest(self) -> str: ...


try:  # ISA-L's SIMD adler32: same values as zlib's, about 5x faster
    from isal.isal_zlib import adler32 as _adler32
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the reference
    _adler32 = zlib.adler32


class _Adler32:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 1

    def update(self, data) -> None:
        self.value = _adler32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value & 0xFFFFFFFF:08x}"


class _Xxh3:
    __slots__ = ("h",)

    def __init__(self) -> None:
        import xxhash

        self.h = xxhash.xxh3_128()

    def update(self, data) -> None:
        self.h.update(data)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


class _Blake3:
    __slots__ = ("h",)

    def __init__(self) -> None:
        import blake3

        self.h = blake3.blake3()

    def update(self, data) -> None:
        self.h.update(data)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


_FACTORIES = {"adler32": _Adler32, "xxh3-128": _Xxh3, "blake3": _Blake3}


def check_checksum_format(name: object, **context) -> str:
    """Return ``name`` if it is a supported checksum format, else raise naming it."""
    if not isinstance(name, str) or name not in _FACTORIES:
        raise FormatError(
            f"unsupported checksum format {name!r} (supported: {', '.join(CHECKSUM_FORMATS)})",
            **context,
        )
    return name


def new_checksum(name: str, **context) -> Checksum:
    """A fresh incremental checksum of the given format."""
    return _FACTORIES[check_checksum_format(name, **context)]()


def checksum_bytes(name: str, data) -> str:
    """Checksum of one buffer."""
    if name == "adler32":  # the common case, without an object per buffer (one per tiny tensor)
        return f"{_adler32(data, 1) & 0xFFFFFFFF:08x}"
    h = new_checksum(name)
    h.update(data)
    return h.hexdigest()


def is_checksum(name: str, value: object) -> bool:
    """True if ``value`` is a well-formed checksum of format ``name``."""
    return isinstance(value, str) and _CHECKSUM_PATTERNS[name].fullmatch(value) is not None


_CHECKSUM_PATTERNS = {name: re.compile(f"[0-9a-f]{{{n}}}") for name, n in CHECKSUM_HEX_LENGTH.items()}


def format_digest(tensors: Iterable[tuple[str, str, Iterable[int]]]) -> str:
    """Digest of the tensor layout: sorted ``{"name", "dtype", "shape"}`` of every tensor."""
    with gc_paused():  # a dict a tensor, no cycles
        rows = sorted(tensors, key=_first)
        entries = [{"name": name, "dtype": dtype, "shape": list(map(int, shape))} for name, dtype, shape in rows]
        return sha256_digest(canonical_json(entries))


def _first(row: tuple) -> str:
    return row[0]


def snapshot_digest(checksum_format: str, format_digest_value: str, checksums: Mapping[str, str]) -> str:
    """Digest of a checkpoint's content, built from its per-tensor checksums."""
    check_checksum_format(checksum_format)
    return sha256_digest(
        canonical_json(
            {
                "checksum_format": checksum_format,
                "format_digest": format_digest_value,
                "tensors": dict(checksums),
            }
        )
    )
