"""A real S3 server for the tests, and a fault-injecting proxy to put in front of it.

The ``s3`` session fixture runs moto's standalone S3 server (``MotoServer``
from ``testbed/s3.py``: ``python -m moto.server`` as a subprocess bound to
127.0.0.1 at a free port, stopped by its process group) with the test bucket.
moto enforces ``If-None-Match: *`` (412), which is what publication semantics
need.

``FaultProxy`` (from ``testbed/s3proxy.py``, shared with the benchmarks) is an
HTTP/1.1 proxy on 127.0.0.1 that forwards to the server and injects bounded
faults (503, 500, resets, stalls, truncated bodies, 403/404,
stripped conditional headers), can cap each connection's bandwidth and delay
every response like real S3, and logs every request (Range, body bytes sent,
start and end times) for assertions.

Run ``python -m tests.support.s3_support crash-publish ...`` to publish in a process that
is SIGKILLed right before it would write the catalog record, and
``python -m tests.support.s3_support transfer download|upload ...`` to download or
upload in a process a test can SIGKILL mid-transfer.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest


from storage.settings import ObjectStoreSettings  # noqa: E402
from testbed.s3 import MotoServer  # noqa: E402
from testbed.s3proxy import FaultProxy, Faults  # noqa: E402

BUCKET = "refit-e2e"
ACCESS_KEY_ID = "canonical-refit-test"
SECRET_ACCESS_KEY = "canonical-refit-test-secret"
REGION = "us-east-1"


def aws_environment(endpoint_url: str | None = None) -> dict[str, str]:
    """The standard AWS variables a client of the test server needs (and nothing else)."""
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
           "AWS_DEFAULT_REGION": REGION}
    if endpoint_url:
        env["AWS_ENDPOINT_URL_S3"] = endpoint_url
    return env


# -- the session fixture ---------------------------------------------------------------------------


@dataclass
class S3:
    """The test S3 server: its endpoint, the bucket, and settings the project's clients use."""

    server: MotoServer
    bucket: str = BUCKET

    @property
    def endpoint(self) -> str:
        return self.server.url

    def prefix(self, name: str) -> str:
        """A fresh ``s3://bucket/name-xxxxxxxx`` prefix, so tests never see each other's objects."""
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:8]}"

    def settings(self, endpoint: str | None = None, **overrides) -> ObjectStoreSettings:
        """Object-store settings for ``endpoint`` (default: the server) with quick backoff."""
        values = dict(endpoint_url=endpoint or self.endpoint, region=REGION, backoff_initial_s=0.05,
                      backoff_max_s=0.5, read_timeout_s=1.5, connect_timeout_s=2.0)
        values.update(overrides)
        return ObjectStoreSettings(**values)

    def proxy(self, faults: Faults | None = None, lifetime_s: float = 120.0, *, bandwidth_bps: float = 0.0,
              latency_s: float = 0.0) -> FaultProxy:
        """A fault proxy in front of the server (per-connection cap, latency); use it as a context manager."""
        return FaultProxy(self.endpoint, faults or Faults(), lifetime_s=lifetime_s, bandwidth_bps=bandwidth_bps,
                          latency_s=latency_s)


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 with the test bucket, and AWS credentials in the environment.

    Only the standard credential variables are set; every client gets the
    endpoint from ``ObjectStoreSettings`` (or, in the receiver-process test,
    from the environment it is started with).
    """
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log", BUCKET).start()
    saved = {k: os.environ.get(k) for k in aws_environment()}
    try:
        os.environ.update(aws_environment())
        yield S3(server)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def s3_lab(root: Path, s3: S3, name: str):
    """A ``Lab`` whose catalog is ``s3://bucket/name-xxxx/catalog`` (payloads go next to it)."""
    from tests.support.lab import Lab, tiny_shape

    lab = Lab(root, shape=tiny_shape())
    lab.catalog = f"{s3.prefix(name)}/catalog"
    return lab


def process_env(**extra: str) -> dict[str, str]:
    """Environment for a child process: ours without AWS or project settings, the harness's
    Prefect API, and ``extra``."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "CANONICAL_REFIT_", "FSSPEC_"))}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# -- a publisher that dies before its catalog record ---------------------------------------------


def crash_publish(argv: list[str]) -> None:
    """Run ``flows.publish`` with ``argv``, SIGKILLing this process as the catalog record is written."""
    from storage.catalog.records import Catalog

    def die(self, record):
        sys.stdout.write(f"killed before writing {self.record_url(record.version)}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    Catalog.write = die
    from flows.publish import main

    raise SystemExit(main(argv))


# -- a transfer in a process of its own (to be SIGKILLed) ------------------------------------------


def transfer_child(argv: list[str]) -> None:
    """``download URL DEST`` or ``upload LOCAL URL`` with ``ObjectStoreSettings`` from the environment."""
    from storage.objects.store import ObjectStore

    store = ObjectStore(ObjectStoreSettings())
    if argv[0] == "download":
        size = store.download(argv[1], Path(argv[2]))
    elif argv[0] == "upload":
        size = store.put_immutable_file(argv[2], Path(argv[1]))
    else:
        raise SystemExit(f"unknown transfer {argv[0]!r}")
    print(f"done {size}", flush=True)


# -- read paths compared on the test server ------------------------------------------------------


def bench_reads(mib: int = 16, files: int = 8, concurrency: int = 4) -> None:
    """Print MB/s and peak traced memory of each way to read objects from moto (median of 3)."""
    import tempfile
    import tracemalloc
    from concurrent.futures import ThreadPoolExecutor

    from storage.objects.store import ObjectStore

    with tempfile.TemporaryDirectory(prefix="s3-bench-") as tmp:
        server = MotoServer(Path(tmp) / "moto.log", BUCKET).start()
        try:
            os.environ.update(aws_environment())
            store = ObjectStore(S3(server).settings(read_timeout_s=60))
            size = mib * 2**20
            urls = [f"s3://{BUCKET}/bench/{i:02d}.bin" for i in range(files)]
            for url in urls:
                store.put_immutable(url, os.urandom(size))
            fs, _ = store.locate(urls[0])
            paths = [store.locate(u)[1] for u in urls]
            ways = {
                "ObjectStore.download (streamed GET)":
                    lambda i: store.download(urls[i], Path(tmp) / f"{i}.bin", expected_size=size),
                "ObjectStore.read_bytes (HEAD + cat_file)": lambda i: store.read_bytes(urls[i], max_size=size),
                "s3fs cat_file": lambda i: fs.cat_file(paths[i]),
                "s3fs open(block_size=64 MiB).read()": lambda i: fs.open(paths[i], "rb", block_size=64 * 2**20).read(),
            }
            print(f"{files} objects of {mib} MiB on moto; MB = 10^6 bytes")
            for name, read in ways.items():
                tracemalloc.start()
                read(0)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                rates = []
                for _ in range(3):
                    start = time.perf_counter()
                    for i in range(files):
                        read(i)
                    rates.append(files * size / (time.perf_counter() - start) / 1e6)
                start = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    list(pool.map(read, range(files)))
                parallel = files * size / (time.perf_counter() - start) / 1e6
                print(f"{name:<50} sequential {sorted(rates)[1]:7.0f} MB/s   {concurrency} at a time "
                      f"{parallel:7.0f} MB/s   peak {peak / 2**20:6.1f} MiB per object")
        finally:
            server.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["crash-publish"]:
        crash_publish(sys.argv[2:])
    elif sys.argv[1:2] == ["transfer"]:
        transfer_child(sys.argv[2:])
    elif sys.argv[1:2] == ["bench"]:
        bench_reads(*(int(a) for a in sys.argv[2:5]))
    else:
        raise SystemExit("usage: python -m tests.support.s3_support crash-publish PUBLISH-ARGS... | "
                         "transfer download URL DEST | transfer upload LOCAL URL | bench [MIB FILES WORKERS]")
