"""URL forms of object storage (docs/format.md, section 2): validation, normalisation, joining.

Kept apart from ``storage.objects.store`` so that settings can validate URLs without
importing a filesystem client.
"""

from __future__ import annotations

import os
import re

from storage.errors import InvalidURI

_S3_SEGMENT = re.compile(r"^[^/?#]+$")


def normalize_url(url: str) -> str:
    """Return ``url`` with plain local paths turned into absolute ``file://`` URLs.

    S3 URIs are validated strictly (docs/format.md, section 2).
    """
    if not isinstance(url, str) or not url:
        raise InvalidURI("empty object URL", file=repr(url))
    if "://" not in url:
        return "file://" + os.path.abspath(os.path.expanduser(url))
    protocol, rest = url.split("://", 1)
    if protocol in ("s3", "s3a"):
        validate_s3_uri(url)
    if protocol == "file":
        return "file://" + os.path.abspath(rest or "/")
    return url


def validate_s3_uri(url: str) -> None:
    """Reject anything but ``s3://bucket/key`` with non-empty segments and no query or fragment."""
    if "?" in url or "#" in url:
        raise InvalidURI("S3 URI must not carry a ?query or #fragment", file=url)
    rest = url.split("://", 1)[1]
    segments = rest.split("/")
    if rest.endswith("/"):
        segments = segments[:-1]
    if not segments or not segments[0]:
        raise InvalidURI("S3 URI has no bucket", file=url)
    if any(not _S3_SEGMENT.match(segment) for segment in segments):
        raise InvalidURI("S3 URI has an empty path segment ('//')", file=url)
    if not 3 <= len(segments[0]) <= 63:
        raise InvalidURI("S3 bucket names have 3 to 63 characters", file=url)


def storage_kind(url: str) -> str:
    """The protocol of ``url`` as one kind of storage (``s3a`` is ``s3``; a plain path is ``file``)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    return "s3" if scheme == "s3a" else scheme


def join_url(base: str, *names: str) -> str:
    """``base`` + ``/name`` for each name (no normalisation of ``..``)."""
    out = base.rstrip("/")
    for name in names:
        out += "/" + name.strip("/")
    return out


def parent_url(url: str) -> str:
    """Everything before the last ``/`` of ``url``."""
    head, sep, _ = url.rstrip("/").rpartition("/")
    if not sep or head.endswith(":/"):
        raise InvalidURI("URL has no parent folder", file=url)
    return head
