"""Ranges split for idle connections at the end of a download, and the record of a split download, against moto
through the proxy. Which requests were made is read from the proxy's log, never from timings."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest

from tests.support.s3_support import s3  # noqa: F401  (s3 is a fixture)
from storage.objects.store import ObjectStore
from storage.objects.transfer import SPLIT_MIN, partial_paths, range_plan
from storage.settings import ObjectStoreSettings
from storage.urls import join_url
from testbed.s3proxy import Faults, peak_open

MIB = 2**20


def _object(s3, name: str, size: int) -> tuple[str, bytes]:
    data = os.urandom(size)
    url = join_url(s3.prefix("transfer-split"), name)
    # False only where a retry after a lost answer met its own first write (identical bytes); else it raises
    ObjectStore(s3.settings()).put_immutable(url, data)
    return url, data


def _key(url: str) -> str:
    return "/" + url.split("://", 1)[1]


def _span(request) -> tuple[int, int]:
    start, end = request.range.removeprefix("bytes=").split("-")
    return int(start), int(end) + 1


def test_a_range_answered_late_is_split_onto_the_connections_that_finished(s3, tmp_path):
    size, rs = 48 * MIB, 12 * MIB  # four ranges on four connections
    url, data = _object(s3, "late.bin", size)
    late = f"bytes={3 * rs}-{size - 1}"
    # the last range is refused once (503) and retried 0.75-1.5 s later: at 8 MB/s per connection it still has
    # megabytes to come when the other three end
    faults = Faults(rate=1.0, kinds=("slowdown",), max_per_key=1, ranges=(late,))
    with s3.proxy(faults, bandwidth_bps=8e6) as proxy:
        store = ObjectStore(s3.settings(proxy.url, range_size=rs, concurrency=4, backoff_initial_s=1.5,
                                        backoff_max_s=1.5))
        dest = tmp_path / "late.bin"
        assert store.download(url, dest) == size
        gets = [r for r in proxy.requests(_key(url), "GET") if r.fault is None]
        spans = sorted(_span(r) for r in gets)
    assert dest.read_bytes() == data
    planned = [(i * rs, (i + 1) * rs) for i in range(4)]
    split = [s for s in spans if s not in planned]
    assert split, spans  # at least one request for the second part of a range still going
    starts = {start for start, _ in split}
    for start, end in split:  # each starts inside a planned range, ends where a range or another split part ends
        assert start % rs and start + SPLIT_MIN <= end and (end % rs == 0 or end == size or end in starts)
    assert proxy.injected() == {"slowdown": 1}
    assert not partial_paths(dest)[0].exists() and not partial_paths(dest)[1].exists()


def test_a_record_with_split_ranges_resumes_from_each_part(s3, tmp_path):
    size, half = 4 * MIB, MIB // 2
    url, data = _object(s3, "split-record.bin", size)
    fs, path = ObjectStore(s3.settings()).locate(url)
    dest = tmp_path / "split-record.bin"
    part, record = partial_paths(dest)
    # range 1 was split at its middle into a new range 4; ranges 0 and 4 completed, range 1 has 100000 bytes
    have = bytearray(size)
    have[:MIB] = data[:MIB]
    have[MIB + half:2 * MIB] = data[MIB + half:2 * MIB]
    have[MIB:MIB + 100000] = data[MIB:MIB + 100000]
    part.write_bytes(bytes(have))
    record.write_text(json.dumps({"url": url, "size": size, "identity": fs.info(path)["ETag"], "range_size": MIB,
                                  "done": [0, 4], "partial": {"1": 100000},
                                  "split": {"1": [MIB, MIB + half], "4": [MIB + half, 2 * MIB]}}))
    with s3.proxy() as proxy:
        assert ObjectStore(s3.settings(proxy.url, range_size=MIB)).download(url, dest) == size
        spans = sorted(_span(r) for r in proxy.requests(_key(url), "GET"))
    assert spans == [(MIB + 100000, MIB + half), (2 * MIB, 3 * MIB), (3 * MIB, 4 * MIB)]
    assert dest.read_bytes() == data


@pytest.mark.parametrize("split", [
    {"1": [MIB, MIB + MIB // 2]},  # a gap: nothing covers the rest of range 1
    {"1": [MIB, MIB + MIB // 2], "4": [MIB, 2 * MIB]},  # an overlap
    {"4": [3 * MIB, 5 * MIB]},  # past the end of the object
    {"1": "all"},  # not a pair of offsets
])
def test_a_record_whose_split_ranges_do_not_cover_the_object_once_is_not_trusted(s3, tmp_path, split):
    size = 4 * MIB
    url, data = _object(s3, "split-bad.bin", size)
    fs, path = ObjectStore(s3.settings()).locate(url)
    dest = tmp_path / "split-bad.bin"
    part, record = partial_paths(dest)
    part.write_bytes(b"\0" * size)  # nothing of the object: trusting any of it would corrupt the result
    record.write_text(json.dumps({"url": url, "size": size, "identity": fs.info(path)["ETag"], "range_size": MIB,
                                  "done": [0, 1], "partial": {}, "split": split}))
    with s3.proxy() as proxy:
        assert ObjectStore(s3.settings(proxy.url, range_size=MIB)).download(url, dest) == size
        assert sum(r.sent for r in proxy.requests(_key(url), "GET")) == size  # all of it again
    assert dest.read_bytes() == data
    assert not part.exists() and not record.exists()


def test_a_gb_scale_object_is_planned_as_whole_waves_of_ranges_for_every_connection():
    defaults = ObjectStoreSettings()
    for size in (3 * 10**9, 2**30, 265 * 10**6):  # a fused expert block of gpt-oss size, 1 GiB, a shard
        rs = range_plan(size, defaults.range_size, defaults.concurrency)
        count = -(-size // rs)
        assert min(defaults.range_size, 8 * MIB) <= rs <= defaults.range_size, (size, rs)
        assert count >= defaults.concurrency and count % defaults.concurrency == 0, (size, count)


def test_one_large_object_is_fetched_over_every_connection_with_memory_bounded_by_them(s3, tmp_path):
    """Small mode of a GB-scale fused tensor's object: one download keeps the whole connection budget busy
    (the fetch stage's worker does not serialize it) and holds at most a chunk per connection in memory."""
    size, rs, connections = 12 * MIB, MIB, 4
    url, data = _object(s3, "fused.bin", size)
    with s3.proxy(bandwidth_bps=2e6) as proxy:  # each 1 MiB range takes half a second: they overlap
        store = ObjectStore(s3.settings(proxy.url, range_size=rs, concurrency=connections))
        assert store.size(url) == size  # builds the S3 client (botocore's models) before memory is traced
        dest = tmp_path / "fused.bin"
        tracemalloc.start()
        try:
            assert store.download(url, dest) == size
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        gets = [r for r in proxy.requests(_key(url), "GET") if r.fault is None]
    assert dest.read_bytes() == data
    assert len(gets) >= size // rs and all(_span(r)[1] - _span(r)[0] <= rs for r in gets)
    assert peak_open(gets) == connections  # every connection at once, never more
    assert peak < connections * rs, f"download held {peak:,} bytes at once for a {size:,}-byte object"
