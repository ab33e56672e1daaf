"""A fleet on one machine for the fleet benchmarks: PostgreSQL, a Prefect server on it, moto, taps and nodes.

``FleetLab`` (a context manager) creates a fresh PostgreSQL database and a
Prefect server on it (or uses a running server, ``api_url``), moto S3, and
nodes that each reach the API through an ``ApiTap`` and S3 through a
``FaultProxy`` (no faults: it logs every request with its bytes) of their
own; the ``Trainer`` publishes from this process. ``idle`` measures what idle
agents cost (API requests, server and database CPU, RSS); ``wave`` publishes
one step and measures it reaching every node (latencies from the published
event's time and the runs' states, API and S3 requests per node, whether each
payload object was fetched exactly once). ``saturate`` polls the API as fast
as a few clients can; ``summarize_waves`` gives latencies and per-node costs
over several waves. ``spans`` runs every agent through ``python -m
testbed.nodes agent`` (stage spans recorded).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Callable

from testbed.api_tap import ApiTap, TapHub
from testbed.nodes import NodeProcess
from testbed.postgres import Postgres
from testbed.prefect_server import (
    PrefectServer, deployment_ids, is_final, parse_time, published_events, runs_of, target_of,
)
from testbed.processes import load_average, quiet_env, wait_until
from testbed.s3 import MotoServer
from testbed.s3proxy import FaultProxy, Faults
from testbed.trainer import Trainer

BUCKET = "refit-fleet"
AWS = {"AWS_ACCESS_KEY_ID": "canonical-refit-bench", "AWS_SECRET_ACCESS_KEY": "canonical-refit-bench-secret",
       "AWS_DEFAULT_REGION": "us-east-1"}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def classify_s3(request) -> str:
    """What an S3 request (a ``FaultProxy`` log entry) was for."""
    if request.method == "GET" and "list-type" in request.query:
        return "list"
    if "/revisions/" in request.path:
        return f"payload {request.method}"
    if "/nodes/" in request.path:
        return f"node record {request.method}"
    if "/catalog/" in request.path:
        return f"catalog {request.method}"
    return f"other {request.method}"


class FleetLab:
    """PostgreSQL, a Prefect server on it (or an existing one), moto, and nodes each behind an API tap and an S3
    proxy of their own; the trainer publishes from this process. Use as a context manager."""

    def __init__(self, root: Path, *, poll_s: float | None, shape=None, share: float | None = None,
                 api_url: str | None = None, spans: Path | None = None, log: Callable[[str], None] = print,
                 scaled: int = 0, serve_args: tuple[str, ...] = (), auth_string: str | None = None):
        self.root = Path(root)
        self.auth_string = auth_string  # Prefect's basic authentication on the server and every client
        self.serve_args = tuple(serve_args)  # more flags of every node's deployments.serve (e.g. --head-poll-seconds 5)
        self.scaled = scaled  # API processes of a scaled-out server (Redis messaging, services apart); 0: one server
        self.poll_s, self.shape, self.share, self.log = poll_s, shape, share, log
        self.external_api = api_url
        self.spans = spans
        self.database: Postgres | None = None
        self.server: PrefectServer | None = None
        self.nodes: dict[str, NodeProcess] = {}
        self.taps: dict[str, ApiTap] = {}
        self.proxies: dict = {}
        self.ids: dict[str, dict[str, object]] = {}
        self.catalog = f"s3://{BUCKET}/fleet-{uuid.uuid4().hex[:8]}/catalog"
        self.model = "lab/fleet"

    # -- set-up and tear-down ----------------------------------------------------------------------------

    def __enter__(self) -> "FleetLab":
        self.hub = TapHub()
        self.moto = MotoServer(self.root / "moto.log", BUCKET).start()
        if self.external_api:
            self.api_url = self.external_api
        else:
            self.database = Postgres().create()
            if self.scaled:
                from testbed.scaled_server import ScaledPrefectServer

                self.server = ScaledPrefectServer(self.root / "server", self.database.url, apis=self.scaled).start()
                what = f"{self.scaled} API processes and the services apart, on Redis messaging and PostgreSQL"
            else:
                self.server = PrefectServer(self.root, self.database.url, auth_string=auth_string).start()
                what = "one Prefect server process on PostgreSQL"
            self.api_url = self.server.url
            self.log(f"{what} (database {self.database.name}): healthy after {self.server.startup_s:.1f}s")
        os.environ.update(AWS)
        os.environ.update(PREFECT_API_URL=self.api_url, PREFECT_HOME=str(self.root / "trainer-home"),
                          DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", **self._auth())
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
        self.trainer = Trainer(self.root / "trainer", self.catalog, self.model, shape=self.shape, share=self.share,
                               endpoint=self.moto.url)
        return self

    def __exit__(self, *exc) -> None:
        for node in self.nodes.values():
            node.stop(timeout_s=20)
        if self.server is not None:
            self.server.stop()
        for proxy in self.proxies.values():
            proxy.stop()
        self.moto.stop()
        self.hub.stop()
        if self.database is not None:
            self.database.drop()

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api_url, auth_string=self.auth_string)

    def _auth(self) -> dict[str, str]:
        return {"PREFECT_API_AUTH_STRING": self.auth_string} if self.auth_string else {}

    def server_cpu(self) -> float:
        return self.server.cpu_seconds() if self.server else 0.0

    def database_cpu(self) -> float:
        return self.database.cpu_seconds() if self.database else 0.0

    # -- nodes ----------------------------------------------------------------------------------------------

    def add_node(self, name: str) -> NodeProcess:
        urls = getattr(self.server, "urls", None) or [self.api_url]
        tap = self.hub.tap(urls[len(self.nodes) % len(urls)], name)  # nodes spread over the API processes
        proxy = FaultProxy(self.moto.url, Faults(), lifetime_s=24 * 3600).start()
        module = ("-m", "testbed.nodes", "agent", str(self.spans)) if self.spans else ("-m", "deployments.serve")
        env = quiet_env(PREFECT_API_URL=tap.url, PREFECT_HOME=str(self.root / "homes" / name), **AWS, **self._auth())
        node = NodeProcess(name, self.root / "nodes", self.catalog, self.model, self.trainer.launch, env,
                           s3_endpoint=proxy.url, poll_s=self.poll_s, agent_module=module, extra=self.serve_args)
        self.nodes[name], self.taps[name], self.proxies[name] = node, tap, proxy
        return node

    def start(self, names: list[str], timeout_s: float = 300) -> float:
        """Start the nodes' agents; wait until each registered and its start-up run ended. Seconds it took."""
        started = time.monotonic()
        for name in names:
            self.nodes[name].start()
        with self.client() as client:
            for name in names:
                node = self.nodes[name]

                def registered():
                    if not node.alive:
                        raise RuntimeError(f"{name}'s agent exited\n{node.diagnostics()}")
                    return deployment_ids(client, list(node.deployments.values()))

                ids = wait_until(f"{name} to register", registered, timeout_s, every_s=0.5,
                                 diagnostics=node.diagnostics)
                self.ids[name] = {short: ids[full] for short, full in node.deployments.items()}
            for name in names:
                wait_until(f"{name}'s start-up run", lambda: [r for r in runs_of(client, [self.ids[name]["latest"]])
                                                             if is_final(r) and not r.auto_scheduled], timeout_s,
                           every_s=0.5, diagnostics=self.nodes[name].diagnostics)
        return time.monotonic() - started

    # -- measurements ---------------------------------------------------------------------------------------

    def idle(self, seconds: float) -> dict:
        """What the idle agents cost over ``seconds``: API requests per node per minute, server and database CPU,
        agent RSS."""
        start, cpu0, db0 = time.time(), self.server_cpu(), self.database_cpu()
        agents0 = {name: node.cpu_seconds() for name, node in self.nodes.items()}
        time.sleep(seconds)
        end = time.time()
        elapsed = end - start
        per_node = {}
        for name, node in self.nodes.items():
            counts = self.taps[name].counts(start, end)
            per_node[name] = {"requests_per_min": round(sum(counts.values()) * 60 / elapsed, 1),
                              "requests": dict(counts), "rss_mb": round(node.rss_bytes() / 1e6, 1),
                              "agent_cpu_pct": round((node.cpu_seconds() - agents0[name]) / elapsed * 100, 2)}
        requests = sum(sum(self.taps[n].counts(start, end).values()) for n in self.nodes)
        return {"seconds": round(elapsed, 1), "nodes": len(self.nodes), "per_node": per_node,
                "api_requests_per_s": round(requests / elapsed, 2),
                "server_cpu_pct": round((self.server_cpu() - cpu0) / elapsed * 100, 2),
                "database_cpu_pct": round((self.database_cpu() - db0) / elapsed * 100, 2),
                "load_average": load_average()}

    def wave(self, kind: str = "delta", timeout_s: float = 300, settle_s: float = 3.0, **publish: str) -> dict:
        """Publish the trainer's next step from this process and measure it reaching every node."""
        names = list(self.nodes)
        marks = {name: len(self.proxies[name].log) for name in names}
        cpu0, db0 = self.server_cpu(), self.database_cpu()
        rows0 = self.database.stats() if self.database else {}
        result, published_at = self.trainer.publish(kind, **publish)
        publish_s = time.time() - published_at
        version = result.version
        with self.client() as client:
            def finished():
                runs = {}
                for name in names:
                    found = [r for r in runs_of(client, [self.ids[name]["on_publish"]])
                             if target_of(r) == version and is_final(r)]
                    if not found:
                        return None
                    runs[name] = found[0]
                return runs

            runs = wait_until(f"every node to finish its refit to {version}", finished, timeout_s, every_s=0.1,
                              diagnostics=lambda: "\n".join(n.diagnostics() for n in self.nodes.values()))
            done_at = time.time()
            event = wait_until(f"the published event of {version}", lambda: next(
                (e for e in published_events(self.api_url, "2000-01-01T00:00:00Z", self.auth_string)
                 if e["resource"]["prefect.resource.id"].endswith(f".{version}")), None), 60, every_s=0.5)
            event_at = parse_time(event["occurred"])
            states = {name: {s.name: parse_time(s.timestamp) for s in client.read_flow_run_states(run.id)}
                      for name, run in runs.items()}
        time.sleep(settle_s)  # the runs' last log batches and the agents' next polls land
        cpu, db = self.server_cpu() - cpu0, self.database_cpu() - db0
        rows = {k: v - rows0[k] for k, v in self.database.stats().items() if k != "active_s"} if rows0 else {}
        nodes = {}
        for name in names:
            run, st = runs[name], states[name]
            claimed, running, final = st.get("Pending"), st.get("Running"), parse_time(run.end_time or run.updated)
            counts = self.taps[name].counts((claimed or event_at) - 0.05, final + settle_s)
            polls = counts.pop("POST /deployments/get_scheduled_flow_runs", 0)
            events = sum(v for k, v in counts.items() if k.startswith("WS /events/in"))
            http = {k: v for k, v in counts.items() if not k.startswith("WS ")}
            s3 = self._s3(name, marks[name], version)
            nodes[name] = {
                "state": run.state_name, "created_after_event_s": round(parse_time(run.created) - event_at, 3),
                "claimed_after_event_s": round(claimed - event_at, 3) if claimed else None,
                "run_start_after_event_s": round(running - event_at, 3) if running else None,
                "ready_after_event_s": round(final - event_at, 3),
                "ready_after_publish_start_s": round(final - published_at, 3),
                "run_wall_s": round(final - running, 3) if running else None,
                "run_start_at": running, "ready_at": final,
                "api_requests": sum(http.values()), "api_events_sent": events, "api_polls_in_window": polls,
                "api_by_kind": dict(sorted(http.items(), key=lambda kv: -kv[1])),
                "events_by_name": dict(sorted(self.taps[name].events((claimed or event_at) - 0.05,
                                                                    final + settle_s).items(),
                                              key=lambda kv: -kv[1])), "s3": s3}
        ready = [n["ready_after_publish_start_s"] for n in nodes.values()]
        return {"version": version, "kind": kind, "payload_bytes": result.bytes_written, "files": result.files,
                "publish_s": round(publish_s, 3), "event_after_publish_start_s": round(event_at - published_at, 3),
                "all_ready_after_publish_start_s": round(max(ready), 3),
                "all_ready_after_event_s": round(max(n["ready_after_event_s"] for n in nodes.values()), 3),
                "observed_all_done_after_publish_start_s": round(done_at - published_at, 3),
                "server_cpu_s": round(cpu, 3), "database_cpu_s": round(db, 3), "database": rows, "nodes": nodes,
                "load_average": load_average()}

    def _s3(self, name: str, mark: int, version: str) -> dict:
        """The node's S3 requests since ``mark``: counts by kind, GET bytes, and whether each payload object of
        ``version`` was fetched exactly once."""
        log = self.proxies[name].log[mark:]
        kinds = Counter(classify_s3(r) for r in log)
        objects: dict[str, list] = {}
        for r in log:
            if r.method == "GET" and not r.query and f"/revisions/{version}/" in r.path:
                objects.setdefault(r.path, []).append(r)
        gets = [r for r in log if r.method == "GET"]
        return {"requests": len(log), "by_kind": dict(kinds), "get_requests": len(gets),
                "get_bytes": sum(r.sent for r in gets),
                "payload_objects": len(objects), "payload_gets": sum(len(v) for v in objects.values()),
                "payload_bytes": sum(r.sent for v in objects.values() for r in v),
                "payload_ranged_gets": sum(1 for v in objects.values() for r in v if r.range),
                "each_payload_object_once": all(len(v) == 1 or (all(r.range for r in v) and
                                                                len({r.range for r in v}) == len(v))
                                                for v in objects.values())}


def saturate(api_url: str, deployment_ids_: list, *, threads: int = 4, seconds: float = 10.0,
             cpu: Callable[[], float] = lambda: 0.0, db_cpu: Callable[[], float] = lambda: 0.0) -> dict:
    """Poll as fast as ``threads`` clients can (the agents' own request) for ``seconds``: what one server process
    sustains, its latency, and its CPU."""
    import httpx

    body = {"deployment_ids": [str(i) for i in deployment_ids_], "scheduled_before": "2000-01-01T00:00:00Z"}
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker() -> None:
        with httpx.Client(base_url=api_url, timeout=30) as client:
            while time.monotonic() < stop:
                t = time.perf_counter()
                client.post("/deployments/get_scheduled_flow_runs", json=body).raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - t)

    cpu0, db0, started = cpu(), db_cpu(), time.monotonic()
    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(seconds + 60)
    elapsed = time.monotonic() - started
    return {"threads": threads, "seconds": round(elapsed, 1), "requests": len(latencies),
            "requests_per_s": round(len(latencies) / elapsed, 1),
            "latency_ms": {"p50": _r(percentile(latencies, .5) * 1000, 1), "p99": _r(percentile(latencies, .99) * 1000, 1)},
            "server_cpu_pct": round((cpu() - cpu0) / elapsed * 100, 1),
            "database_cpu_pct": round((db_cpu() - db0) / elapsed * 100, 1), "load_average": load_average()}


def summarize_waves(waves: list[dict]) -> dict:
    """Latencies and per-node costs over several waves."""
    nodes = [n for w in waves for n in w["nodes"].values()]
    starts = [n["run_start_after_event_s"] for n in nodes]
    return {
        "waves": len(waves), "nodes": len(waves[0]["nodes"]) if waves else 0,
        "payload_bytes": [w["payload_bytes"] for w in waves],
        "publish_to_all_ready_s": {"p50": _r(percentile([w["all_ready_after_publish_start_s"] for w in waves], .5)),
                                   "max": _r(max(w["all_ready_after_publish_start_s"] for w in waves))},
        "event_to_all_ready_s": {"p50": _r(percentile([w["all_ready_after_event_s"] for w in waves], .5)),
                                 "max": _r(max(w["all_ready_after_event_s"] for w in waves))},
        "publish_s": {"p50": _r(percentile([w["publish_s"] for w in waves], .5))},
        "event_to_run_created_s": _dist([n["created_after_event_s"] for n in nodes]),
        "event_to_run_start_s": _dist(starts),
        "run_wall_s": _dist([n["run_wall_s"] for n in nodes]),
        "api_requests_per_refit": _dist([n["api_requests"] for n in nodes]),
        "api_events_per_refit": _dist([n["api_events_sent"] for n in nodes]),
        "s3_get_requests_per_refit": _dist([n["s3"]["get_requests"] for n in nodes]),
        "s3_requests_per_refit": _dist([n["s3"]["requests"] for n in nodes]),
        "s3_get_bytes_per_refit": _dist([n["s3"]["get_bytes"] for n in nodes]),
        "payload_fetched_once_everywhere": all(n["s3"]["each_payload_object_once"] for n in nodes),
        "server_cpu_s_per_refit": _r(sum(w["server_cpu_s"] for w in waves) / max(1, len(nodes))),
        "database_cpu_s_per_refit": _r(sum(w["database_cpu_s"] for w in waves) / max(1, len(nodes))),
        "database_per_refit": {k: _r(sum(w["database"].get(k, 0) for w in waves) / max(1, len(nodes)), 1)
                               for k in ("commits", "rows_inserted", "rows_updated")},
    }


def _r(x, digits: int = 3):
    return None if x is None else round(x, digits)


def _dist(values: list) -> dict:
    xs = [v for v in values if v is not None]
    return {"p50": _r(percentile(xs, .5)), "max": _r(max(xs)) if xs else None, "min": _r(min(xs)) if xs else None}
