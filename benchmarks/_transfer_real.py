"""The transfer benchmark's real-server path: one object on moto's S3 server behind a per-connection cap.

This is the setting of an outside check (a 265 MB object, 8 connections,
12.5 MB/s each): moto, the project's test server (``testbed.s3.MotoServer``),
behind ``testbed.throttle.ConnectionThrottle`` (a TCP relay in a process of its
own capping every TCP connection, not every response), downloaded with the
default settings by a fresh store, timed from the ``download`` call (client
built, HEAD, every range) to the file renamed into place, against
connections x the cap.

moto answers ranged GETs one at a time: each reads the whole object under the
object's lock before it slices out the range, so the answers to the first
wave's requests arrive one after another, whatever the client does. The
measurement prints, beside each run's ratio, the bound that stagger sets for
any client with the same connections in flight: each connection can carry bytes
only from its first answer on, so the download ends no earlier than the mean of
the first answers plus size / (connections x cap). ``splits=False`` also runs
each repetition with ``transfer.SPLIT_MIN`` out of reach (no range split onto a
connection that finished: the behaviour before splits), for a before/after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MB = 10**6
MIB = 2**20
BUCKET = "bench"


class Process:
    """A child process that prints its URL on its first line; stopped by PID."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True,
                                     cwd=Path(__file__).resolve().parents[1])
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.stop()
            raise RuntimeError(f"{args} did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def set_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def same_file(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while block := fa.read(16 * MIB):
            if block != fb.read(len(block)):
                return False
    return True


class _Timeline:
    """Wraps ``_Download._stream`` to record each request's end, the first answer of each range and the count."""

    def __init__(self, transfer):
        self.transfer, self.stream = transfer, transfer._Download._stream
        self.ends: dict[int, float] = {}  # thread -> when its last request of the run ended
        self.answers: dict[tuple[int, int], float] = {}  # (job, range) -> monotonic time of its first answer
        self.requests = 0

    def __enter__(self) -> "_Timeline":
        stream, timeline = self.stream, self

        def timed(job, index):
            try:
                return stream(job, index)
            finally:
                flowing = job._flowing.get(index) if index is not None else None
                if flowing is not None:
                    timeline.answers.setdefault((id(job), index), flowing[0])
                timeline.ends[threading.get_ident()] = time.perf_counter()
                timeline.requests += 1

        self.transfer._Download._stream = timed
        return self

    def __exit__(self, *exc) -> None:
        self.transfer._Download._stream = self.stream

    def clear(self) -> None:
        self.ends.clear()
        self.answers.clear()
        self.requests = 0


def measure(root: Path, *, size: int, cap_mb_s: float, repeat: int, splits: bool) -> dict:
    """Upload ``size`` random bytes to a fresh moto, then download them ``repeat`` times through the cap
    (and, with ``splits``, as many times without range splits); prints one line a run and the summary."""
    import storage.objects.transfer as transfer
    from storage.objects.store import ObjectStore
    from storage.settings import ObjectStoreSettings
    from testbed.s3 import MotoServer

    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
            "AWS_EC2_METADATA_DISABLED")
    saved = {k: os.environ.get(k) for k in keys}
    set_env({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_SESSION_TOKEN": None,
             "AWS_PROFILE": None, "AWS_EC2_METADATA_DISABLED": "true"})
    folder = root / "real-server"
    (folder / "downloads").mkdir(parents=True, exist_ok=True)
    moto = MotoServer(folder / "moto.log", bucket=BUCKET).start()
    relay = None
    try:
        local = folder / "object.bin"
        with open(local, "wb") as fh:
            for start in range(0, size, 64 * MIB):
                fh.write(os.urandom(min(64 * MIB, size - start)))
        settings = {"region": "us-east-1", "addressing_style": "path"}
        url = f"s3://{BUCKET}/object.bin"
        ObjectStore(ObjectStoreSettings(endpoint_url=moto.url, **settings)).put_immutable_file(url, local)
        relay = Process(["-m", "testbed.throttle", moto.url, str(cap_mb_s)])
        conns = ObjectStoreSettings().concurrency
        print(f"\nreal-server path: {size / MB:g} MB on moto's S3 server behind a cap of {cap_mb_s:g} MB/s per TCP "
              f"connection, {conns} connections (bound {conns * cap_mb_s:g} MB/s), a fresh store per run, "
              "default settings", flush=True)

        def once(mode: str, timeline: _Timeline) -> dict:
            dest = folder / "downloads" / "object.bin"
            dest.unlink(missing_ok=True)
            timeline.clear()
            load = os.getloadavg()[0]
            split_min = transfer.SPLIT_MIN
            transfer.SPLIT_MIN = split_min if mode == "split" else 1 << 62
            try:
                started, clock = time.perf_counter(), time.monotonic()
                ObjectStore(ObjectStoreSettings(endpoint_url=relay.url, **settings)).download(url, dest)
                finished = time.perf_counter()
            finally:
                transfer.SPLIT_MIN = split_min
            if not same_file(local, dest):
                raise AssertionError("the download is not byte-exact")
            return _run_row(size, conns, cap_mb_s, finished - started, load, timeline, started, finished, clock)

        modes = ("no split", "split") if not splits else ("split",)
        rows: dict[str, list[dict]] = {mode: [] for mode in modes}
        with _Timeline(transfer) as timeline:
            for run in range(repeat):
                for mode in modes:
                    row = once(mode, timeline)
                    rows[mode].append(row)
                    print(f"run {run + 1} {mode:<9} {row['seconds']:6.2f} s  {size / row['seconds'] / MB:6.1f} MB/s  "
                          f"ratio {row['ratio']:5.3f} (this server's bound {row['server_bound']:5.3f})  "
                          f"{row['requests']:2d} requests, connections idle at the end {row['idle_connection_s']:4.2f} s "
                          f"in all  (load average {row['load']:.1f})", flush=True)
        return _summary(rows, size, conns, cap_mb_s, repeat)
    finally:
        if relay is not None:
            relay.stop()
        moto.stop()
        set_env(saved)


def _run_row(size: int, conns: int, cap_mb_s: float, seconds: float, load: float, timeline: _Timeline,
             started: float, finished: float, clock: float) -> dict:
    """One run: its ratio, the bound of this server's answer times, and the idle tail."""
    line = size / (conns * cap_mb_s * MB)  # seconds at connections x cap
    first = sorted(t - clock for t in timeline.answers.values())[:conns]
    server_bound = line / (sum(first) / len(first) + line) if first else 1.0
    return {"seconds": round(seconds, 3), "ratio": round(line / seconds, 3), "server_bound": round(server_bound, 3),
            "first_answers_s": [round(t, 3) for t in first], "load": round(load, 2), "requests": timeline.requests,
            "idle_connection_s": round(sum(finished - t for t in timeline.ends.values()), 2)}


def _summary(rows: dict[str, list[dict]], size: int, conns: int, cap_mb_s: float, repeat: int) -> dict:
    def median(mode: str, key: str) -> float:
        values = sorted(r[key] for r in rows[mode])
        return values[len(values) // 2]

    result = {"schema": "canonical-refit.benchmark.transfer.real-server.v1",
              "config": {"size": size, "cap_mb_s": cap_mb_s, "connections": conns, "repeat": repeat,
                         "cpus": os.cpu_count(), "server": "moto", "throttle": "per TCP connection"},
              "runs": rows, "median_ratio": {m: median(m, "ratio") for m in rows},
              "best_ratio": {m: max(r["ratio"] for r in rows[m]) for m in rows},
              "median_server_bound": {m: median(m, "server_bound") for m in rows},
              "median_idle_connection_s": {m: median(m, "idle_connection_s") for m in rows}}
    for mode in rows:
        print(f"{mode}: ratio of {conns} x {cap_mb_s:g} MB/s, median (best) of {repeat}: "
              f"{result['median_ratio'][mode]:.3f} ({result['best_ratio'][mode]:.3f}); this server's bound for "
              f"{conns} requests in flight {result['median_server_bound'][mode]:.3f}; connection-seconds idle at "
              f"the end {result['median_idle_connection_s'][mode]:.2f}", flush=True)
    return result
