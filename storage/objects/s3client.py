"""The S3 client of an ``ObjectStore``: s3fs over aiobotocore, configured from ``ObjectStoreSettings``.

The store's own retry loop owns every retry (botocore's and s3fs's are turned
off), the connection pool holds at least the connection budget, uploads carry
a CRC32 S3 verifies, and s3fs's own concurrent ranged reads are off (the
store's downloads split objects into ranges on its budget instead).

Every client gets a session of its own (credentials and configuration are
resolved per client, so a changed environment is picked up), but the sessions
of a process share one loader of botocore's data files: the S3 service model
and the endpoint rules are parsed once, not for every fresh store, which takes
most of a fresh client's cost (about 0.1 s of CPU) off the first request of
every download.
"""

from __future__ import annotations

import os
import threading

from storage.settings import ObjectStoreSettings

_loaders: dict[str, object] = {}  # AWS_DATA_PATH -> botocore's loader of its data files, shared by sessions
_loaders_lock = threading.Lock()


def new_session():
    """A fresh aiobotocore session whose botocore data files (service models, endpoints) come from a loader
    shared by every session of this process (immutable data, loaded once)."""
    import botocore.loaders
    from aiobotocore.session import AioSession

    session = AioSession()
    data_path = os.environ.get("AWS_DATA_PATH", "")
    with _loaders_lock:
        loader = _loaders.get(data_path)
        if loader is None:
            loader = _loaders[data_path] = botocore.loaders.create_loader(data_path or None)
    session.register_component("data_loader", loader)
    return session


def s3_filesystem(s: ObjectStoreSettings):
    """A fresh ``s3fs.S3FileSystem`` for settings ``s`` (its client is built on the first request)."""
    import s3fs

    config = {
        "connect_timeout": s.connect_timeout_s,
        "read_timeout": s.read_timeout_s,
        "max_pool_connections": max(s.max_pool_connections, s.concurrency),
        # botocore's ``max_attempts`` counts retries, not attempts: ``total_max_attempts``
        # 1 turns its retries off, so our loop owns them and counts every one
        "retries": {"total_max_attempts": 1, "mode": "standard"},
    }
    # integrity on the way up: botocore sends a CRC32 of every PutObject and UploadPart body (a header,
    # or a trailer over https), which S3 verifies before it stores anything (BadDigest otherwise: a
    # transient error, the upload is sent again); asked for explicitly so that an environment setting
    # (AWS_REQUEST_CHECKSUM_CALCULATION=when_required) cannot turn it off. A SHA-256 of each payload
    # (botocore's default over plain http only) would cost a CPU-second per GB
    config["request_checksum_calculation"] = "when_supported"
    config["s3"] = {"payload_signing_enabled": False}
    if s.addressing_style != "auto":
        config["s3"]["addressing_style"] = s.addressing_style
    fs = s3fs.S3FileSystem(
        anon=s.anonymous,
        endpoint_url=s.endpoint_url,
        client_kwargs={"region_name": s.region} if s.region else {},
        config_kwargs=config,
        default_block_size=s.block_size,
        max_concurrency=1,
        use_listings_cache=False,
        skip_instance_cache=True,
        session=new_session(),
    )
    fs.retries = 1
    fs.connect_timeout = s.connect_timeout_s
    fs.read_timeout = s.read_timeout_s
    return fs
