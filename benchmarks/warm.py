"""Warm-path benchmark: one idle node agent, a 2 MB delta published from a warm trainer process, publish -> Ready.

    python -m benchmarks.warm                            # starts its own Prefect server on PostgreSQL
    python -m benchmarks.warm --api-url http://127.0.0.1:4200/api   # against a running server
    python -m benchmarks.warm --quick

One node agent (``python -m deployments.serve``, run through
``testbed.nodes agent``, which only records each stage's start and
end), moto S3 behind a logging proxy, and a trainer in this process that
publishes with ``flows.publish.run_publish`` (so the trainer's own start-up
is not counted; its event goes to the server). For each publication:

- publish -> Ready: from the trainer's call to the refit run's Ready state;
- Prefect's overhead per refit: the run's wall time (Running -> Ready) minus
  its stage work, the union of the stage spans (fetch and apply overlap);
- the steps in between: publish, event -> run created (the automation),
  -> claimed (the agent's poll), -> Running (the flow engine's start).

Then, with the agent idle: its RSS and its API requests per minute. Goals:
publish -> Ready <= 2.0 s and overhead <= 0.5 s (p50 over the publications;
the max is printed too). Writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks._bench import bench_main
from benchmarks._meter import union_s
from testbed.fleet import FleetLab, percentile
from testbed.processes import load_average, machine

SCHEMA = "canonical-refit.benchmark.warm.v1"
GOALS = {"publish_to_ready_s": 2.0, "overhead_s": 0.5}


def log(message: str) -> None:
    print(f"[warm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.warm", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--api-url", help="a running Prefect server (PostgreSQL); default: start one on a fresh "
                                     "PostgreSQL database at 127.0.0.1:5432, dropped after")
    p.add_argument("--publications", type=int, default=6, help="measured delta publications")
    p.add_argument("--poll-seconds", type=float, default=None, help="the agent's poll interval (default: serve's)")
    p.add_argument("--idle-seconds", type=float, default=60.0, help="idle measurement (API requests, RSS)")
    p.add_argument("--gap-seconds", type=float, default=3.0, help="idle time between publications")
    p.add_argument("--quick", action="store_true", help="3 publications, 20 s idle")
    p.add_argument("--json", type=Path, help="where to write the result (default benchmarks/results/warm-*.json)")
    p.add_argument("--keep", action="store_true", help="keep the working folder")
    args = p.parse_args(argv)
    if args.quick:
        args.publications, args.idle_seconds = 3, 20.0
    return args


def spans_of(path: Path, flow_run: str) -> list[dict]:
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []
    return [s for line in lines if line.get("flow_run") == flow_run for s in line.get("spans", [])]


def extras_of(path: Path, flow_run: str) -> dict[str, float]:
    """Seconds of the run's steps outside its stages (the node record, the artifacts), by name."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return {}
    return {line["extra"]: round(line["end"] - line["start"], 3) for line in lines
            if line.get("flow_run") == flow_run and "extra" in line}


def run(args: argparse.Namespace, root: Path) -> dict:
    from flows.synthetic import ModelShape

    shape, share = ModelShape(vocab=8192, hidden=512, intermediate=1376, layers=4, shards=2), 0.045
    spans_path = root / "spans.jsonl"
    result: dict = {"schema": SCHEMA, "machine": machine(), "model_bytes": shape.nbytes, "goals": GOALS,
                    "load_average_start": load_average(), "api": "external" if args.api_url else "started"}
    with FleetLab(root, poll_s=args.poll_seconds, shape=shape, share=share, api_url=args.api_url,
                  spans=spans_path, log=log) as lab:
        lab.add_node("warm1")
        result["agent_ready_s"] = round(lab.start(["warm1"]), 1)
        log("launch revision and a first delta (not measured: the first delta copies the launch snapshot once)")
        lab.wave("initial")
        lab.wave("delta")
        rows = []
        with lab.client() as client:
            for i in range(args.publications):
                time.sleep(args.gap_seconds)  # the node is idle when the trainer publishes
                wave = lab.wave("delta")
                node = wave["nodes"]["warm1"]
                run_id = next(r for r in _runs(client, lab) if r.parameters["params"]["target"] == wave["version"])
                stages = spans_of(spans_path, str(run_id.id))
                work = union_s([(s["start"], s["end"]) for s in stages])
                row = {"version": wave["version"], "payload_bytes": wave["payload_bytes"],
                       "publish_to_ready_s": node["ready_after_publish_start_s"], "publish_s": wave["publish_s"],
                       "event_after_publish_start_s": wave["event_after_publish_start_s"],
                       "event_to_created_s": node["created_after_event_s"],
                       "event_to_claimed_s": node["claimed_after_event_s"],
                       "event_to_run_start_s": node["run_start_after_event_s"],
                       "run_wall_s": node["run_wall_s"], "stage_work_s": round(work, 3),
                       "overhead_s": round(node["run_wall_s"] - work, 3) if stages else None,
                       "before_first_stage_s": round(min(x["start"] for x in stages) - node["run_start_at"], 3)
                       if stages else None,
                       "after_last_stage_s": round(node["ready_at"] - max(x["end"] for x in stages), 3)
                       if stages else None,
                       "stages": {s["stage"]: round(s["end"] - s["start"], 3) for s in stages},
                       "outside_stages": extras_of(spans_path, str(run_id.id)),
                       "api_requests": node["api_requests"], "api_events_sent": node["api_events_sent"],
                       "s3": node["s3"], "load_average": wave["load_average"]}
                rows.append(row)
                log(f"{row['version']}: {row['payload_bytes'] / 1e6:.2f} MB, publish -> Ready "
                    f"{row['publish_to_ready_s']:.2f}s, overhead {row['overhead_s']}s, load {row['load_average'][0]}")
        log(f"idle agent, {args.idle_seconds:.0f}s")
        idle = lab.idle(args.idle_seconds)
    result["publications"] = rows
    result["idle"] = {"requests_per_min": idle["per_node"]["warm1"]["requests_per_min"],
                      "requests": idle["per_node"]["warm1"]["requests"], "rss_mb": idle["per_node"]["warm1"]["rss_mb"],
                      "agent_cpu_pct": idle["per_node"]["warm1"]["agent_cpu_pct"],
                      "server_cpu_pct": idle["server_cpu_pct"], "seconds": idle["seconds"]}
    summary = {}
    for key in ("publish_to_ready_s", "overhead_s", "publish_s", "event_to_created_s", "event_to_claimed_s",
                "event_to_run_start_s", "run_wall_s", "stage_work_s", "before_first_stage_s", "after_last_stage_s",
                "api_requests", "api_events_sent"):
        values = [r[key] for r in rows if r[key] is not None]
        summary[key] = {"p50": round(percentile(values, .5), 3), "max": round(max(values), 3)} if values else None
    extras = sorted({k for r in rows for k in r["outside_stages"]})
    summary["outside_stages_s"] = {k: round(percentile([r["outside_stages"][k] for r in rows
                                                        if k in r["outside_stages"]], .5), 3) for k in extras}
    summary["goals"] = {key: {"goal": goal, "p50": summary[key]["p50"], "max": summary[key]["max"],
                              "met": summary[key]["p50"] <= goal} for key, goal in GOALS.items() if summary[key]}
    result["summary"] = summary
    result["load_average_end"] = load_average()
    return result


def _runs(client, lab: FleetLab) -> list:
    from testbed.prefect_server import runs_of

    return runs_of(client, [lab.ids["warm1"]["on_publish"]])


def table(r: dict) -> str:
    s = r["summary"]
    sizes = ", ".join(f"{row['payload_bytes'] / 1e6:.2f}" for row in r["publications"])
    lines = [f"warm path: one idle node, {r['model_bytes'] / 1e6:.0f} MB model, deltas of {sizes} MB; load average "
             f"{r['load_average_start']} -> {r['load_average_end']}"]
    for key, goal in s["goals"].items():
        lines.append(f"{key:<28} p50 {goal['p50']:.2f} s  max {goal['max']:.2f} s   goal <= {goal['goal']} s: "
                     f"{'met' if goal['met'] else 'NOT met'}")
    for key, label in (("publish_s", "publish (trainer call)"), ("event_to_created_s", "event -> run created"),
                       ("event_to_claimed_s", "event -> claimed"), ("event_to_run_start_s", "event -> run start"),
                       ("run_wall_s", "run wall (Running -> Ready)"), ("stage_work_s", "stage work (union)"),
                       ("before_first_stage_s", "Running -> first stage"),
                       ("after_last_stage_s", "last stage -> Ready")):
        lines.append(f"{label:<28} p50 {s[key]['p50']:.2f} s  max {s[key]['max']:.2f} s")
    lines.append(f"{'outside the stages (p50)':<28} " + ", ".join(
        f"{k} {v:.2f} s" for k, v in s["outside_stages_s"].items()))
    lines.append(f"{'API per refit':<28} {s['api_requests']['p50']:.0f} requests + {s['api_events_sent']['p50']:.0f} "
                 "event messages")
    i = r["idle"]
    lines.append(f"{'idle agent':<28} RSS {i['rss_mb']:.0f} MB, {i['requests_per_min']:.0f} API requests/min, "
                 f"CPU {i['agent_cpu_pct']:.1f} %")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main("warm", argv, parse_args, run, table, log)


if __name__ == "__main__":
    raise SystemExit(main())
