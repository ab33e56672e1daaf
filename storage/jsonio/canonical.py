"""Canonical JSON (docs/format.md, section 3.1): the one encoding of every record, digest input and state file.

Cross-cutting: the formats hash it, the catalog and the store write it.
"""

from __future__ import annotations

import json


def canonical_json(value) -> bytes:
    """``json.dumps(value, sort_keys=True, separators=(",", ":"))`` as UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


def unique_keys(pairs):
    """``object_pairs_hook`` for ``json.loads`` that refuses an object with a repeated key."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out
