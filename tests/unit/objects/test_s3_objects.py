"""ObjectStore against a real S3 server (moto) and a fault-injecting proxy in front of it."""

from __future__ import annotations

import os
import tracemalloc

import pytest
from tests.support.s3_support import s3  # noqa: F401  (s3 is a fixture)

from storage.errors import (
    AccessDenied, ConditionalWritesUnsupported, ImmutableConflict, InvalidURI, ObjectNotFound,
    PermanentStorageError,
)
from storage.objects.store import ObjectStore, TransferStats
from storage.urls import join_url
from storage.settings import ObjectStoreSettings, RefitParams
from testbed.processes import free_port
from testbed.s3proxy import FAULT_KINDS, Faults


def _put(s3, name: str, data: bytes) -> str:
    url = join_url(s3.prefix("objects"), name)
    assert ObjectStore(s3.settings()).put_immutable(url, data) is True
    return url


@pytest.mark.parametrize("url", [
    "s3://refit-e2e//revisions/r1/index.json",
    "s3://refit-e2e/revisions/r1/index.json?versionId=3",
    "s3://refit-e2e/revisions/r1/index.json#frag",
    "s3:///revisions/r1/index.json",
    "s3://ab/revisions/r1/index.json",
])
def test_invalid_s3_uri_fails_before_any_request(s3, url):
    with s3.proxy() as proxy:
        store = ObjectStore(s3.settings(proxy.url))
        with pytest.raises(InvalidURI) as err:
            store.read_bytes(url, max_size=100)
        assert url in str(err.value)
        assert proxy.requests() == []
        assert store.stats.attempts == 0


def test_endpoint_and_credentials_come_from_the_environment(s3, monkeypatch, tmp_path):
    url = _put(s3, "env.bin", b"from the environment")
    # botocore's own variable, with nothing in the settings
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    assert ObjectStore(ObjectStoreSettings()).read_bytes(url, max_size=100) == b"from the environment"
    # the project's variable wins over botocore's (which now points at a closed port)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    with s3.proxy() as proxy:
        monkeypatch.setenv("CANONICAL_REFIT_S3_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("CANONICAL_REFIT_S3_RETRY_ATTEMPTS", "2")
        settings = ObjectStoreSettings()
        assert (settings.endpoint_url, settings.retry_attempts) == (proxy.url, 2)
        assert RefitParams(catalog=url, model="org/name").storage == settings  # what a receiver gets
        assert ObjectStore(settings).read_bytes(url, max_size=100) == b"from the environment"
        assert [r.method for r in proxy.requests(url.split("://", 1)[1].split("/", 1)[1])] == ["HEAD", "GET"]
        # no credentials anywhere: a permanent error at once, naming the URI
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(key)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        store = ObjectStore(ObjectStoreSettings())
        with pytest.raises(PermanentStorageError, match="credentials") as err:
            store.read_bytes(url, max_size=100)
        assert url in str(err.value)
        assert store.stats.attempts == 1


def test_create_only_writes_are_immutable(s3, tmp_path):
    store = ObjectStore(s3.settings())
    url = join_url(s3.prefix("immutable"), "bucket-00000.safetensors")
    assert store.put_immutable(url, b"published bytes") is True
    assert store.put_immutable(url, b"published bytes") is False  # identical re-put: a no-op
    for other in (b"PUBLISHED BYTES", b"published", b"published bytes and more"):
        with pytest.raises(ImmutableConflict) as err:
            store.put_immutable(url, other)
        assert url in str(err.value)
    assert store.read_bytes(url, max_size=100) == b"published bytes"

    local = tmp_path / "shard.safetensors"
    local.write_bytes(os.urandom(300_000))
    file_url = join_url(s3.prefix("immutable"), "model-00001-of-00002.safetensors")
    assert store.put_immutable_file(file_url, local) is True
    assert store.put_immutable_file(file_url, local) is False
    local.write_bytes(local.read_bytes()[:-1] + b"\0")
    with pytest.raises(ImmutableConflict):
        store.put_immutable_file(file_url, local)


def test_large_files_go_multipart_and_stay_create_only(s3, tmp_path):
    part = 5 * 2**20
    local = tmp_path / "model-00001-of-00001.safetensors"
    local.write_bytes(os.urandom(2 * part + 12345))
    url = join_url(s3.prefix("multipart"), local.name)
    with s3.proxy() as proxy:
        store = ObjectStore(s3.settings(proxy.url, block_size=part))
        assert store.put_immutable_file(url, local) is True
        assert [r.method for r in proxy.requests(local.name) if r.method in ("PUT", "POST")] == \
            ["POST", "PUT", "PUT", "PUT", "POST"]  # create, three parts, conditional complete
        uploads = len(proxy.requests(local.name, "PUT"))
        # a republish of the same large file compares instead of uploading it again
        assert store.put_immutable_file(url, local) is False
        local.write_bytes(local.read_bytes()[:-1] + b"\0")
        with pytest.raises(ImmutableConflict):
            store.put_immutable_file(url, local)
        assert len(proxy.requests(local.name, "PUT")) == uploads
    # the multipart completion itself is conditional: the server refuses to replace the object
    fs, path = ObjectStore(s3.settings()).locate(url)
    with pytest.raises(FileExistsError):
        fs.put_file(str(local), path, mode="create", chunksize=part)


def test_conditional_write_probe(s3):
    # moto refuses the second create-only PUT: the probe passes and leaves nothing behind
    prefix = s3.prefix("probe")
    store = ObjectStore(s3.settings())
    store.ensure_conditional_writes(join_url(prefix, "catalog"))
    assert store.list_names(join_url(prefix, "catalog", ".canonical-refit-probe")) == []
    # a server that ignores If-None-Match (the proxy strips it) overwrites silently ...
    with s3.proxy(Faults(strip_conditional=True)) as proxy:
        careless = ObjectStore(s3.settings(proxy.url))
        url = join_url(prefix, "overwritten.bin")
        assert careless.put_immutable(url, b"first") is True
        assert careless.put_immutable(url, b"other") is True
        assert careless.read_bytes(url, max_size=10) == b"other"
        # ... so the publisher's probe refuses it, naming the server
        with pytest.raises(ConditionalWritesUnsupported, match="If-None-Match") as err:
            careless.ensure_conditional_writes(join_url(prefix, "catalog"))
        assert proxy.url in str(err.value)
        assert "allow_unconditional_writes=True" in str(err.value)  # the field (the publish CLI: its flag)
        careless.ensure_conditional_writes(join_url(prefix, "catalog"), allow_unconditional=True)
        probes = len(proxy.requests(".canonical-refit-probe", "PUT"))
        with pytest.raises(ConditionalWritesUnsupported):  # remembered per server: not probed again
            careless.ensure_conditional_writes(join_url(prefix, "catalog"))
        assert len(proxy.requests(".canonical-refit-probe", "PUT")) == probes == 2


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_transient_faults_are_retried(s3, tmp_path, kind):
    data = os.urandom(1_500_000)
    url, download_url = _put(s3, f"read-{kind}.bin", data), _put(s3, f"download-{kind}.bin", data)
    new_url = join_url(s3.prefix("objects"), f"new-{kind}.bin")
    # every request is faulted once, then gets through; aiohttp itself resends an idempotent
    # request once after a reset on a kept-alive connection, so resets come twice
    faults = Faults(rate=1.0, kinds=(kind,), max_per_key=2 if kind == "reset" else 1, stall_s=2.0)
    with s3.proxy(faults) as proxy:
        stats = TransferStats()
        store = ObjectStore(s3.settings(proxy.url, read_timeout_s=1.0), stats)
        assert store.read_bytes(url, max_size=len(data)) == data
        dest = tmp_path / "downloaded.bin"
        assert store.download(download_url, dest, expected_size=len(data)) == len(data)
        assert dest.read_bytes() == data
        created = store.put_immutable(new_url, b"written through faults")
        # True unless a faulted attempt had in fact created the object (a reset after the write
        # landed): the retry then meets its own bytes and reports them as already there
        landed = [r for r in proxy.requests(new_url.split("://", 1)[1].split("/", 1)[1], "PUT") if r.status == 200]
        assert len(landed) == 1 and created is (landed[0].fault is None)
        assert proxy.injected()[kind] >= (2 if kind == "truncate" else 4)  # truncation hits GETs only
    assert ObjectStore(s3.settings()).read_bytes(new_url, max_size=100) == b"written through faults"
    assert stats.retries >= 2 and stats.backoff_s > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["downloaded.bin"]  # no partial files left


def test_permanent_errors_fail_at_once(s3, tmp_path):
    prefix = s3.prefix("permanent")
    _ = ObjectStore(s3.settings()).put_immutable(join_url(prefix, "secret", "x.bin"), b"x")
    with s3.proxy(Faults(deny=("/secret/",))) as proxy:
        store = ObjectStore(s3.settings(proxy.url))
        missing = join_url(prefix, "missing.bin")
        for call in (lambda: store.read_bytes(missing, max_size=10),
                     lambda: store.download(missing, tmp_path / "m", expected_size=3)):
            with pytest.raises(ObjectNotFound) as err:
                call()
            assert missing in str(err.value)
        # a HEAD that misses is followed by one listing (s3fs checks for a "directory"); nothing more
        assert len(proxy.requests("missing.bin")) <= 3
        denied = join_url(prefix, "secret", "x.bin")
        for call in (lambda: store.read_bytes(denied, max_size=10),
                     lambda: store.download(denied, tmp_path / "d", expected_size=1)):
            with pytest.raises(AccessDenied) as err:
                call()
            assert denied in str(err.value)
        assert [r.status for r in proxy.requests("/secret/")] == [403, 403]
    assert store.stats.retries == 0 and store.stats.attempts == 4
    assert list(tmp_path.iterdir()) == []


def test_download_streams_with_bounded_memory(s3, tmp_path):
    size = 8 * 2**20
    data = os.urandom(size)
    url = _put(s3, "large.bin", data)
    store = ObjectStore(s3.settings())
    assert store.size(url) == size  # builds the S3 client (botocore's models take ~13 MB) first
    tracemalloc.start()
    try:
        store.download(url, tmp_path / "large.bin", expected_size=size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (tmp_path / "large.bin").read_bytes() == data
    assert peak < size // 4, f"download held {peak:,} bytes at once for a {size:,}-byte object"


def test_every_upload_carries_a_checksum_and_a_body_corrupted_on_the_way_is_sent_again(s3, tmp_path):
    """A single PUT and every part of a multipart upload carry a CRC32 the store checks (the proxy checks it as
    S3 does, moto does not): a body corrupted in transit is refused (BadDigest) and sent again, never stored."""
    part = 5 * 2**20
    small, large = tmp_path / "bucket-00000.safetensors", tmp_path / "model-00001-of-00001.safetensors"
    small.write_bytes(os.urandom(300_000))
    large.write_bytes(os.urandom(2 * part + 12345))
    prefix = s3.prefix("integrity")
    with s3.proxy(Faults(verify_checksums=True, corrupt_puts=(small.name, f"{large.name}?partNumber=2",
                                                            large.name))) as proxy:
        store = ObjectStore(s3.settings(proxy.url, block_size=part))
        for local in (small, large):
            assert store.put_immutable_file(join_url(prefix, local.name), local) is True
        puts = proxy.requests(method="PUT")
        assert puts and all(r.checksum == "x-amz-checksum-crc32" for r in puts), [(r.path, r.checksum) for r in puts]
        refused = [r for r in puts if r.status == 400]
        assert [r.fault for r in refused] == ["bad-digest"] * len(refused) and len(refused) >= 2
        assert {r.path.rsplit("/", 1)[-1] for r in refused} == {small.name, large.name}
    reader = ObjectStore(s3.settings())
    for local in (small, large):
        assert reader.read_bytes(join_url(prefix, local.name), max_size=local.stat().st_size) == local.read_bytes()
