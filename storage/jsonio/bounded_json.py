"""Bounded, strict JSON: the one parser of every JSON document the program reads (docs/format.md, section 10).

``load_json(data, limits, error=..., **context)`` refuses, with ``error`` (a ``RefitError`` class) naming the
object, anything that is not:

- at most ``limits.max_bytes`` bytes (checked before anything else),
- strict UTF-8 without a byte order mark (never UTF-16/32 sniffing, no encoded or escaped lone surrogates),
- at most ``limits.max_depth`` containers deep and at most ``limits.elements_allowed`` elements, both counted by an
  O(n) scan of the bytes *before* ``json.loads`` builds anything (so no RecursionError, no object bombs),
- free of repeated keys, ``NaN``, ``Infinity`` and numbers that overflow to infinity.

Memory: ``json.loads`` spends at most ``ELEMENT_COST`` bytes of Python objects per element beyond the decoded
text (measured for the costliest shapes: an empty object in a list, a short unique key); the element count
allowed is what keeps the parse within ``MEMORY_RATIO`` times the input's bytes, or within the kind's
``free_elements`` floor for small documents (tests/unit/format/test_bounded_json.py measures it with tracemalloc).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
from dataclasses import dataclass, fields
from functools import cache
from typing import TypeVar

from pydantic_core import ValidationError

from storage.errors import FormatError, RefitError
from storage.runtime.gc_pause import gc_paused

MEMORY_RATIO = 4
ELEMENT_COST = 112  # bytes of Python objects per element, worst shape (measured: tests/unit/format/test_bounded_json.py)
_BOM = b"\xef\xbb\xbf"
_CHUNK = 1 << 15  # bytes per step of the structure scan: its arrays stay under a megabyte
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
T = TypeVar("T")


@dataclass(frozen=True)
class JsonLimits:
    """What one kind of document may be: bytes, nesting depth, elements.

    An *element* is a value or a key: the scan counts one per ``,``, ``:`` and opening bracket outside
    strings, plus one (the top-level value). A document of ``n`` bytes may have
    ``min(max_elements, max(free_elements, (MEMORY_RATIO * n - decoded text) // ELEMENT_COST))``.
    """

    kind: str  # how errors name the document: "record", "index", "header", ...
    max_bytes: int
    max_depth: int
    max_elements: int
    free_elements: int = 1 << 16

    def elements_allowed(self, n: int, text_cost: int) -> int:
        by_size = (MEMORY_RATIO * n - text_cost) // ELEMENT_COST
        return min(self.max_elements, max(self.free_elements, by_size))


MiB = 2**20
# The kinds, and who reads each (docs/format.md, section 10, states them for other implementations).
# Catalog records, sequence claims, the head hint, node records, publication plans, the local server's record:
RECORD = JsonLimits("record", 1 * MiB, 32, 1 << 16)
# Index manifests: 500k tensors of 55-character names make a 43 MB index of 1M elements.
INDEX = JsonLimits("index", 64 * MiB, 16, 1 << 23, 1 << 20)
# Safetensors headers (shards and buckets): the safetensors library's byte bound; 4M elements is a bucket of
# ~300k tensors with their checksums (a header costs 6-10x its bytes as Python objects, so it needs a floor).
HEADER = JsonLimits("header", 100 * MiB, 16, 1 << 22, 1 << 22)
# A publisher rank's part: layout, checksums and weight map of its tensors (~10 elements a tensor).
PART = JsonLimits("publication part", 64 * MiB, 16, 1 << 23, 1 << 22)
# The node's own files: state.json, active.json, verified and chain records, memos, source records, the kept
# base's record (a checksum per tensor), partial-download records.
STORE_RECORD = JsonLimits("state file", 64 * MiB, 32, 1 << 23, 1 << 21)


def load_json(data: bytes | bytearray | memoryview | str, limits: JsonLimits, *, error: type[RefitError] = FormatError,
              expect: type | None = None, **context):
    """The parsed document, or ``error(message, **context)``: ``context`` names it (``file``, ``revision``,
    ``local_file``...). ``expect=dict`` also refuses any other top-level type."""
    kind = limits.kind

    def fail(message: str) -> RefitError:
        return error(f"{kind} {message}", **context)

    try:
        if isinstance(data, str):
            data = data.encode("utf-8")  # strict: a lone surrogate fails here
        data = bytes(data)
        n = len(data)
        if n > limits.max_bytes:
            raise fail(f"is {n} bytes, more than the {limits.max_bytes}-byte limit")
        if data.startswith(_BOM):
            raise fail("starts with a byte order mark: JSON here is UTF-8 without one")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise fail(f"is not UTF-8 JSON ({exc.reason} at byte {exc.start})") from None
        text_cost = n if data.isascii() else sys.getsizeof(text)
        allowed = limits.elements_allowed(n, text_cost)
        depth, elements, keys = _structure(data, limits.max_depth, allowed)
        if depth > limits.max_depth:
            raise fail(f"nests deeper than {limits.max_depth} levels")
        if elements > allowed:
            raise fail(f"has more than {allowed} elements (keys and values) for its {n} bytes")
        with gc_paused():  # the parse builds no cycles: a collection here would walk every object it made
            value = _parse(text, keys)
        del text
        if b"\\" in data and _SURROGATE_ESCAPE.search(data):
            _refuse_lone_surrogates(value)
    except RefitError:
        raise
    except RecursionError:  # unreachable past the depth scan; kept so no parse ever escapes untyped
        raise fail("nests too deeply") from None
    except MemoryError:
        raise fail("does not fit in memory") from None
    except ValueError as exc:  # JSONDecodeError, a hook's refusal, UnicodeError (a lone surrogate), digit limits
        raise fail(f"is not valid JSON ({exc})") from None
    if expect is not None and not isinstance(value, expect):
        raise fail(f"is a JSON {_json_type(value)}, not {_json_type_name(expect)}")
    return value


def read_bounded(path, limits: JsonLimits, *, error: type[RefitError] = FormatError, missing_ok: bool = False,
                 **context) -> bytes | None:
    """The bytes of the local regular file ``path``, its size checked before they are read; None if it is
    missing and ``missing_ok``. A FIFO, device or socket is refused without blocking (``O_NONBLOCK``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        if missing_ok:
            return None
        raise error(f"{limits.kind} is missing", **context) from None
    except OSError as exc:
        raise error(f"{limits.kind} cannot be opened ({exc.strerror})", **context) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{limits.kind} is not a regular file", **context)
        if info.st_size > limits.max_bytes:
            raise error(f"{limits.kind} is {info.st_size} bytes, more than the {limits.max_bytes}-byte limit",
                        **context)
        chunks, left = [], limits.max_bytes + 1  # a file that grows while read is still bounded
        while left > 0:
            chunk = os.read(fd, min(left, 8 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except OSError as exc:
        raise error(f"{limits.kind} cannot be read ({exc.strerror})", **context) from None
    finally:
        os.close(fd)


def validation_error(exc, error: type[RefitError], *, what: str = "record", **context) -> RefitError:
    """A pydantic ``ValidationError`` as ``error`` naming the object (``context``) and the first bad field."""
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first.get("loc", ())) or None
    return error(f"invalid {what}: {first.get('msg', 'invalid value')}", field=field, **context)


def parse_record(cls: type[T], raw, *, error: type[RefitError] = FormatError, hint: str = "", **context) -> T:
    """``raw`` (a parsed JSON document) as the strict record type ``cls`` (a pydantic dataclass), or ``error``
    naming the object (``context``: ``file``, ``local_file``...) and the first bad field, ``hint`` (what to do)
    ending its message. Fields a record lacks take their defaults (an older writer's). Keys ``cls`` does not
    know are refused when its config says ``extra="forbid"``, else ignored (a newer writer's: the record's
    docstring says why it needs that)."""
    if not isinstance(raw, dict):
        raise error(f"not a {cls.__name__} record: a JSON {_json_type(raw)}, not an object{hint}", **context)
    names, forbid = _field_names(cls)
    if forbid:
        unknown = sorted(str(key) for key in raw if key not in names)
        if unknown:
            more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
            raise error(f"not a valid {cls.__name__} record ({unknown[0]}: unknown field{more}){hint}",
                        field=unknown[0], **context)
    try:
        return cls(**{key: value for key, value in raw.items() if key in names})
    except ValidationError as exc:
        errors = exc.errors()
        where = [".".join(str(p) for p in e.get("loc", ())) or "record" for e in errors]
        said = "; ".join(f"{w}: {e.get('msg', 'invalid value')}" for w, e in zip(where[:3], errors))
        more = f"; and {len(errors) - 3} more" if len(errors) > 3 else ""
        raise error(f"not a valid {cls.__name__} record ({said}{more}){hint}", field=where[0], **context) from None


def load_record(data: bytes | bytearray | memoryview | str, cls: type[T], limits: JsonLimits, *,
                error: type[RefitError] = FormatError, hint: str = "", **context) -> T:
    """``load_json`` then ``parse_record``: one strict record read from its bytes."""
    return parse_record(cls, load_json(data, limits, error=error, **context), error=error, hint=hint, **context)


def read_record(path, cls: type[T], limits: JsonLimits, *, error: type[RefitError] = FormatError, hint: str = "",
                missing_ok: bool = False, **context) -> T | None:
    """``read_bounded`` then ``load_record``: one strict record read from the local file ``path`` (None if it is
    missing and ``missing_ok``); every refusal is ``error`` naming the file (``local_file``, unless ``context``
    names it otherwise) with ``hint`` ending its message."""
    context = context or {"local_file": str(path)}
    try:
        raw = read_bounded(path, limits, error=error, missing_ok=missing_ok, **context)
        document = None if raw is None else load_json(raw, limits, error=error, **context)
    except error as exc:
        if hint:
            exc.reason += hint
            exc.args = (exc._render(),)
        raise
    return None if raw is None else parse_record(cls, document, error=error, hint=hint, **context)


@cache
def _field_names(cls: type) -> tuple[frozenset[str], bool]:
    """(the field names of ``cls``, whether its config forbids any other key)."""
    config = getattr(cls, "__pydantic_config__", None) or {}
    return frozenset(f.name for f in fields(cls)), config.get("extra") == "forbid"


# -- the structure scan ----------------------------------------------------------------------------------------

@cache
def _tables():
    """Per byte: the nesting step (+1 ``[{``, -1 ``]}``) and whether it separates elements (``,:``). NumPy is
    imported here, by the first scan: a command that reads no large record never loads it."""
    import numpy as np

    step = np.zeros(256, np.int8)
    step[[ord("["), ord("{")]] = 1
    step[[ord("]"), ord("}")]] = -1
    separator = np.zeros(256, np.bool_)
    separator[[ord(","), ord(":")]] = True
    return step, separator


def _structure(data: bytes, max_depth: int, max_elements: int) -> tuple[int, int, int | None]:
    """(deepest nesting, elements, keys) of ``data``, counting only brackets, commas and colons outside strings;
    ``keys`` is the number of object members (colons outside strings) where that is known, else None.

    Bytes without a backslash (every header, index and record the program writes): ``_scan_plain``, exact.
    Bytes with one: where the counts over all of them (strings included) are already within bounds, that upper
    bound is the answer; otherwise the NumPy scan of ``_scan_escaped`` follows JSON's own string rules. Up to
    the first syntax error (where ``json.loads`` stops) the exact scans see exactly the containers
    ``json.loads`` would build.
    """
    if b"\\" not in data:
        return _scan_plain(data, max_depth, max_elements)
    opens = data.count(b"[") + data.count(b"{")
    elements = opens + data.count(b",") + data.count(b":") + 1
    if opens <= max_depth and elements <= max_elements:
        return opens, elements, None
    return (*_scan_escaped(data, max_depth, max_elements), None)


def _scan(data: bytes, max_depth: int, max_elements: int) -> tuple[int, int]:
    """The exact (deepest nesting, elements) outside strings, chunk by chunk; stops early once past either
    bound."""
    if b"\\" in data:
        return _scan_escaped(data, max_depth, max_elements)
    return _scan_plain(data, max_depth, max_elements)[:2]


def _scan_escaped(data: bytes, max_depth: int, max_elements: int) -> tuple[int, int]:
    """``_scan`` of bytes with a backslash: per chunk, NumPy arrays over every byte (a ``"`` opens or closes a
    string unless an odd run of backslashes precedes it, and such runs can cross chunks)."""
    import numpy as np

    step_of, separates = _tables()
    a = np.frombuffer(data, np.uint8)
    parity = depth = deepest = run = 0
    elements = 1
    for start in range(0, len(a), _CHUNK):
        c = a[start:start + _CHUNK]
        quote = c == 34
        backslash = c == 92
        # index of the last non-backslash at or before each position (the carried run counts as before 0)
        last = np.where(backslash, np.int32(-1 - run), np.arange(len(c), dtype=np.int32))
        np.maximum.accumulate(last, out=last)
        before = np.empty_like(last)
        before[0] = -1 - run  # so that position 0 sees the carried run
        before[1:] = last[:-1]
        run_length = np.arange(-1, len(c) - 1, dtype=np.int32) - before
        quote &= (run_length & 1) == 0
        run = int(len(c) - 1 - last[-1])
        inside = np.cumsum(quote, dtype=np.int32)
        inside += parity
        parity = int(inside[-1]) & 1
        outside = (inside & 1) == 0
        step = step_of[c]
        step[~outside] = 0
        elements += int(np.count_nonzero(separates[c] & outside)) + int(np.count_nonzero(step > 0))
        levels = np.cumsum(step, dtype=np.int32)
        levels += depth
        deepest = max(deepest, int(levels.max()))
        depth = int(levels[-1])
        if deepest > max_depth or elements > max_elements:
            break  # refused anyway: no need to read the rest
    return deepest, elements


_STRUCTURE = b'"[]{},:'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = tuple(1 if b in b"[{" else -1 for b in range(256))  # of a bracket
_PLAIN_CHUNK = 8  # times _CHUNK: a plain scan's per-chunk arrays are over brackets only


def _scan_plain(data: bytes, max_depth: int, max_elements: int) -> tuple[int, int, int]:
    """``_scan`` of bytes without a backslash, and the colons outside strings. Every ``"`` opens or closes a
    string, so each chunk is first cut down to its quotes and structural bytes, less every two adjacent quotes
    (C-speed ``bytes`` methods): what is left reads as the chunk does (the same bytes on each side of the
    quotes), and in a typical document (no string holding ``[]{},:``) is the structure alone. Splitting that at
    its quotes leaves, every other piece, the bytes outside strings; only the brackets among them go through
    NumPy (a few in plain Python), for the running depth.

    Two adjacent quotes close one string and open the next, or open and close one that holds nothing
    structural: without them the quotes still alternate, and every other byte keeps its side.
    """
    inside = False
    depth = deepest = colons = 0
    elements = 1
    size = _CHUNK * _PLAIN_CHUNK
    for start in range(0, len(data), size):
        pieces = data[start:start + size].translate(None, _NOT_STRUCTURE).replace(b'""', b"").split(b'"')
        outside = b"".join(pieces[1::2] if inside else pieces[0::2])
        inside ^= bool((len(pieces) - 1) & 1)
        brackets = outside.translate(None, _NOT_BRACKETS)
        opens = brackets.count(b"[") + brackets.count(b"{")
        found = outside.count(b":")
        colons += found
        elements += opens + outside.count(b",") + found
        if opens == len(brackets):  # only openings (or none): the deepest is the last
            depth += opens
            deepest = max(deepest, depth)
        else:
            depth, deepest = _levels(brackets, depth, deepest)
        if deepest > max_depth or elements > max_elements:
            break  # refused anyway: no need to read the rest
    return deepest, elements, colons


def _levels(brackets: bytes, depth: int, deepest: int) -> tuple[int, int]:
    """(depth after ``brackets``, deepest so far) from the ``depth`` before them: a few in plain Python (a
    command that reads only small records never imports NumPy), more as one NumPy running sum."""
    if len(brackets) <= 64:
        for byte in brackets:
            depth += _STEP[byte]
            deepest = max(deepest, depth)
        return depth, deepest
    import numpy as np

    step_of, _ = _tables()
    levels = np.cumsum(step_of[np.frombuffer(brackets, np.uint8)], dtype=np.int32)
    levels += depth
    return int(levels[-1]), max(deepest, int(levels.max()))


# -- the parse and its hooks ------------------------------------------------------------------------------------


def _parse(text: str, keys: int | None):
    """``json.loads(text)``, refusing repeated keys, ``NaN``, ``Infinity`` and floats that overflow.

    With ``keys`` (the number of members the document holds, counted outside strings), objects are built
    by ``json.loads`` itself and the repeats found by counting: the objects' sizes add up to ``keys`` unless
    one repeats a key (a repeat keeps one entry). Else, or when they do not add up, every object goes through
    ``_unique_keys`` (a list of pairs first: slower), which names the repeated key."""
    if keys is not None:
        objects: list[dict] = []
        keep = objects.append

        def kept(obj: dict) -> dict:
            keep(obj)
            return obj

        value = json.loads(text, object_hook=kept if keys else None, parse_constant=_no_constant,
                           parse_float=_finite_float)
        if sum(map(len, objects)) == keys:
            return value
        objects.clear()  # a repeat: this parse is let go (``kept`` still holds the list) before the next one
        del value
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite_float)


def _unique_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows to infinity")
    return value


def _refuse_lone_surrogates(value) -> None:
    """A ``\\uD800``-style escape not paired with its other half decodes to a string that is not Unicode."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not item.isascii():
            item.encode("utf-8")  # UnicodeEncodeError on a lone surrogate


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _json_type_name(cls: type) -> str:
    return {dict: "an object", list: "an array", str: "a string"}.get(cls, cls.__name__)
