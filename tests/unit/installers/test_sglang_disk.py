"""The `sglang-disk` installer: stock SGLang's update_weights_from_disk on the stable path {store}/current."""

from __future__ import annotations

import os

from flows.cli import main as cli_main
from tests.support.sglang_flows import (assert_engine_holds, cli_args, engine_lab, holds_exactly, http_json, published,  # noqa: F401
                          sglang, store_of)
from tests.support.sglang_mock import MockSGLang
from tests.support.sglang_support import fake_sglang  # noqa: F401  (fixture)
from tasks.installers.sglang import stable_path


def disk(*engines, **kw):
    return sglang(*engines, kind="sglang-disk", **kw)


def link_target(lab) -> str:
    return os.readlink(stable_path(store_of(lab)))


def test_the_engines_model_path_stays_the_same_across_refits(engine_lab):
    lab = engine_lab
    current = str(stable_path(store_of(lab)))
    with MockSGLang(lab.launch, lab.shape, custom_weight_loader=[]) as engine:  # stock SGLang
        state, result = lab.refit(target="r1", installer=disk(engine))
        assert state.name == "Ready", result.error
        assert_engine_holds(engine, lab, "r1")
        info = http_json(engine.url, "/model_info")
        assert (info["model_path"], info["weight_version"]) == (current, "r1")
        assert link_target(lab) == store_of(lab).active().path

        state, result = lab.refit(target="r2", installer=disk(engine))
        assert state.name == "Ready", result.error
        assert_engine_holds(engine, lab, "r2")
        info = http_json(engine.url, "/model_info")
        assert (info["model_path"], info["weight_version"]) == (current, "r2")  # same path, new weights
        assert all(c.model_path == current for c in engine.runner_configs)
        assert link_target(lab) == store_of(lab).active().path
        assert os.path.samefile(current, store_of(lab).absolute(store_of(lab).current().path))
        bodies = [b for path, b in engine.bodies if path == "/update_weights_from_disk"]
        assert [b["model_path"] for b in bodies] == [current, current]
        assert [b["weight_version"] for b in bodies] == ["r1", "r2"]


def test_a_failed_load_poisons_because_sglangs_rollback_reads_the_new_checkpoint(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as engine:
        state, result = lab.refit(target="r1", installer=disk(engine))
        assert state.name == "Ready", result.error
        engine.faults.fail_load_after = 3  # fails once; SGLang's "rollback" then reloads

        state, result = lab.refit(target="r2", installer=disk(engine))

        assert state.name == "Poisoned", result.error
        assert "Rolling back to original weights" in result.error
        store = store_of(lab)
        assert store.poisoned().version == "r2" and store.active().version == "r1"
        # the "rollback" re-read the NEW path: the engine runs r2 while SGLang reported failure
        assert holds_exactly(engine, lab, "r2")
        assert http_json(engine.url, "/model_info")["weight_version"] == "r1"

        assert cli_main(["recover", *cli_args(lab, engine, installer="sglang-disk")]) == 0
        assert store.poisoned() is None and store.active().version == "r2"
        assert http_json(engine.url, "/model_info")["weight_version"] == "r2"
        assert link_target(lab) == store.active().path


def test_loader_setup_failures_leave_the_engine_and_the_stable_path_as_they_were(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as engine:
        state, result = lab.refit(target="r1", installer=disk(engine))
        assert state.name == "Ready", result.error
        before = link_target(lab)
        engine.faults.fail_iterator = "cannot list shards"

        state, result = lab.refit(target="r2", installer=disk(engine))

        assert state.name == "Failed", result.error
        assert "Failed to get weights iterator" in result.error
        assert store_of(lab).poisoned() is None and store_of(lab).active().version == "r1"
        assert link_target(lab) == before
        assert_engine_holds(engine, lab, "r1")
        assert http_json(engine.url, "/model_info")["weight_version"] == "r1"


def test_with_a_draft_model_a_setup_failure_still_poisons(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape, speculative_algorithm="EAGLE") as engine:
        engine.faults.fail_iterator = "cannot list shards"
        state, result = lab.refit(target="r1", installer=disk(engine))
        # SGLang stops at the first failing runner: the target may already hold new weights
        assert state.name == "Poisoned", result.error


def test_rejected_requests_leave_the_stable_path_where_it_was(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as engine:
        engine.faults.reject_status = 422
        state, result = lab.refit(target="r1", installer=disk(engine))
        assert state.name == "Failed", result.error
        assert not os.path.lexists(stable_path(store_of(lab)))
        assert http_json(engine.url, "/model_info")["model_path"] == str(lab.launch)
        assert_engine_holds(engine, lab, "r0")


def test_several_engines_share_the_stable_path(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as one, MockSGLang(lab.launch, lab.shape, tp_size=2) as two:
        state, result = lab.refit(target="r2", installer=disk(one, two))
        assert state.name == "Ready", result.error
        for engine in (one, two):
            assert_engine_holds(engine, lab, "r2")
            assert http_json(engine.url, "/model_info")["model_path"] == str(stable_path(store_of(lab)))
