"""Object-storage transfer throughput against a model of real S3 (``python -m benchmarks.transfer``).

Real S3 serves one connection at roughly 100 MB/s and adds a few ms to every
request, so a node reaches line rate only over many connections. This
benchmark puts ``testbed.s3proxy`` in front of an S3 server, capping every
connection (default 100 MB/s) and delaying every response (default 5 ms), and
measures ``ObjectStore`` with its default settings:

* download of one large object (default 2000 MB) and of a revision of 20
  objects (2000 MB in all), the latter the way the fetch stage does it: a
  HEAD of each, then ``concurrency`` callers of ``download``;
* create-only upload of the same (``put_immutable_file``; multipart for the
  large object).

Then one full shard (default 265 MiB) behind a slower cap (default 12.5 MB/s
per connection): its download against min(connections × cap, ceiling), goal
0.8 (ranges sized to the object fill every connection to the end), and a
download killed (SIGKILL, in a process of its own) at 53 % of the object then
run again: the bytes the rerun fetches over the bytes the killed run had not
received, goal at most 1.1 (resume inside ranges, from the last recorded
byte).

Each rate is compared with the bound min(connections × per-connection cap,
loopback ceiling), the ceiling being the same transfer through the same proxy
without cap or latency, measured in the same run; the goal is a ratio of at
least 0.8 with default settings. A curve over range sizes and connection
budgets (download of the large object) follows; ``--curve-only`` measures
just that. MB = 10^6 bytes. Where client, proxy and server share a few cores,
the uncapped run can thrash and come out slower than the capped one (a ratio
above 1): the machine, not the cap, is then the bound, and runs vary by tens
of percent with other load; ``--repeat`` keeps the best of several runs.

The server is the minimal S3 subset of ``benchmarks._s3server`` (ranged GETs
sent with ``sendfile``, answered at once, as real S3 answers them), run in its
own process over a scratch folder; proxy and server each run in a process of
their own, so neither shares the client's GIL. Not moto: it reads the whole
object for every ranged GET, under the object's lock, so it answers a large
object's ranges one after another (see the project's S3 notes).

Then the real-server path (``benchmarks._transfer_real``), the setting of an
outside check: the shard's size (default 265 MB) on moto, the project's test
server, behind ``testbed.throttle.ConnectionThrottle`` (a cap of
``--shard-cap-mb-s`` on every TCP connection), downloaded by a fresh store with
the default settings. Both ratios are printed side by side, with the bound
moto's one-at-a-time answers set for any client with the same connections in
flight. ``--moto-shard`` measures only that path, each run also without range
splits (the behaviour before them); ``--no-real-server`` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import _transfer_real as real
from benchmarks._s3server import S3Handler, serve
from benchmarks._transfer_real import Process as _Process, same_file as _same_file, set_env as _set_env

MB = 10**6
MIB = 2**20
BUCKET = "bench"
GOAL = 0.8
RESUME_GOAL = 1.1


# -- the measurements -----------------------------------------------------------------------------


@dataclass
class Row:
    what: str
    bytes: int
    seconds: float
    connections: int
    cap_mb_s: float
    ceiling_mb_s: float
    range_mib: int = 0

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / MB

    @property
    def bound_mb_s(self) -> float:
        return min(self.connections * self.cap_mb_s, self.ceiling_mb_s) if self.cap_mb_s else self.ceiling_mb_s

    @property
    def ratio(self) -> float:
        return self.mb_s / self.bound_mb_s

    def as_dict(self) -> dict:
        return asdict(self) | {"mb_s": round(self.mb_s, 1), "bound_mb_s": round(self.bound_mb_s, 1),
                               "ratio": round(self.ratio, 3)}


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path):
        self.args, self.root = args, root
        self.data, self.local, self.out = root / "server", root / "local", root / "downloads"
        for folder in (self.data / BUCKET, self.local, self.out):
            folder.mkdir(parents=True, exist_ok=True)
        credentials = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_SESSION_TOKEN": None,
                       "AWS_PROFILE": None, "AWS_EC2_METADATA_DISABLED": "true"}
        self._saved_env = {k: os.environ.get(k) for k in credentials}
        _set_env(credentials)  # the server checks no signature; restored by close()
        self.server = _Process(["-m", "benchmarks.transfer", "--serve", str(self.data)])
        self.proxies: dict[tuple[float, float], _Process] = {}

    def close(self) -> None:
        for p in [*self.proxies.values(), self.server]:
            p.stop()
        _set_env(self._saved_env)

    def proxy(self, cap_mb_s: float, latency_ms: float) -> str:
        key = (cap_mb_s, latency_ms)
        if key not in self.proxies:
            self.proxies[key] = _Process(["-m", "testbed.s3proxy", self.server.url, "--bandwidth-mb-s",
                                          str(cap_mb_s), "--latency-ms", str(latency_ms)])
        return self.proxies[key].url

    def store(self, endpoint: str, **overrides):
        """A fresh store (default settings unless overridden) whose S3 client is already built."""
        from storage.objects.store import ObjectStore
        from storage.settings import ObjectStoreSettings

        store = ObjectStore(ObjectStoreSettings(endpoint_url=endpoint, region="us-east-1",
                                                addressing_style="path", **overrides))
        store.size(f"s3://{BUCKET}/big.bin")
        return store

    # -- data ------------------------------------------------------------------------------------

    def make(self, name: str, size: int) -> Path:
        """A local file of ``size`` random bytes, also placed on the server as ``bench/name``."""
        import numpy as np

        path = self.local / name
        rng = np.random.default_rng(abs(hash(name)) % 2**32)
        with open(path, "wb") as fh:
            for start in range(0, size, 64 * MIB):
                fh.write(rng.bytes(min(64 * MIB, size - start)))
        os.link(path, self.data / BUCKET / name)
        return path

    def clear_downloads(self) -> None:
        shutil.rmtree(self.out)
        self.out.mkdir()

    # -- transfers (each returns seconds) ----------------------------------------------------------

    def download(self, store, names: list[str], verify: bool) -> float:
        urls = [f"s3://{BUCKET}/{n}" for n in names]
        self.clear_downloads()
        start = time.perf_counter()
        if len(urls) == 1:
            store.download(urls[0], self.out / names[0])
        else:  # as the fetch stage does: sizes first, then concurrency callers
            workers = store.settings.concurrency
            with ThreadPoolExecutor(workers) as pool:
                sizes = list(pool.map(store.size, urls))
                list(pool.map(lambda a: store.download(a[0], self.out / a[1], expected_size=a[2]),
                              zip(urls, names, sizes)))
        seconds = time.perf_counter() - start
        if verify:
            for n in names:
                if not _same_file(self.local / n, self.out / n):
                    raise AssertionError(f"download of {n} is not byte-exact")
        return seconds

    def upload(self, store, names: list[str]) -> float:
        prefix = f"up-{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        with ThreadPoolExecutor(store.settings.concurrency) as pool:
            created = list(pool.map(lambda n: store.put_immutable_file(f"s3://{BUCKET}/{prefix}/{n}",
                                                                        self.local / n), names))
        seconds = time.perf_counter() - start
        if not all(created):
            raise AssertionError("an upload was not created")
        for n in names:
            segments = S3Handler._segments(self.data / BUCKET / prefix / n) or []
            if sum(size for _, size in segments) != (self.local / n).stat().st_size:
                raise AssertionError(f"upload of {n} is missing or has the wrong size")
        shutil.rmtree(self.data / BUCKET / prefix)
        return seconds

    def run(self) -> dict:
        a = self.args
        big = self.make("big.bin", int(a.size_mb * MB))
        each = int(a.revision_mb * MB / a.objects)
        revision = [] if a.curve_only else [self.make(f"bucket-{i:05d}.safetensors", each).name
                                            for i in range(a.objects)]
        capped, free = self.proxy(a.cap_mb_s, a.latency_ms), self.proxy(0, 0)
        conns = self.store(capped).settings.concurrency
        rows, curve = [], []
        work = [("download", f"1 object of {a.size_mb:g} MB", [big.name]),
                ("download", f"revision of {a.objects} objects, {a.revision_mb:g} MB", revision),
                ("upload", f"1 object of {a.size_mb:g} MB", [big.name]),
                ("upload", f"revision of {a.objects} objects, {a.revision_mb:g} MB", revision)]
        self.download(self.store(free), [big.name], False)  # warm the page cache and the proxies
        big_ceiling = big.stat().st_size / min(self.download(self.store(free), [big.name], False)
                                               for _ in range(a.repeat)) / MB if a.curve_only else 0.0
        for kind, label, names in ([] if a.curve_only else work):
            total = sum((self.local / n).stat().st_size for n in names)
            run = self.download if kind == "download" else self.upload
            extra = (True,) if kind == "download" else ()
            free_s, capped_s = [], []
            for _ in range(a.repeat):  # interleaved, so both see the same machine
                free_s.append(run(self.store(free), names, *extra))
                capped_s.append(run(self.store(capped), names, *extra))
            ceiling = total / min(free_s) / MB
            rows.append(Row(f"{kind} {label}", total, min(capped_s), conns, a.cap_mb_s, ceiling))
            _print_row(rows[-1])
            if kind == "download" and names == [big.name]:
                big_ceiling = ceiling
        print(f"\ncurve: download of {a.size_mb:g} MB through the capped proxy (best of {a.repeat})")
        for mib in a.curve_ranges:
            for n in a.curve_connections:
                seconds = min(self.download(self.store(capped, range_size=mib * MIB, concurrency=n), [big.name],
                                            False) for _ in range(a.repeat))
                curve.append(Row(f"range {mib} MiB, {n} connections", big.stat().st_size, seconds, n,
                                 a.cap_mb_s, big_ceiling, mib))
                _print_row(curve[-1])
        shard = None if a.curve_only or not a.shard_mib else self.shard()
        if shard:
            rows.append(shard["row"])
        met = all(r.ratio >= GOAL for r in rows) if rows else None
        if rows:
            print(f"\ngoal: every ratio >= {GOAL} with default settings: {'met' if met else 'NOT met'}")
        if shard:
            r = shard["resume"]
            print(f"goal: a rerun after kill -9 at {r['killed_at']:.0%} fetches <= {RESUME_GOAL} x the missing "
                  f"bytes: {r['ratio']:.3f} x ({r['fetched_bytes'] / MB:.1f} of {r['missing_bytes'] / MB:.1f} MB) "
                  f"{'met' if r['met'] else 'NOT met'}")
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k != "serve"}
        return {"schema": "canonical-refit.benchmark.transfer.v1", "config": config | {"connections": conns},
                "rows": [r.as_dict() for r in rows], "curve": [r.as_dict() for r in curve], "goal_met": met,
                "resume": shard and shard["resume"]}

    def shard(self) -> dict:
        """One full shard behind the slower cap: its download's ratio, then a download killed at
        ``--kill-at`` of the object and its rerun (bytes fetched against bytes missing)."""
        from storage.objects.store import TransferStats

        a = self.args
        shard = self.make("shard.safetensors", a.shard_mib * MIB)
        size = shard.stat().st_size
        capped, free = self.proxy(a.shard_cap_mb_s, a.latency_ms), self.proxy(0, 0)
        free_s, capped_s = [], []
        for _ in range(a.repeat):
            free_s.append(self.download(self.store(free), [shard.name], True))
            capped_s.append(self.download(self.store(capped), [shard.name], True))
        conns = self.store(capped).settings.concurrency
        row = Row(f"download 1 shard of {a.shard_mib} MiB at {a.shard_cap_mb_s:g} MB/s", size, min(capped_s), conns,
                  a.shard_cap_mb_s, size / min(free_s) / MB)
        _print_row(row)

        self.clear_downloads()
        dest = self.out / shard.name
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.transfer", "--child-download",
                                  f"s3://{BUCKET}/{shard.name}", "--child-dest", str(dest), "--child-endpoint",
                                  capped], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        received = 0
        for line in child.stdout:
            if not line.startswith("landed "):
                continue
            received = int(line.split()[-1])
            if received >= a.kill_at * size:
                os.kill(child.pid, signal.SIGKILL)
                break
        child.wait(timeout=60)
        if child.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the download to be killed ended on its own ({child.returncode})")
        stats = TransferStats()
        store = self.store(capped)
        store.stats = stats
        started = time.perf_counter()
        store.download(f"s3://{BUCKET}/{shard.name}", dest)
        seconds = time.perf_counter() - started
        if not _same_file(shard, dest):
            raise AssertionError("the resumed download is not byte-exact")
        missing = size - received
        ratio = stats.bytes_read / missing
        resume = {"size": size, "killed_at": received / size, "received_bytes": received, "missing_bytes": missing,
                  "fetched_bytes": stats.bytes_read, "ratio": round(ratio, 4), "goal": RESUME_GOAL,
                  "met": ratio <= RESUME_GOAL, "rerun_s": round(seconds, 2)}
        return {"row": row, "resume": resume}


def _child_download(args: argparse.Namespace) -> int:
    """Download one object, printing the bytes landed after each chunk (the parent kills it midway)."""
    from storage.objects.store import ObjectStore
    from storage.settings import ObjectStoreSettings

    _set_env({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_EC2_METADATA_DISABLED": "true"})
    store = ObjectStore(ObjectStoreSettings(endpoint_url=args.child_endpoint, region="us-east-1",
                                            addressing_style="path"))
    landed = 0

    def progress(n: int) -> None:
        nonlocal landed
        landed += n
        print(f"landed {landed}", flush=True)

    store.download(args.child_download, args.child_dest, progress=progress)
    return 0


def _real_server(args: argparse.Namespace, root: Path, result: dict) -> dict:
    """The real-server path after the modelled one, and the two ratios side by side."""
    size = int(args.moto_size_mb * MB)
    measured = real.measure(root, size=size, cap_mb_s=args.shard_cap_mb_s, repeat=args.repeat, splits=True)
    modelled = result["rows"][-1]
    ratio, bound = measured["median_ratio"]["split"], measured["median_server_bound"]["split"]
    print(f"\none large object over {modelled['connections']} connections of {args.shard_cap_mb_s:g} MB/s:\n"
          f"  modelled S3 (answers at once, each response capped), {modelled['bytes'] / MB:.0f} MB: ratio "
          f"{modelled['ratio']:.3f}\n"
          f"  real-server path (moto, each TCP connection capped), {size / MB:.0f} MB: ratio {ratio:.3f} "
          f"(moto's answers one at a time bound any client with {modelled['connections']} requests in flight "
          f"to {bound:.3f})\n"
          f"goal: the real-server path >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'}", flush=True)
    return measured


def _print_row(row: Row) -> None:
    verdict = "met" if row.ratio >= GOAL else "not met"
    print(f"{row.what:<48} {row.bytes / MB:8.0f} MB {row.seconds:7.2f} s {row.mb_s:7.0f} MB/s   "
          f"bound {row.bound_mb_s:5.0f} MB/s (min({row.connections} x {row.cap_mb_s:g}, ceiling "
          f"{row.ceiling_mb_s:.0f}))   ratio {row.ratio:4.2f}  {verdict}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--size-mb", type=float, default=2000, help="the large object, MB")
    add("--revision-mb", type=float, default=2000, help="the revision's objects in all, MB")
    add("--objects", type=int, default=20, help="objects in the revision")
    add("--cap-mb-s", type=float, default=100, help="per-connection bandwidth of the modelled S3, MB/s")
    add("--latency-ms", type=float, default=5, help="delay of every response, ms")
    add("--curve-ranges", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64],
        help="range sizes of the curve, MiB")
    add("--curve-connections", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16],
        help="connection budgets of the curve")
    add("--shard-mib", type=int, default=265, help="the full shard of the resume measurement, MiB (0 skips it)")
    add("--shard-cap-mb-s", type=float, default=12.5, help="per-connection cap of the shard's measurements, MB/s")
    add("--kill-at", type=float, default=0.53, help="share of the shard received when its download is killed")
    add("--repeat", type=int, default=2, help="runs of each transfer; the best counts")
    add("--curve-only", action="store_true", help="measure the download ceiling and the curve only")
    add("--moto-shard", action="store_true", help="measure only the real-server path (one object on moto behind a "
                                                  "per-TCP-connection cap), with and without splits")
    add("--moto-size-mb", type=float, default=265, help="the object of the real-server path, MB")
    add("--no-real-server", action="store_true", help="skip the real-server path after the shard")
    add("--quick", action="store_true", help="a smoke run: objects of at most 200 MB, one run each, "
                                             "a two-point curve")
    add("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    add("--json", type=Path, default=None, help="also write the results here")
    add("--serve", type=Path, default=None, help=argparse.SUPPRESS)  # internal: run the S3 server
    add("--child-download", help=argparse.SUPPRESS)  # internal: the download to be killed
    add("--child-dest", type=Path, help=argparse.SUPPRESS)
    add("--child-endpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.revision_mb = min(args.size_mb, 200), min(args.revision_mb, 200)
        args.shard_mib = min(args.shard_mib, 64)
        args.moto_size_mb = min(args.moto_size_mb, args.shard_mib * MIB / MB)
        args.curve_ranges, args.curve_connections = args.curve_ranges[:1], args.curve_connections[:2]
        args.repeat = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    if args.child_download:
        return _child_download(args)
    root = Path(tempfile.mkdtemp(prefix="transfer-bench-", dir=args.workdir))
    bench = None
    try:
        if args.moto_shard:
            result = real.measure(root, size=int(args.moto_size_mb * MB), cap_mb_s=args.shard_cap_mb_s,
                                  repeat=args.repeat, splits=False)
        else:
            print(f"modelled S3: {args.cap_mb_s:g} MB/s per connection, {args.latency_ms:g} ms per request; "
                  f"MB = 10^6 bytes; {os.cpu_count()} CPUs", flush=True)
            bench = Bench(args, root)
            result = bench.run()
            bench.close()
            bench = None
            if args.shard_mib and not args.curve_only and not args.no_real_server:
                result["real_server"] = _real_server(args, root, result)
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
