"""Node agents as processes: ``python -m deployments.serve --node NAME --name-suffix -NAME ...``, one per node.

``NodeProcess`` runs one node's agent with its own cache, Prefect home and
log (a fresh log per start), in its own session; it is started, stopped
(SIGTERM: the agent stops at a safe point), killed (SIGKILL: a crashed host)
and restarted by PID, and reads the node's installed version from its own
``active.json``. ``agent_module`` may name the wrapper below instead of
``deployments.serve``:

    python -m testbed.nodes agent SPANS.jsonl SERVE-ARGS...

runs ``deployments.serve`` with every stage's [start, end] (and the steps of a
run outside its stages) appended to ``SPANS.jsonl`` (the warm benchmark).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed.processes import PYTHON, ROOT, process_cpu_seconds, process_rss_bytes, stop_group, tail


@dataclass
class NodeProcess:
    """One node: ``python -m deployments.serve`` for ``name``, with its own cache, Prefect home and log."""

    name: str
    root: Path
    catalog: str
    model: str
    seed: Path
    env: dict[str, str]  # PREFECT_API_URL, PREFECT_HOME, AWS credentials, ...
    s3_endpoint: str | None = None
    poll_s: float | None = None
    installer: tuple[str, ...] = ("--installer", "none")
    extra: tuple[str, ...] = ()
    agent_module: tuple[str, ...] = ("-m", "deployments.serve")
    proc: subprocess.Popen | None = None
    starts: int = 0
    logs: list[Path] = field(default_factory=list)

    def __post_init__(self):
        self.root = Path(self.root) / self.name
        self.root.mkdir(parents=True, exist_ok=True)
        self.cache = self.root / "cache"

    @property
    def suffix(self) -> str:
        return f"-{self.name}"

    @property
    def deployments(self) -> dict[str, str]:
        """Short name -> full deployment name on the server (publish only where the agent serves it)."""
        names = {"latest": f"refit/refit-latest{self.suffix}", "on_publish": f"refit/refit-on-publish{self.suffix}"}
        if "--serve-publish" in self.extra:
            names["publish"] = f"publish/publish{self.suffix}"
        return names

    def argv(self) -> list[str]:
        cmd = [PYTHON, *self.agent_module, "--node", self.name, f"--name-suffix={self.suffix}",
               "--catalog", self.catalog, "--model", self.model, "--seed-checkpoint", str(self.seed),
               "--cache-dir", str(self.cache), "--apply-workers", "2", *self.installer]
        if self.s3_endpoint:
            cmd += ["--s3-endpoint-url", self.s3_endpoint]
        if self.poll_s is not None:
            cmd += ["--poll-seconds", str(self.poll_s)]
        return cmd + list(self.extra)

    @property
    def log(self) -> Path:
        return self.logs[-1] if self.logs else self.root / "agent-1.log"

    def start(self) -> "NodeProcess":
        assert not self.alive, f"{self.name} is already running"
        self.starts += 1
        log = self.root / f"agent-{self.starts}.log"
        self.logs.append(log)
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(self.argv(), env=self.env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the agent stops at a safe point and exits); SIGKILL after ``timeout_s``."""
        stop_group(self.proc, timeout_s)
        return self.proc.returncode if self.proc else None

    def kill(self) -> None:
        """SIGKILL, no warning: a crashed host."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def store(self):
        from storage.store.local_store import LocalStore

        return LocalStore(self.cache, self.model, create=False)

    def active_version(self) -> str | None:
        """The installed version, from the node's own ``active.json``."""
        from storage.errors import RefitError

        try:
            store = self.store()
            active = store.active() if store.exists else None
        except RefitError:
            return None
        return active.version if active else None

    def rss_bytes(self) -> int:
        return process_rss_bytes(self.proc.pid) if self.alive else 0

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid) if self.alive else 0.0

    def diagnostics(self) -> str:
        return f"--- {self.name} ({self.log.name}) ---\n{tail(self.log)}"


# -- an agent that also records its stages' spans (the warm benchmark) -----------------------------------------


def _install_span_recorder(path: Path) -> None:
    """Every Receiver the refit code builds records each stage's [start, end] (Unix time) into ``path``."""
    import tasks.receiver
    from contextlib import contextmanager

    base = tasks.receiver.Receiver

    class SpanReceiver(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._spans: list[dict] = []

        @contextmanager
        def stage(self, name):
            start = time.time()
            try:
                with super().stage(name) as record:
                    yield record
            finally:
                self._spans.append({"stage": name, "start": start, "end": time.time()})

        def close(self):
            from prefect.context import FlowRunContext

            context = FlowRunContext.get()
            run_id = str(context.flow_run.id) if context and context.flow_run else None
            with open(path, "a") as fh:
                fh.write(json.dumps({"flow_run": run_id, "target": self.params.target, "spans": self._spans}) + "\n")
            super().close()

    tasks.receiver.Receiver = SpanReceiver
    import flows.refit
    import flows.report

    flows.refit.Receiver = SpanReceiver

    def timed(name: str, fn):
        """``fn``, also recording its span as a step of the run outside its stages (``extra``)."""
        def wrapper(*args, **kwargs):
            from prefect.context import FlowRunContext

            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                context = FlowRunContext.get()
                run_id = str(context.flow_run.id) if context and context.flow_run else None
                with open(path, "a") as fh:
                    fh.write(json.dumps({"flow_run": run_id, "extra": name, "start": start, "end": time.time()})
                             + "\n")
        return wrapper

    flows.refit.report_node = timed("node record and event", flows.refit.report_node)
    reporter = flows.report.PrefectReporter
    reporter.__init__ = timed("progress artifact", reporter.__init__)
    reporter.publish_result = timed("result artifacts", reporter.publish_result)


def agent_main(argv: list[str]) -> int:
    """``python -m testbed.nodes agent SPANS.jsonl SERVE-ARGS...``: deployments.serve, stage spans recorded."""
    _install_span_recorder(Path(argv[0]))
    from deployments.serve import main

    return main(argv[1:])


if __name__ == "__main__":
    if sys.argv[1:2] == ["agent"]:
        raise SystemExit(agent_main(sys.argv[2:]))
    raise SystemExit("usage: python -m testbed.nodes agent SPANS.jsonl SERVE-ARGS...")
