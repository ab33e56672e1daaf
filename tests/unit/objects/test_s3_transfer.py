"""Ranged, resumable, cancellable downloads and concurrent multipart uploads, against moto through the proxy.

Objects are a few MiB with 1 MiB ranges (S3 parts stay at their 5 MiB minimum).
Overlap is read from the proxy's request log (start and end of every request),
never from timings.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.support.s3_support import aws_environment, s3  # noqa: F401  (s3 is a fixture)

from storage.errors import (
    AccessDenied, Cancelled, ImmutableConflict, ObjectNotFound, StoreError, TransientStorageError,
)
from storage.objects.store import ObjectStore, TransferStats
from storage.objects.multipart import S3Multipart, upload_parts
from storage.objects.transfer import STREAM_CHUNK, partial_paths, range_plan
from storage.urls import join_url
from testbed.s3proxy import Faults, peak_open

MIB = 2**20
ROOT = Path(__file__).resolve().parents[3]
PART = 5 * MIB


def _object(s3, name: str, size: int) -> tuple[str, bytes]:
    data = os.urandom(size)
    url = join_url(s3.prefix("transfer"), name)
    # False only where a retry after a lost answer met its own first write (identical bytes); else it raises
    ObjectStore(s3.settings()).put_immutable(url, data)
    return url, data


def _key(url: str) -> str:
    return "/" + url.split("://", 1)[1]


def _ranges(requests) -> list[tuple[int, int]]:
    """(start, end) of each ranged request, end exclusive."""
    out = []
    for r in requests:
        start, end = r.range.removeprefix("bytes=").split("-")
        out.append((int(start), int(end) + 1))
    return out


def _child(args: list[str], **settings: str) -> subprocess.Popen:
    """``tests/support/s3_support.py transfer ...`` in a process of its own, its store settings from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CANONICAL_REFIT_", "FSSPEC_"))}
    env.update(aws_environment())
    env.update({f"CANONICAL_REFIT_S3_{k.upper()}": v for k, v in settings.items()})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-m", "tests.support.s3_support", "transfer", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, what: str, child: subprocess.Popen | None = None, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if child is not None and child.poll() is not None:
            raise AssertionError(f"the child ended before {what}: {child.communicate()}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _record(dest: Path) -> dict | None:
    try:
        return json.loads(partial_paths(dest)[1].read_bytes())
    except (FileNotFoundError, ValueError):
        return None


# -- ranged downloads ------------------------------------------------------------------------------


def test_a_large_object_comes_as_overlapping_ranges_byte_exact(s3, tmp_path):
    size = 6 * MIB + 12345
    url, data = _object(s3, "ranged.bin", size)
    with s3.proxy(latency_s=0.05) as proxy:
        stats = TransferStats()
        store = ObjectStore(s3.settings(proxy.url, range_size=MIB, concurrency=4), stats)
        landed = []
        dest = tmp_path / "ranged.bin"
        assert store.download(url, dest, progress=landed.append) == size
        assert dest.read_bytes() == data
        gets = proxy.requests(_key(url), "GET")
        assert sorted(_ranges(gets)) == [(i * MIB, min(size, (i + 1) * MIB)) for i in range(7)]
        assert sum(r.sent for r in gets) == size
        assert 1 < peak_open(gets) <= 4 and 1 < proxy.max_in_flight_gets <= 4
        assert [r.method for r in proxy.requests(_key(url)) if r.method != "GET"] == ["HEAD"]
    assert sum(landed) == size and stats.bytes_read == size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ranged.bin"]  # no partial file, no record


def test_an_object_of_one_range_is_one_plain_get(s3, tmp_path):
    url, data = _object(s3, "small.bin", MIB)
    with s3.proxy() as proxy:
        store = ObjectStore(s3.settings(proxy.url, range_size=MIB))
        assert store.download(url, tmp_path / "small.bin", expected_size=MIB) == MIB
        assert [(r.method, r.range) for r in proxy.requests(_key(url))] == [("GET", None)]
    assert (tmp_path / "small.bin").read_bytes() == data


def test_every_caller_and_view_shares_one_connection_budget(s3, tmp_path):
    objects = [_object(s3, f"shared-{i}.bin", 4 * MIB + 1 + i) for i in range(6)]
    with s3.proxy(latency_s=0.02) as proxy:
        store = ObjectStore(s3.settings(proxy.url, range_size=MIB, concurrency=2))
        views = [store.with_stats(TransferStats()) for _ in objects]
        errors = []

        def fetch(i: int) -> None:
            url, data = objects[i]
            try:
                views[i].download(url, tmp_path / f"{i}.bin")
                assert (tmp_path / f"{i}.bin").read_bytes() == data
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(len(objects))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads) and errors == []
        gets = [r for r in proxy.requests("/shared-", "GET")]
        assert len(gets) == 6 * 5 and peak_open(gets) == 2  # six callers, one budget of two
    assert all(v.stats.bytes_read == 4 * MIB + 1 + i for i, v in enumerate(views))


@pytest.mark.parametrize("kind", ["truncate", "slowdown", "reset"])
def test_a_fault_in_one_range_retries_that_range_only(s3, tmp_path, kind):
    size = 5 * MIB
    url, data = _object(s3, f"fault-{kind}.bin", size)
    bad = f"bytes={2 * MIB}-{3 * MIB - 1}"
    with s3.proxy(Faults(rate=1.0, kinds=(kind,), max_per_key=1, ranges=(bad,))) as proxy:
        stats = TransferStats()
        store = ObjectStore(s3.settings(proxy.url, range_size=MIB, concurrency=3), stats)
        assert store.download(url, tmp_path / "f.bin", expected_size=size) == size
        assert (tmp_path / "f.bin").read_bytes() == data
        gets = proxy.requests(_key(url), "GET")
        assert proxy.injected() == {kind: 1}
        others = [r for r in gets if not (r.range or "").startswith("bytes=2")]
        assert sorted(r.range for r in others) == sorted(f"bytes={i * MIB}-{(i + 1) * MIB - 1}" for i in (0, 1, 3, 4))
        faulted = [r for r in gets if r not in others]
        assert [r.fault for r in faulted] == [kind, None] and faulted[0].range == bad
        if kind == "truncate":
            # the retry asks only for what the cut body did not bring to the file: from where it stopped, or a
            # little before when the client dropped the body's last chunk with the error
            (start, end), = _ranges([faulted[1]])
            assert end == 3 * MIB and 2 * MIB <= start <= 2 * MIB + faulted[0].sent
        else:
            assert faulted[1].range == bad
    # aiohttp itself resends an idempotent request once after a reset on a kept-alive connection
    assert stats.retries == (0 if kind == "reset" else 1)


# -- resume ----------------------------------------------------------------------------------------


def test_a_killed_download_resumes_with_the_missing_ranges(s3, tmp_path):
    size = 8 * MIB
    url, data = _object(s3, "resume.bin", size)
    dest = tmp_path / "resume.bin"
    part, record = partial_paths(dest)
    # the child is slowed to 1 MB/s per connection and SIGKILLed once two ranges are recorded
    with s3.proxy(bandwidth_bps=1e6) as slow:
        child = _child(["download", url, str(dest)], endpoint_url=slow.url, region="us-east-1",
                       range_size=str(MIB), concurrency="2")
        try:
            _wait_for(lambda: len((_record(dest) or {}).get("done", [])) >= 2, "two recorded ranges", child)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert not dest.exists() and part.exists()
    done = set(_record(dest)["done"])
    assert 2 <= len(done) < 8
    missing = size - len(done) * MIB
    with s3.proxy() as proxy:
        store = ObjectStore(s3.settings(proxy.url, range_size=MIB))
        landed = []
        assert store.download(url, dest, progress=landed.append) == size
        gets = proxy.requests(_key(url), "GET")
        assert sum(r.sent for r in gets) <= 1.1 * missing
        assert {start // MIB for start, _ in _ranges(gets)}.isdisjoint(done)
    assert dest.read_bytes() == data
    assert sum(landed) == size  # the adopted bytes are reported once
    assert not part.exists() and not record.exists()


def test_a_killed_download_resumes_inside_its_ranges_from_the_last_recorded_byte(s3, tmp_path):
    """Two 4 MiB ranges in flight, killed midway: the rerun asks each range for its bytes after the last
    recorded one, so it fetches what the killed run had not received plus at most one checkpoint's worth."""
    size = 8 * MIB
    url, data = _object(s3, "resume-bytes.bin", size)
    dest = tmp_path / "resume-bytes.bin"
    part, record = partial_paths(dest)
    with s3.proxy(bandwidth_bps=1e6) as slow:
        child = _child(["download", url, str(dest)], endpoint_url=slow.url, region="us-east-1",
                       range_size=str(4 * MIB), concurrency="2")
        try:
            _wait_for(lambda: sum((_record(dest) or {}).get("partial", {}).values()) >= 2 * MIB,
                      "two recorded MiB", child)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        received = sum(r.sent for r in slow.requests(_key(url), "GET"))
    kept = _record(dest)
    assert kept["done"] == [] and kept["range_size"] == 4 * MIB and set(kept["partial"]) <= {"0", "1"}
    recorded = sum(kept["partial"].values())
    assert 2 * MIB <= recorded <= received
    with s3.proxy() as proxy:
        landed = []
        assert ObjectStore(s3.settings(proxy.url, range_size=4 * MIB)).download(url, dest,
                                                                               progress=landed.append) == size
        gets = proxy.requests(_key(url), "GET")
        fetched = sum(r.sent for r in gets)
    assert fetched == size - recorded  # not one recorded byte again
    assert fetched <= (size - received) + MIB + 2 * STREAM_CHUNK  # a kill costs at most a checkpoint (1 MiB here)
    starts = {int(k) * 4 * MIB + n for k, n in kept["partial"].items()}
    assert starts <= {start for start, _ in _ranges(gets)}
    assert dest.read_bytes() == data and sum(landed) == size
    assert not part.exists() and not record.exists()


def test_ranges_are_sized_so_the_last_wave_does_not_run_alone(s3, tmp_path):
    mib = MIB
    assert range_plan(265 * mib, 32 * mib, 8) == 16.75 * mib  # 16 ranges: two whole waves, not 8 and a lone ninth
    assert range_plan(2000 * 10**6, 32 * mib, 8) == 30 * mib  # 64 ranges: eight waves
    assert range_plan(20 * mib, 32 * mib, 8) == 32 * mib  # one range: one GET
    assert range_plan(40 * mib, 32 * mib, 8) == 8 * mib  # not split below 8 MiB for whole waves
    assert range_plan(9 * mib, mib, 4) == mib  # never above the configured size
    size = 40 * MIB
    url, data = _object(s3, "waves.bin", size)
    with s3.proxy() as proxy:
        assert ObjectStore(s3.settings(proxy.url, range_size=16 * MIB, concurrency=4)).download(
            url, tmp_path / "waves.bin") == size
        spans = sorted(_ranges(proxy.requests(_key(url), "GET")))
    planned = [(i * 10 * MIB, (i + 1) * 10 * MIB) for i in range(4)]
    assert [s for s in spans if s[0] % (10 * MIB) == 0] == planned  # four ranges of 10 MiB, one wave
    # on a loaded machine a range answered late may be split onto a connection that finished: its second part
    # lies inside it
    assert all(any(p[0] < start < end <= p[1] for p in planned) for start, end in spans if start % (10 * MIB))
    assert (tmp_path / "waves.bin").read_bytes() == data


@pytest.mark.parametrize("change", ["url", "size", "identity", "range_size", "done", "unreadable", "short part"])
def test_a_record_that_does_not_match_is_not_trusted(s3, tmp_path, change):
    size = 4 * MIB
    url, data = _object(s3, "record.bin", size)
    fs, path = ObjectStore(s3.settings()).locate(url)
    dest = tmp_path / "record.bin"
    part, record = partial_paths(dest)
    part.write_bytes(b"\0" * size)  # nothing of the object: trusting any of it would corrupt the result
    good = {"url": url, "size": size, "identity": fs.info(path)["ETag"], "range_size": MIB, "done": [0, 1, 2]}
    changed = {"url": url + "x", "size": size + 1, "identity": '"0123"', "range_size": 2 * MIB,
               "done": [0, 1, 2, 9]}
    bad = dict(good, **{change: changed[change]}) if change in changed else good
    record.write_bytes(b"{not json" if change == "unreadable" else json.dumps(bad).encode())
    if change == "short part":
        part.write_bytes(b"\0" * (size - 1))
    with s3.proxy() as proxy:
        store = ObjectStore(s3.settings(proxy.url, range_size=MIB))
        assert store.download(url, dest) == size
        assert sum(r.sent for r in proxy.requests(_key(url), "GET")) == size  # all of it again
    assert dest.read_bytes() == data
    assert not part.exists() and not record.exists()


def test_a_matching_record_is_trusted_and_only_missing_ranges_are_fetched(s3, tmp_path):
    size = 4 * MIB
    url, data = _object(s3, "trusted.bin", size)
    fs, path = ObjectStore(s3.settings()).locate(url)
    dest = tmp_path / "trusted.bin"
    part, record = partial_paths(dest)
    part.write_bytes(data[:2 * MIB] + b"\0" * (2 * MIB))
    record.write_text(json.dumps({"url": url, "size": size, "identity": fs.info(path)["ETag"],
                                  "range_size": MIB, "done": [0, 1]}))
    with s3.proxy() as proxy:
        assert ObjectStore(s3.settings(proxy.url, range_size=MIB)).download(url, dest) == size
        assert sorted(_ranges(proxy.requests(_key(url), "GET"))) == [(2 * MIB, 3 * MIB), (3 * MIB, 4 * MIB)]
    assert dest.read_bytes() == data


# -- cancel ----------------------------------------------------------------------------------------


def test_cancel_stops_within_a_chunk_and_leaves_a_resumable_record(s3, tmp_path):
    size = 8 * MIB
    url, data = _object(s3, "cancel.bin", size)
    dest = tmp_path / "cancel.bin"
    cancel = threading.Event()
    after = []

    def progress(n: int) -> None:
        if cancel.is_set():
            after.append(n)
        landed.append(n)
        if sum(landed) >= 2.5 * MIB:
            cancel.set()

    landed: list[int] = []
    with s3.proxy(bandwidth_bps=4e6) as proxy:
        store = ObjectStore(s3.settings(proxy.url, range_size=MIB, concurrency=2))
        with pytest.raises(Cancelled) as err:
            store.download(url, dest, cancel=cancel, progress=progress)
        assert url in str(err.value)
        assert sum(after) <= STREAM_CHUNK  # once it is set, at most the chunk the other range had in hand
        done = set(_record(dest)["done"])
        assert len(done) >= 2
        assert len(proxy.requests(_key(url), "GET")) <= len(done) + 2  # no range started after the cancel
    assert not dest.exists()
    # the next download fetches only what was not recorded
    with s3.proxy() as proxy:
        assert ObjectStore(s3.settings(proxy.url, range_size=MIB)).download(url, dest) == size
        assert {s // MIB for s, _ in _ranges(proxy.requests(_key(url), "GET"))}.isdisjoint(done)
    assert dest.read_bytes() == data


def test_cancel_abandons_requests_the_server_has_not_answered(s3, tmp_path):
    url, _ = _object(s3, "held.bin", 3 * MIB)
    cancel = threading.Event()
    outcome: list[BaseException] = []
    # the proxy holds every GET of the object far longer than this test runs
    with s3.proxy(Faults(get_latency_s=60.0, latency_suffix="held.bin")) as proxy:
        store = ObjectStore(s3.settings(proxy.url, range_size=MIB, concurrency=2, read_timeout_s=120))

        def fetch() -> None:
            try:
                store.download(url, tmp_path / "held.bin", cancel=cancel)
            except BaseException as exc:  # checked below
                outcome.append(exc)

        worker = threading.Thread(target=fetch)
        worker.start()
        _wait_for(lambda: len(proxy.requests(_key(url), "GET")) == 2, "two ranged GETs held by the proxy")
        cancel.set()
        worker.join(timeout=30)
        assert not worker.is_alive()
        assert [type(e) for e in outcome] == [Cancelled] and url in str(outcome[0])
        assert all(r.ended is None for r in proxy.requests(_key(url), "GET"))  # still held: not waited for
    assert list(tmp_path.iterdir()) == []  # nothing was recorded, so nothing is kept


def test_a_cancelled_download_sends_nothing(s3, tmp_path):
    url, _ = _object(s3, "never.bin", 3 * MIB)
    cancel = threading.Event()
    cancel.set()
    with s3.proxy() as proxy:
        with pytest.raises(Cancelled, match="never.bin"):
            ObjectStore(s3.settings(proxy.url, range_size=MIB)).download(url, tmp_path / "n.bin", cancel=cancel)
        assert proxy.requests() == []
    assert list(tmp_path.iterdir()) == []


# -- local errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [MIB, 4 * MIB], ids=["one request", "ranges"])
def test_a_folder_removed_mid_download_is_a_local_error(s3, tmp_path, size):
    url, _ = _object(s3, "vanishing.bin", size)
    folder = tmp_path / "artifacts"
    folder.mkdir()

    def progress(_n: int) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    store = ObjectStore(s3.settings(range_size=MIB))
    with pytest.raises(StoreError) as err:
        store.download(url, folder / "vanishing.bin", expected_size=size, progress=progress)
    assert not isinstance(err.value, (ObjectNotFound, TransientStorageError))
    assert err.value.local_file.startswith(str(folder)) and str(folder) in str(err.value)
    assert url in str(err.value)
    assert store.stats.retries == 0


@pytest.mark.parametrize("where", ["s3", "file"])
def test_a_missing_or_unwritable_destination_is_a_local_error(s3, tmp_path, where):
    if where == "s3":
        url, _ = _object(s3, "nowhere.bin", 3 * MIB)
    else:
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "nowhere.bin").write_bytes(b"x" * 1000)
        url = f"file://{tmp_path}/src/nowhere.bin"
    store = ObjectStore(s3.settings(range_size=MIB))
    missing = tmp_path / "no-such-folder" / "nowhere.bin"
    with pytest.raises(StoreError) as err:
        store.download(url, missing)
    assert not isinstance(err.value, ObjectNotFound)
    assert str(missing.parent) in err.value.local_file and url in str(err.value)
    if where == "s3":  # the partial file cannot be written: a directory stands in its place
        dest = tmp_path / "nowhere.bin"
        partial_paths(dest)[0].mkdir()
        with pytest.raises(StoreError) as err:
            store.download(url, dest)
        assert err.value.local_file == str(partial_paths(dest)[0])
    assert store.stats.retries == 0


def test_local_and_memory_objects_are_plain_copies(tmp_path):
    import fsspec

    data = os.urandom(3 * MIB)
    fsspec.filesystem("memory").pipe_file("/transfer-test/object.bin", data)
    (tmp_path / "object.bin").write_bytes(data)
    store = ObjectStore()
    for i, url in enumerate(["memory://transfer-test/object.bin", f"file://{tmp_path}/object.bin"]):
        landed = []
        dest = tmp_path / f"copy-{i}.bin"
        assert store.download(url, dest, progress=landed.append) == len(data)
        assert dest.read_bytes() == data and sum(landed) == len(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy-0.bin", "copy-1.bin", "object.bin"]


# -- concurrent multipart uploads ------------------------------------------------------------------


def _uploads(s3, url: str) -> list:
    fs, path = ObjectStore(s3.settings()).locate(url)
    bucket, key, _ = fs.split_path(path)
    return [u for u in fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) if u["Key"] == key]


def test_parts_are_uploaded_in_parallel_and_completion_stays_create_only(s3, tmp_path):
    local = tmp_path / "model.safetensors"
    local.write_bytes(os.urandom(3 * PART + 4321))
    url = join_url(s3.prefix("upload"), local.name)
    with s3.proxy(latency_s=0.05, bandwidth_bps=20e6) as proxy:
        store = ObjectStore(s3.settings(proxy.url, block_size=PART, concurrency=4))
        assert store.put_immutable_file(url, local) is True
        parts = [r for r in proxy.requests(_key(url), "PUT") if "partNumber=" in r.query]
        assert len(parts) == 4 and peak_open(parts) > 1
        assert sorted(r.received for r in parts) == [4321, PART, PART, PART]
        complete = [r for r in proxy.requests(_key(url), "POST") if "uploadId=" in r.query]
        assert len(complete) == 1 and complete[0].started > max(r.ended for r in parts)
        # an identical republish compares; different bytes are refused; nothing is uploaded again
        assert store.put_immutable_file(url, local) is False
        other = tmp_path / "other.safetensors"
        other.write_bytes(local.read_bytes()[:-1] + b"\0")
        with pytest.raises(ImmutableConflict) as err:
            store.put_immutable_file(url, other)
        assert url in str(err.value)
        assert len(proxy.requests(_key(url), "PUT")) == 4
    assert ObjectStore(s3.settings()).read_bytes(url, max_size=4 * PART) == local.read_bytes()
    assert _uploads(s3, url) == []


def test_a_refused_completion_or_a_failed_part_aborts_the_upload(s3, tmp_path):
    local = tmp_path / "shard.bin"
    local.write_bytes(os.urandom(2 * PART + 10))
    url = join_url(s3.prefix("abort"), local.name)
    store = ObjectStore(s3.settings(block_size=PART))
    assert store.put_immutable_file(url, local) is True
    fs, path = store.locate(url)
    # a racing publisher got there first: the create-only completion is refused (412) and the upload aborted
    assert upload_parts(store, S3Multipart(fs, path), url, local, PART) is False
    assert _uploads(s3, url) == []
    # a part refused for good fails the upload, which is aborted: no parts are left behind
    other = join_url(s3.prefix("abort"), "denied.bin")
    with s3.proxy(Faults(deny=("partNumber=2",))) as proxy:
        with pytest.raises(AccessDenied) as err:
            ObjectStore(s3.settings(proxy.url, block_size=PART)).put_immutable_file(other, local)
        assert other in str(err.value)
        assert [r.method for r in proxy.requests(_key(other)) if r.method == "DELETE"] == ["DELETE"]
    assert _uploads(s3, other) == [] and not store.exists(other)


def test_an_upload_killed_midway_is_retried_from_scratch(s3, tmp_path):
    local = tmp_path / "killed.safetensors"
    local.write_bytes(os.urandom(4 * PART))
    url = join_url(s3.prefix("killed"), local.name)
    with s3.proxy(bandwidth_bps=4e6) as slow:
        child = _child(["upload", str(local), url], endpoint_url=slow.url, region="us-east-1",
                       block_size=str(PART), concurrency="2")
        try:
            _wait_for(lambda: any(r.status == 200 and r.ended for r in slow.requests(_key(url), "PUT")),
                      "an uploaded part", child)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
    store = ObjectStore(s3.settings(block_size=PART, concurrency=4))
    assert not store.exists(url)
    assert len(_uploads(s3, url)) == 1  # the killed process's upload (a bucket lifecycle rule ends it)
    assert store.put_immutable_file(url, local) is True
    assert store.read_bytes(url, max_size=4 * PART) == local.read_bytes()
    assert store.put_immutable_file(url, local) is False


# -- the benchmark ---------------------------------------------------------------------------------


def test_the_transfer_benchmark_runs_end_to_end(tmp_path):
    """``python -m benchmarks.transfer`` as a command from the repository root (tests import no benchmark)."""
    out = tmp_path / "transfer.json"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-m", "benchmarks.transfer", "--quick", "--size-mb", "24",
                           "--revision-mb", "16", "--objects", "4", "--curve-ranges", "8", "--curve-connections", "2",
                           "--shard-mib", "8", "--shard-cap-mb-s", "4", "--workdir", str(tmp_path), "--json", str(out)],
                          cwd=ROOT, env=os.environ | {"PYTHONPATH": path}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"benchmarks.transfer exited with {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result["schema"] == "canonical-refit.benchmark.transfer.v1"
    assert [r["what"].split()[0] for r in result["rows"]] == ["download", "download", "upload", "upload", "download"]
    assert result["rows"][-1]["what"].startswith("download 1 shard of 8 MiB")
    resume = result["resume"]  # the download killed at 53 % and run again
    assert resume["size"] == 8 * MIB and 0.53 <= resume["killed_at"] < 1
    assert 0 < resume["fetched_bytes"] <= resume["size"] and resume["missing_bytes"] == 8 * MIB - resume["received_bytes"]
    assert resume["met"] == (resume["ratio"] <= 1.1)
    assert all(r["bytes"] > 0 and r["seconds"] > 0 and r["ratio"] > 0 for r in result["rows"] + result["curve"])
    assert [(r["range_mib"], r["connections"]) for r in result["curve"]] == [(8, 2)]
    assert "goal: every ratio >= 0.8 with default settings" in done.stdout
    assert "goal: a rerun after kill -9 at" in done.stdout
    real = result["real_server"]  # the same shard on moto behind a cap on each TCP connection, after the model
    assert real["config"]["size"] == 8 * MIB and real["config"]["server"] == "moto"
    assert [run["ratio"] > 0 and 0 < run["server_bound"] <= 1 for run in real["runs"]["split"]] == [True]
    assert "real-server path (moto, each TCP connection capped)" in done.stdout
    assert "goal: the real-server path >= 0.8:" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transfer.json"]  # the scratch folder is gone
