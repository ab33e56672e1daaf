"""Publish and refit over ``s3://`` against a real S3 server (moto), through every stage.

One catalog is published once for the module (revision 0, two deltas, a full
revision, one more delta); receivers with fresh caches refit from it directly,
through faults, and in a separate process configured by the environment alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from tests.support.lab import independent_digest, read_checkpoint
from tests.support.s3_support import aws_environment, process_env, s3, s3_lab  # noqa: F401  (s3 is a fixture)

from flows.synthetic import train_step
from storage.catalog.records import Catalog
from storage.errors import ConditionalWritesUnsupported, ImmutableConflict
from storage.store.local_store import LocalStore
from storage.objects.store import ObjectStore
from storage.urls import join_url, parent_url
from testbed.s3proxy import Faults

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["resolve catalog", "seed checkpoint", "fetch index", "fetch buckets", "apply deltas",
          "verify digest", "install", "activate"]
DELTA_FILES = ["bucket-00000.safetensors", "delta.safetensors.index.json"]


@pytest.fixture(scope="module")
def published(prefect_api, s3, tmp_path_factory):
    """r0 (launch), r1 and r2 (deltas), r3 (full), r4 (delta) under one s3:// catalog."""
    lab = s3_lab(tmp_path_factory.mktemp("s3-published"), s3, "e2e")
    for kind in ("initial", "delta", "delta", "full", "delta"):
        lab.publish(kind, storage=s3.settings())
    return lab


def _ready(lab, state, result, version: str) -> None:
    assert state.name == "Ready", result.error
    assert result.version == version
    assert result.target_digest == independent_digest(lab.expected(version))[1]
    lab.assert_checkpoint(Path(result.checkpoint_path), version)


def test_publish_and_refit_over_s3(published, s3, tmp_path):
    lab = published
    store = ObjectStore(s3.settings())
    root = parent_url(lab.catalog)
    assert store.list_names(lab.catalog, ".json") == [f"r{i}.json" for i in range(5)]
    assert store.list_names(join_url(root, "revisions", "r1")) == DELTA_FILES
    assert len(store.list_names(join_url(root, "revisions", "r3"), ".safetensors")) == lab.shape.shards

    # from the launch snapshot through two deltas, then through the full revision and a delta
    state, result = lab.refit(target="r2", cache_dir=tmp_path / "cache", storage=s3.settings())
    _ready(lab, state, result, "r2")
    assert result.lineage == ["r0", "r1", "r2"]
    state, result = lab.refit(cache_dir=tmp_path / "cache", storage=s3.settings())
    _ready(lab, state, result, "r4")
    assert result.lineage == ["r3", "r4"]
    stages = {s["name"]: s for s in result.stages}
    assert list(stages) == STAGES and all(s["status"] == "COMPLETED" for s in stages.values())
    fetched = sum(store.size(join_url(root, "revisions", v, name)) for v, names in
                  (("r3", store.list_names(join_url(root, "revisions", "r3"), ".safetensors")),
                   ("r4", ["bucket-00000.safetensors"])) for name in names)
    assert stages["fetch buckets"]["bytes"] == fetched
    assert stages["fetch buckets"]["requests"] >= 3 and stages["fetch buckets"]["retries"] == 0


def test_receiver_process_gets_endpoint_and_credentials_from_the_environment(published, s3, tmp_path):
    lab = published
    env = process_env(AWS_ACCESS_KEY_ID=aws_environment()["AWS_ACCESS_KEY_ID"],
                      AWS_SECRET_ACCESS_KEY=aws_environment()["AWS_SECRET_ACCESS_KEY"],
                      AWS_ENDPOINT_URL_S3=s3.endpoint)
    cmd = [sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model,
           "--seed-checkpoint", str(lab.launch), "--cache-dir", str(tmp_path / "cache"), "--json"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "READY"
    assert result["version"] == "r4" and result["lineage"] == ["r3", "r4"]
    assert result["target_digest"] == independent_digest(lab.expected("r4"))[1]
    assert [s["name"] for s in result["stages"]] == STAGES
    lab.assert_checkpoint(Path(result["checkpoint_path"]), "r4")


def test_refit_survives_transient_faults(published, s3, tmp_path):
    lab = published
    faults = Faults(rate=0.3, seed=11, stall_s=2.0)
    with s3.proxy(faults) as proxy:
        settings = s3.settings(proxy.url, read_timeout_s=1.0)
        state, result = lab.refit(target="r2", cache_dir=tmp_path / "cache", storage=settings)
        _ready(lab, state, result, "r2")
        state, result = lab.refit(cache_dir=tmp_path / "cache", storage=settings)
        _ready(lab, state, result, "r4")
        injected = proxy.injected()
    assert sum(injected.values()) >= 5, injected
    retried = [s for s in result.stages if s["retries"]]
    assert retried, result.stages  # the stage table shows where requests were retried ...
    assert all(s["backoff_s"] > 0 and s["requests"] > s["retries"] for s in retried)  # ... and the backoff


def test_permanent_errors_fail_at_once_and_leave_the_installed_version(published, s3, tmp_path):
    lab = published
    cache = tmp_path / "cache"
    state, result = lab.refit(target="r1", cache_dir=cache, storage=s3.settings())
    _ready(lab, state, result, "r1")
    bucket = join_url(parent_url(lab.catalog), "revisions", "r2", "bucket-00000.safetensors")
    path = "/" + bucket.split("://", 1)[1]
    for faults, error in ((Faults(missing=(path,)), "ObjectNotFound"), (Faults(deny=(path,)), "AccessDenied")):
        with s3.proxy(faults) as proxy:
            state, result = lab.refit(target="r2", cache_dir=cache, storage=s3.settings(proxy.url))
            assert state.name == "Failed"
            assert result.status == "FAILED" and result.error_detail["type"] == error
            assert bucket in result.error
            stages = {s["name"]: s for s in result.stages}
            assert stages["fetch buckets"]["status"] == "FAILED"
            assert "attempts" not in stages["fetch buckets"] and stages["fetch buckets"]["retries"] == 0  # once
            assert len(proxy.requests(path)) == 1  # one HEAD: no retry storm
        # nothing changed: r1 is still installed and its checkpoint intact
        assert result.version is None and result.installed_version == "r1"
        assert LocalStore(cache, lab.model).active().version == "r1"
        lab.assert_checkpoint(Path(result.checkpoint_path), "r1")

    bad = lab.catalog.replace("/catalog", "//catalog")
    with s3.proxy() as proxy:
        with pytest.raises(ValidationError, match="empty path segment"):  # refused as a parameter
            lab.refit(catalog=bad, cache_dir=cache, storage=s3.settings(proxy.url))
        assert proxy.requests() == []
    assert LocalStore(cache, lab.model).active().version == "r1"


def test_fetches_are_concurrent_within_the_configured_bound(published, s3, tmp_path):
    lab = published
    # every payload GET is held a moment, so downloads that can overlap do: 3 files, 2 at a time
    with s3.proxy(Faults(get_latency_s=0.4, latency_suffix=".safetensors")) as proxy:
        state, result = lab.refit(cache_dir=tmp_path / "cache", storage=s3.settings(proxy.url, concurrency=2))
        _ready(lab, state, result, "r4")
        assert proxy.max_in_flight_gets == 2
    # one ranged read of each shard's header (the download bounds of a node with no checkpoint), then 3 files
    assert len([r for r in proxy.requests("/revisions/", "GET") if r.path.endswith(".safetensors")]) == 3 + 2


def test_publisher_crash_before_the_record_then_republish(prefect_api, s3, tmp_path):
    lab = s3_lab(tmp_path, s3, "crash")
    lab.publish("initial", storage=s3.settings())
    tensors = lab.next_step()
    folder = lab.write(tensors, "crashing")
    env = process_env(**aws_environment(s3.endpoint))
    cmd = [sys.executable, "-m", "tests.support.s3_support", "crash-publish", "--catalog", lab.catalog,
           "--model", lab.model, "--checkpoint", str(folder), "--kind", "delta",
           "--state-dir", str(lab.root / "publisher"), "--no-event"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == -9, done.stderr[-3000:]
    record = join_url(lab.catalog, "r1.json")
    assert f"killed before writing {record}" in done.stdout
    store = ObjectStore(s3.settings())
    payload = join_url(parent_url(lab.catalog), "revisions", "r1")
    assert store.list_names(payload) == DELTA_FILES  # the payload is there, the record is not
    assert not store.exists(record)
    assert Catalog(store, lab.catalog, lab.model).versions() == ["r0"]

    # the restarted trainer runs the same command: it goes past the crashed publication by itself (sequence 1
    # stays the crashed one's claim; the identical payload objects are accepted, not uploaded again)
    other = train_step(tensors, seed=99)
    result = lab.publish("delta", tensors, version="r1", storage=s3.settings())
    assert (result.version, result.sequence, result.already_published) == ("r1", 2, False)
    assert result.uri == join_url(payload, "delta.safetensors.index.json")
    assert Catalog(store, lab.catalog, lab.model).versions() == ["r0", "r1"]
    # once the record exists, an identical republish is accepted and a different one refused
    again = lab.publish("delta", tensors, version="r1", base_checkpoint=lab.launch, storage=s3.settings())
    assert again.already_published and again.target_digest == result.target_digest
    with pytest.raises(ImmutableConflict) as err:
        lab.publish("delta", other, version="r1", base_checkpoint=lab.launch, storage=s3.settings())
    assert record in str(err.value)
    state, result = lab.refit(target="r1", storage=s3.settings())
    _ready(lab, state, result, "r1")


def test_publisher_refuses_a_server_that_ignores_conditional_writes(prefect_api, s3, tmp_path):
    lab = s3_lab(tmp_path, s3, "unconditional")
    with s3.proxy(Faults(strip_conditional=True)) as proxy:
        with pytest.raises(ConditionalWritesUnsupported, match="If-None-Match"):
            lab.publish("initial", storage=s3.settings(proxy.url))
        store = ObjectStore(s3.settings())
        assert Catalog(store, lab.catalog, lab.model).versions() == []
        result = lab.publish("initial", storage=s3.settings(proxy.url), allow_unconditional_writes=True)
        assert result.version == "r0"
    assert Catalog(store, lab.catalog, lab.model).versions() == ["r0"]
    assert read_checkpoint(lab.launch).keys() == lab.expected("r0").keys()


def test_the_write_probe_is_always_under_the_catalog_prefix_and_deleted(prefect_api, s3, tmp_path):
    """The least-privilege policy lets a publisher delete only under ``catalog/.canonical-refit-probe/``."""
    lab = s3_lab(tmp_path, s3, "probe")
    with s3.proxy() as proxy:
        lab.publish("initial", storage=s3.settings(proxy.url))
        lab.publish("delta", storage=s3.settings(proxy.url))
        probes = [r for r in proxy.requests(".canonical-refit-probe") if r.method in ("PUT", "DELETE")]
    catalog_path = lab.catalog.removeprefix("s3://")
    assert probes and all(f"{catalog_path}/.canonical-refit-probe/" in r.path for r in probes), \
        [r.path for r in probes]
    assert {r.method for r in probes} == {"PUT", "DELETE"}
    assert ObjectStore(s3.settings()).list_names(join_url(lab.catalog, ".canonical-refit-probe")) == []
