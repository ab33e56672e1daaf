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
    lines = ["", "single-thread rates (GB/s of tensor bytes):",
             f"  memcpy {k['memcpy_gb_s']}  in-place xor {k['xor_gb_s']} (anonymous memory)  adler32 "
             f"{k['adler32_gb_s']} (stdlib zlib {k['zlib_adler32_gb_s']})  xxh3-128 {k['xxh3-128_gb_s']}  blake3 "
             f"{k['blake3_gb_s']}",
             f"  zstd decode of the lineage's r2 ({r['revisions'][0].get('encoding') if r.get('revisions') else '?'}):"
             f" {d['stream_gb_s']} streamed, {d['whole_gb_s']} whole frames"]
    dd = r.get("decode_dense")
    if dd:
        lines.append(f"  zstd decode of the dense step: {dd['stream_gb_s']} streamed, {dd['whole_gb_s']} whole frames; "
                     f"{dd['threads']['threads']} threads at once: {dd['threads']['gb_s']}")
    return lines


def _lineage(r: dict) -> list[str]:
    revs = r.get("revisions") or []
    if not revs:
        return []
    lines = ["", "published lineage (run_publish, --base-checkpoint):",
             f"  {'version':<8}{'changed':>9}{'encoding':>12}{'encoded MB':>12}{'of model':>10}{'publish s':>11}"]
    for v in revs:
        lines.append(f"  {v['version']:<8}{v['changed_element_fraction']:>9.2%}{v.get('encoding') or '-':>12}"
                     f"{v['encoded_bytes'] / MB:>12.2f}{v.get('encoded_fraction_of_model', 0):>10.2%}"
                     f"{v['publish_s']:>11.2f}")
    return lines


def sweep_table(r: dict) -> list[str]:
    """One line per sweep step: bytes on the wire, publishing rate and apply time per publisher setting."""
    rows = r.get("sweep") or []
    if not rows:
        return []
    labels = ("auto", "xor", "xor_gaps")
    lines = ["", "RL sweep (one training step each; wire = buckets + index over the full checkpoint's files; "
                 "apply = in place on the work disk, over a plain in-place XOR of the same bytes):",
             f"  {'step':<7}{'changed':>8}  " + "  ".join(f"{lab + ': encoding':>22}{'wire':>7}{'GB/s':>6}{'apply':>7}"
                                                          for lab in labels) + f"{'XOR s':>8}{'pages':>9}"]
    for row in rows:
        cells = []
        for lab in labels:
            p, a = row["publish"].get(lab) or {}, row["apply"].get(lab) or {}
            cells.append(f"{(p.get('encoding') or '-') + ' z' + str(p.get('level')):>22}"
                         f"{100 * p.get('fraction_of_full', 0):>6.2f}%{p.get('gb_s', 0):>6.2f}"
                         f"{a.get('over_reference', 0):>6.2f}x")
        a = row["apply"].get("auto") or {}
        pages = f"{a.get('pages_written')}/{a.get('pages_of_changed_tensors')}"
        lines.append(f"  {row['share']:<7}{row['changed_element_share']:>8.2%}  " + "  ".join(cells)
                     + f"{row['xor_reference']['reference_s']:>8.3f}{pages:>9}")
    return lines


def _sweep(r: dict) -> list[str]:
    if not r.get("apply_threads"):
        return []
    lines = ["", f"apply throughput of the dense step (storage.patch.patcher, checkpoint in {r['config']['memdir_kind']}):",
             f"  {'threads':>7}{'GB/s':>8}{'ideal':>8}{'ratio':>7}"]
    for row in r["apply_threads"]:
        lines.append(f"  {row['threads']:>7}{row['gb_s']:>8.3f}{row['ideal_gb_s'] or 0:>8.3f}{row['ratio'] or 0:>7.2f}")
    if r.get("apply_disk"):
        a = r["apply_disk"]
        lines.append(f"  on the work disk, {a['threads']} thread(s): {a['gb_s']} GB/s (no flush: write-back comes "
                     "after READY)")
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
            lines += ["", f"{label}: {run['wall_s']:.3f}s wall, data plane {run['data_plane_s']}s, READY at "
                          f"{run.get('ready_s')}s, on disk at {run.get('flushed_s')}s (background write-back); peak "
                          f"RSS {job['max_rss_bytes'] / MB:.0f} MB, peak anon {job['peak_anon_bytes'] / MB:.0f} MB"
                          f"{where}"]
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
             f"model: {r['model']['bytes'] / MB:.0f} MB bf16, {r['model']['tensors']} tensors; each delta of the "
             f"lineage: {first.get('changed_element_fraction', 0):.2%} of elements changed, {first.get('encoding')}, "
             f"{first.get('encoded_fraction_of_model', 0):.2%} of the model"]
    lines += _lineage(r) + sweep_table(r) + _rates(r) + _sweep(r) + _refits(r) + _others(r)
    lines += ["", "targets (measured / bound):"]
    for t in r["targets"]:
        verdict = {True: "met", False: "NOT met", None: "-"}[t["met"]]
        lines.append(f"  [{verdict}] {t['target']}: {t['measured']} {t['unit']} vs {t['bound']} -> ratio {t['ratio']}"
                     + (f"  ({t['note']})" if t.get("note") else ""))
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
