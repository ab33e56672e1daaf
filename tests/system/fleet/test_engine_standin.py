"""The engine stand-in as users run it: ``python -m deployments.engine_standin --model-path DIR --port N``.

A process of its own, talked to over HTTP with the request and response
shapes of SGLang's own server (docs/sglang.md): ``/health``,
``/server_info``, ``/model_info``, ``/update_weights_from_disk``,
``/update_weight_version`` and ``/generate``; a refused load changes
nothing; ``--api-key`` is enforced; SIGTERM ends it; started again it is back
on its launch weights, ``weight_version`` "default", as a restarted SGLang is.
"""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from testbed.processes import ROOT, free_port, quiet_env


def checkpoint(folder: Path, *, broken: bool = False) -> Path:
    """A one-tensor safetensors checkpoint (``broken``: the tensor's bytes run past the end of the file)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = struct.pack("<4e", 1.0, 2.0, 3.0, 4.0)
    end = len(data) + (64 if broken else 0)
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, end]}})
    header += " " * (-len(header) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + data)
    (folder / "config.json").write_text("{}")
    return folder


class StandIn:
    """One stand-in process on a fixed port."""

    def __init__(self, model_path: Path, port: int, *extra: str):
        self.port = port
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.engine_standin", "--model-path", str(model_path), "--port", str(port),
             *extra], cwd=ROOT, env=quiet_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.banner = self.proc.stdout.readline()  # printed once it listens

    def call(self, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.stdout.close()
            self.proc.stderr.close()


@pytest.fixture
def launch(tmp_path) -> Path:
    return checkpoint(tmp_path / "launch")


def test_the_stand_in_answers_sglang_weight_updates_as_a_process(tmp_path, launch):
    port = free_port()
    engine = StandIn(launch, port)
    try:
        assert f"http://127.0.0.1:{port}" in engine.banner and "weight_version default" in engine.banner
        assert engine.call("GET", "/health")[0] == 200
        status, info = engine.call("GET", "/server_info")
        assert status == 200 and info["tp_size"] == 1 and info["model_path"] == str(launch)
        assert isinstance(info["version"], str) and "custom_weight_loader" in info
        status, model = engine.call("GET", "/model_info")
        assert status == 200
        assert (model["model_path"], model["weight_version"], model["is_generation"]) == (str(launch), "default", True)

        # SGLang's update_weights_from_disk: {model_path, load_format?, weight_version?} -> success, message,
        # num_paused_requests; /model_info then reports the new path and version
        step = checkpoint(tmp_path / "step-1")
        status, reply = engine.call("POST", "/update_weights_from_disk",
                                    {"model_path": str(step), "weight_version": "r1"})
        assert status == 200 and reply["success"] is True and reply["num_paused_requests"] == 0
        assert isinstance(reply["message"], str)
        model = engine.call("GET", "/model_info")[1]
        assert (model["model_path"], model["weight_version"]) == (str(step), "r1")

        # a folder that is not a checkpoint, and one whose tensor lies outside its file: 400, nothing changed
        empty = tmp_path / "empty"
        empty.mkdir()
        for folder in (empty, checkpoint(tmp_path / "broken", broken=True)):
            status, reply = engine.call("POST", "/update_weights_from_disk",
                                        {"model_path": str(folder), "weight_version": "r2"})
            assert status == 400 and reply["success"] is False and str(folder) in reply["message"]
        model = engine.call("GET", "/model_info")[1]
        assert (model["model_path"], model["weight_version"]) == (str(step), "r1")

        # update_weight_version: {new_version, abort_all_requests} -> success, message, new_version
        status, reply = engine.call("POST", "/update_weight_version", {"new_version": "r1b",
                                                                      "abort_all_requests": False})
        assert (status, reply["success"], reply["new_version"]) == (200, True, "r1b")
        assert engine.call("GET", "/model_info")[1]["weight_version"] == "r1b"

        # /generate with token ids (as with --skip-tokenizer-init): output_ids, and the weight_version answering
        status, reply = engine.call("POST", "/generate", {"input_ids": [1, 2, 3],
                                                          "sampling_params": {"max_new_tokens": 4}})
        assert status == 200 and len(reply["output_ids"]) == 4 and reply["meta_info"]["weight_version"] == "r1b"

        # malformed requests get FastAPI's 422, as SGLang's do; an unknown path 404
        assert engine.call("POST", "/update_weights_from_disk", {"weight_version": "r3"})[0] == 422
        assert engine.call("POST", "/update_weights_from_disk", b"{not json")[0] == 422
        assert engine.call("POST", "/update_weight_version", {"new_version": 3})[0] == 422
        assert engine.call("GET", "/no_such_endpoint")[0] == 404
    finally:
        assert engine.stop() == 0  # SIGTERM: a clean exit

    # started again on the same port: back on its launch weights, whatever it ran before
    engine = StandIn(launch, port)
    try:
        model = engine.call("GET", "/model_info")[1]
        assert (model["model_path"], model["weight_version"]) == (str(launch), "default")
    finally:
        engine.stop()


def test_the_stand_in_enforces_its_api_key(launch):
    engine = StandIn(launch, free_port(), "--api-key", "sekrit")
    try:
        status, reply = engine.call("GET", "/model_info")
        assert status == 401 and "error" in reply
        status, reply = engine.call("GET", "/model_info", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, model = engine.call("GET", "/model_info", headers={"Authorization": "Bearer sekrit"})
        assert status == 200 and model["weight_version"] == "default"
    finally:
        engine.stop()


def test_a_node_installs_into_the_stand_in_process_and_its_heartbeat_sees_a_restart(tmp_path):
    """The stand-in as the fleet uses it: a refit with ``--installer sglang-disk`` loads into the process, and
    the node's heartbeat reports DRIFTED once the process was restarted on its launch weights."""
    from flows import node_report
    from flows.synthetic import ModelShape, random_model, write_checkpoint
    from storage.settings import InstallerSettings, PublishParams, RefitParams
    from tasks.installers import make_installer

    shape = ModelShape(vocab=64, hidden=16, intermediate=32, layers=1, shards=1)
    launch = write_checkpoint(tmp_path / "launch", random_model(shape, seed=3), shards=1)
    catalog = (tmp_path / "objects" / "catalog").as_uri()
    from flows.publish import run_publish

    run_publish(PublishParams(catalog=catalog, model="lab/standin", checkpoint=launch, kind="initial",
                              state_dir=tmp_path / "publisher", emit_event=False))
    port = free_port()
    engine = StandIn(launch, port)
    try:
        installer = InstallerSettings(kind="sglang-disk", engine_urls=[f"http://127.0.0.1:{port}"])
        params = RefitParams(catalog=catalog, model="lab/standin", node="gpu1", cache_dir=tmp_path / "cache",
                             seed_checkpoint=str(launch), installer=installer)
        from flows.refit import run_refit

        result = run_refit(params)
        assert result.status == "READY", result.error
        model = engine.call("GET", "/model_info")[1]
        assert model["weight_version"] == result.version and model["model_path"].endswith("current")
        beat = node_report.refresh_node(params, make_installer(installer))
        assert (beat.condition(), beat.version) == ("READY", result.version)
    finally:
        assert engine.stop() == 0
    engine = StandIn(launch, port)  # restarted: back on its launch weights
    try:
        beat = node_report.refresh_node(params, make_installer(installer))
        assert beat.condition() == "DRIFTED" and beat.version is None
        assert beat.engines == {f"http://127.0.0.1:{port}": "default"}
    finally:
        engine.stop()


def test_an_engine_killed_mid_load_leaves_the_node_poisoned_until_recover_and_the_heartbeat_says_so(tmp_path):
    """``--load-seconds``: a kill lands in a load. The refit ends POISONED; the heartbeat keeps saying POISONED
    (not DRIFTED, which an agent would try to heal by installing into a store that refuses) while the engine is
    down and after it came back on its launch weights; ``recover`` re-installs, and the next beat says READY."""
    import os
    import threading

    from flows import node_report
    from flows.publish import run_publish
    from flows.recover import run_recover
    from flows.refit import run_refit
    from flows.synthetic import ModelShape, random_model, train_step, write_checkpoint
    from storage.settings import InstallerSettings, PublishParams, RecoverParams, RefitParams
    from storage.store.local_store import LocalStore
    from tasks.installers import make_installer

    shape = ModelShape(vocab=64, hidden=16, intermediate=32, layers=1, shards=1)
    tensors = random_model(shape, seed=5)
    launch = write_checkpoint(tmp_path / "launch", tensors, shards=1)
    step = write_checkpoint(tmp_path / "step-1", train_step(tensors, seed=6), shards=1)
    catalog, model = (tmp_path / "objects" / "catalog").as_uri(), "lab/standin"
    for folder, kind in ((launch, "initial"), (step, "delta")):
        run_publish(PublishParams(catalog=catalog, model=model, checkpoint=folder, kind=kind,
                                  state_dir=tmp_path / "publisher", emit_event=False))
    port = free_port()
    installer = InstallerSettings(kind="sglang-disk", engine_urls=[f"http://127.0.0.1:{port}"])

    def params(target: str) -> RefitParams:
        return RefitParams(catalog=catalog, model=model, node="gpu1", cache_dir=tmp_path / "cache", target=target,
                           seed_checkpoint=str(launch), installer=installer)

    engine = StandIn(launch, port, "--load-seconds", "1.5")
    assert run_refit(params("r0")).status == "READY"
    link = tmp_path / "cache" / model.replace("/", "--") / "current"
    outcome: list = []
    refit = threading.Thread(target=lambda: outcome.append(run_refit(params("r1"))))
    refit.start()
    deadline = time.monotonic() + 60
    while "r1" not in (os.readlink(link) if link.is_symlink() else "") and time.monotonic() < deadline:
        time.sleep(0.02)  # the installer switches the stable path, then asks the engine to load it
    time.sleep(0.5)
    engine.proc.kill()  # SIGKILL in the middle of the load
    engine.stop()
    refit.join(120)
    assert outcome and outcome[0].status == "POISONED", outcome and outcome[0].error
    assert LocalStore(tmp_path / "cache", model, create=False).poisoned() is not None

    beat = node_report.refresh_node(params("latest"), make_installer(installer))  # the engine is gone
    assert beat.condition() == "POISONED" and beat.version is None
    engine = StandIn(launch, port)  # back on its launch weights: still poisoned, never merely drifted
    try:
        beat = node_report.refresh_node(params("latest"), make_installer(installer))
        assert beat.condition() == "POISONED" and beat.engines == {installer.engine_urls[0]: "default"}

        recovered = run_recover(RecoverParams(model=model, cache_dir=tmp_path / "cache"))
        assert recovered.status == "READY", recovered.error
        beat = node_report.refresh_node(params("latest"), make_installer(installer))
        assert (beat.condition(), beat.version) == ("READY", recovered.version)
        assert engine.call("GET", "/model_info")[1]["weight_version"] == recovered.version
    finally:
        engine.stop()
