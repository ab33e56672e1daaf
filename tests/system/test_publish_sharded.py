"""One revision published by several trainer ranks at once: the same revision a single publisher makes.

Three ranks each hold a third of a tiny model's tensors. The launch revision is
published by three threads (``flows.api.publish`` with ``rank``), the delta by
three processes (``python -m flows.publish --rank R --world-size 3 --publication
ID``), a full revision by threads again; a single publisher publishes the same
tensors to another catalog. The records are the same but for their payload URL
and time, the delta indexes the same but for the bucket names, and a node
reconstructs byte-identical checkpoints from either. A rank that never comes
leaves nothing visible, and the next publication goes past it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from flows import api
from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint
from tests.support.lab import ROOT_DIR, independent_digest, read_checkpoint, tree_hash
from storage.catalog.records import Catalog
from storage.errors import CatalogError
from storage.objects.store import ObjectStore

MODEL = "lab/sharded"
SHAPE = ModelShape(vocab=512, hidden=64, intermediate=160, layers=2, shards=2)
RANKS = 3


def split(tensors: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    names = sorted(tensors)
    return [{n: tensors[n] for n in names[r::RANKS]} for r in range(RANKS)]


def by_ranks(root: Path, tensors: dict, kind: str, publication: str, **kw) -> list:
    """Every rank's ``flows.api.publish`` of its third (a checkpoint folder of its own), in threads; their results
    by rank."""
    results, errors = [None] * RANKS, []
    folders = [write_checkpoint(root / "trainer" / publication / f"rank{r}", part, shards=1)
               for r, part in enumerate(split(tensors))]

    def rank(r: int) -> None:
        try:
            results[r] = api.publish(folders[r], catalog=f"file://{root}/catalog", model=MODEL, kind=kind,
                                     rank=r, world_size=RANKS, publication=publication, state_dir=root / "state",
                                     emit_event=False, part_timeout_s=60, **kw)
        except Exception as exc:  # the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [], errors
    return results


def record(root: Path, version: str) -> dict:
    out = json.loads((root / "catalog" / f"{version}.json").read_text())
    out.pop("created_at_unix_ms")
    out.pop("uri")
    return out


def refit(root: Path, launch: Path, target: str):
    result = api.refit(catalog=f"file://{root}/catalog", model=MODEL, target=target, cache_dir=root / "node",
                       seed_checkpoint=launch, installer={"kind": "none"})
    assert result.status == "READY", result.error
    return result


def test_ranks_publish_the_revision_a_single_publisher_would(tmp_path):
    steps = [random_model(SHAPE, seed=3)]
    steps += [train_step(steps[0], seed=4), train_step(train_step(steps[0], seed=4), seed=5)]
    launch = write_checkpoint(tmp_path / "launch", steps[0], shards=SHAPE.shards)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for n, kind in enumerate(("initial", "delta", "full")):
        api.publish(write_checkpoint(tmp_path / f"step{n}", steps[n], shards=SHAPE.shards),
                    catalog=f"file://{single}/catalog", model=MODEL, kind=kind, state_dir=single / "state",
                    emit_event=False)

    assert {r.version for r in by_ranks(sharded, steps[0], "initial", "run7-step0")} == {"r0"}
    # the delta from three processes, with the command line
    for r, part in enumerate(split(steps[1])):
        write_checkpoint(tmp_path / f"rank{r}-step1", part, shards=1)
    procs = [subprocess.Popen([sys.executable, "-m", "flows.publish", "--catalog", f"file://{sharded}/catalog",
                               "--model", MODEL, "--checkpoint", str(tmp_path / f"rank{r}-step1"), "--kind", "delta",
                               "--rank", str(r), "--world-size", str(RANKS), "--publication", "run7-step1",
                               "--state-dir", str(sharded / "state"), "--no-event", "--part-timeout", "120", "--json"],
                              cwd=ROOT_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(RANKS)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * RANKS, [o[0][-1500:] + o[1][-1500:] for o in outs]
    assert {json.loads(o[0].strip().splitlines()[-1])["version"] for o in outs} == {"r1"}
    by_ranks(sharded, steps[2], "full", "run7-step2")

    assert not (sharded / "catalog" / "publications").exists() or not any(
        (sharded / "catalog" / "publications").iterdir())  # rank 0 removed each committed publication's plan and parts
    for version in ("r0", "r1", "r2"):  # the same records: sequence, base, digests, formats
        assert record(sharded, version) == record(single, version), version
    catalog = Catalog(ObjectStore(), f"file://{sharded}/catalog", MODEL)
    index = json.loads(Path(catalog.read("r1").uri.removeprefix("file://")).read_text())
    single_index = json.loads(Path(Catalog(ObjectStore(), f"file://{single}/catalog", MODEL).read("r1").uri
                                   .removeprefix("file://")).read_text())
    assert index["metadata"] == single_index["metadata"] and set(index["weight_map"]) == set(single_index["weight_map"])
    assert len(set(index["weight_map"].values())) >= RANKS  # each rank's buckets

    # what a node reconstructs is byte-identical, from either catalog
    for version, step in (("r1", steps[1]), ("r2", steps[2])):
        a, b = refit(single, launch, version), refit(sharded, launch, version)
        assert a.target_digest == b.target_digest == independent_digest(step)[1]
        if version == "r1":  # a delta patches the node's own files: the same files, byte for byte
            assert tree_hash(Path(a.checkpoint_path)) == tree_hash(Path(b.checkpoint_path))
        else:  # a full revision is its publishers' shards (one per rank here): the same tensors, byte for byte
            got_a, got_b = read_checkpoint(Path(a.checkpoint_path)), read_checkpoint(Path(b.checkpoint_path))
            assert sorted(got_a) == sorted(got_b) and all(got_a[n].tobytes() == got_b[n].tobytes() for n in got_a)


def test_a_rank_that_never_comes_makes_nothing_visible_and_the_next_publication_goes_past(tmp_path):
    steps = [random_model(SHAPE, seed=8)]
    steps.append(train_step(steps[0], seed=9))
    root = tmp_path / "sharded"
    by_ranks(root, steps[0], "initial", "a-0")
    alone = write_checkpoint(tmp_path / "rank0-alone", split(steps[1])[0], shards=1)
    with pytest.raises(CatalogError, match="timed out .* every rank's part") as caught:
        api.publish(alone, catalog=f"file://{root}/catalog", model=MODEL, rank=0, world_size=RANKS,
                    publication="a-1", state_dir=root / "state", emit_event=False, part_timeout_s=2)
    assert caught.value.revision is None or caught.value.revision == "r1"
    assert Catalog(ObjectStore(), f"file://{root}/catalog", MODEL).versions() == ["r0"]
    results = by_ranks(root, steps[1], "delta", "a-1-again")  # a new publication id: sequence 1 stays the dead one's
    assert {(r.version, r.sequence) for r in results} == {("r2", 2)}
    launch = write_checkpoint(tmp_path / "launch", steps[0], shards=SHAPE.shards)
    assert refit(root, launch, "latest").target_digest == independent_digest(steps[1])[1]


def publish_by_processes(root: Path, folders: list[Path], publication: str, *, kill: dict[int, str],
                         timeout_s: float) -> list[subprocess.CompletedProcess]:
    """Every rank as ``python -m flows.publish --rank R ...``; rank R is killed (SIGKILL) at killpoint
    ``kill[R]``."""
    import os

    procs = []
    for r, folder in enumerate(folders):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CANONICAL_REFIT_KILLPOINT")}
        if r in kill:
            env["CANONICAL_REFIT_KILLPOINT"] = kill[r]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "flows.publish", "--catalog", f"file://{root}/catalog", "--model", MODEL,
             "--checkpoint", str(folder), "--rank", str(r), "--world-size", str(len(folders)), "--publication",
             publication, "--state-dir", str(root / "state"), "--no-event", "--part-timeout", str(timeout_s),
             "--json"], cwd=ROOT_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in procs]


@pytest.mark.parametrize("rank, point", [(1, "publish.part_uploaded"), (0, "publish.planned")])
def test_a_rank_killed_mid_publish_leaves_nothing_visible_and_does_not_wedge_the_next(tmp_path, rank, point):
    """A rank killed after uploading its payload (before its part), or rank 0 killed right after its plan:
    the other ranks fail after the part timeout naming what they waited for, no revision appears, the dead
    publication's payload is an orphan, and the next publication of the same step goes past by itself."""
    steps = [random_model(SHAPE, seed=20)]
    steps.append(train_step(steps[0], seed=21))
    root = tmp_path / "sharded"
    by_ranks(root, steps[0], "initial", "k-0")
    folders = [write_checkpoint(tmp_path / f"rank{r}-step1", part, shards=1) for r, part in enumerate(split(steps[1]))]
    done = publish_by_processes(root, folders, "k-1", kill={rank: point}, timeout_s=4)
    assert done[rank].returncode == -9, done[rank].stderr[-2000:]
    for r, out in enumerate(done):
        if r != rank:
            assert out.returncode not in (0, -9), out.stdout[-2000:]
            assert "timed out" in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]
    catalog = Catalog(ObjectStore(), f"file://{root}/catalog", MODEL)
    assert catalog.versions() == ["r0"]  # nothing visible
    listed = subprocess.run([sys.executable, "-m", "flows.publish", "orphans", "--catalog", f"file://{root}/catalog",
                             "--model", MODEL, "--older-than-hours", "0", "--json"], cwd=ROOT_DIR,
                            capture_output=True, text=True, timeout=120)
    orphans = {o["url"].removeprefix(f"file://{root}/"): o for o in
               json.loads(listed.stdout.strip().splitlines()[-1])["orphans"]}
    payloads = [u for u in orphans if u.startswith("revisions/")]
    # the dead publication's plan (and parts) are listed; the committed k-0's were removed by its rank 0
    assert "catalog/publications/k-1" in orphans and not any(u.endswith("/k-0") for u in orphans)
    if point == "publish.part_uploaded":  # the killed rank's buckets are there, referenced by nothing
        assert [Path(u).name.split(".")[0] for u in payloads] == ["r1"] and orphans[payloads[0]]["objects"] > 0

    again = publish_by_processes(root, folders, "k-1-again", kill={}, timeout_s=120)  # the same command, a new id
    assert [p.returncode for p in again] == [0] * RANKS, [p.stderr[-1500:] for p in again]
    assert {json.loads(p.stdout.strip().splitlines()[-1])["version"] for p in again} == {"r2"}
    launch = write_checkpoint(tmp_path / "launch", steps[0], shards=SHAPE.shards)
    assert refit(root, launch, "latest").target_digest == independent_digest(steps[1])[1]


@pytest.mark.parametrize("given, says", [(dict(rank=3, world_size=3, publication="p"), "rank 3 is not below"),
                                         (dict(rank=0, world_size=2), "together")])
def test_a_rank_outside_its_publication_is_refused_before_anything_is_written(tmp_path, given, says):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=says):
        api.publish(split(random_model(SHAPE, seed=1))[0], catalog=f"file://{tmp_path}/catalog", model=MODEL,
                    kind="initial", state_dir=tmp_path / "state", emit_event=False, **given)
    assert not (tmp_path / "catalog").exists() and not (tmp_path / "state").exists()
