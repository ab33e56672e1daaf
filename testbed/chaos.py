"""The fleet under seeded faults: does any node claim what its engine does not run, does ``wait`` ever lie?

    python -m testbed.chaos --small                      # 2 nodes, 3 revisions, an engine and an agent kill
    python -m testbed.chaos --nodes 4 --revisions 6 --seed 7 --faults agent,engine,storage,server --json

Builds a fleet on this machine (``testbed/chaos_fleet.py``: a Prefect server
on PostgreSQL, ``file://`` or moto S3 storage, per node an engine stand-in
process and an agent installing into it with ``sglang-disk``), publishes
the launch revision, waits for every node to run it, then publishes
``--revisions`` more, one every ``--spacing`` seconds, while the faults of a
plan drawn from ``--seed`` fire (``testbed/chaos_plan.py``: agents and
engines killed with SIGKILL at chosen phases, a storage outage, the server
killed and restarted). After each publication the barrier runs as a trainer
runs it, ``python -m flows.fleet wait`` and ``flows.api.wait_for``; a
watcher (``testbed/chaos_watch.py``) samples every node's record against
its engine. A node made poisoned is recovered as an operator would
(``python -m flows.refit recover``).

It prints, and with ``--json`` prints as one JSON object:

* **false READY**: seconds in which a node's record claimed a version its
  engine had not run for longer than the window the contract allows, one
  heartbeat plus the stale grace (``storage.catalog.nodes.stale_after_s``);
* **wrong answers** of the barrier: ``reached`` while a node's engine does
  not run the version, ``failed`` (every revision is valid), ``poisoned``
  naming no poisoned node;
* **convergence**: seconds from the end of the last fault (or the last
  publication) until every node's engine runs the newest revision and its
  record says so, within ``--converge-seconds``; then one more ``wait`` for
  it must answer ``reached``.

Exit 0 when there was no false READY, no wrong answer and the fleet
converged; 1 otherwise; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from testbed.chaos_plan import KINDS, FaultRunner, make_plan, plan_json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m testbed.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default 4; --small: 2)")
    parser.add_argument("--revisions", type=int, default=None, help="publications after the launch revision "
                                                                    "(default 6; --small: 3)")
    parser.add_argument("--seed", type=int, default=1, help="draws the faults' nodes, publications, phases, "
                                                            "delays and durations")
    parser.add_argument("--faults", default=None,
                        help=f"comma-separated kinds among {','.join(KINDS)} (default: all; --small: agent,engine)")
    parser.add_argument("--small", action="store_true", help="the suite's mode: 2 nodes, 3 revisions, one agent "
                                                             "kill (its engine restarted meanwhile), one engine kill")
    parser.add_argument("--storage", choices=("file", "s3"), default=None,
                        help="file:// or moto S3 behind fault proxies (default: s3 when a storage outage is "
                             "planned, else file)")
    parser.add_argument("--heartbeat-seconds", type=float, default=2.0, help="every agent's --heartbeat-seconds")
    parser.add_argument("--head-poll-seconds", type=float, default=5.0, help="every agent's --head-poll-seconds")
    parser.add_argument("--engine-load-seconds", type=float, default=None,
                        help="each engine load takes this long, so that an engine kill can land in one and poison "
                             "the node (default 1; --small: 0)")
    parser.add_argument("--spacing", type=float, default=None, help="seconds between publications "
                                                                   "(default 15; --small: 6)")
    parser.add_argument("--outage-seconds", type=float, default=None,
                        help="how long a storage outage or a server kill lasts (default 20; --small: 8)")
    parser.add_argument("--converge-seconds", type=float, default=None,
                        help="how long the fleet may take to converge after the faults (default 180; --small: 60)")
    parser.add_argument("--root", type=Path, default=None, help="working folder (default: a temporary one, "
                                                                "removed after)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    small = args.small
    args.nodes = args.nodes or (2 if small else 4)
    args.revisions = args.revisions or (3 if small else 6)
    kinds = tuple(k.strip() for k in (args.faults or ("agent,engine" if small else ",".join(KINDS))).split(",")
                  if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or args.nodes < 1 or args.revisions < 1:
        parser.error(f"unknown fault kinds {unknown} (choose among {', '.join(KINDS)})" if unknown
                     else "--nodes and --revisions must be at least 1")
    args.kinds = kinds
    args.storage = args.storage or ("s3" if "storage" in kinds else "file")
    if "storage" in kinds and args.storage != "s3":
        parser.error("a storage outage needs --storage s3")
    if args.engine_load_seconds is None:
        args.engine_load_seconds = 0.0 if small else 1.0
    args.spacing = args.spacing or (6.0 if small else 15.0)
    args.outage_seconds = args.outage_seconds or (8.0 if small else 20.0)
    args.converge_seconds = args.converge_seconds or (60.0 if small else 180.0)
    return args


def run_chaos(args: argparse.Namespace, log=print) -> dict:
    """One chaos run (see the module); its result as a dict (``ok``: no false READY, no wrong answer,
    converged)."""
    if args.root is not None:
        return _run(args, Path(args.root), log)
    with tempfile.TemporaryDirectory(prefix="chaos-") as root:
        return _run(args, Path(root), log)


def _run(args, root: Path, log) -> dict:
    from storage.catalog.nodes import stale_after_s
    from testbed.chaos_fleet import ChaosFleet
    from testbed.chaos_watch import Judge, Watcher
    from testbed.processes import load_average, wait_until

    window_s = stale_after_s(args.heartbeat_seconds)
    names = [f"n{i}" for i in range(1, args.nodes + 1)]
    plan = make_plan(args.seed, names, args.revisions, args.kinds, small=args.small, window_s=window_s,
                     outage_s=args.outage_seconds, load_s=args.engine_load_seconds)
    started = time.monotonic()
    with ChaosFleet(root, args.nodes, storage=args.storage, heartbeat_s=args.heartbeat_seconds,
                    head_poll_s=args.head_poll_seconds, engine_load_s=args.engine_load_seconds, log=log) as fleet:
        fleet.start_agents()  # they boot while the launch revision is published (their head check finds it)
        publications = [fleet.publish("initial")]
        sequence = {publications[0]["version"]: 0}
        watcher = Watcher(fleet, window_s).start()
        recoveries: list[dict] = []
        watcher.on_poisoned = _operator(fleet, recoveries, log)
        launch = publications[0]["version"]
        wait_until(f"every node to run {launch}", lambda: fleet.agents_alive() and watcher.on_latest(launch), 240,
                   every_s=0.2,
                   diagnostics=lambda: f"{watcher.where()}\n{fleet.diagnostics()}")
        log(f"chaos: {args.nodes} node(s) run {launch} after {time.monotonic() - started:.1f}s; faults: "
            + "; ".join(f.describe() for f in plan))
        judge = Judge(fleet, watcher, sequence)
        runner = FaultRunner(fleet, watcher, plan, phase_timeout_s=max(args.spacing * 2, 20.0), log=log)
        wait_timeout = args.revisions * args.spacing + args.outage_seconds * 2 + args.converge_seconds
        for slot in range(1, args.revisions + 1):
            runner.before_publish(slot)
            publication = fleet.publish("delta")
            publication["at_s"] = round(time.monotonic() - watcher.started, 2)
            publications.append(publication)
            sequence[publication["version"]] = slot
            log(f"chaos: published {publication['version']} at {time.monotonic() - watcher.started:.1f}s "
                f"(event delivered: {publication['event_delivered']})")
            judge.start(publication["version"], wait_timeout, cli=slot % 2 == 1 or slot == args.revisions)
            runner.after_publish(slot, publication["version"])
            time.sleep(args.spacing)
        healed = runner.join(args.outage_seconds * 3 + 60)
        faults_end = max(runner.ended_at(), publications[-1]["at_s"])
        latest = publications[-1]["version"]
        converged = _converge(watcher, latest, args.converge_seconds)
        convergence_s = round(converged - watcher.started - faults_end, 2) if converged else None
        if converged:
            judge.start(latest, 30.0)  # one more barrier on the converged fleet: it must say reached
        judge.join(60.0 if converged else 5.0)  # a barrier still waiting on a fleet that did not converge: ended
        watcher.stop()
        exited = fleet.exited_agents()
        result = _result(args, window_s, plan, publications, watcher, judge, recoveries, convergence_s, healed)
        result.update(agents_exited=exited, ok=result["ok"] and not exited)
        result.update(wall_s=round(time.monotonic() - started, 1), load_average=load_average(),
                      where_at_end=watcher.where())
        (root / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _operator(fleet, recoveries: list[dict], log):
    """What an operator does when a node reports itself poisoned: ``recover`` on that host, once per report."""
    import threading

    busy: set[str] = set()

    def recover(name: str) -> None:
        try:
            outcome = fleet.recover(name)
            recoveries.append(outcome)
            log(f"chaos: {name} was poisoned; recover: exit {outcome['exit']}")
        finally:
            time.sleep(5)  # its record needs a heartbeat to say what recover did
            busy.discard(name)

    def on_poisoned(name: str) -> None:
        if name not in busy:
            busy.add(name)
            threading.Thread(target=recover, args=(name,), daemon=True).start()

    return on_poisoned


def _converge(watcher, latest: str, timeout_s: float) -> float | None:
    """When every node's engine ran ``latest`` and its record claimed it (monotonic time); None: not in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if watcher.on_latest(latest):
            return time.monotonic()
        time.sleep(0.1)
    return None


def _result(args, window_s: float, plan, publications, watcher, judge, recoveries, convergence_s, healed) -> dict:
    tracks = watcher.tracks
    false_s = round(sum(t.false_ready_s for t in tracks.values()), 2)
    wrong = [a for a in judge.answers if a["wrong"]]
    outcomes: dict[str, int] = {}
    for answer in judge.answers:
        outcomes[answer["outcome"]] = outcomes.get(answer["outcome"], 0) + 1
    final = [a for a in judge.answers if a["version"] == publications[-1]["version"]]
    converged = convergence_s is not None and bool(final) and all(a["outcome"] == "reached" for a in final)
    return {
        "ok": false_s == 0 and not wrong and converged and healed,
        "seed": args.seed, "nodes": args.nodes, "revisions": args.revisions, "storage": args.storage,
        "faults": plan_json(plan), "heartbeat_s": args.heartbeat_seconds, "window_s": window_s,
        "false_ready_s": false_s, "false_ready_samples": sum(t.false_samples for t in tracks.values()),
        "samples": watcher.samples,
        "false_ready": {name: t.episodes for name, t in tracks.items() if t.episodes},
        "answers": len(judge.answers), "answers_list": judge.answers, "outcomes": outcomes, "wrong_answers": len(wrong), "wrong": wrong,
        "converged": converged, "convergence_s": convergence_s, "faults_healed": healed,
        "publications": publications, "recoveries": recoveries,
    }


def summary(result: dict) -> str:
    lines = [
        f"chaos: seed {result['seed']}, {result['nodes']} node(s), {result['revisions']} revision(s), "
        f"{result['storage']} storage; window {result['window_s']:.1f}s (heartbeat {result['heartbeat_s']:g}s + "
        "grace)",
        f"false READY: {result['false_ready_s']:.2f}s ({result['false_ready_samples']} of {result['samples']} "
        "samples)",
        f"barrier answers: {result['answers']} ({', '.join(f'{k} {v}' for k, v in sorted(result['outcomes'].items()))})"
        f", wrong: {result['wrong_answers']}",
        f"converged: {'yes' if result['converged'] else 'NO'}"
        + (f", every node on the newest {result['convergence_s']:.1f}s after the faults ended"
           if result["convergence_s"] is not None else ""),
        f"publications told the nodes: {sum(1 for p in result['publications'] if p['event_delivered'])} of "
        f"{len(result['publications'])}; recoveries: {len(result['recoveries'])}; wall {result['wall_s']:.0f}s",
    ]
    for name, code in result.get("agents_exited", {}).items():
        lines.append(f"  agent {name} exited by itself (exit {code})")
    for answer in result["wrong"]:
        lines.append(f"  wrong: {answer['how']} wait {answer['version']}: {answer['wrong']}")
    for node, episodes in result["false_ready"].items():
        for e in episodes:
            lines.append(f"  false READY: {node} claimed {e['version']} from {e['first_at_s']}s to "
                         f"{e['last_at_s']}s; its engine left it at {e['engine_off_at_s']}s (now {e['engine']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else \
        (lambda line: print(line, flush=True))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    import logging

    logging.getLogger("canonical_refit").setLevel(logging.ERROR)  # the barrier's own retries, in this process
    result = run_chaos(args, log)
    print(json.dumps(result) if args.json else summary(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
