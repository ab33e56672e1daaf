"""Whether a server enforces create-only writes: probed once per server and bucket.

Some S3-compatible servers ignore ``If-None-Match: *`` and overwrite
silently; publishing there could replace an immutable revision. The probe
writes a fresh object under the prefix twice, create-only, and checks that the
second write was refused; then it deletes it. ``ObjectStore.ensure_conditional_writes``
is the entry point.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Protocol

from storage.errors import ConditionalWritesUnsupported
from storage.objects.sources import protocols_of
from storage.urls import join_url, normalize_url

log = logging.getLogger("canonical_refit.objects")
_conditional_probes: dict[str, bool] = {}  # "endpoint|bucket" -> whether If-None-Match is enforced
_verified_lock = threading.Lock()


class _Store(Protocol):
    """What the probe needs of ``ObjectStore``."""

    def locate(self, url: str): ...
    def is_local(self, fs) -> bool: ...
    def put_immutable(self, url: str, data: bytes) -> bool: ...
    def call(self, what: str, url: str, fn, *, check=None): ...


def ensure_conditional_writes(store: _Store, prefix_url: str, *, allow_unconditional: bool = False) -> None:
    """Check once per server and bucket that create-only writes are enforced (see the module)."""
    fs, path = store.locate(prefix_url)
    if store.is_local(fs) or "memory" in protocols_of(fs):
        return  # our own create-only path (link, exclusive) is used for these
    key = f"{_server_of(fs)}|{path.split('/', 1)[0]}"
    with _verified_lock:
        enforced = _conditional_probes.get(key)
    if enforced is None:
        enforced = probe_conditional_writes(store, prefix_url)
        with _verified_lock:
            _conditional_probes[key] = enforced
    if enforced:
        return
    message = (
        f"the object store at {key.split('|')[0]} does not enforce conditional writes "
        "(If-None-Match: *): a second create-only PUT overwrote a probe object, so published "
        "revisions would not be immutable"
    )
    if not allow_unconditional:
        raise ConditionalWritesUnsupported(
            message + "; use a server that enforces them or pass allow_unconditional_writes=True",
            file=prefix_url,
        )
    log.warning("%s; continuing because unconditional writes were explicitly allowed", message)


def probe_conditional_writes(store: _Store, prefix_url: str) -> bool:
    """True if a second create-only PUT of the same new key is refused."""
    probe = join_url(normalize_url(prefix_url), ".canonical-refit-probe", uuid.uuid4().hex)
    fs, path = store.locate(probe)
    store.put_immutable(probe, b"first")

    def second() -> bool:
        try:
            fs.pipe_file(path, b"second", mode="create")
            return False
        except FileExistsError:
            return True

    # a retry after a lost response meets our own first write: still a refusal
    enforced = store.call("conditional-write probe", probe, second)
    try:
        fs.rm_file(path)
    except Exception as exc:  # a leftover probe object is harmless
        log.info("could not delete conditional-write probe %s: %s", probe, exc)
    log.info("conditional writes %s by the server of %s",
             "are enforced" if enforced else "are NOT enforced", prefix_url)
    return enforced


def _server_of(fs) -> str:
    """Which server a filesystem talks to: the S3 endpoint the client resolved (settings or env)."""
    if "s3" in protocols_of(fs):
        return str(fs.connect().meta.endpoint_url)  # builds the client, sends no request
    return protocols_of(fs)[0]
