"""What the refit benchmark concludes: derived figures, the targets, a table and a plot."""

from __future__ import annotations

MB = 1e6
FETCH_STAGES = ("fetch index", "fetch buckets")


def stage(run: dict | None, name: str) -> dict | None:
    """The stage row named ``name`` of one run (``None`` if the run had no such stage)."""
    return next((s for s in (run or {}).get("stages", []) if s.get("stage") == name), None)


def stage_seconds(run: dict | None, *names: str) -> float:
    return sum((stage(run, n) or {}).get("seconds", 0.0) for n in names)


def stage_bytes(run: dict | None, *names: str) -> int:
    return sum((stage(run, n) or {}).get("bytes", 0) for n in names)


def memory(job: dict, largest_bucket: int) -> dict:
    """Peak memory of a refit process against its bound (300 MB plus the largest bucket)."""
    return {"max_rss_bytes": job["max_rss_bytes"], "peak_anon_bytes": job["peak_anon_bytes"],
            "peak_file_bytes": job["peak_file_bytes"], "ru_maxrss_bytes": job["ru_maxrss_bytes"],
            "largest_bucket_bytes": largest_bucket, "bound_bytes": 300_000_000 + largest_bucket,
            "definition": ("max_rss: VmHWM of the refit's own process (includes the file pages of the mmapped "
                           "checkpoint it touched); peak_anon: RssAnon sampled every 20 ms (private memory only); "
                           "ru_maxrss also carries the parent's peak across fork/exec on Linux")}


def fetched(single: dict | None, catchup: dict | None, full_bytes: int) -> dict:
    """Bytes a refit downloaded (indexes and buckets) against the size of a full checkpoint."""
    one = stage_bytes((single or {}).get("runs", [None])[0], *FETCH_STAGES)
    out = {"fetched_bytes": one, "full_checkpoint_bytes": full_bytes, "fraction_of_full": one / full_bytes}
    if catchup:
        many = stage_bytes(catchup["runs"][0], *FETCH_STAGES)
        out.update(catchup_fetched_bytes=many, catchup_fraction_of_full=many / full_bytes)
    return out


def _writes(runs: list[dict]) -> dict:
    out = {"apply_s": round(sum(stage_seconds(r, "apply deltas") for r in runs), 4)}
    for key in ("write_bytes", "minor_faults", "major_faults", "read_bytes"):
        out[f"apply_stage_{key}"] = sum(int(((stage(r, "apply deltas") or {}).get("counters") or {}).get(key, 0))
                                        for r in runs)
    downloaded = sum(stage_bytes(r, *FETCH_STAGES) for r in runs)
    out["run_write_bytes"] = sum(int(r["counters"].get("write_bytes", 0)) for r in runs)
    out["checkpoint_write_bytes"] = max(0, out["run_write_bytes"] - downloaded)
    return out


def catch_up(refits: dict, decode: dict | None, deltas: list[str], workers: int) -> dict:
    """One refit over K deltas (folded) against K one-delta refits: apply time, bytes dirtied, faults."""
    folded, singles = refits["catchup"]["runs"][0], refits["sequential"]["runs"]
    changed = stage_bytes(folded, "apply deltas")
    out = {"k": len(deltas), "workers": workers, "changed_tensor_bytes": changed,
           "folded": _writes([folded]), "sequential": _writes(singles)}
    for side in ("folded", "sequential"):
        w = out[side]["checkpoint_write_bytes"]
        out[side]["write_passes"] = round(w / changed, 2) if changed else None
    if decode:
        decode_sum = sum(decode["revisions"][v]["stream_s"] for v in deltas)
        out.update(decode_sum_single_thread_s=round(decode_sum, 4),
                   decode_sum_per_worker_s=round(decode_sum / workers, 4))
    out["definition"] = (
        "apply_s: 'apply deltas' stage seconds; checkpoint_write_bytes: write_bytes of /proc/self/io over the "
        "whole refit (file pages the process turned dirty, mmap stores included) minus the bytes it downloaded; "
        "write_passes = checkpoint_write_bytes / bytes of the changed tensors; faults from getrusage around the "
        "apply stage; decode sums: single-thread streaming decode of the K deltas' frames")
    return out


def _flow_throttled(r: dict) -> tuple[str, dict] | None:
    for mode in ("server", "ephemeral"):
        job = (r.get("prefect") or {}).get(mode)
        for run in (job or {}).get("runs", []):
            if run.get("label") == "rate-limited":
                return f"Prefect flow ({mode})", run
    return None


def overlap(r: dict, bandwidth_mb_s: float) -> dict | None:
    """A rate-limited refit's data-plane wall against fetching alone and applying alone."""
    fetch_only, single = r.get("fetch_only"), (r["refits"].get("single") or {}).get("runs", [None])[0]
    if not fetch_only or not single:
        return None
    fetch_s = fetch_only["seconds"]
    apply_s = stage_seconds(single, "apply deltas", "verify digest")
    longest, both = max(fetch_s, apply_s), fetch_s + apply_s
    out = {"bandwidth_mb_s": bandwidth_mb_s, "fetch_s": fetch_s, "apply_s": round(apply_s, 4),
           "max_s": round(longest, 4), "sum_s": round(both, 4), "runs": {}}
    candidates = []
    if _flow_throttled(r):
        candidates.append(_flow_throttled(r))
    if r["refits"].get("throttled"):
        candidates.append(("refit runbook without Prefect", r["refits"]["throttled"]["runs"][0]))
    for name, run in candidates:
        out["runs"][name] = {"data_plane_s": run["data_plane_s"], "wall_s": run["wall_s"],
                             "over_max": round(run["data_plane_s"] / longest, 3),
                             "over_sum": round(run["data_plane_s"] / both, 3),
                             "spans": {s["stage"]: s.get("span") for s in run["stages"]}}
    if r.get("baseline_throttled"):
        b = r["baseline_throttled"]
        out["runs"]["baseline"] = {"data_plane_s": b["wall_s"], "wall_s": b["wall_s"],
                                   "over_max": round(b["wall_s"] / longest, 3),
                                   "over_sum": round(b["wall_s"] / both, 3)}
    if candidates:
        out["e2e_source"], run = candidates[0]
        out["e2e_s"] = run["data_plane_s"]
    out["definition"] = (
        "fetch_s: the revision's files downloaded alone through the rate-limited store; apply_s: apply+verify "
        "stages of the unthrottled plain refit; data_plane_s: from the start of the first to the end of the last "
        "of fetch buckets/apply deltas/verify digest (overlapping stages count once); e2e_s: the Prefect flow's "
        "when it ran (the flow is where fetch and apply may overlap), else the plain stages'")
    return out


def _target(name: str, measured, bound, direction: str, unit: str, note: str = "") -> dict:
    if measured is None or not bound:
        return {"target": name, "measured": measured, "bound": bound, "ratio": None, "met": None,
                "direction": direction, "unit": unit, "note": note or "not measured in this run"}
    ratio = measured / bound
    return {"target": name, "measured": round(measured, 4), "bound": round(bound, 4), "ratio": round(ratio, 3),
            "met": ratio >= 1 if direction == ">=" else ratio <= 1, "direction": direction, "unit": unit,
            "note": note}


def sweep_row(r: dict, label: str) -> dict | None:
    """The sweep's row of one share (``"2%"``, ``"dense"``)."""
    return next((row for row in r.get("sweep") or [] if row["share"] == label), None)


def _rl_targets(r: dict) -> list[dict]:
    """The goals of an RL step (2 % of elements changed): bytes, publishing rate, apply against touching the bytes."""
    out = []
    row = sweep_row(r, "2%")
    if not row:
        return out
    pub, apply, ref = row["publish"], row["apply"], row["xor_reference"]
    for label, what in (("auto", "canonical --encoding auto"), ("xor_gaps", "opt-in xor_gaps")):
        p = pub.get(label) or {}
        out.append(_target(f"bytes at 2 % changed: {what} ({p.get('encoding')}, zstd {p.get('level')}) <= 2.0 % of "
                           "the full checkpoint", p.get("fraction_of_full") and 100 * p["fraction_of_full"], 2.0,
                           "<=", "%", f"{p.get('wire_bytes')} bytes of buckets and index; settings default xor: "
                           f"{100 * (pub.get('xor') or {}).get('fraction_of_full', 0):.2f} %"))
    for label in ("auto", "xor_gaps"):
        p = pub.get(label) or {}
        out.append(_target(f"publish at 2 % changed ({label} -> {p.get('encoding')}) >= 1 GB/s of model bytes",
                           p.get("gb_s"), 1.0, ">=", "GB/s", f"stage_delta with {r['config']['publish_workers']} "
                           f"threads: {p.get('seconds')} s wall, {p.get('cpu_s')} s CPU (all runs {p.get('runs_s')})"))
    mem = (r.get("publish_memory") or {}).get("best") or {}
    out.append(_target("publish a 2 % step from memory (kept base in memory) >= 0.5 x in-memory XOR, same threads",
                       mem.get("over_xor"), 0.5, ">=", "x", mem and
                       f"{mem['gb_s']} GB/s of model against the XOR's {mem['xor']['gb_s']} GB/s "
                       f"({mem['xor']['threads']} threads); stages {mem['stages']}"))
    for label in ("auto", "xor", "xor_gaps"):
        a = apply.get(label) or {}
        enc = (pub.get(label) or {}).get("encoding")
        out.append(_target(f"apply at 2 % changed ({label}: {enc}) <= 1.3 x plain in-place XOR over the same bytes",
                           a.get("seconds"), 1.3 * ref["reference_s"], "<=", "s",
                           f"reference {ref['reference_s']} s ({ref['bytes'] / 1e9:.2f} GB); pages written "
                           f"{a.get('pages_written')} of {a.get('pages_of_changed_tensors')}; buckets validated "
                           f"before in {a.get('validate_s')} s"))
    single = ((r.get("refits") or {}).get("single") or {}).get("runs", [None])[0]
    lineage = sweep_row(r, (r.get("revisions") or [{}])[0].get("share_target", ""))
    if single and lineage:
        ref_s = lineage["xor_reference"]["reference_s"]
        st = stage(single, "apply deltas") or {}
        written = ((st.get("counters") or {}).get("write_bytes") or 0) // 4096
        out.append(_target("steady-state refit r1 -> r2, 'apply deltas' stage (validation, takeover, patch) <= 1.3 x "
                           "plain in-place XOR", st.get("seconds"), 1.3 * ref_s, "<=", "s",
                           f"reference {ref_s} s from the sweep's {lineage['share']} step; {written} pages dirtied "
                           f"in the stage"))
        out.append({"target": "time to READY (reported; the checkpoint's write-back runs after it, in the background)",
                    "measured": single.get("ready_s"), "bound": None, "ratio": None, "met": None, "direction": "",
                    "unit": "s", "note": f"on disk {single.get('flushed_s')} s after the start "
                                         f"({single.get('flush_wait_s')} s waited after the refit returned)"})
    return out


def targets(r: dict) -> list[dict]:
    """Each target as measured / bound (a >= target is met at ratio >= 1, a <= target at <= 1)."""
    out = _rl_targets(r)
    sweep = r.get("apply_threads") or []
    top = max(sweep, key=lambda row: row["threads"]) if sweep else None
    threads_decode = ((r.get("decode_dense") or {}).get("threads") or {}).get("gb_s")
    for row in sweep:
        out.append(_target(f"dense step: apply >= 0.9 x threads x single-thread decode ({row['threads']} thread(s))",
                           row["gb_s"], row["ideal_gb_s"] and 0.9 * row["ideal_gb_s"], ">=", "GB/s",
                           f"ideal {row['ideal_gb_s']} GB/s; checkpoint in {r['config']['memdir_kind']}"
                           + (f"; {top['threads']} threads decoding alone reach {threads_decode} GB/s"
                              if row is top and threads_decode else "")))
    ov = r.get("overlap") or {}
    out.append(_target("overlap: e2e <= 1.15 x max(fetch, apply)", ov.get("e2e_s"),
                       ov.get("max_s") and 1.15 * ov["max_s"], "<=", "s",
                       ov.get("e2e_s") and f"{ov['e2e_source']}; fetch {ov['fetch_s']}s, apply {ov['apply_s']}s, "
                       f"fetch+apply {ov['sum_s']}s"))
    cu = r.get("catch_up") or {}
    lineage = sweep_row(r, (r.get("revisions") or [{}])[0].get("share_target", ""))
    touch = lineage and lineage["xor_reference"]["reference_s"]
    decode_bound = cu.get("decode_sum_per_worker_s")
    bound = decode_bound and max(decode_bound, touch or 0)
    out.append(_target(f"catch-up K={cu.get('k')}: apply <= 1.1 x max(decode of the K frames / "
                       f"{cu.get('workers')} workers, one in-place XOR pass)",
                       (cu.get("folded") or {}).get("apply_s"), bound and 1.1 * bound, "<=", "s",
                       cu.get("decode_sum_single_thread_s") and
                       f"single-thread decode of the K deltas' frames: {cu['decode_sum_single_thread_s']}s; "
                       f"in-place XOR over the model: {touch}s; K one-delta refits: "
                       f"{(cu.get('sequential') or {}).get('apply_s')}s"))
    out.append(_target("catch-up: one write pass over the changed tensors (<= 1.1 passes)",
                       (cu.get("folded") or {}).get("write_passes"), 1.1, "<=", "passes", cu and
                       f"{cu['k']} one-delta refits: {cu['sequential']['write_passes']} passes; the 0.1 allows for "
                       "page rounding and the store's own state files"))
    mem = r.get("memory") or {}
    bound = mem.get("bound_bytes", 0) / MB
    out.append(_target("peak RSS <= 300 MB + largest bucket (VmHWM of the refit process)",
                       mem.get("max_rss_bytes") and mem["max_rss_bytes"] / MB, bound, "<=", "MB",
                       "includes the mmapped checkpoint's file pages the process touched"))
    out.append(_target("peak anonymous memory <= 300 MB + largest bucket", mem.get("peak_anon_bytes") and
                       mem["peak_anon_bytes"] / MB, bound, "<=", "MB", "RssAnon sampled every 20 ms"))
    server = (r.get("prefect") or {}).get("server")
    out.append(_target("Prefect overhead per refit against a running server <= 1.5 s",
                       server and server["runs"][0]["overhead_s"], 1.5, "<=", "s",
                       server and f"first flow of a fresh process; next flow {server['runs'][1]['overhead_s']}s"))
    eph = (r.get("prefect") or {}).get("ephemeral")
    if eph:
        out.append({"target": "Prefect overhead, ephemeral API (reported, no bound)",
                    "measured": eph["runs"][0]["overhead_s"], "bound": None, "ratio": None, "met": None,
                    "direction": "", "unit": "s",
                    "note": f"first flow starts a temporary server on a fresh database; next flow "
                            f"{eph['runs'][1]['overhead_s']}s"})
    return out
