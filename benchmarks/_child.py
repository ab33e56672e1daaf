"""One measured job in a fresh process: ``python -m benchmarks._child JOB.json OUT.json``.

Modes:
- ``plain``: the refit runbook without Prefect (``flows.refit.run_refit``, the
  flow's own body; its stages run as plain functions outside a flow run);
- ``flow``: the Prefect flow ``flows.refit.refit`` (ephemeral API, or the
  server named by ``PREFECT_API_URL`` in the child's environment);
- ``baseline``: ``benchmarks._baseline`` on a copy of the base checkpoint.

Both refit modes run the code as it is: the benchmark only swaps in a
``Receiver`` subclass whose ``stage()`` also records each stage's start and
end and the process counters around it. After each refit it waits for the
background write-back of the new checkpoint (``storage.store.flush``), timed on its
own: ``ready_s`` is when the target became READY (the end of "verify
digest"), ``flushed_s`` when its pages were on disk. Stages may overlap (fetch and
apply), so a run's stage work is the union of the stage spans, and a flow's
overhead is its wall time minus that. Each run may first restore the
receiver cache from a pristine snapshot. A fresh process per job makes its
peak resident set (``VmHWM``) the job's own.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks._meter import RssSampler, counters, delta, max_rss_bytes, ru_maxrss_bytes, union_s
from benchmarks._scratch import clone_store, copy_checkpoint
from testbed import throttle

ROOT = Path(__file__).resolve().parents[1]
DATA_STAGES = ("fetch buckets", "apply deltas", "verify digest")


def install_metered_receiver():
    """Make every ``Receiver`` the refit code builds a ``MeteredReceiver``; returns the class."""
    import tasks.receiver

    base = tasks.receiver.Receiver

    class MeteredReceiver(base):
        """A receiver whose stages also record their span and process counters (faults, I/O, CPU)."""

        last = None
        origin = 0.0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.meters: dict[str, dict] = {}
            self.spans: dict[str, list[float]] = {}
            MeteredReceiver.last = self

        @contextmanager
        def stage(self, name):
            before = counters()
            try:
                with super().stage(name) as record:
                    yield record
            finally:
                after = counters()
                self.meters[name] = delta(after, before)
                self.spans[name] = [round(before["wall"] - self.origin, 4), round(after["wall"] - self.origin, 4)]

    tasks.receiver.Receiver = MeteredReceiver
    if "flows.refit" in sys.modules:
        sys.modules["flows.refit"].Receiver = MeteredReceiver  # the flow's module-level name
    return MeteredReceiver


def _expected_digest(params, version: str) -> str:
    from storage.catalog.records import Catalog
    from storage.objects.store import ObjectStore

    return Catalog(ObjectStore(params.storage), params.catalog, params.model).read(version).target_digest


def _stages(rx) -> list[dict]:
    out = []
    for record in rx.ledger.stages.values():
        row = record.row()
        row["span"] = rx.spans.get(record.name)
        row["counters"] = rx.meters.get(record.name, {})
        out.append(row)
    return out


def _peak(sampler, rx, origin: float, stop: float) -> dict | None:
    """Where in the run the anonymous memory peaked: time from the run's start and the stage running then."""
    peak = sampler.peak_between(origin, stop)
    if peak is None:
        return None
    at = peak.pop("at") - origin
    names = [n for n, (b, e) in rx.spans.items() if b <= at <= e]
    return peak | {"at_s": round(at, 3), "stages": names}


def _data_plane_s(stages: list[dict]) -> float | None:
    """Wall time from the first data stage's start to the last one's end (overlapping stages count once)."""
    spans = [s["span"] for s in stages if s["stage"] in DATA_STAGES and s.get("span")]
    return round(max(e for _, e in spans) - min(b for b, _ in spans), 4) if spans else None


def _refit_run(mode: str, params, target: str, metered, sampler) -> dict:
    from flows.refit import refit, run_refit
    from flows.report import result_of, watching

    from storage.store.flush import wait_for_flushes

    metered.origin = time.perf_counter()
    before = counters()
    if mode == "flow":
        with watching() as watch:
            result = result_of(refit(params, return_state=True), watch)
    else:
        result = run_refit(params)
    if result.status != "READY" or result.version != target:
        raise SystemExit(f"{mode} refit to {target} ended {result.status}: {result.error}")
    totals = delta(counters(), before)
    # durability is off the critical path: the checkpoint's pages are written back after READY, in the background
    waited = time.perf_counter()
    wait_for_flushes()
    flush_wait_s = time.perf_counter() - waited
    flush_counters = delta(counters(), before)
    rx = metered.last
    active = rx.store.active()
    if active is None or active.version != target or active.digest != _expected_digest(params, target):
        raise SystemExit(f"refit to {target} did not install it: {active}")
    stages = _stages(rx)
    # stages may overlap (fetch and apply): the work is the time some stage was running, counted once
    work = union_s([s["span"] for s in stages if s.get("span")])
    ready = (rx.spans.get("verify digest") or [None, None])[1]
    out = {"target": target, "catalog": params.catalog, "status": "READY", "version": active.version,
           "digest": active.digest, "wall_s": totals["wall_s"], "stage_work_s": round(work, 4),
           "ready_s": ready, "flush_wait_s": round(flush_wait_s, 4),
           "flushed_s": round(totals["wall_s"] + flush_wait_s, 4),
           "flush_write_bytes": int(flush_counters.get("write_bytes", 0) - totals.get("write_bytes", 0)),
           "stage_seconds_sum": round(sum(s["seconds"] for s in stages), 4),
           "data_plane_s": _data_plane_s(stages), "stages": stages, "lineage": list(rx.ledger.lineage),
           "peak_memory": _peak(sampler, rx, metered.origin, metered.origin + totals["wall_s"]),
           "counters": totals}
    if mode == "flow":
        out["overhead_s"] = round(totals["wall_s"] - work, 4)
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    mode = spec["mode"]
    throttle.configure(spec.get("throttle_bytes_per_s") or 0)
    t0 = time.perf_counter()
    metered = None
    if mode in ("flow", "plain"):
        import flows.refit  # noqa: F401  (every stage and Prefect, imported before anything is timed)

        metered = install_metered_receiver()
    else:
        import benchmarks._baseline  # noqa: F401
    import_s = time.perf_counter() - t0
    from storage.settings import RefitParams

    runs, total = [], counters()
    with RssSampler() as sampler:
        for run in spec["runs"]:
            restore_s = 0.0
            if run.get("restore"):
                r0 = time.perf_counter()
                clone_store(Path(spec["pristine"]), Path(spec["cache"]))
                restore_s = time.perf_counter() - r0
            if mode == "baseline":
                from benchmarks._baseline import run_baseline

                work = Path(spec["work"])
                copy_checkpoint(Path(spec["base_checkpoint"]), work)
                out = run_baseline(run.get("catalog") or spec["catalog"], spec["model"], run["target"], work,
                                   Path(spec["download"]), workers=spec["workers"], concurrency=spec["concurrency"])
            else:
                overrides = {"target": run["target"]} | ({"catalog": run["catalog"]} if run.get("catalog") else {})
                out = _refit_run(mode, RefitParams(**(spec["params"] | overrides)), run["target"], metered,
                                 sampler)
            out["restore_s"] = round(restore_s, 3)
            out["label"] = run.get("label", run["target"])
            runs.append(out)
    result = {"mode": mode, "import_s": round(import_s, 3), "runs": runs,
              "max_rss_bytes": max_rss_bytes(), "ru_maxrss_bytes": ru_maxrss_bytes(), **sampler.result(),
              "counters": delta(counters(), total), "throttled_bytes": throttle.LINK.bytes}
    Path(argv[1]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
