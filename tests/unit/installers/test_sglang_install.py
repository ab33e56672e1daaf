"""The `sglang` installer end to end: refit flow -> mock SGLang 0.5.23 server -> in-engine loader -> torch module."""

from __future__ import annotations

import base64
import json
import pickle

from flows.cli import main as cli_main
from tasks.installers.sglang_loader import LOADER_PATH
from tests.support.sglang_flows import (assert_engine_holds, cli_args, closed_port_url, engine_lab, holds_exactly,  # noqa: F401
                          http_json, published, sglang, store_of)
from tests.support.sglang_mock import MockSGLang
from tests.support.sglang_support import fake_sglang  # noqa: F401  (fixture)
from storage.errors import ReceiverPoisoned


def run_cli(capsys, args: list[str]) -> tuple[int, dict]:
    capsys.readouterr()
    code = cli_main(args + ["--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_installs_a_verified_revision_and_confirms_its_version(engine_lab, capsys):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape, tp_size=2) as engine:
        code, result = run_cli(capsys, ["--catalog", lab.catalog, "--seed-checkpoint", str(lab.launch),
                                        "--target", "r2", *cli_args(lab, engine)])
        assert code == 0, result
        assert (result["status"], result["version"]) == ("READY", "r2")
        assert_engine_holds(engine, lab, "r2")  # both TP ranks hold the target bytes
        info = http_json(engine.url, "/model_info")
        assert info["weight_version"] == "r2"
        # the engine's configured model path and load format are untouched
        assert (info["model_path"], info["load_format"]) == (str(lab.launch), "auto")
        assert all(c.model_path == str(lab.launch) for c in engine.runner_configs)
        # the request SGLang got: the loader's import path, one pickled empty list per TP rank
        (body,) = [b for path, b in engine.bodies if path == "/update_weights_from_tensor"]
        assert body["load_format"] == LOADER_PATH and body["selector"] == "target"
        assert [pickle.loads(base64.b64decode(e)) for e in body["serialized_named_tensors"]] == [[], []]
        assert "weight_version" not in body  # set only once every rank reported success
        # SGLang's own check: the fused qkv parameter's k slice now holds r2's k_proj
        name = "model.layers.1.self_attn.k_proj.weight"
        got = http_json(engine.url, "/get_weights_by_name", {"name": name, "truncate_size": 3})
        want = engine.models[0].get_weights_by_name(name, 3)
        assert got == want and len(got) == 3
        active = store_of(lab).active()
        assert (active.version, active.installer) == ("r2", "sglang")


def test_failure_before_mutation_keeps_the_previous_version_active(engine_lab, capsys):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as engine:
        state, result = lab.refit(target="r1", installer=sglang(engine))
        assert state.name == "Ready", result.error
        engine.faults.fail_iterator = "safetensors file vanished"

        state, result = lab.refit(target="r2", installer=sglang(engine))

        assert state.name == "Failed" and result.status == "FAILED"
        assert "no engine's weights were touched" in result.error and "safetensors file vanished" in result.error
        assert "'r2'" in result.error  # names the revision
        assert result.version is None and result.installed_version == "r1"
        store = store_of(lab)
        assert store.poisoned() is None and store.active().version == "r1"
        assert_engine_holds(engine, lab, "r1")
        assert http_json(engine.url, "/model_info")["weight_version"] == "r1"

        code, out = run_cli(capsys, ["--catalog", lab.catalog, "--seed-checkpoint", str(lab.launch),
                                     "--target", "r2", *cli_args(lab, engine)])
        assert (code, out["status"], out["installed_version"]) == (1, "FAILED", "r1")

        engine.faults.fail_iterator = None  # the receiver is healthy: the next refit just works
        state, result = lab.refit(target="r2", installer=sglang(engine))
        assert state.name == "Ready", result.error
        assert_engine_holds(engine, lab, "r2")


def test_failure_after_mutation_poisons_until_recover_succeeds(engine_lab, capsys):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as engine:
        state, result = lab.refit(target="r1", installer=sglang(engine))
        assert state.name == "Ready", result.error
        engine.faults.fail_load_after, engine.faults.fail_load_times = 4, 2  # this load and the first recovery

        code, out = run_cli(capsys, ["--catalog", lab.catalog, "--seed-checkpoint", str(lab.launch),
                                     "--target", "r2", *cli_args(lab, engine)])

        assert (code, out["status"]) == (3, "POISONED")
        assert "partially written" in out["error"] and "injected failure" in out["error"]
        store = store_of(lab)
        assert store.poisoned().version == "r2" and store.active().version == "r1"
        assert not holds_exactly(engine, lab, "r1") and not holds_exactly(engine, lab, "r2")

        # further installs are refused, and the engine is not called
        calls = engine.calls["/update_weights_from_tensor"]
        state, result = lab.refit(target="r2", installer=sglang(engine))
        assert state.name == "Poisoned"
        assert result.error_detail["type"] == ReceiverPoisoned.__name__
        assert "recover" in result.error
        assert engine.calls["/update_weights_from_tensor"] == calls

        # a recovery that fails again keeps the mark
        code = cli_main(["recover", *cli_args(lab, engine)])
        assert code == 3 and store.poisoned() is not None and store.active().version == "r1"

        code = cli_main(["recover", *cli_args(lab, engine)])
        assert code == 0
        assert store.poisoned() is None and store.active().version == "r2"
        assert_engine_holds(engine, lab, "r2")
        assert http_json(engine.url, "/model_info")["weight_version"] == "r2"


def test_timeouts_and_malformed_answers_after_the_request_was_sent_poison(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as engine:
        engine.faults.delay_s = 2.0
        state, result = lab.refit(target="r1", installer=sglang(engine, timeout_s=0.5))
        assert state.name == "Poisoned", result.error
        assert "timed out" in result.error
        assert store_of(lab).poisoned() is not None and store_of(lab).active() is None

        engine.faults.delay_s, engine.faults.malformed = 0.0, True
        code = cli_main(["recover", *cli_args(lab, engine)])
        assert code == 3 and store_of(lab).poisoned() is not None

        engine.faults.malformed = False
        assert cli_main(["recover", *cli_args(lab, engine)]) == 0
        assert store_of(lab).poisoned() is None
        assert_engine_holds(engine, lab, "r1")


def test_a_crashed_engine_poisons_and_recovery_waits_for_it(engine_lab, capsys):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as engine:
        engine.faults.drop = True  # the server goes away after loading, without answering
        state, result = lab.refit(target="r1", installer=sglang(engine))
        assert state.name == "Poisoned", result.error
        assert "dropped" in result.error
        # the engine is gone: recovery cannot install, so the mark stays
        assert cli_main(["recover", *cli_args(lab, engine)]) == 3
        assert store_of(lab).poisoned() is not None
        with MockSGLang(lab.launch, lab.shape) as restarted:  # the operator restarts it, on another port
            # recovery goes through the engines the node was poisoned with, unless told otherwise explicitly
            assert cli_main(["recover", *cli_args(lab, restarted)]) == 3
            assert "--override-installer" in capsys.readouterr().out
            assert cli_main(["recover", *cli_args(lab, restarted), "--override-installer"]) == 0
            assert_engine_holds(restarted, lab, "r1")
        assert store_of(lab).poisoned() is None


def test_rejections_before_the_engine_acted_leave_everything_as_it_was(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as engine, \
            MockSGLang(lab.launch, lab.shape, custom_weight_loader=[]) as stock, \
            MockSGLang(lab.launch, lab.shape, api_key="sesame") as locked:
        cases = [
            (sglang(closed_port_url()), "could not send"),
            (sglang(stock), "--custom-weight-loader tasks.installers.sglang_loader.load_prepared_checkpoint"),
            (sglang(locked), "HTTP 401"),
            (sglang(locked, api_key="wrong"), "HTTP 401"),
        ]
        engine.faults.reject_status = 400
        cases.append((sglang(engine), "injected rejection"))
        for installer, words in cases:
            state, result = lab.refit(target="r1", installer=installer)
            assert state.name == "Failed", (words, result.error)
            assert words in result.error
            assert store_of(lab).poisoned() is None and store_of(lab).active() is None
        for server in (engine, stock, locked):
            assert_engine_holds(server, lab, "r0")
        assert stock.calls["/update_weights_from_tensor"] == 0

        state, result = lab.refit(target="r1", installer=sglang(locked, api_key="sesame"))
        assert state.name == "Ready", result.error
        assert_engine_holds(locked, lab, "r1")


def test_several_engines_install_in_parallel_and_activate_only_together(engine_lab):
    lab = engine_lab
    with MockSGLang(lab.launch, lab.shape) as one, MockSGLang(lab.launch, lab.shape, tp_size=2) as two:
        state, result = lab.refit(target="r1", installer=sglang(one, two))
        assert state.name == "Ready", result.error
        for engine in (one, two):
            assert_engine_holds(engine, lab, "r1")
            assert http_json(engine.url, "/model_info")["weight_version"] == "r1"

        # one replica unreachable: nothing is sent to any of them
        state, result = lab.refit(target="r2", installer=sglang(one, closed_port_url()))
        assert state.name == "Failed" and store_of(lab).active().version == "r1"
        assert one.calls["/update_weights_from_tensor"] == 1
        assert_engine_holds(one, lab, "r1")

        # one replica fails after loading began: the receiver is poisoned, nothing is activated
        two.faults.fail_load_after = 2
        state, result = lab.refit(target="r2", installer=sglang(one, two))
        assert state.name == "Poisoned", result.error
        assert store_of(lab).active().version == "r1"
        assert_engine_holds(one, lab, "r2")  # the healthy replica did load

        two.faults.fail_load_after = None
        assert cli_main(["recover", *cli_args(lab, one, two)]) == 0
        for engine in (one, two):
            assert_engine_holds(engine, lab, "r2")
        assert store_of(lab).active().version == "r2"


def test_python_m_flows_refit_installs_into_the_engine(engine_lab):
    """The command line itself, in its own process, against the engine's HTTP API."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL

    lab = engine_lab
    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value())
    with MockSGLang(lab.launch, lab.shape) as engine:
        run = subprocess.run(
            [sys.executable, "-m", "flows.refit", "--catalog", lab.catalog, "--seed-checkpoint", str(lab.launch),
             *cli_args(lab, engine), "--json"],
            cwd=Path(__file__).resolve().parents[3], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert (result["status"], result["version"]) == ("READY", "r2")
        assert_engine_holds(engine, lab, "r2")
        assert http_json(engine.url, "/model_info")["weight_version"] == "r2"
