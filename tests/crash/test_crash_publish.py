"""A trainer killed at any instant of a publication never wedges the catalog (CI mode of the publisher trials).

Every publisher kill point is hit in both modes (the restarted trainer runs the
same command again, or the next step's), plus a few random moments; the next
publication must succeed by itself and a fresh node must refit to it exactly
(``tests/support/crash_publish.py`` says what each trial checks).
"""

from __future__ import annotations

import json

import pytest

import tests.support.crash_publish as cp
from storage.runtime.killpoints import PUBLISH_POINTS


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return cp.build_world(tmp_path_factory.mktemp("publish-crash-world"))


def test_every_publisher_kill_point_is_gone_past_by_the_next_publication(world, tmp_path):
    trials = cp.plan_trials(world, 2 * len(PUBLISH_POINTS) + 4, seed=3)
    for i, trial in enumerate(trials):
        cp.run_trial(world, trial, tmp_path / f"t{i:03d}")
    summary = cp.summarize(trials)
    assert summary["failures"] == [], json.dumps(summary["failures"], indent=1)
    assert summary["recovered"] == summary["trials"]
    assert summary["kill_points_not_reached"] == []
    assert set(summary["kill_points"]) == set(PUBLISH_POINTS)


def test_a_crashed_publication_under_a_named_version_does_not_block_that_name(world, tmp_path, capsys):
    """Killed after its payload went up under --version v2; the restarted trainer publishes another checkpoint
    under the same name: its payload goes beside the orphan, which no record references."""
    from tests.support.lab import Lab

    root = tmp_path / "named"
    lab = Lab(root / "lab", shape=world.lab.shape)  # r0 and r1 published in place (their URIs are under root)
    for kind, version in (("initial", "r0"), ("delta", "r1")):
        lab.publish(kind, world.lab.revisions[version])
    killed = world.children.run(cp.job(world, root, world.steps[0], version="v2",
                                       env={"CANONICAL_REFIT_KILLPOINT": "publish.uploaded"}))
    assert killed["status"] == "KILLED"
    orphan = sorted(p.name for p in (root / "lab" / "revisions" / "v2").iterdir())
    out = world.children.run(cp.job(world, root, world.steps[1], version="v2"))
    assert out["status"] == "PUBLISHED" and out["version"] == "v2", out
    assert "/revisions/v2." in out["uri"] and out["sequence"] == 3  # sequence 2 stays the crashed one's claim
    assert sorted(p.name for p in (root / "lab" / "revisions" / "v2").iterdir()) == orphan  # left as it was
    assert cp.check_catalog(world, root, out, world.digests[1]) == []

    # the orphan is found and reclaimed by the documented command; what the records reference stays
    catalog = f"file://{root / 'lab' / 'catalog'}"
    listed = _orphans(capsys, "--catalog", catalog, "--model", world.lab.model, "--older-than-hours", "0")
    assert [o["url"] for o in listed["orphans"]] == [f"file://{root / 'lab' / 'revisions' / 'v2'}"]
    assert _orphans(capsys, "--catalog", catalog, "--model", world.lab.model)["orphans"] == []  # too young
    _orphans(capsys, "--catalog", catalog, "--model", world.lab.model, "--older-than-hours", "0", "--delete")
    assert not (root / "lab" / "revisions" / "v2").exists()
    assert cp.check_catalog(world, root, out, world.digests[1]) == []


def _orphans(capsys, *args: str) -> dict:
    from flows.publish import main

    capsys.readouterr()
    assert main(["orphans", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
