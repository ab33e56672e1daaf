"""How errors raised by fsspec, s3fs, botocore and aiohttp map onto the project's hierarchy.

Transient (worth retrying with backoff): timeouts, throttling, 5xx, resets,
short bodies. Permanent (raised at once, URI in the message): missing object,
access denied, invalid request. ``classify`` is for errors of remote calls
only; an error of a local file (a download's partial file, an upload's
source) goes through ``local_error`` instead, so it is never mistaken for a
missing object and never retried.
"""

from __future__ import annotations

import errno

from storage.errors import (
    AccessDenied, InvalidURI, ObjectNotFound, PermanentStorageError, RefitError, StoreError,
    TransientStorageError,
)

_TRANSIENT_ERRNOS = {
    errno.EBUSY, errno.EIO, errno.EREMOTEIO, errno.ECONNRESET, errno.ECONNABORTED,
    errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE, errno.EAGAIN, errno.ENETUNREACH,
    errno.EHOSTUNREACH,
}
_TRANSIENT_S3_CODES = {
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestTimeTooSkewed", "500", "502", "503", "504",
    # the store refused bytes that do not match the checksum sent with them: corrupted on the way, so
    # sending them again is the cure (the local file is intact)
    "BadDigest", "XAmzContentChecksumMismatch", "InvalidDigest",
}
_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "ExpiredToken", "SignatureDoesNotMatch", "403"}
_TRANSIENT_EXCEPTION_NAMES = {
    # botocore / aiohttp / asyncio names, matched by name so that neither is imported here
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "HTTPClientError", "ProxyConnectionError", "ResponseStreamingError", "IncompleteReadError",
    "ClientPayloadError", "ServerDisconnectedError", "ClientOSError", "ClientConnectionError",
    "ClientConnectorError", "ServerTimeoutError", "ContentLengthError", "TransferEncodingError",
    "FSTimeoutError", "ResponseParserError", "IncompleteRead",
}


def classify(exc: BaseException, uri: str) -> RefitError:
    """Map an exception raised by fsspec/s3fs/botocore/aiohttp to our hierarchy."""
    if isinstance(exc, RefitError):
        return exc.with_context(file=uri)
    name = type(exc).__name__
    detail = f"{name}: {exc}"
    code = _s3_error_code(exc)
    if code in _NOT_FOUND_CODES or isinstance(exc, FileNotFoundError):
        return ObjectNotFound(f"object not found ({detail})", file=uri)
    if code in _DENIED_CODES or isinstance(exc, PermissionError):
        return AccessDenied(f"access denied ({detail})", file=uri)
    if code in _TRANSIENT_S3_CODES:
        return TransientStorageError(f"transient storage error ({detail})", file=uri)
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return TransientStorageError(f"transient storage error ({detail})", file=uri)
    if name in _TRANSIENT_EXCEPTION_NAMES or any(
        cls.__name__ in _TRANSIENT_EXCEPTION_NAMES for cls in type(exc).__mro__
    ):
        return TransientStorageError(f"transient storage error ({detail})", file=uri)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return StoreError(f"no space left on the local disk ({detail})", file=uri)
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return TransientStorageError(f"transient storage error ({detail})", file=uri)
    if isinstance(exc, (ValueError, TypeError)) and "bucket" in str(exc).lower():
        return InvalidURI(f"invalid object URL ({detail})", file=uri)
    return PermanentStorageError(f"storage request failed ({detail})", file=uri)


def local_error(exc: OSError, path, uri: str, doing: str) -> StoreError:
    """A local file's I/O error (ENOENT, ENOSPC, EIO, ...) while ``doing``: a ``StoreError`` naming ``path``."""
    detail = f"{type(exc).__name__}: {exc}"
    if exc.errno == errno.ENOSPC:
        reason = f"no space left on the local disk while {doing} ({detail})"
    else:
        reason = f"local file error while {doing} ({detail})"
    return StoreError(reason, file=uri, local_file=str(path))


def s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code (or HTTP status) behind ``exc``, if it carries a botocore response."""
    return _s3_error_code(exc)


def _s3_error_code(exc: BaseException) -> str | None:
    for candidate in (exc, exc.__cause__, exc.__context__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            code = error.get("Code")
            if code:
                return str(code)
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if status:
                return str(status)
    return None


def local_call(doing: str, path, uri: str, fn, *args):
    """``fn(*args)``, an operation on a local file: its ``OSError`` becomes a ``StoreError`` naming ``path``
    (``local_error``), never a remote error to retry."""
    try:
        return fn(*args)
    except OSError as exc:
        raise local_error(exc, path, uri, doing) from exc
