"""Process counters for the benchmark: CPU time, page faults, I/O bytes and resident memory.

``counters()`` reads ``getrusage(RUSAGE_SELF)`` and ``/proc/self/io`` (Linux).
``write_bytes`` there is charged to the process when it *dirties* a page of a
file (``write()`` or a store through a shared mmap), once per clean-to-dirty
transition, so it counts the checkpoint bytes a pass rewrites even before the
kernel writes them back. ``RssSampler`` polls ``/proc/self/status`` from a
thread: ``VmRSS`` includes the file pages of mmaps the process touched (page
cache the kernel can drop), ``RssAnon`` only private memory (heap, buffers).
A process's own peak is ``VmHWM``; ``ru_maxrss`` also carries its parent's.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from contextlib import contextmanager
from pathlib import Path

_IO_KEYS = ("rchar", "wchar", "read_bytes", "write_bytes", "cancelled_write_bytes")


def _proc_io() -> dict[str, int]:
    try:
        with open("/proc/self/io") as fh:
            pairs = (line.split(":", 1) for line in fh)
            values = {k.strip(): int(v) for k, v in pairs}
    except OSError:
        return {}
    return {k: values[k] for k in _IO_KEYS if k in values}


def counters() -> dict[str, float]:
    """CPU seconds, faults, context switches and I/O bytes of this process so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "cpu_user_s": ru.ru_utime,
        "cpu_sys_s": ru.ru_stime,
        "minor_faults": ru.ru_minflt,
        "major_faults": ru.ru_majflt,
        "voluntary_switches": ru.ru_nvcsw,
        "involuntary_switches": ru.ru_nivcsw,
    }
    out.update(_proc_io())
    out["wall"] = time.perf_counter()
    return out


def delta(after: dict, before: dict) -> dict:
    """``after - before`` for every counter, with ``wall`` renamed ``wall_s``."""
    out = {k: after[k] - before.get(k, 0) for k in after}
    out["wall_s"] = out.pop("wall")
    for k in ("cpu_user_s", "cpu_sys_s", "wall_s"):
        out[k] = round(out[k], 4)
    return out


@contextmanager
def measured():
    """``with measured() as m: ...`` then ``m`` holds the counter deltas of the block."""
    result: dict = {}
    before = counters()
    try:
        yield result
    finally:
        result.update(delta(counters(), before))


def max_rss_bytes() -> int:
    """Peak resident set of this process's own memory map (``VmHWM``).

    ``ru_maxrss`` is not used for this: Linux folds the parent's high-water
    mark into it across fork/exec, so a child of a large parent reports the
    parent's peak (see ``ru_maxrss_bytes``).
    """
    return _status_kib(("VmHWM",)).get("VmHWM", 0)


def ru_maxrss_bytes() -> int:
    """``getrusage().ru_maxrss`` in bytes (includes the peak inherited from the parent at exec)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_kib(keys=("VmRSS", "RssAnon", "RssFile")) -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


class RssSampler:
    """Peaks of ``VmRSS``, ``RssAnon`` and ``RssFile`` polled every ``interval_s`` from a thread.

    ``samples`` keeps ``(perf_counter, VmRSS, RssAnon, RssFile)`` of every poll,
    so a peak can be placed in the stage that was running.
    """

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peaks = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.samples: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        now = _status_kib()
        for key, value in now.items():
            if value > self.peaks[key]:
                self.peaks[key] = value
        self.samples.append((time.perf_counter(), now.get("VmRSS", 0), now.get("RssAnon", 0), now.get("RssFile", 0)))

    def peak_between(self, start: float, end: float) -> dict | None:
        """The sample with the most anonymous memory in ``[start, end]`` (perf_counter times)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return None
        t, rss, anon, file = max(inside, key=lambda s: s[2])
        return {"at": t, "rss_bytes": rss, "anon_bytes": anon, "file_bytes": file,
                "max_rss_bytes": max(s[1] for s in inside)}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "RssSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()

    def result(self) -> dict[str, int]:
        return {"peak_rss_bytes": self.peaks["VmRSS"], "peak_anon_bytes": self.peaks["RssAnon"],
                "peak_file_bytes": self.peaks["RssFile"]}


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages (what ``uptime`` prints)."""
    return [round(x, 2) for x in os.getloadavg()]


def union_s(spans) -> float:
    """Length of the union of ``[start, end]`` intervals (time any of them was running)."""
    total, end = 0.0, float("-inf")
    for b, e in sorted(spans):
        if e > end:
            total += e - max(b, end)
            end = e
    return total


def _rss_anon() -> int:
    return _status_kib(("RssAnon",)).get("RssAnon", 0)


class RefitWatch:
    """While a refit runs: each stage's process CPU seconds (``Receiver.stage`` timed from outside), the cyclic
    collector's runs, the peak ``RssAnon`` (sampled every 5 ms), and the files mapped (``/proc/self/smaps``
    every 100 ms: the most bytes of files under ``root`` mapped at once, the largest mapping, their resident
    and anonymous pages, and any private writable mapping, whose written pages would count as anonymous)."""

    def __init__(self, root: Path):
        self.root = str(root.resolve())
        self.cpu: dict[str, float] = {}
        self.collections = [0, 0, 0]
        self.anon_before = self.anon_peak = _rss_anon()
        self._pattern = None
        self._sizes: dict[str, int] = {}
        self._private: set[str] = set()
        self.maps = {"mapped_bytes_peak": 0, "largest_mapping_bytes": 0, "resident_bytes_peak": 0,
                     "anonymous_bytes_peak": 0, "private_writable": 0, "largest_file_bytes": 0}

    def __enter__(self) -> "RefitWatch":
        import gc
        import threading
        from contextlib import contextmanager

        import tasks.receiver as receiver

        self._stage = original = receiver.Receiver.stage
        cpu = self.cpu

        @contextmanager
        def timed(rx, name):
            begun = time.process_time()
            try:
                with original(rx, name) as record:
                    yield record
            finally:
                cpu[name] = cpu.get(name, 0.0) + time.process_time() - begun

        receiver.Receiver.stage = timed
        gc.callbacks.append(self._collected)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import gc

        import tasks.receiver as receiver

        receiver.Receiver.stage = self._stage
        gc.callbacks.remove(self._collected)
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _rss_anon())

    def _collected(self, phase: str, info: dict) -> None:
        if phase == "stop":
            self.collections[info["generation"]] += 1

    def _sample(self) -> None:
        ticks = 0
        while not self._stop.wait(0.005):
            self.anon_peak = max(self.anon_peak, _rss_anon())
            ticks += 1
            if ticks % 20 == 0:
                self._mappings()

    def _mappings(self) -> None:
        import re

        m = self.maps
        try:
            with open("/proc/self/smaps") as fh:
                text = fh.read()
        except OSError:
            return
        if self._pattern is None:
            self._pattern = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+ +(" + re.escape(self.root)
                                       + r"\S*)\n((?:[A-Za-z_]+:.*\n)*)", re.M)
        total = resident = anonymous = 0
        for found in self._pattern.finditer(text):  # the mappings of files under ``root`` only
            lo, hi, perms, path, fields = found.groups()
            size = int(hi, 16) - int(lo, 16)
            total += size
            m["largest_mapping_bytes"] = max(m["largest_mapping_bytes"], size)
            if perms.startswith("rw") and perms.endswith("p"):
                self._private.add(path)
                m["private_writable"] = len(self._private)  # files mapped private and writable
            if path not in self._sizes:
                try:
                    self._sizes[path] = os.path.getsize(path)
                except OSError:
                    self._sizes[path] = 0
                m["largest_file_bytes"] = max(m["largest_file_bytes"], self._sizes[path])
            rss = re.search(r"^Rss: +(\d+) kB", fields, re.M)
            anon = re.search(r"^Anonymous: +(\d+) kB", fields, re.M)
            resident += int(rss.group(1)) * 1024 if rss else 0
            anonymous += int(anon.group(1)) * 1024 if anon else 0
        m["mapped_bytes_peak"] = max(m["mapped_bytes_peak"], total)
        m["resident_bytes_peak"] = max(m["resident_bytes_peak"], resident)
        m["anonymous_bytes_peak"] = max(m["anonymous_bytes_peak"], anonymous)

    def result(self) -> dict:
        return {"anon_before_bytes": self.anon_before, "anon_peak_bytes": self.anon_peak,
                "stage_cpu_s": {k: round(v, 4) for k, v in self.cpu.items()},
                "gc_collections": self.collections, "mappings": self.maps}
