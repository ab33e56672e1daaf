"""The chaos command's fleet: a Prefect server on PostgreSQL, storage, and nodes that are an agent and an engine.

``ChaosFleet`` builds, on this machine, what ``python -m testbed.chaos``
breaks: a Prefect server on a fresh PostgreSQL database, a catalog on
``file://`` or on moto S3 (then every node, and the barrier's readers, reach
S3 through a ``FaultProxy`` of their own, so that a storage outage can be
switched on and off), the trainer (``testbed.trainer``, publishing in this
process), and per node an engine stand-in process
(``python -m deployments.engine_standin``) and an agent process
(``python -m deployments.serve --installer sglang-disk``) installing into it.

Every process can be killed with SIGKILL and started again: an engine comes
back on its launch weights (``weight_version`` "default", as SGLang does),
an agent recovers its store and its runs, the server comes back on the same
port and database.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from testbed.nodes import NodeProcess
from testbed.processes import PYTHON, ROOT, free_port, quiet_env, stop_group, tail, wait_until

MODEL = "lab/chaos"
BUCKET = "refit-chaos"
AWS = {"AWS_ACCESS_KEY_ID": "canonical-refit-chaos", "AWS_SECRET_ACCESS_KEY": "canonical-refit-chaos-secret",
       "AWS_DEFAULT_REGION": "us-east-1"}


def ask_engine(port: int, timeout_s: float = 1.0) -> str | None:
    """The ``weight_version`` the engine on ``port`` reports (``GET /model_info``); None: no answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/model_info")
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            return None
        version = json.loads(body).get("weight_version")
        return version if isinstance(version, str) else None
    except (OSError, ValueError):
        return None
    finally:
        conn.close()


@dataclass
class EngineProcess:
    """``python -m deployments.engine_standin --model-path LAUNCH --port PORT`` in its own session."""

    name: str
    launch: Path
    log_path: Path
    load_s: float = 0.0  # each load takes this long (--load-seconds): an engine kill can land in one
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "EngineProcess":
        """Start it (on its launch weights) and wait until it answers."""
        self.starts += 1
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "deployments.engine_standin", "--model-path", str(self.launch), "--port",
                 str(self.port), "--load-seconds", str(self.load_s)], cwd=ROOT, env=quiet_env(), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until(f"engine {self.name} to answer", lambda: self._answers(), timeout_s, every_s=0.05,
                   diagnostics=lambda: tail(self.log_path))
        return self

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"engine {self.name} exited with {self.proc.returncode}\n{tail(self.log_path)}")
        return ask_engine(self.port, 0.5) is not None

    def kill(self) -> None:
        """SIGKILL: the engine is gone, with whatever it ran."""
        _killpg(self.proc)

    def stop(self) -> None:
        stop_group(self.proc, 5.0)

    def report(self) -> str | None:
        return ask_engine(self.port)


def _killpg(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


@dataclass
class Node:
    """One node of the chaos fleet: its agent and its engine."""

    name: str
    agent: NodeProcess
    engine: EngineProcess
    lock: threading.Lock = field(default_factory=threading.Lock)  # one fault at a time restarts a process


class ChaosFleet:
    """The server, the storage, the trainer and the nodes (``with``: everything stopped and the database dropped)."""

    def __init__(self, root: Path, nodes: int, *, storage: str = "file", heartbeat_s: float = 2.0,
                 head_poll_s: float = 5.0, poll_s: float = 2.0, engine_load_s: float = 0.0, log=print):
        self.root = Path(root)
        self.count, self.storage, self.log = nodes, storage, log
        self.heartbeat_s, self.head_poll_s, self.poll_s = heartbeat_s, head_poll_s, poll_s
        self.engine_load_s = engine_load_s
        self.nodes: dict[str, Node] = {}
        self.proxies: dict[str, object] = {}  # node name (and "waiters") -> FaultProxy, with S3
        self.database = self.server = self.moto = None
        self.server_lock = threading.Lock()

    # -- set-up ------------------------------------------------------------------------------------------------

    def __enter__(self) -> "ChaosFleet":
        from testbed.prefect_server import PrefectServer, migrated_postgres

        self.root.mkdir(parents=True, exist_ok=True)
        self.database = migrated_postgres()  # a copy of a migrated database: the server starts sooner
        self.server = PrefectServer(self.root / "server", self.database.url)
        starting = threading.Thread(target=self._start_server, name="server-start", daemon=True)
        starting.start()  # meanwhile: storage, the trainer's launch snapshot, the engines
        if self.storage == "s3":
            from testbed.s3 import MotoServer

            os.environ.update(AWS)
            self.moto = MotoServer(self.root / "moto.log", BUCKET).start()
            self.catalog = f"s3://{BUCKET}/chaos-{uuid.uuid4().hex[:8]}/catalog"
        else:
            self.catalog = (self.root / "objects" / "catalog").as_uri()
        from flows.synthetic import ModelShape
        from testbed.trainer import Trainer

        self.trainer = Trainer(self.root / "trainer", self.catalog, MODEL, endpoint=self.moto.url if self.moto else None,
                               shape=ModelShape(vocab=256, hidden=32, intermediate=64, layers=2, shards=2))
        for i in range(1, self.count + 1):
            name = f"n{i}"
            engine = EngineProcess(name, self.trainer.launch, self.root / f"engine-{name}.log",
                                   self.engine_load_s).start()
            self.nodes[name] = Node(name, self._agent(name, engine), engine)
        starting.join()
        if self._server_error is not None:
            raise self._server_error
        os.environ.update(PREFECT_API_URL=self.server.url, PREFECT_HOME=str(self.root / "trainer-home"),
                          DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
        return self

    def _start_server(self) -> None:
        self._server_error = None
        try:
            self.server.start()
        except BaseException as exc:  # re-raised by the caller's thread
            self._server_error = exc

    def _agent(self, name: str, engine: EngineProcess) -> NodeProcess:
        env = self.server.client_env(self.root / "homes" / name, **(AWS if self.moto else {}))
        endpoint = None
        if self.moto is not None:
            endpoint = self._proxy(name)
        return NodeProcess(name, self.root / "nodes", self.catalog, MODEL, self.trainer.launch, env,
                           s3_endpoint=endpoint, poll_s=self.poll_s,
                           installer=("--installer", "sglang-disk", "--engine-url", engine.url),
                           extra=("--heartbeat-seconds", str(self.heartbeat_s),
                                  "--head-poll-seconds", str(self.head_poll_s)))

    def _proxy(self, name: str) -> str:
        from testbed.s3proxy import FaultProxy, Faults

        proxy = FaultProxy(self.moto.url, Faults(), lifetime_s=24 * 3600).start()
        self.proxies[name] = proxy
        return proxy.url

    def waiter_endpoint(self) -> str | None:
        """The S3 endpoint the barrier's readers use (behind a proxy of their own, down in a storage outage)."""
        if self.moto is None:
            return None
        return self.proxies["waiters"].url if "waiters" in self.proxies else self._proxy("waiters")

    def storage_settings(self, endpoint: str | None):
        from storage.settings import ObjectStoreSettings

        if endpoint is None:
            return ObjectStoreSettings()
        return ObjectStoreSettings(endpoint_url=endpoint, region=AWS["AWS_DEFAULT_REGION"])

    def start_agents(self) -> None:
        for node in self.nodes.values():
            node.agent.start()

    def agents_alive(self) -> bool:
        """True while every agent runs; an agent that exited by itself raises, with its log."""
        for node in self.nodes.values():
            if node.agent.proc is not None and node.agent.proc.poll() is not None:
                raise RuntimeError(f"{node.name}'s agent exited with {node.agent.proc.returncode}\n"
                                   f"{node.agent.diagnostics()}")
        return True

    def exited_agents(self) -> dict[str, int]:
        """Agents that are not running although no fault holds them down: node -> exit code."""
        return {name: node.agent.proc.returncode for name, node in self.nodes.items()
                if node.agent.proc is not None and node.agent.proc.poll() is not None and not node.lock.locked()}

    def __exit__(self, *exc) -> None:
        for node in self.nodes.values():
            node.agent.stop(timeout_s=10)
            node.engine.stop()
        if self.server is not None:
            self.server.stop()
        for proxy in self.proxies.values():
            proxy.stop()
        if self.moto is not None:
            self.moto.stop()
        if self.database is not None:
            self.database.drop()

    # -- faults --------------------------------------------------------------------------------------------------

    def kill_server(self) -> None:
        with self.server_lock:
            _killpg(self.server.proc)

    def start_server(self) -> float:
        """Start the killed server again (same port, same database); seconds until healthy."""
        with self.server_lock:
            self.server.start()
            return self.server.startup_s

    def outage(self, on: bool) -> None:
        """Every node's and every reader's S3 answers 503 SlowDown (``on``), or serves again."""
        for proxy in self.proxies.values():
            proxy.outage("slowdown" if on else None)

    def publish(self, kind: str, **extra) -> dict:
        """The trainer publishes its next step; what its result says (version, whether the nodes were told)."""
        started = time.monotonic()
        result, _ = self.trainer.publish(kind, **extra)
        return {"version": result.version, "seconds": round(time.monotonic() - started, 2),
                "event_delivered": getattr(result, "event_delivered", None),
                "event_error": getattr(result, "event_error", None)}

    def recover(self, name: str) -> dict:
        """What an operator does for a poisoned node: ``python -m flows.refit recover`` on its store."""
        node = self.nodes[name]
        done = subprocess.run([PYTHON, "-m", "flows.refit", "recover", "--model", MODEL, "--cache-dir",
                               str(node.agent.cache), "--json"], cwd=ROOT, env=node.agent.env, capture_output=True,
                              text=True, timeout=120)
        lines = done.stdout.strip().splitlines()
        return {"node": name, "exit": done.returncode, "result": lines[-1] if lines else done.stderr[-500:]}

    def diagnostics(self) -> str:
        return "\n".join(n.agent.diagnostics() for n in self.nodes.values())
