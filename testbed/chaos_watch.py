"""The chaos command's judge: every node's claim against what its engine runs, and every barrier's answer.

``Watcher`` samples, every ``sample_s``, each node's status record (read
straight from storage, never through a node's faulty proxy) and what its
engine reports (``GET /model_info``'s ``weight_version``). A node *claims* a
version V when ``flows.fleet wait`` would count it there: its record's
``condition()`` is not POISONED, STALE or DRIFTED and its ``version`` is V.

The contract (docs/fleet.md, "Chaos") allows a claim to outlive the
engine's change by one heartbeat plus the stale grace (``window_s``): the
next heartbeat, or the record going stale, takes it back. A sample is
**false READY** when the node claims V and its engine has not reported V
since a sample more than ``window_s`` ago (the time counted from the first
sample that saw the engine off V, giving the claim the benefit of the
sampling gap). The seconds of such samples are summed per node.

``Judge`` runs the barrier as a trainer does, ``python -m flows.fleet wait``
(a process) and ``flows.api.wait_for`` (a thread), and judges each answer
at the moment it comes: ``reached`` is **wrong** when an expected node's
engine has not reported the version (or a newer one) within ``window_s``;
``failed`` is wrong (every revision the chaos publishes is valid); ``poisoned``
is wrong unless a node it names was seen poisoned. A ``timeout`` is counted,
not judged wrong.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import dataclass, field

from testbed.chaos_fleet import AWS, MODEL, ChaosFleet
from testbed.processes import PYTHON, ROOT


@dataclass
class NodeTrack:
    """What the watcher knows of one node."""

    engine: str | None = None  # what the engine reported at the last sample
    last_seen: dict = field(default_factory=dict)  # version -> last sample time the engine reported it
    off_since: dict = field(default_factory=dict)  # version -> first sample time after last_seen that did not
    claim: str | None = None
    claim_since: float = 0.0
    poisoned_at: float | None = None  # last sample at which the record said POISONED
    false_ready_s: float = 0.0
    false_samples: int = 0
    episodes: list = field(default_factory=list)  # [{version, engine, from_s, to_s}]

    def engine_off_since(self, version: str, now: float) -> float | None:
        """Since when the engine has not run ``version`` (None: it runs it now)."""
        if self.engine == version:
            return None
        if version in self.off_since:
            return self.off_since[version]
        return self.claim_since if self.claim == version else now


class Watcher:
    """Samples every node's record and engine (a thread); ``false_ready`` and ``converged`` read its state."""

    def __init__(self, fleet: ChaosFleet, window_s: float, sample_s: float = 0.25):
        from storage.objects.store import ObjectStore

        self.fleet, self.window_s, self.sample_s = fleet, window_s, sample_s
        self.objects = ObjectStore.shared(fleet.storage_settings(fleet.moto.url if fleet.moto else None))
        self.tracks = {name: NodeTrack() for name in fleet.nodes}
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.samples = 0
        self.read_errors = 0
        self.records: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-watcher", daemon=True)
        self.on_poisoned = None  # callback(node) when a record says POISONED

    def start(self) -> "Watcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            self.sample(min(time.monotonic() - last, 1.0))
            last = time.monotonic()
            self._stop.wait(self.sample_s)

    def sample(self, dt: float) -> None:
        from storage.catalog.nodes import DRIFTED, STALE, scan_node_records
        from storage.errors import RefitError

        engines = {name: node.engine.report() for name, node in self.fleet.nodes.items()}
        try:
            scan = scan_node_records(self.objects, self.fleet.catalog, MODEL)
        except RefitError:
            self.read_errors += 1
            return
        now = time.monotonic()
        by_name = {r.node: r for r in scan.records}
        with self.lock:
            self.samples += 1
            self.records = by_name
            for name, track in self.tracks.items():
                reported = engines[name]
                track.engine = reported
                for version in list(track.last_seen):
                    if version != reported and version not in track.off_since:
                        track.off_since[version] = now
                if reported is not None:
                    track.last_seen[reported] = now
                    track.off_since.pop(reported, None)
                record = by_name.get(name)
                condition = record.condition() if record is not None else None
                if condition == "POISONED":
                    track.poisoned_at = now
                    if self.on_poisoned is not None:
                        self.on_poisoned(name)
                claim = None if record is None or condition in ("POISONED", STALE, DRIFTED) else record.version
                if claim != track.claim:
                    track.claim, track.claim_since = claim, now
                self._judge_claim(track, claim, now, dt)

    def _judge_claim(self, track: NodeTrack, claim: str | None, now: float, dt: float) -> None:
        if claim is None:
            return
        off = track.engine_off_since(claim, now)
        if off is None or now - off <= self.window_s:
            return
        track.false_ready_s += dt
        track.false_samples += 1
        since = round(off - self.started, 2)
        if track.episodes and track.episodes[-1]["version"] == claim and track.episodes[-1]["engine_off_at_s"] == since:
            track.episodes[-1]["last_at_s"] = round(now - self.started, 2)
        else:
            track.episodes.append({"version": claim, "engine": track.engine, "engine_off_at_s": since,
                                   "first_at_s": round(now - self.started, 2), "last_at_s": round(now - self.started, 2)})

    def confirmed(self, name: str, at_or_above, when: float) -> bool:
        """Did the engine of ``name`` run a version ``at_or_above`` accepts within ``window_s`` before ``when``?"""
        with self.lock:
            track = self.tracks[name]
            if track.engine is not None and at_or_above(track.engine):
                return True
            return any(at_or_above(v) and when - track.off_since.get(v, when) <= self.window_s
                       for v in track.last_seen)

    def poisoned_since(self, name: str, since: float) -> bool:
        with self.lock:
            at = self.tracks[name].poisoned_at
            return at is not None and at >= since - self.window_s

    def on_latest(self, version: str) -> bool:
        """Every node's engine reports ``version`` and its record claims it."""
        with self.lock:
            return all(t.engine == version and t.claim == version for t in self.tracks.values())

    def where(self) -> dict:
        with self.lock:
            return {name: {"engine": t.engine, "claims": t.claim,
                           "record": self.records[name].condition() if name in self.records else None}
                    for name, t in self.tracks.items()}


class Judge:
    """Starts barriers (CLI and API) for published versions and judges each answer when it comes."""

    def __init__(self, fleet: ChaosFleet, watcher: Watcher, sequence: dict[str, int], poll_s: float = 0.5):
        self.fleet, self.watcher, self.sequence, self.poll_s = fleet, watcher, sequence, poll_s
        self.answers: list[dict] = []
        self.threads: list[threading.Thread] = []
        self.procs: list[subprocess.Popen] = []
        self.lock = threading.Lock()

    def at_or_above(self, version: str):
        wanted = self.sequence[version]
        return lambda v: v in self.sequence and self.sequence[v] >= wanted

    def start(self, version: str, timeout_s: float, *, cli: bool = True, api: bool = True) -> None:
        if cli:
            self._spawn(self._cli, version, timeout_s)
        if api:
            self._spawn(self._api, version, timeout_s)

    def _spawn(self, target, version: str, timeout_s: float) -> None:
        thread = threading.Thread(target=target, args=(version, timeout_s), daemon=True, name=f"wait-{version}")
        self.threads.append(thread)
        thread.start()

    def _cli(self, version: str, timeout_s: float) -> None:
        expect = [a for name in self.fleet.nodes for a in ("--expect", name)]
        endpoint = self.fleet.waiter_endpoint()
        argv = [PYTHON, "-m", "flows.fleet", "wait", "--catalog", self.fleet.catalog, "--model", MODEL,
                "--version", version, *expect, "--timeout", str(timeout_s), "--poll", str(self.poll_s), "--json"]
        if endpoint:
            argv += ["--s3-endpoint-url", endpoint]
        started = time.monotonic()
        env = self.fleet.server.client_env(self.fleet.root / "waiter-home", **(AWS if endpoint else {}))
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with self.lock:
            self.procs.append(proc)
        out, err = proc.communicate()
        answered = time.monotonic()
        lines = out.strip().splitlines()
        try:
            said = json.loads(lines[-1]) if lines else {}
        except ValueError:
            said = {}
        outcome = said.get("outcome") or {0: "reached", 1: "timeout", 3: "poisoned", 4: "failed"}.get(
            proc.returncode, f"exit {proc.returncode}")
        self._judge("cli", version, outcome, proc.returncode, said.get("poisoned") or [], started, answered,
                    detail=said.get("failures") or (err.strip()[-400:] if proc.returncode not in (0, 1, 3, 4) else None))

    def _api(self, version: str, timeout_s: float) -> None:
        from flows.api import wait_for

        started = time.monotonic()
        try:
            outcome = wait_for(version, catalog=self.fleet.catalog, model=MODEL, expect=list(self.fleet.nodes),
                               timeout_s=timeout_s, poll_s=self.poll_s,
                               storage=self.fleet.storage_settings(self.fleet.waiter_endpoint()), check=False)
            kind, poisoned, detail = outcome.outcome, outcome.poisoned, outcome.failures or None
        except Exception as exc:  # an answer too: a barrier that raises instead of waiting through
            kind, poisoned, detail = f"raised {type(exc).__name__}", [], str(exc)[:400]
        self._judge("api", version, kind, None, poisoned, started, time.monotonic(), detail=detail)

    def _judge(self, how: str, version: str, outcome: str, code, poisoned: list, started: float, answered: float,
               detail=None) -> None:
        wrong = None
        if outcome == "reached":  # the engines asked now, and what the watcher saw of them before (the window)
            accepts = self.at_or_above(version)
            off = [n for n, node in self.fleet.nodes.items()
                   if not (accepts(node.engine.report() or "") or self.watcher.confirmed(n, accepts, answered))]
            if off:
                wrong = f"reached, but the engines of {', '.join(off)} do not run {version} or newer"
        elif outcome == "poisoned":  # the watcher may see the record a sample later than the barrier did
            deadline = time.monotonic() + 3.0
            while not any(self.watcher.poisoned_since(n, started) for n in poisoned) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not any(self.watcher.poisoned_since(n, started) for n in poisoned):
                wrong = f"poisoned: {', '.join(poisoned)}, never seen poisoned"
        elif outcome == "failed":
            wrong = f"failed, though every revision is valid: {detail}"
        elif outcome != "timeout":
            wrong = f"{outcome}: {detail}"
        answer = {"how": how, "version": version, "outcome": outcome, "exit": code,
                  "after_s": round(answered - started, 2), "at_s": round(answered - self.watcher.started, 2),
                  "wrong": wrong, "where": self.watcher.where() if wrong else None}
        with self.lock:
            self.answers.append(answer)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
        for thread in self.threads:
            thread.join(5)
