"""Concurrent multipart uploads under the store's connection budget; completion stays create-only.

Parts of ``block_size`` go up in parallel on the ``ConnectionBudget`` every
download of the store shares; the completion carries ``If-None-Match: *``,
so a key that exists is never replaced (the caller then compares bytes:
an identical republish is accepted). An upload that does not complete is
aborted, so no parts are left behind.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import threading
import zlib
from pathlib import Path

from storage.errors import ObjectNotFound, StoreError
from storage.objects.budget import Requester, Stopped
from storage.objects.classify import local_call

log = logging.getLogger("canonical_refit.transfer")


class S3Multipart:
    """The S3 multipart-upload API through s3fs's client; completion is create-only (If-None-Match)."""

    def __init__(self, fs, path: str):
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)

    def create(self) -> str:
        return self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)["UploadId"]

    def upload_part(self, upload_id: str, number: int, data: bytes) -> str:
        # the CRC32 botocore would compute on the event loop shared by every request, computed
        # here on the calling thread instead (zlib releases the GIL)
        crc32 = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
        return self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=upload_id,
                               PartNumber=number, Body=data, ChecksumCRC32=crc32)["ETag"]

    def complete(self, upload_id: str, etags: dict[int, str]) -> None:
        """Raises ``FileExistsError`` if the key already exists."""
        parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id,
                        MultipartUpload={"Parts": parts}, IfNoneMatch="*")

    def abort(self, upload_id: str) -> None:
        self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id)


def upload_parts(store: Requester, wire: S3Multipart, url: str, local: Path, part_size: int) -> bool:
    """Upload ``local`` to ``url`` in ``part_size`` parts, in parallel on the store's budget.

    Returns True if the object was created, False if the create-only
    completion found the key already there (the caller compares the bytes).
    An upload that does not complete is aborted, so no parts are left behind.
    """
    local = Path(local)
    failed = threading.Event()
    size = local_call("reading the file to upload", local, url, os.path.getsize, local)
    fd = local_call("opening the file to upload", local, url, os.open, local, os.O_RDONLY)
    try:
        upload_id = store.call("create multipart upload", url, wire.create)

        def part(number: int) -> str:
            if failed.is_set():
                raise Stopped("stopped: another part of this upload failed", file=url)
            offset = (number - 1) * part_size
            length = min(part_size, size - offset)
            data = local_call("reading the file to upload", local, url, os.pread, fd, length, offset)
            if len(data) != length:
                raise StoreError(f"the file to upload shrank while it was read (part {number})",
                                 file=url, local_file=str(local))
            return store.call(f"upload of part {number}", url, lambda: wire.upload_part(upload_id, number, data))

        tries = 0

        def complete() -> bool:
            nonlocal tries
            tries += 1
            try:
                wire.complete(upload_id, etags)
                return True
            except FileExistsError:
                return False
            except FileNotFoundError:  # NoSuchUpload: an earlier attempt completed it but its answer was lost
                if tries > 1:
                    return False
                raise

        try:
            calls = {n: (lambda n=n: part(n)) for n in range(1, math.ceil(size / part_size) + 1)}
            etags = store.budget.run(calls, url=url, failed=failed)
            created = store.call("create-only completion of the multipart upload", url, complete)
        except BaseException:
            _abort(store, wire, url, upload_id)
            raise
        if not created:
            _abort(store, wire, url, upload_id)
        return created
    finally:
        os.close(fd)


def _abort(store: Requester, wire: S3Multipart, url: str, upload_id: str) -> None:
    try:
        store.call("abort of the multipart upload", url, lambda: wire.abort(upload_id))
    except ObjectNotFound:  # NoSuchUpload: already completed or aborted
        pass
    except Exception as exc:  # the server is unreachable
        log.warning("could not abort multipart upload %s of %s (its parts stay until the bucket's lifecycle "
                    "rules remove them): %s", upload_id, url, exc)
