"""SIGKILL in the middle of an undo: the next run's recovery restores the exact verified bytes.

A hostile revision on top of the installed r1 passes every check made before the store changes (its last tensor's
checksum is wrong: only applying it tells), so the refit takes ``materialized/r1`` over, patches every other tensor,
is rejected at the last one and starts undoing them in place. The child refit is killed (``kill -9``, kill point
``undo.tensor``) after a few tensors are reverted and before the others are: the taken-over folder then holds
neither r1 nor the hostile revision. Right after the kill nothing may claim otherwise (no READY state, record or
engine load names bytes the folder does not hold); the next run recovers, and r1 is back byte for byte (compared
with the safetensors library and file by file with the store before the refit), READY, installed and recorded as
the files it is.
"""

from __future__ import annotations

import json
import shutil

import pytest

import tests.support.adversarial_support as av
import tests.support.crash_support as cs


@pytest.fixture(scope="module")
def world(prefect_api, tmp_path_factory):
    return av.hostile_world(tmp_path_factory)


def _last_taken(world) -> str:
    """The tensor the apply stage takes last (smallest, then smallest name): every other one is patched by then."""
    expected = world.lab.expected("r1")
    return min(expected, key=lambda n: (expected[n].nbytes, n))


@pytest.mark.parametrize("nth", [1, 4])
def test_a_kill_during_the_undo_is_recovered_to_the_exact_verified_bytes(world, tmp_path, nth):
    tensor = _last_taken(world)
    bucket = world.index("d2")["weight_map"][tensor]
    version = world.new("d2", files={bucket: av.replace_frame(tensor, lambda f: f, checksum="00000001")})
    crash = world.world
    cache = tmp_path / "cache"
    shutil.copytree(world.golden, cache, symlinks=True)
    store = cache / world.model_folder
    before = av.checkpoint_content(store, "r1")
    verified_before = json.loads((store / "verified" / "r1.json").read_text())
    kplog = cache / "killpoints.log"

    out = crash.children.run(crash.job(cache, version, env={"CANONICAL_REFIT_KILLPOINT": f"undo.tensor:{nth}",
                                                            "CANONICAL_REFIT_KILLPOINT_LOG": str(kplog)}))
    assert out["status"] == "KILLED", out
    assert kplog.read_text().split() == ["undo.tensor"]  # died in the undo, with tensors left to revert
    events = [e["what"] for e in cs.events(cache)]
    assert events.count("undo.tensor") == nth and "apply.materialized" in events
    state = json.loads((store / "state.json").read_text())
    assert state["status"] == "UPDATING" and state["version"] == version, state  # it does not claim r1
    assert not (store / verified_before["path"]).exists()  # r1's folder was taken over, and is half undone
    assert cs.check_after_crash(crash, cache) == []

    again = crash.children.run(crash.job(cache, "r1"))
    assert again["status"] == "READY", again
    assert cs.check_recovered(crash, cache, "r1") == []  # byte-exact (safetensors), READY, recorded, installed
    assert av.checkpoint_content(store, "r1") == before  # every file of r1, byte for byte, as before the refit
    engine = cs.RecordingEngine(cache / "engine.json")
    assert [load["version"] for load in engine.loads()] == ["r1"]  # the hostile bytes never reached the engine

    rejected = crash.children.run(crash.job(cache, version))  # the same revision again: the same error, undone
    assert rejected["status"] != "READY" and rejected["error"]["type"] == "ChecksumMismatch", rejected
    assert (rejected["error"].get("tensor"), rejected["error"].get("revision")) == (tensor, version), rejected
    assert cs.check_recovered(crash, cache, "r1") == []
    assert av.checkpoint_content(store, "r1") == before
