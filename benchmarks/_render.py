"""How the refit benchmark shows its result: a plain-text table and a PNG of apply throughput."""

from __future__ import annotations

from pathlib import Path

MB = 1e6


def _stage_lines(run: dict) -> list[str]:
    lines = [f"    {'stage':<16}{'start':>8}{'seconds':>9}{'MB':>9}{'MB/s':>9}{'dirtied MB':>11}{'minflt':>9}"]
    for s in run.get("stages", []):
        c = s.get("counters") or {}
        start = f"{s['span'][0]:.3f}" if s.get("span") else "-"
        lines.append(f"    {s['stage']:<16}{start:>8}{s['seconds']:>9.3f}{s['bytes'] / MB:>9.1f}"
                     f"{s.get('MB/s', 0):>9.1f}{c.get('write_bytes', 0) / MB:>11.1f}{c.get('minor_faults', 0):>9}")
    return lines


def _rates(r: dict) -> list[str]:
    k, d = r.get("kernels"), r.get("decode")
    if not k or not d:
        return []
    return ["", "single-thread rates (GB/s of tensor bytes):",
            f"  memcpy {k['memcpy_gb_s']}  in-place xor {k['xor_gb_s']}  adler32 {k['adler32_gb_s']} "
            f"(stdlib zlib {k['zlib_adler32_gb_s']})  xxh3-128 {k['xxh3-128_gb_s']}  blake3 {k['blake3_gb_s']}",
            f"  zstd decode {d['stream_gb_s']} (streamed in 4 MiB blocks), {d['whole_gb_s']} (whole frames)"]


def _sweep(r: dict) -> list[str]:
    if not r.get("apply_threads"):
        return []
    lines = ["", f"apply throughput (storage.patcher, one delta, checkpoint in {r['config']['memdir_kind']}):",
             f"  {'threads':>7}{'GB/s':>8}{'ideal':>8}{'ratio':>7}"]
    for row in r["apply_threads"]:
        lines.append(f"  {row['threads']:>7}{row['gb_s']:>8.3f}{row['ideal_gb_s'] or 0:>8.3f}{row['ratio'] or 0:>7.2f}")
    if r.get("apply_disk"):
        a = r["apply_disk"]
        lines.append(f"  on the work disk, {a['threads']} thread(s): {a['gb_s']} GB/s (msync + fsync included)")
    return lines


def _refits(r: dict) -> list[str]:
    lines = []
    for key, label in (("cold", "cold refit r0 -> r1 (seed, copy, apply)"), ("single", "refit r1 -> r2"),
                       ("throttled", "refit r1 -> r2 through the rate-limited store (plain stages)")):
        job = r["refits"].get(key)
        if job:
            run = job["runs"][0]
            peak = run.get("peak_memory") or {}
            where = f" (at {peak['at_s']}s, in {', '.join(peak['stages']) or 'no stage'})" if peak else ""
            lines += ["", f"{label}: {run['wall_s']:.3f}s wall, data plane {run['data_plane_s']}s; peak RSS "
                          f"{job['max_rss_bytes'] / MB:.0f} MB, peak anon {job['peak_anon_bytes'] / MB:.0f} MB{where}"]
            lines += _stage_lines(run)
    f = r.get("fetch")
    if f:
        lines += ["", f"fetched for one delta: {f['fetched_bytes'] / MB:.1f} MB = {f['fraction_of_full']:.1%} of "
                      f"a full checkpoint" + (f"; for the catch-up: {f['catchup_fraction_of_full']:.1%}"
                                       if "catchup_fraction_of_full" in f else "")]
    cu = r.get("catch_up")
    if cu:
        lines += ["", f"catch-up of {cu['k']} deltas, apply stage:"]
        for side in ("folded", "sequential"):
            s = cu[side]
            lines.append(f"  {side:<11}{s['apply_s']:.3f}s, {s['checkpoint_write_bytes'] / MB:.0f} MB of checkpoint "
                         f"pages dirtied ({s['write_passes']} passes), {s['apply_stage_minor_faults']} minor / "
                         f"{s['apply_stage_major_faults']} major faults")
        if "decode_sum_single_thread_s" in cu:
            lines.append(f"  decode of the {cu['k']} deltas' frames on one thread: {cu['decode_sum_single_thread_s']}s")
    return lines


def _others(r: dict) -> list[str]:
    lines = []
    b = r.get("baseline")
    if b:
        lines += ["", f"baseline (fetch all, decode whole frames, XOR, hash): {b['wall_s']:.3f}s = fetch "
                      f"{b['fetch_s']:.3f} + apply {b['apply_s']:.3f} + hash {b['hash_s']:.3f}; peak RSS "
                      f"{b['max_rss_bytes'] / MB:.0f} MB, peak anon {b['peak_anon_bytes'] / MB:.0f} MB"]
    ov = r.get("overlap")
    if ov:
        lines += ["", f"rate-limited store ({ov['bandwidth_mb_s']:g} MB/s): fetch alone {ov['fetch_s']:.3f}s, apply "
                      f"{ov['apply_s']:.3f}s"]
        for name, run in ov["runs"].items():
            lines.append(f"  {name}: data plane {run['data_plane_s']:.3f}s (/max {run['over_max']}, /sum "
                         f"{run['over_sum']}), wall {run['wall_s']:.3f}s")
    for mode, pf in (r.get("prefect") or {}).items():
        if pf:
            runs = "; ".join(f"{x['label']}: {x['wall_s']:.2f}s wall, {x['overhead_s']:.2f}s overhead"
                             for x in pf["runs"])
            start = f"; server started in {pf['server_startup_s']}s" if pf.get("server_startup_s") else ""
            lines.append(f"Prefect {mode}: import {pf['import_s']}s{start}; {runs}")
    return lines


def table(r: dict) -> str:
    """The human-readable summary printed at the end of a run."""
    m = r["machine"]
    first = r["revisions"][0] if r.get("revisions") else {}
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gb']} GB RAM; load average {r['load']['start']} "
             f"at start, {r['load']['end']} at end",
             f"model: {r['model']['bytes'] / MB:.0f} MB bf16, {r['model']['tensors']} tensors; each delta: "
             f"{first.get('changed_element_fraction', 0):.0%} of elements changed, compression ratio "
             f"{first.get('compression_ratio')}"]
    lines += _rates(r) + _sweep(r) + _refits(r) + _others(r)
    lines += ["", "targets (measured / bound):"]
    for t in r["targets"]:
        verdict = {True: "met", False: "NOT met", None: "-"}[t["met"]]
        lines.append(f"  [{verdict}] {t['target']}: {t['measured']} {t['unit']} vs {t['bound']} -> ratio {t['ratio']}")
    for e in r.get("errors", []):
        lines.append(f"ERROR in {e['step']}: {e['error'].splitlines()[0]}")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> Path | None:
    """PNG of apply throughput against threads, with the decode ceiling and the 0.9 target."""
    rows = r.get("apply_threads")
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = [row["threads"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(threads, [row["gb_s"] for row in rows], "o-", label=f"apply, checkpoint in {r['config']['memdir_kind']}")
    if all(row["ideal_gb_s"] for row in rows):
        ax.plot(threads, [row["ideal_gb_s"] for row in rows], "k--", label="threads x single-thread zstd decode")
        ax.plot(threads, [0.9 * row["ideal_gb_s"] for row in rows], ":", color="gray", label="target: 0.9 x that")
    if r.get("apply_disk"):
        a = r["apply_disk"]
        ax.plot([a["threads"]], [a["gb_s"]], "s", color="tab:red", label="apply on the work disk (msync + fsync)")
    if r.get("baseline"):
        b = r["baseline"]
        ax.plot([b["workers"]], [b["apply_gb_s"]], "^", color="tab:green", label="baseline: whole-frame decode + XOR")
    ax.set_xlabel("threads")
    ax.set_ylabel("GB/s of tensor bytes")
    ax.set_xticks(threads)
    ax.set_ylim(bottom=0)
    loads = [r["load"]["start"][0], *(v[0] for v in r["load"]["sections"].values())]
    ax.set_title(f"apply throughput, {r['model']['bytes'] / 1e9:.2f} GB bf16 model, {r['machine']['cores']} cores "
                 f"(1-min load {min(loads):g} to {max(loads):g} during the run)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
