"""Publisher crash trials: a trainer killed at any instant of a publication never wedges the catalog.

A trial copies a world where r0 and r1 are published (catalog, payloads and
the publisher's kept copy), runs ``flows.publish.run_publish`` of the next
training step in a child process that SIGKILL ends at a publisher kill point
(``storage.runtime.killpoints.PUBLISH_POINTS``) or at a random moment, then runs the
next publication as a restarted trainer would, with no manual step:

- ``same``: the same command again (the same checkpoint, auto-named);
- ``next``: the next step's command (a newer checkpoint, auto-named).

It must succeed, and then every record of the catalog is valid, no two share
a sequence, the orphaned payload (if any) is referenced by no record, and a
fresh receiver refits to ``latest`` byte-exactly. ``tests/crash/test_crash.py`` runs
every point in CI; ``python -m tests.support.crash_harness --publisher`` the full mode.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import tests.support.crash_support as cs

MODES = ("same", "next")


@dataclass
class PublishWorld:
    """r0 and r1 published; the checkpoints of the next two training steps on disk with their digests."""

    root: Path
    lab: object
    steps: list[Path] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    publish_s: float = 1.0  # how long a child's publication takes here (random kills fall inside it)
    children: cs.Children = field(default_factory=lambda: cs.Children(cs.child_publish))

    @property
    def golden(self) -> Path:
        return self.lab.root


def build_world(root: Path) -> PublishWorld:
    from flows.synthetic import train_step
    from tests.support.lab import Lab, independent_digest, tiny_shape

    lab = Lab(Path(root) / "lab", shape=tiny_shape())
    lab.publish("initial")
    lab.publish("delta")
    world = PublishWorld(Path(root), lab)
    step2 = lab.next_step()
    for name, tensors in (("next-2", step2), ("next-3", train_step(step2, seed=7003))):
        world.steps.append(lab.write(tensors, name))
        world.digests.append(independent_digest(tensors)[1])
    times = []
    for n in range(3):  # the first child also warms the page cache and the forkserver
        calibration = Path(root) / f"calibrate-{n}"
        shutil.copytree(world.golden, calibration / "lab", symlinks=True)
        started = time.monotonic()
        out = world.children.run(job(world, calibration, world.steps[0]))
        times.append(time.monotonic() - started)
        if out.get("status") != "PUBLISHED":
            raise RuntimeError(f"calibration publication failed: {out}")
    world.publish_s = min(times)
    return world


@dataclass
class PublishTrial:
    kill: str  # "point:name:n" or "random:seconds"
    mode: str  # what the restarted trainer publishes: the same checkpoint, or the next step's
    killed: bool = False
    reached: str | None = None
    next_result: dict = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def plan_trials(world: PublishWorld, count: int, *, seed: int) -> list[PublishTrial]:
    """Every publisher kill point in both modes first, then random moments."""
    from storage.runtime.killpoints import PUBLISH_POINTS

    trials = [PublishTrial(f"point:{p}:1", mode) for p in PUBLISH_POINTS for mode in MODES]
    rng = random.Random(seed)
    while len(trials) < count:
        trials.append(PublishTrial(f"random:{rng.uniform(0.0, world.publish_s):.3f}", rng.choice(MODES)))
    return trials


def job(world: PublishWorld, root: Path, checkpoint: Path, **extra) -> dict:
    lab_root = root / "lab"
    out = {"catalog": f"file://{lab_root / 'catalog'}", "model": world.lab.model, "checkpoint": str(checkpoint),
           "state_dir": str(lab_root / "publisher"), "log": str(root / "publish.log"),
           "result": str(root / "result.json")}
    out.update(extra)
    return out


def run_trial(world: PublishWorld, trial: PublishTrial, root: Path) -> PublishTrial:
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(world.golden, root / "lab", symlinks=True)
    kplog = root / "killpoints.log"
    first = job(world, root, world.steps[0], env={"CANONICAL_REFIT_KILLPOINT_LOG": str(kplog)})
    if trial.kill.startswith("point:"):
        first["env"]["CANONICAL_REFIT_KILLPOINT"] = trial.kill.split(":", 1)[1]
        out = world.children.run(first)
    else:
        out = world.children.run(first, kill_after_s=float(trial.kill.split(":")[1]))
    trial.killed = out.get("status") == "KILLED"
    trial.reached = kplog.read_text().split()[-1] if kplog.exists() and kplog.read_text().split() else None
    if trial.kill.startswith("point:") and not trial.killed:
        trial.violations.append(f"the publisher was not killed at {trial.kill}: {out}")
    nxt = world.steps[0] if trial.mode == "same" else world.steps[1]
    trial.next_result = world.children.run(job(world, root, nxt))
    if trial.next_result.get("status") != "PUBLISHED":
        trial.violations.append(f"the next publication failed: {trial.next_result}")
        return trial
    want = world.digests[0] if trial.mode == "same" else world.digests[1]
    trial.violations += check_catalog(world, root, trial.next_result, want)
    return trial


def check_catalog(world: PublishWorld, root: Path, published: dict, want_digest: str) -> list[str]:
    """Every record valid, sequences unique, orphans unreferenced, and a fresh node refits to latest exactly."""
    from flows.refit import run_refit
    from storage.catalog.records import Catalog
    from storage.objects.store import ObjectStore
    from storage.settings import InstallerSettings, RefitParams

    bad = []
    catalog_dir = root / "lab" / "catalog"
    catalog = Catalog(ObjectStore(), f"file://{catalog_dir}", world.lab.model)
    records = [catalog.read(v) for v in catalog.versions()]
    sequences = [r.sequence for r in records]
    if len(set(sequences)) != len(sequences):
        bad.append(f"two records share a sequence: {sorted(sequences)}")
    latest = catalog.latest()
    if (latest.version, latest.target_digest) != (published["version"], want_digest):
        bad.append(f"latest is {latest.version} {latest.target_digest}, published {published}")
    for record in records:  # a record is written last: whatever it references is complete
        if record.uri is None:
            continue
        index = Path(record.uri.removeprefix("file://"))
        if not index.is_file():
            bad.append(f"{record.version} references a missing index {index}")
            continue
        names = set(json.loads(index.read_text())["weight_map"].values())
        missing = [n for n in names if not (index.parent / n).is_file()]
        if missing:
            bad.append(f"{record.version} references missing objects {missing}")
    params = RefitParams(catalog=f"file://{catalog_dir}", model=world.lab.model, seed_checkpoint=str(world.lab.launch),
                         cache_dir=root / "node", target="latest", installer=InstallerSettings(kind="none"),
                         apply_workers=2, lock_timeout_s=30)
    result = run_refit(params)
    if result.status != "READY" or result.target_digest != want_digest:
        bad.append(f"a fresh node did not refit to latest exactly: {result.status} {result.error} "
                   f"{result.target_digest} (want {want_digest})")
    return bad


def summarize(trials: list[PublishTrial]) -> dict:
    from storage.runtime.killpoints import PUBLISH_POINTS

    reached = {t.kill.split(":")[1] for t in trials if t.kill.startswith("point:") and t.killed}
    return {"trials": len(trials), "killed": sum(t.killed for t in trials),
            "recovered": sum(t.ok for t in trials), "kill_points": sorted(reached),
            "kill_points_not_reached": sorted(set(PUBLISH_POINTS) - reached),
            "failures": [{"kill": t.kill, "mode": t.mode, "reached": t.reached, "violations": t.violations}
                         for t in trials if not t.ok]}
