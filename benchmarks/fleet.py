"""Fleet benchmark: one publication, N node agents, one Prefect server on PostgreSQL — what it costs and how fast.

    python -m benchmarks.fleet --nodes 8
    python -m benchmarks.fleet --quick          # 3 nodes, a tiny model, 2 publications
    python -m benchmarks.fleet --sweep 8,16,32,64 --model tiny [--scaled 2]

Starts a Prefect server on a fresh PostgreSQL database (dropped after), moto
S3, and N ``python -m deployments.serve --node nodeK`` agents, each with its
own store. Each node reaches the API through a counting tap of its own
(``testbed/api_tap.py``: a TCP proxy that parses what the node sends —
HTTP requests and websocket event messages — without changing the agent) and
S3 through a ``FaultProxy`` of its own (no faults: it logs every request with
its bytes). The trainer publishes from this process (``run_publish``; the
event goes to the server), then the benchmark reads each node's flow run and
its states back from the API.

Reported: publish -> all nodes Ready (p50 and max over the publications);
event -> run start per node (the published event's ``occurred`` to the run's
Running state); S3 requests, GETs and bytes per node per revision, and
whether every payload object was fetched exactly once per node; Prefect API
requests and event messages per node per refit; the server's and the
database's CPU per refit; and, with every agent idle, requests per node per
minute, the server's CPU with and without them, and each agent's RSS. Writes
JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._bench import ROOT, bench_main
from testbed.fleet import FleetLab, saturate, summarize_waves
from testbed.processes import load_average, machine

SCHEMA = "canonical-refit.benchmark.fleet.v1"


def log(message: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=8, help="node agents (processes) to run")
    p.add_argument("--publications", type=int, default=4, help="delta publications measured")
    p.add_argument("--poll-seconds", type=float, default=None,
                   help="the agents' poll interval (default: deployments.serve's default)")
    p.add_argument("--idle-seconds", type=float, default=30.0, help="length of each idle measurement")
    p.add_argument("--model", choices=("tiny", "2mb"), default="2mb",
                   help="tiny: 0.3 MB model, ~0.1 MB deltas; 2mb: 42 MB model, ~2 MB RL-like deltas")
    p.add_argument("--scaled", type=int, default=0, metavar="APIS",
                   help="scale the server out as Prefect documents: this many API processes, the background "
                        "services in a process of their own, Redis messaging (0: one server process)")
    p.add_argument("--sweep", default="", metavar="N,N,...",
                   help="run the fleet once per node count (e.g. 8,16,32,64), each on a fresh server, and print "
                        "every goal per count and whether the server's CPU per refit stays flat")
    p.add_argument("--quick", action="store_true", help="3 nodes, tiny model, 2 publications, 10 s idle")
    p.add_argument("--json", type=Path, help="where to write the result (default benchmarks/results/fleet-*.json)")
    p.add_argument("--keep", action="store_true", help="keep the working folder")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.publications, args.idle_seconds, args.model = 3, 2, 10.0, "tiny"
    try:
        args.sweep_nodes = [int(n) for n in args.sweep.split(",") if n.strip()]
    except ValueError:
        p.error("--sweep takes node counts, e.g. 8,16,32,64")
    if args.nodes < 1 or args.publications < 1 or any(n < 1 for n in args.sweep_nodes):
        p.error("--nodes, --sweep and --publications must be >= 1")
    return args


def model_of(name: str):
    from flows.synthetic import ModelShape

    if name == "tiny":
        return ModelShape(vocab=512, hidden=64, intermediate=160, layers=2, shards=2), None
    return ModelShape(vocab=8192, hidden=512, intermediate=1376, layers=4, shards=2), 0.045


def run(args: argparse.Namespace, root: Path) -> dict:
    if not args.sweep_nodes:
        return run_fleet(args, root)
    sweep = []
    for nodes in args.sweep_nodes:  # each count in a process and on a server of its own (Prefect's event client
        log(f"sweep: {nodes} nodes")  # keeps the first API it reached for the life of its process)
        out = root / f"fleet-{nodes}.json"
        argv = ["--nodes", str(nodes), "--publications", str(args.publications), "--idle-seconds",
                str(args.idle_seconds), "--model", args.model, "--scaled", str(args.scaled), "--json", str(out)]
        if args.poll_seconds is not None:
            argv += ["--poll-seconds", str(args.poll_seconds)]
        subprocess.run([sys.executable, "-m", "benchmarks.fleet", *argv], check=True, cwd=ROOT)
        sweep.append(json.loads(out.read_text()))
    return {"schema": SCHEMA, "machine": machine(), "sweep": sweep}


def run_fleet(args: argparse.Namespace, root: Path) -> dict:
    shape, share = model_of(args.model)
    names = [f"node{k + 1}" for k in range(args.nodes)]
    result: dict = {"schema": SCHEMA, "machine": machine(), "nodes": args.nodes, "model": args.model,
                    "fan_out": "agent",  # the one path: each agent's reconcile loop (no server automation)
                    "model_bytes": shape.nbytes, "load_average_start": load_average()}
    result["scaled_api_processes"] = args.scaled
    with FleetLab(root, poll_s=args.poll_seconds, shape=shape, share=share, log=log, scaled=args.scaled) as lab:
        result["server_startup_s"] = round(lab.server.startup_s, 1) if lab.server else None
        log(f"server alone, idle {args.idle_seconds:.0f}s")
        result["idle_server_alone"] = lab.idle(args.idle_seconds)
        for name in names:
            lab.add_node(name)
        log(f"starting {args.nodes} node agents")
        result["agents_ready_s"] = round(lab.start(names), 1)
        result["poll_s"] = args.poll_seconds
        log(f"{args.nodes} idle agents, {args.idle_seconds:.0f}s")
        result["idle_agents"] = lab.idle(args.idle_seconds)
        log("saturating the API with polls (what one server process sustains)")
        result["poll_saturation"] = saturate(lab.api_url, list(lab.ids[names[0]].values()), seconds=10.0,
                                             cpu=lab.server_cpu, db_cpu=lab.database_cpu)
        log("publishing the launch revision (every node's first refit, not measured)")
        result["initial"] = lab.wave("initial")
        waves = []
        for i in range(args.publications):
            wave = lab.wave("delta")
            waves.append(wave)
            log(f"{wave['version']}: {wave['payload_bytes'] / 1e6:.2f} MB, all {args.nodes} Ready "
                f"{wave['all_ready_after_publish_start_s']:.2f}s after publish started "
                f"({wave['all_ready_after_event_s']:.2f}s after the event); load {wave['load_average'][0]}")
        result["waves"] = waves
        result["summary"] = summarize_waves(waves)
        idle = result["idle_agents"]
        polls = sum(n["requests"].get("POST /deployments/get_scheduled_flow_runs", 0) for n in idle["per_node"].values())
        extra = idle["server_cpu_pct"] - result["idle_server_alone"]["server_cpu_pct"]
        extra_db = idle["database_cpu_pct"] - result["idle_server_alone"]["database_cpu_pct"]
        result["summary"]["server_cpu_ms_per_poll"] = round(extra * 10 * idle["seconds"] / polls, 2) if polls else None
        result["summary"]["database_cpu_ms_per_poll"] = round(extra_db * 10 * idle["seconds"] / polls, 2) \
            if polls else None
        result["summary"]["idle_requests_per_node_per_min"] = round(
            sum(n["requests_per_min"] for n in idle["per_node"].values()) / len(idle["per_node"]), 1)
        result["summary"]["agent_rss_mb"] = max(n["rss_mb"] for n in idle["per_node"].values())
    result["load_average_end"] = load_average()
    return result


GOALS = (  # issue-level goals for the fleet (docs/fleet.md): (label, measured value, limit)
    ("event -> run start p99 <= 3 s", lambda r: _p99(r, "run_start_after_event_s"), 3.0),
    ("publication -> every node Ready p99 <= 45 s", lambda r: _p99_waves(r, "all_ready_after_publish_start_s"),
     45.0),
    ("server CPU per refit <= 0.25 s", lambda r: r["summary"]["server_cpu_s_per_refit"], 0.25),
    ("API requests + event messages per refit <= 32 (half of 30 + 34)",
     lambda r: r["summary"]["api_requests_per_refit"]["p50"] + r["summary"]["api_events_per_refit"]["p50"], 32),
)


def _p99(r: dict, key: str) -> float:
    values = sorted(n[key] for w in r["waves"] for n in w["nodes"].values() if n.get(key) is not None)
    return values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]


def _p99_waves(r: dict, key: str) -> float:
    values = sorted(w[key] for w in r["waves"])
    return values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]


def goals(r: dict) -> list[str]:
    out = []
    for label, measure, limit in GOALS:
        value = measure(r)
        out.append(f"goal {label:<62}{'met' if value <= limit else 'NOT met'} ({value:.2f})")
    return out


FLAT = 1.2  # the server's CPU per refit at the largest count, at most this times the smallest count's


def sweep_table(r: dict) -> str:
    """Every count's goals side by side, and whether the per-refit server cost stays flat."""
    rows = r["sweep"]
    lines = [table(row) + "\n" for row in rows]
    lines.append(f"{'nodes':>6} | {'publish -> all Ready p99':>25} | {'event -> run start p50 / p99':>29} | "
                 f"{'server CPU per refit':>20} | {'requests + events per refit':>27}")
    for row in rows:
        s = row["summary"]
        lines.append(f"{row['nodes']:>6} | {_p99_waves(row, 'all_ready_after_publish_start_s'):>23.2f} s | "
                     f"{s['event_to_run_start_s']['p50']:>12.2f} s / {_p99(row, 'run_start_after_event_s'):>9.2f} s | "
                     f"{s['server_cpu_s_per_refit']:>18.2f} s | "
                     f"{s['api_requests_per_refit']['p50'] + s['api_events_per_refit']['p50']:>27.0f}")
    first, last = rows[0]["summary"]["server_cpu_s_per_refit"], rows[-1]["summary"]["server_cpu_s_per_refit"]
    flat = last <= FLAT * first
    lines.append(f"goal {'server CPU per refit flat from ' + str(rows[0]['nodes']) + ' to ' + str(rows[-1]['nodes']) + ' nodes (<= 1.2 x)':<62}"
                 f"{'met' if flat else 'NOT met'} ({first:.2f} -> {last:.2f} s)")
    return "\n".join(lines)


def table(r: dict) -> str:
    if "sweep" in r:
        return sweep_table(r)
    s = r["summary"]
    lines = [f"fleet: {r['nodes']} nodes, model {r['model']} ({r['model_bytes'] / 1e6:.0f} MB), deltas "
             f"{', '.join(f'{b / 1e6:.2f}' for b in s['payload_bytes'])} MB, poll {r['poll_s'] or 'default'} s; "
             f"load average {r['load_average_start']} -> {r['load_average_end']}; fan-out by "
             f"{'the agents' if r.get('fan_out', 'agent') == 'agent' else 'a server automation per node'}",
             f"{'publish -> all Ready':<44}p50 {s['publish_to_all_ready_s']['p50']:.2f} s   max "
             f"{s['publish_to_all_ready_s']['max']:.2f} s",
             f"{'event -> all Ready':<44}p50 {s['event_to_all_ready_s']['p50']:.2f} s   max "
             f"{s['event_to_all_ready_s']['max']:.2f} s",
             f"{'event -> flow run created (agent loop)':<44}p50 {s['event_to_run_created_s']['p50']:.2f} s   max "
             f"{s['event_to_run_created_s']['max']:.2f} s",
             f"{'event -> run start, per node':<44}p50 {s['event_to_run_start_s']['p50']:.2f} s   max "
             f"{s['event_to_run_start_s']['max']:.2f} s",
             f"{'refit run wall (Running -> Ready)':<44}p50 {s['run_wall_s']['p50']:.2f} s   max "
             f"{s['run_wall_s']['max']:.2f} s",
             f"{'S3 requests / GETs per node per revision':<44}{s['s3_requests_per_refit']['p50']:.0f} / "
             f"{s['s3_get_requests_per_refit']['p50']:.0f}  (GET bytes p50 "
             f"{s['s3_get_bytes_per_refit']['p50'] / 1e6:.2f} MB)",
             f"{'each payload object fetched once per node':<44}{s['payload_fetched_once_everywhere']}",
             f"{'Prefect API requests per node per refit':<44}p50 {s['api_requests_per_refit']['p50']:.0f}   "
             f"max {s['api_requests_per_refit']['max']:.0f}   (+ {s['api_events_per_refit']['p50']:.0f} event "
             "messages)",
             f"{'server CPU / database time per refit':<44}{s['server_cpu_s_per_refit'] * 1000:.0f} ms / "
             f"{s['database_cpu_s_per_refit'] * 1000:.0f} ms  ({s['database_per_refit']['commits']:.0f} commits, "
             f"{s['database_per_refit']['rows_inserted']:.0f} rows inserted)",
             f"{'idle: requests per node per minute':<44}{s['idle_requests_per_node_per_min']:.0f}",
             f"{'idle: server CPU alone / with agents':<44}{r['idle_server_alone']['server_cpu_pct']:.1f} % / "
             f"{r['idle_agents']['server_cpu_pct']:.1f} %  ({s['server_cpu_ms_per_poll']} ms server CPU + "
             f"{s['database_cpu_ms_per_poll']} ms database time per poll)",
             f"{'idle: agent RSS':<44}{s['agent_rss_mb']:.0f} MB",
             f"{'polls one server process sustains':<44}{r['poll_saturation']['requests_per_s']:.0f}/s at "
             f"{r['poll_saturation']['server_cpu_pct']:.0f} % server CPU (p50 "
             f"{r['poll_saturation']['latency_ms']['p50']:.0f} ms, p99 {r['poll_saturation']['latency_ms']['p99']:.0f} "
             f"ms, {r['poll_saturation']['threads']} clients)"]
    if r.get("scaled_api_processes"):
        lines.insert(1, f"server: {r['scaled_api_processes']} API processes + services apart, Redis messaging, "
                        "PostgreSQL; CPU figures are every server process together")
    return "\n".join(lines + goals(r))


def main(argv: list[str] | None = None) -> int:
    return bench_main("fleet", argv, parse_args, run, table, log)


if __name__ == "__main__":
    raise SystemExit(main())
