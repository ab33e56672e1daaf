"""The record of a partial download (``.{name}.part.json``) is a strict record.

``storage.objects.partial.PartialRecord`` is read through
``storage.jsonio.bounded_json.read_record``: a value of the wrong JSON type,
a missing key or a key this version does not know is refused with a
``StoreError`` naming the record's path and the object's URL, and the
download then starts again from zero (never half-understood). A record as
today's code writes it is resumed from.
"""

from __future__ import annotations

import json
import os

import pytest
from tests.support.s3_support import aws_environment, s3  # noqa: F401  (s3 is a fixture)

from storage.errors import StoreError
from storage.objects.partial import PartialRecord, read_partial_record
from storage.objects.store import ObjectStore
from storage.objects.transfer import partial_paths
from storage.urls import join_url

MIB = 2**20
URL = "s3://bucket/prefix/record.bin"
TODAY = {"done": [0, 2], "identity": '"0123abcd"', "partial": {"1": 100000}, "range_size": MIB, "size": 4 * MIB,
         "split": {"1": [MIB, MIB + MIB // 2], "4": [MIB + MIB // 2, 2 * MIB]}, "url": URL}


def test_a_record_as_written_today_parses(tmp_path):
    path = tmp_path / ".record.bin.part.json"
    path.write_text(json.dumps(TODAY))
    assert read_partial_record(path, URL) == PartialRecord(
        url=URL, size=4 * MIB, identity='"0123abcd"', range_size=MIB, done=[0, 2], partial={"1": 100000},
        split={"1": (MIB, MIB + MIB // 2), "4": (MIB + MIB // 2, 2 * MIB)})
    older = {k: v for k, v in TODAY.items() if k not in ("partial", "split")}  # before ranges in flight were kept
    path.write_text(json.dumps(older))
    assert read_partial_record(path, URL).partial == {} and read_partial_record(path, URL).split == {}
    assert read_partial_record(tmp_path / "missing.json", URL) is None


@pytest.mark.parametrize("contents, field", [
    (TODAY | {"size": "4194304"}, "size"),
    (TODAY | {"size": 4194304.0}, "size"),
    (TODAY | {"done": [0, "2"]}, "done.1"),
    (TODAY | {"done": [True]}, "done.0"),
    (TODAY | {"partial": {"1": "100000"}}, "partial.1"),
    (TODAY | {"split": {"1": [MIB]}}, "split.1.1"),
    (TODAY | {"identity": None}, "identity"),
    ({k: v for k, v in TODAY.items() if k != "range_size"}, "range_size"),
    (TODAY | {"checksum": "crc32"}, "checksum"),
    ([TODAY], None),
])
def test_a_malformed_record_is_refused_naming_the_file_and_the_object(tmp_path, contents, field):
    path = tmp_path / ".record.bin.part.json"
    path.write_text(json.dumps(contents))
    with pytest.raises(StoreError) as caught:
        read_partial_record(path, URL)
    error = caught.value
    assert (error.local_file, error.file, error.field) == (str(path), URL, field)
    assert str(path) in str(error) and "the download starts again" in str(error)


@pytest.mark.parametrize("change", ["wrong type", "unknown key"])
def test_a_download_with_a_refused_record_starts_again_from_zero(s3, tmp_path, change):
    size = 4 * MIB
    data = os.urandom(size)
    url = join_url(s3.prefix("strict-partial"), f"{change.replace(' ', '-')}.bin")
    objects = ObjectStore(s3.settings(range_size=MIB))
    objects.put_immutable(url, data)
    fs, key = objects.locate(url)
    dest = tmp_path / "object.bin"
    part, record = partial_paths(dest)
    part.write_bytes(b"\0" * size)  # nothing of the object: trusting any of it would corrupt the result
    good = {"url": url, "size": size, "identity": fs.info(key)["ETag"], "range_size": MIB, "done": [0, 1, 2],
            "partial": {}}
    record.write_text(json.dumps(good | ({"size": str(size)} if change == "wrong type" else {"extra": 1})))
    with s3.proxy() as proxy:
        assert ObjectStore(s3.settings(proxy.url, range_size=MIB)).download(url, dest) == size
        assert sum(r.sent for r in proxy.requests("/" + url.split("://", 1)[1], "GET")) == size  # all of it
    assert dest.read_bytes() == data and not part.exists() and not record.exists()
