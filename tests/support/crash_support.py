"""Refit children to kill, a stand-in engine, and the invariants a store must keep across crashes.

The children run the product's own runbook (``flows.refit.run_refit``, the
body of the refit flow); outside a flow run its stages run as plain
functions, so a trial costs a fork instead of a Prefect start-up. They are forked from a ``forkserver``
that imported the pipeline once; each child re-reads the kill-point
environment (``storage.runtime.killpoints`` is reloaded in the child, so the
functions the stages already hold see the new settings).

The engine is a stand-in (``RecordingEngine``): at every install it hashes
the checkpoint it was given with an implementation written from docs/format.md
section 3 alone, so a test can prove no unverified byte was ever installed.
Expected bytes come from the ``Lab`` that published them, never from the
code under test.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import signal
import struct
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec
from fsspec.implementations.local import LocalFileSystem

PRELOAD = ["crash_support", "flows.refit", "flows.publish"]


# --- a filesystem that counts downloads across processes ------------------------------------------


class CountingFileSystem(LocalFileSystem):
    """``countfile://`` = ``file://`` that appends one line per download to ``$COUNTFS_LOG``."""

    protocol = ("countfile",)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("countfile://"):
            path = path[len("countfile://"):]
        return super()._strip_protocol(path)

    def get_file(self, rpath, lpath, **kwargs):
        log = os.environ.get("COUNTFS_LOG")
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps({"pid": os.getpid(), "path": str(rpath)}) + "\n").encode())
            finally:
                os.close(fd)
        return super().get_file(rpath, lpath, **kwargs)


if TYPE_CHECKING:
    from tests.support.crash_trials import World

fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)


def downloads(log: Path) -> list[dict]:
    """Every download the counting filesystem saw."""
    if not Path(log).exists():
        return []
    return [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]


# --- an independent reader (docs/format.md, section 3 only; no project code) ------------------------------------


def raw_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """``{name: (dtype, shape, bytes)}`` of every ``*.safetensors`` file in ``folder``."""
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            out[name] = (entry["dtype"], entry["shape"], data[8 + n + start : 8 + n + end])
    return out


def folder_digest(folder: Path) -> str:
    """Snapshot digest (adler32) of a checkpoint folder, computed from its raw bytes."""
    tensors = raw_tensors(folder)
    layout = sorted(({"name": k, "dtype": d, "shape": s} for k, (d, s, _) in tensors.items()),
                    key=lambda e: e["name"])
    fmt = "sha256:" + hashlib.sha256(json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    sums = {k: f"{zlib.adler32(b, 1) & 0xffffffff:08x}" for k, (_, _, b) in tensors.items()}
    body = {"checksum_format": "adler32", "format_digest": fmt, "tensors": sums}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# --- the stand-in engine ---------------------------------------------------------------------------------


class RecordingEngine:
    """An engine stand-in: loads (hashes) the checkpoint and remembers what it runs.

    ``engine.json`` is what the engine runs now; ``engine.log`` one line per
    completed load with the digest claimed by the receiver and the digest of
    the bytes actually read. ``gate``: a file to wait for before loading (a
    slow load, so a test can hold the installation fence open).
    """

    name = "recording-engine"

    def __init__(self, state: Path, gate: Path | None = None, gate_timeout_s: float = 60.0):
        self.state, self.gate, self.gate_timeout_s = Path(state), gate, gate_timeout_s

    @property
    def log(self) -> Path:
        return self.state.with_suffix(".log")

    def install(self, request):
        from tasks.installers import InstallOutcome

        _event(self.state.parent, "install.start", request.version)
        if self.gate is not None:
            deadline = time.monotonic() + self.gate_timeout_s
            while not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        got = folder_digest(request.path)
        line = {"pid": os.getpid(), "version": request.version, "claimed": request.digest, "bytes": got}
        _append(self.log, line)
        tmp = self.state.with_name(f".{self.state.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(line))
        os.replace(tmp, self.state)
        _event(self.state.parent, "install.done", request.version)
        return InstallOutcome(f"engine loaded {request.version}")

    def is_current(self, identity) -> bool:
        running = self.running()
        return running is not None and running["version"] == identity.version and running["claimed"] == identity.digest

    def running(self) -> dict | None:
        return json.loads(self.state.read_text()) if self.state.exists() else None

    def loads(self) -> list[dict]:
        return [json.loads(x) for x in self.log.read_text().splitlines()] if self.log.exists() else []


def _append(path: Path, value: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(value) + "\n").encode())
    finally:
        os.close(fd)


def _event(folder: Path, what: str, version: str | None) -> None:
    """Ordered cross-process events (``events.log`` next to the engine state)."""
    _append(Path(folder) / "events.log", {"pid": os.getpid(), "what": what, "version": version,
                                          "t": time.monotonic_ns()})


def events(folder: Path) -> list[dict]:
    path = Path(folder) / "events.log"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# --- the receiver's own runbook, in a child process ------------------------------------------------------


def child_refit(job: dict) -> None:
    """Body of one child process: configure kill points, run the product's runbook, write a result file.

    ``flows.refit.run_refit`` is what the flow runs; outside a flow run its
    stages run as plain functions, so a trial costs a fork, not a Prefect start.
    """
    for key in [k for k in os.environ if k.startswith("CANONICAL_REFIT_")]:
        del os.environ[key]
    os.environ.update({k: str(v) for k, v in (job.get("env") or {}).items()})
    os.environ["CANONICAL_REFIT_KILLPOINT_TRACE"] = str(Path(job["cache"]) / "events.log")
    import storage.runtime.killpoints

    importlib.reload(storage.runtime.killpoints)  # same module dict: every bound killpoint() sees the new settings
    logging.basicConfig(filename=job["log"], level=logging.INFO, force=True,
                        format="%(asctime)s %(process)d %(name)s: %(message)s")
    ours = logging.getLogger("canonical_refit")
    ours.handlers.clear()  # no Prefect API handler outside a flow run: the log file is enough
    ours.propagate = True
    from flows.refit import run_refit
    from storage.errors import RefitError
    from storage.settings import RefitParams

    params = RefitParams(catalog=job["catalog"], model=job["model"], seed_checkpoint=job["seed"],
                         cache_dir=job["cache"], target=job["target"], apply_workers=2,
                         lock_timeout_s=job.get("lock_timeout_s", 120), activate=job.get("activate", True),
                         cache_max_gb=job.get("cache_max_gb", 500.0))
    engine = RecordingEngine(Path(job["cache"]) / "engine.json",
                             gate=Path(job["gate"]) if job.get("gate") else None)
    started = time.monotonic()
    result = run_refit(params, installer=engine)
    out = {"status": result.status, "version": result.version, "notes": result.notes, "error": result.error_detail}
    if result.error_detail and not _is_typed(result.error_detail["type"], RefitError):
        out["status"] = "ERROR"  # an untyped error is a finding: report it, do not hide it
    out["seconds"] = time.monotonic() - started
    Path(job["result"]).write_text(json.dumps(out))


def child_publish(job: dict) -> None:
    """Body of one publisher child: kill points configured, the product's publication runbook, a result file."""
    for key in [k for k in os.environ if k.startswith("CANONICAL_REFIT_")]:
        del os.environ[key]
    os.environ.update({k: str(v) for k, v in (job.get("env") or {}).items()})
    import storage.runtime.killpoints

    importlib.reload(storage.runtime.killpoints)
    logging.basicConfig(filename=job["log"], level=logging.INFO, force=True,
                        format="%(asctime)s %(process)d %(name)s: %(message)s")
    from flows.publish import run_publish
    from storage.errors import RefitError
    from storage.settings import PublishParams

    params = PublishParams(catalog=job["catalog"], model=job["model"], checkpoint=job["checkpoint"], kind="delta",
                           state_dir=job["state_dir"], emit_event=False, version=job.get("version"))
    try:
        result = run_publish(params)
        out = {"status": "PUBLISHED", "version": result.version, "sequence": result.sequence, "uri": result.uri}
    except RefitError as exc:
        out = {"status": "FAILED", "error": exc.to_dict()}
    Path(job["result"]).write_text(json.dumps(out))


def _is_typed(name: str, base: type) -> bool:
    def walk(cls):
        yield cls
        for sub in cls.__subclasses__():
            yield from walk(sub)

    return any(cls.__name__ == name for cls in walk(base))


# --- running children -------------------------------------------------------------------------------------


class Children:
    """Forks children (``child_refit`` by default) from a forkserver that imported the pipeline once."""

    def __init__(self, body=None):
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.body = body or child_refit

    def start(self, job: dict):
        proc = self.ctx.Process(target=self.body, args=(job,), daemon=True)
        proc.start()
        return proc

    def run(self, job: dict, *, kill_after_s: float | None = None, timeout_s: float = 120.0) -> dict:
        """Run one child; SIGKILL it after ``kill_after_s`` if given. Returns its result (or how it died)."""
        Path(job["result"]).unlink(missing_ok=True)
        proc = self.start(job)
        if kill_after_s is not None:
            proc.join(kill_after_s)
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout_s)
        if proc.exitcode is None:  # bounded: a hung child is a failure, not a wait
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            return {"status": "HUNG"}
        return self.outcome(job, proc.exitcode)

    @staticmethod
    def outcome(job: dict, exitcode: int) -> dict:
        if exitcode == -signal.SIGKILL:
            return {"status": "KILLED"}
        path = Path(job["result"])
        return json.loads(path.read_text()) if path.exists() else {"status": f"EXIT {exitcode}"}


# --- invariants ---------------------------------------------------------------------------------------------------


def _read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def _identity(folder: Path) -> dict:
    return {e.name: [e.stat().st_size, e.stat().st_mtime_ns] for e in sorted(os.scandir(folder), key=lambda e: e.name)
            if e.is_file(follow_symlinks=False) and not e.name.startswith(".")}


def check_after_crash(world: World, cache: Path) -> list[str]:
    """What must hold at any instant, even right after a SIGKILL."""
    from storage.store.flush import wait_for_flushes

    wait_for_flushes()  # a refit of this process may still be writing its checkpoint back
    bad = []
    store = Path(cache) / world.lab.model.replace("/", "--")
    engine = RecordingEngine(Path(cache) / "engine.json")
    for load in engine.loads():
        want = world.expected_digest(load["version"])
        if load["bytes"] != want or load["claimed"] != want:
            bad.append(f"engine loaded {load['version']} with bytes {load['bytes']}, expected {want}")
    active = _read(store / "active.json")
    if active is not None and active["digest"] != world.expected_digest(active["version"]):
        bad.append(f"active.json names {active['version']} with digest {active['digest']}")
    state = _read(store / "state.json")
    if state is not None and state["status"] == "READY" and state["version"] is not None:
        folder = store / state["source"]
        if not folder.is_dir() or folder_digest(folder) != world.expected_digest(state["version"]):
            bad.append(f"state READY at {state['version']} but {state['source']} does not hold its bytes")
    return bad


def check_recovered(world: World, cache: Path, target: str, *, engine: bool = True) -> list[str]:
    """After recovery: READY at ``target``, byte-exact, verified, and installed consistently."""
    from tests.support.lab import read_checkpoint

    store = Path(cache) / world.lab.model.replace("/", "--")
    want = world.expected_digest(target)
    bad = check_after_crash(world, cache)
    state, active = _read(store / "state.json"), _read(store / "active.json")
    verified = _read(store / "verified" / f"{target}.json")
    if state is None or state["status"] != "READY" or state["version"] != target:
        return bad + [f"state.json is {state}, expected READY at {target}"]
    if verified is None or verified["path"] != state["source"] or verified["target_digest"] != want:
        return bad + [f"verified record of {target} is {verified and {k: verified[k] for k in ('path', 'target_digest')}}"]
    folder = store / verified["path"]
    if _identity(folder) != verified["files"] or state["files"] != verified["files"]:
        bad.append(f"files of {folder} differ from the verified record")
    got = read_checkpoint(folder)  # the safetensors library, not our reader
    expected = world.lab.expected(target)
    if sorted(got) != sorted(expected) or any(got[n].tobytes() != a.tobytes() for n, a in expected.items()):
        bad.append(f"tensors of {folder} are not byte-exact to {target}")
    if active is None or (active["version"], active["digest"], active["path"]) != (target, want, verified["path"]):
        bad.append(f"active.json is {active and {k: active[k] for k in ('version', 'digest', 'path')}}")
    elif active["files"] != verified["files"]:
        bad.append("active.json's file identity differs from the installed checkpoint's")
    running = RecordingEngine(Path(cache) / "engine.json").running()
    if engine and (running is None or running["version"] != target or running["bytes"] != want):
        bad.append(f"the engine runs {running and running['version']}, expected {target}")
    if (store / "poisoned.json").exists():
        bad.append("poisoned.json is left behind")
    for record in (store / "verified").glob("*.json"):
        rec = json.loads(record.read_text())
        if (store / rec["path"]).is_dir() and _identity(store / rec["path"]) == rec["files"]:
            if folder_digest(store / rec["path"]) != world.expected_digest(rec["version"]):
                bad.append(f"verified record {rec['version']} vouches for bytes that are not its revision's")
    vouched = {json.loads(p.read_text())["path"] for p in (store / "verified").glob("*.json")}
    for folder in sorted((store / "materialized").iterdir()):
        if f"materialized/{folder.name}" not in vouched:
            bad.append(f"materialized/{folder.name} is left without a verified record")
    leftovers = [str(p.relative_to(store)) for p in store.rglob(".*") if p.name.endswith((".tmp", ".part"))]
    if leftovers:
        bad.append(f"temporary files left after recovery: {leftovers[:3]}")
    if any(store.joinpath("tmp").iterdir()):
        bad.append("tmp/ is not empty after recovery")
    return bad
