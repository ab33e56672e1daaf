"""Publishing without waiting: ``flows.api.publish(..., wait=False)`` returns once the tensors were read.

The trainer then changes its tensors in place and trains on while the payload
uploads and the record is written; ``handle.result()`` gives the
``PublishResult`` or raises the typed error. Every test drives
``flows.api.publish``; the upload is held at the publisher's
``publish.file`` point (the kill-point gate) where a test must see the
handle before its upload ends, and refused by the fault proxy where a test
needs it to fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import storage.runtime.killpoints as killpoints
from flows import api
from tests.support.lab import ROOT_DIR
from tests.support.s3_support import s3  # noqa: F401  (a fixture)
from storage.catalog.kept_base import PublisherCopy
from storage.errors import AccessDenied
from storage.objects.store import ObjectStore
from testbed.s3proxy import Faults

MODEL = "org/async"


def step(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"model.embed_tokens.weight": rng.standard_normal((128, 64)).astype(np.float32),
            "model.layers.0.mlp.up_proj.weight": rng.standard_normal((96, 64)).astype(np.float32),
            "lm_head.weight": np.full((128, 64), seed, dtype=np.float32)}


def files_under(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def gate(tmp_path, monkeypatch):
    """Holds the next publication's upload at its first payload object until the returned callable opens it."""
    path = tmp_path / "gate-open"
    monkeypatch.setattr(killpoints, "_GATE_NAME", "publish.file")
    monkeypatch.setattr(killpoints, "_GATE_PATH", str(path))
    monkeypatch.setattr(killpoints, "_gated", set())
    return lambda: path.touch()


@pytest.mark.parametrize("keep", ["memory", "disk"])
def test_a_trainer_that_does_not_wait_publishes_what_a_waiting_one_does(tmp_path, keep):
    """Five steps: the trainer overwrites its tensors right after each call returns and calls again before the
    previous upload has ended; the catalog, payloads and records are a waiting publisher's, step for step."""
    trainer = step(0)
    handles = []
    for n in range(5):
        for name, value in step(n).items():
            trainer[name][...] = value  # the optimizer step, in place
        kind = "initial" if n == 0 else "delta"
        handles.append(api.publish(trainer, catalog=f"file://{tmp_path}/async/catalog", model=MODEL, kind=kind,
                                   keep_base=keep, state_dir=tmp_path / "state-async", emit_event=False,
                                   wait=False))
        for name in trainer:
            trainer[name][...] = -1.0  # trains on: nothing published may depend on these bytes any more
        api.publish(step(n), catalog=f"file://{tmp_path}/sync/catalog", model=MODEL, kind=kind, keep_base=keep,
                    state_dir=tmp_path / "state-sync", emit_event=False)
    results = [h.result(timeout=60) for h in handles]
    assert [(h.version, h.sequence) for h in handles] == [(f"r{n}", n) for n in range(5)]
    assert [r.version for r in results] == [f"r{n}" for n in range(5)] and all(h.done() for h in handles)
    left, right = files_under(tmp_path / "async"), files_under(tmp_path / "sync")
    assert sorted(left) == sorted(right)
    for name in left:
        if name.startswith("catalog/r"):
            x, y = json.loads(left[name]), json.loads(right[name])
            for field in ("created_at_unix_ms", "uri"):
                x.pop(field), y.pop(field)
            assert x == y, name
        elif not name.startswith("catalog/sequences/"):
            assert left[name] == right[name], name
    assert PublisherCopy(tmp_path / "state-async", MODEL, keep_base=keep).kept_version() == "r4"


def test_the_handle_comes_back_before_the_upload_ends_and_the_record_only_after(tmp_path, gate):
    catalog = tmp_path / "catalog"
    common = dict(catalog=f"file://{catalog}", model=MODEL, keep_base="memory", state_dir=tmp_path / "state",
                  emit_event=False)
    api.publish(step(0), kind="initial", **common)
    tensors = step(1)
    handle = api.publish(tensors, wait=False, **common)  # returns while the upload is held at its first object
    assert (handle.version, handle.sequence, handle.done()) == ("r1", 1, False)
    assert not (catalog / "r1.json").exists()
    for value in tensors.values():
        value[...] = 7.0  # the trainer's next step, while r1 uploads
    gate()
    result = handle.result(timeout=60)
    assert (catalog / "r1.json").exists() and result.version == "r1"
    ref = dict(catalog=f"file://{tmp_path}/ref/catalog", model=MODEL, state_dir=tmp_path / "ref-state",
               emit_event=False)
    api.publish(step(0), kind="initial", **ref)
    reference = api.publish(step(1), kind="full", **ref)
    assert result.target_digest == reference.target_digest  # the bytes read before the call returned


@pytest.mark.parametrize("keep", ["memory", "disk"])
def test_a_failed_upload_raises_from_the_handle_and_the_next_step_is_published_against_the_last_good_base(
        tmp_path, s3, keep):  # noqa: F811
    """r2's upload is refused: ``result()`` raises AccessDenied naming r2 and its object, the kept base stays
    r1, and the next step is published against r1 (as r3: the failed publication's sequence claim is spent),
    with the bytes of a publisher that never tried the failed step."""
    catalog, reference = f"{s3.prefix('async-fail')}/catalog", f"{s3.prefix('async-ref')}/catalog"
    common = dict(model=MODEL, keep_base=keep, state_dir=tmp_path / "state", emit_event=False)
    for n, kind in ((0, "initial"), (1, "delta")):
        api.publish(step(n), catalog=catalog, kind=kind, storage=s3.settings(), **common)
        api.publish(step(n), catalog=reference, kind=kind, storage=s3.settings(), model=MODEL,
                    state_dir=tmp_path / "ref-state", emit_event=False)
    with s3.proxy(Faults(deny=("revisions/r2/",), deny_methods=("PUT",))) as proxy:
        handle = api.publish(step(2), catalog=catalog, wait=False, storage=s3.settings(proxy.url), **common)
        with pytest.raises(AccessDenied) as caught:
            handle.result(timeout=60)
    assert caught.value.revision == "r2" and "revisions/r2/" in caught.value.file, caught.value
    assert PublisherCopy(tmp_path / "state", MODEL, keep_base=keep).kept_version() == "r1"
    again = api.publish(step(3), catalog=catalog, wait=False, storage=s3.settings(), **common).result(timeout=60)
    expected = api.publish(step(3), catalog=reference, storage=s3.settings(), model=MODEL,
                           state_dir=tmp_path / "ref-state", emit_event=False)
    assert (again.version, again.sequence) == ("r3", 3) and expected.version == "r2"
    assert (again.target_digest, again.encoded_bytes) == (expected.target_digest, expected.encoded_bytes)
    fs, path = ObjectStore(s3.settings()).locate(catalog)
    assert json.loads(fs.cat_file(f"{path}/r3.json"))["base_version"] == "r1"


def test_waiting_is_refused_where_it_cannot_hold(tmp_path):
    common = dict(catalog=f"file://{tmp_path}/catalog", model=MODEL, state_dir=tmp_path / "state",
                  emit_event=False, wait=False)
    with pytest.raises(ValueError, match="sharded"):
        api.publish(step(0), kind="initial", rank=0, world_size=2, publication="p-1", **common)
    assert not (tmp_path / "catalog").exists()


def test_a_trainer_killed_while_its_upload_is_pending_is_published_past_by_the_next_one(tmp_path):
    """kill -9 while the handle's upload is held: no record; the restarted trainer's same call publishes the
    step as the next revision against r0 (its kept base on disk is still the last good one)."""
    catalog, state, gate_path = f"file://{tmp_path}/catalog", tmp_path / "state", tmp_path / "never-opened"
    script = textwrap.dedent("""
        import json, sys, time
        import numpy as np
        from flows import api
        def step(s):
            rng = np.random.default_rng(s)
            return {"w": rng.standard_normal((256, 64)).astype(np.float32)}
        kw = dict(catalog=sys.argv[1], model="org/async", state_dir=sys.argv[2], emit_event=False)
        api.publish(step(0), kind="initial", **kw)
        handle = api.publish(step(1), wait=False, **kw)
        print(json.dumps({"version": handle.version, "done": handle.done()}), flush=True)
        time.sleep(600)
    """)
    env = {**__import__("os").environ, "CANONICAL_REFIT_KILLPOINT_GATE": f"publish.file:{gate_path}"}
    proc = subprocess.Popen([sys.executable, "-c", script, catalog, str(state)], cwd=ROOT_DIR, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = json.loads(proc.stdout.readline())
        assert line == {"version": "r1", "done": False}
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not (tmp_path / "catalog" / "r1.json").exists()
    rng = np.random.default_rng(1)
    result = api.publish({"w": rng.standard_normal((256, 64)).astype(np.float32)}, catalog=catalog,
                         model="org/async", state_dir=state, emit_event=False)
    assert (result.version, result.sequence, result.changed_tensors) == ("r2", 2, 1)  # the dead claim is spent
    assert json.loads((tmp_path / "catalog" / "r2.json").read_text())["base_version"] == "r0"
    assert PublisherCopy(state, "org/async").kept_version() == "r2"
