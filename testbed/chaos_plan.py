"""The chaos command's faults: a plan drawn from a seed, and the threads that inject and heal them.

Four kinds (``--faults``):

* ``agent``: the node's agent is killed with SIGKILL, and started again
  after ``down_s``; with ``engine_too`` its engine is also killed and
  restarted on its launch weights while the agent is down (the dead agent's
  record must stop counting by itself);
* ``engine``: the node's engine is killed with SIGKILL and started again on
  its launch weights (``weight_version`` "default") after ``down_s``;
* ``storage``: every node's S3, and the barrier readers', answer 503
  SlowDown for ``down_s`` (needs ``--storage s3``);
* ``server``: the Prefect server is killed with SIGKILL and started again
  on the same port and database after ``down_s``.

Each fault belongs to one publication (``slot``) and fires at a **phase**
of it: ``before-publish`` (server, storage: the publication is made while
it is down), ``wave`` (a drawn delay after the publication: the refits are
running), ``installed`` (the node's engine reports the new version: its run
has not written its record yet), ``recorded`` (the node's record claims the
new version: the run is in its bookkeeping; for the server and storage, the
first node's record does, the others are still in their runs), ``idle`` (a
drawn delay after ``recorded``). The phase the node was really in when the fault fired (what
its engine reported and its record claimed) is kept with the fault.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass, field

KINDS = ("agent", "engine", "storage", "server")
PHASES = {"agent": ("wave", "installed", "recorded", "idle"), "engine": ("wave", "installed", "recorded", "idle"),
          "storage": ("before-publish", "wave", "recorded", "idle"),
          "server": ("before-publish", "wave", "recorded", "idle")}


@dataclass
class Fault:
    kind: str
    slot: int  # the publication (1..revisions) it belongs to
    phase: str
    node: str | None = None
    delay_s: float = 0.0  # after the publication (wave) or after the record claims it (idle)
    down_s: float = 0.0
    engine_too: bool = False  # agent: its engine restarts too while it is down
    fired_at_s: float | None = None
    healed_at_s: float | None = None
    seen_at_fire: dict = field(default_factory=dict)  # what the node's engine reported and its record claimed
    error: str | None = None

    def describe(self) -> str:
        where = f" {self.node}" if self.node else ""
        extra = " (+ its engine restarted meanwhile)" if self.engine_too else ""
        return f"{self.kind} kill{where} at r{self.slot} ({self.phase}), down {self.down_s:.1f}s{extra}" if \
            self.kind in ("agent", "engine", "server") else f"storage outage at r{self.slot} ({self.phase}), " \
                                                            f"{self.down_s:.1f}s"


def make_plan(seed: int, nodes: list[str], revisions: int, kinds: tuple[str, ...], *, small: bool,
              window_s: float, outage_s: float, load_s: float = 0.0) -> list[Fault]:
    """The faults of one run, drawn from ``seed``: in ``small`` mode one of each kind, else about one agent and one
    engine fault for every two nodes, one storage outage and one server kill; each at a drawn publication and phase.
    An agent stays down longer than ``window_s`` (so its record must go stale); a ``wave`` fault fires within
    1 s plus an engine's ``load_s`` of the publication (so that it may land in a load)."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    busy: dict[tuple[str, int], bool] = {}  # (node, slot): one process fault per node and publication
    slots = list(range(1, revisions + 1))
    for kind in kinds:
        count = 1 if small or kind in ("storage", "server") else max(1, len(nodes) // 2)
        for _ in range(count):
            slot = rng.choice(slots)
            fault = Fault(kind, slot, rng.choice(PHASES[kind]))
            if kind in ("agent", "engine"):
                free = [n for n in nodes if not busy.get((n, slot))] or nodes
                fault.node = rng.choice(free)
                busy[(fault.node, slot)] = True
            if kind == "agent":
                fault.down_s = round(window_s + rng.uniform(1.0, 4.0), 1)
                fault.engine_too = small or rng.random() < 0.5
            elif kind == "engine":
                fault.down_s = round(rng.uniform(0.3, 2.5), 1)
            else:
                fault.down_s = round(outage_s * rng.uniform(0.8, 1.2), 1)
            fault.delay_s = round(rng.uniform(0.0, 1.0 + load_s) if fault.phase == "wave" else rng.uniform(0.5, 2.0), 2)
            faults.append(fault)
    return sorted(faults, key=lambda f: (f.slot, f.kind))


class FaultRunner:
    """Fires the plan's faults at their phases, heals them after ``down_s``, and keeps what happened."""

    def __init__(self, fleet, watcher, plan: list[Fault], *, phase_timeout_s: float, log=print):
        self.fleet, self.watcher, self.plan, self.log = fleet, watcher, plan, log
        self.phase_timeout_s = phase_timeout_s
        self.threads: list[threading.Thread] = []

    def before_publish(self, slot: int) -> None:
        """Fire this publication's ``before-publish`` faults now (they heal in the background)."""
        for fault in self.plan:
            if fault.slot == slot and fault.phase == "before-publish":
                self._inject(fault)
                self._spawn(self._heal_after, fault)

    def after_publish(self, slot: int, version: str) -> None:
        for fault in self.plan:
            if fault.slot == slot and fault.phase != "before-publish":
                self._spawn(self._run, fault, version)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="chaos-fault")
        self.threads.append(thread)
        thread.start()

    def join(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def ended_at(self) -> float:
        """When the last fault was healed (seconds since the watcher started)."""
        return max((f.healed_at_s or 0.0 for f in self.plan), default=0.0)

    def _run(self, fault: Fault, version: str) -> None:
        try:
            self._until_phase(fault, version)
            self._inject(fault)
            self._heal_after(fault)
        except Exception as exc:  # a fault that could not be injected or healed is reported, never hidden
            fault.error = f"{type(exc).__name__}: {exc}"
            self.log(f"chaos: {fault.describe()}: {fault.error}")

    def _until_phase(self, fault: Fault, version: str) -> None:
        if fault.phase == "wave":
            time.sleep(fault.delay_s)
            return
        track = self.watcher.tracks.get(fault.node) if fault.node else None
        deadline = time.monotonic() + self.phase_timeout_s

        def reached() -> bool:
            if fault.phase == "installed":
                return track is not None and track.engine == version
            if track is not None:
                return track.claim == version
            return any(t.claim == version for t in self.watcher.tracks.values())  # the others mid-run

        while not reached() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not reached():
            fault.phase += " (not reached: fired at its timeout)"
        if fault.phase.startswith("idle"):
            time.sleep(fault.delay_s)

    def _now(self) -> float:
        return round(time.monotonic() - self.watcher.started, 2)

    def _inject(self, fault: Fault) -> None:
        if fault.node:
            track = self.watcher.tracks[fault.node]
            fault.seen_at_fire = {"engine": track.engine, "claims": track.claim}
        fault.fired_at_s = self._now()
        self.log(f"chaos: {fault.describe()}: fired at {fault.fired_at_s:.1f}s")
        if fault.kind == "agent":
            self.fleet.nodes[fault.node].lock.acquire()
            self.fleet.nodes[fault.node].agent.kill()
        elif fault.kind == "engine":
            self.fleet.nodes[fault.node].lock.acquire()
            self.fleet.nodes[fault.node].engine.kill()
        elif fault.kind == "storage":
            self.fleet.outage(True)
        else:
            self.fleet.kill_server()

    def _heal_after(self, fault: Fault) -> None:
        node = self.fleet.nodes.get(fault.node) if fault.node else None
        try:
            if fault.kind == "agent" and fault.engine_too:
                time.sleep(fault.down_s / 2)
                node.engine.kill()
                node.engine.start()
                time.sleep(fault.down_s / 2)
            else:
                time.sleep(fault.down_s)
            if fault.kind == "agent":
                node.agent.start()
            elif fault.kind == "engine":
                node.engine.start()
            elif fault.kind == "storage":
                self.fleet.outage(False)
            else:
                self.fleet.start_server()
        finally:
            if node is not None:
                node.lock.release()
            fault.healed_at_s = self._now()


def plan_json(plan: list[Fault]) -> list[dict]:
    return [asdict(f) for f in plan]
