"""Per-tensor checksums, format digests and snapshot digests (docs/format.md, section 3)."""

from __future__ import annotations

import hashlib
import re
import zlib
from typing import Iterable, Mapping, Protocol

import numpy as np

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


ADLER_MOD = 65521


def adler32_of(data, value: int = 1) -> int:
    """``zlib.adler32(data, value)`` (ISA-L's when installed)."""
    return _adler32(data, value) & 0xFFFFFFFF


def adler32_combine(first: int, second: int, length: int) -> int:
    """adler32 of ``X + Y`` from ``first`` = adler32(X), ``second`` = adler32(Y) and ``length`` = len(Y) (zlib's
    ``adler32_combine``): with A = 1 + sum of the bytes and B = the sum of A after each byte, both mod 65521,
    A = A1 + A2 - 1 and B = B1 + B2 + len(Y) * (A1 - 1)."""
    a1, a2 = first & 0xFFFF, second & 0xFFFF
    a = (a1 + a2 - 1) % ADLER_MOD
    b = ((first >> 16) + (second >> 16) + length * (a1 - 1)) % ADLER_MOD
    return b << 16 | a


def adler32_delta(length: int, index: np.ndarray, old: np.ndarray, new: np.ndarray) -> tuple[int, int]:
    """What changing the bytes at ``index`` (distinct positions, < ``length`` <= 2**27) of a ``length``-byte
    buffer from ``old`` to ``new`` (uint8) adds to its adler32's two sums A and B (mod 65521), from those bytes
    alone (``adler32_add`` applies it to a checksum, ``adler32_sub`` takes it back).

    adler32 is linear in the bytes: a byte at position i counts once in A and ``length - i`` times in B, so
    changes d_i = new_i - old_i add sum(d_i) to A and ``length * sum(d_i) - sum(i * d_i)`` to B (the sums are
    exact in int64 for buffers up to 2**27 bytes).
    """
    d = new.astype(np.int64)
    d -= old
    total, weighted = int(d.sum()), int(np.dot(index, d))
    return total % ADLER_MOD, (length * total - weighted) % ADLER_MOD


def adler32_add(value: int, delta: tuple[int, int]) -> int:
    """The adler32 ``value`` of a buffer after the change ``delta`` (``adler32_delta``)."""
    return ((value >> 16) + delta[1]) % ADLER_MOD << 16 | ((value & 0xFFFF) + delta[0]) % ADLER_MOD


def adler32_sub(value: int, delta: tuple[int, int]) -> int:
    """The adler32 ``value`` of a buffer before the change ``delta`` (``adler32_delta``)."""
    return ((value >> 16) - delta[1]) % ADLER_MOD << 16 | ((value & 0xFFFF) - delta[0]) % ADLER_MOD


def adler32_changed(value: int, length: int, index: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """adler32 of a ``length``-byte buffer whose adler32 was ``value`` once the bytes at ``index`` changed from
    ``old`` to ``new`` (``adler32_delta``)."""
    return adler32_add(value, adler32_delta(length, index, old, new))


class _Adler32:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 1

    def update(self, data) -> None:
        self.value = _adler32(data, self.value)

    def combine(self, value: int, length: int) -> None:
        """Append a buffer of ``length`` bytes known only by its adler32 ``value``."""
        self.value = adler32_combine(self.value & 0xFFFFFFFF, value, length)

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


def checksum_ranges(name: str, data: memoryview, offsets: list[int], sizes: list[int]) -> list[str]:
    """``checksum_bytes(name, data[o: o + n])`` of each ``o, n`` in ``zip(offsets, sizes)`` (adler32, the common
    case: without a call a range)."""
    if name == "adler32":
        adler32 = _adler32
        return [f"{adler32(data[o: o + n], 1) & 0xFFFFFFFF:08x}" for o, n in zip(offsets, sizes)]
    return [checksum_bytes(name, data[o: o + n]) for o, n in zip(offsets, sizes)]


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
