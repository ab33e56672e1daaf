"""A loopback HTTP server that answers like SGLang 0.5.23's weight-update API (docs/sglang.md).

Endpoints, request bodies and responses follow the notes:

- ``GET /server_info``: server arguments (``tp_size``, ``custom_weight_loader``, ...) and ``version``;
- ``GET /model_info``: ``model_path``, ``served_model_name``, ``weight_version``, ``load_format``, ...;
- ``POST /update_weights_from_tensor``: one base64 pickle per TP rank; a registered
  ``load_format`` is imported and called as ``fn(model, named_tensors)`` in each
  rank; ``{"success", "message"}``, 200 or 400;
- ``POST /update_weights_from_disk``: SGLang's own path, faithfully including its
  flaws: the runner's model path is overwritten before loading, and the
  "rollback" after a failed load re-reads the *new* path;
  ``{"success", "message", "num_paused_requests"}``, 200 or 400;
- ``POST /update_weight_version``: ``{"new_version", "abort_all_requests"}`` ->
  ``{"success", "message", "new_version"}``;
- ``GET|POST /get_weights_by_name``: ``{"name", "truncate_size"}`` -> nested lists.

A malformed body gets FastAPI's 422. An exception escaping a custom loader, an
unknown ``load_format`` or a missing rank entry crash SGLang's scheduler, which
takes the server down: the mock drops the connection and stops listening.
Each TP rank holds a full replica of ``TinySGLangLlama`` (the mock does not
shard); ranks load concurrently, one thread each, as SGLang's rank processes do.

The HTTP server, the reported state and the endpoints that need no model are
the product's engine stand-in (``deployments/engine_standin.py``, which users
run to try a fleet without a GPU); this adds the real weights, the tensor
path and the faults to inject.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deployments.engine_standin import DROP as _DROP, EngineStandIn
from tasks.installers.sglang_loader import LOADER_PATH
from flows.synthetic import ModelShape
from tests.support.sglang_support import DefaultModelLoader, Faults, LoadConfig, TinySGLangLlama, engine_context


class _SafeUnpickler(pickle.Unpickler):
    """Like SGLang's ``SafeUnpickler`` for what we send: builtin containers only."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def _deserialize(entry: str):
    return _SafeUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()


def _dynamic_import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class _RunnerConfig:
    def __init__(self, model_path: str):
        self.model_path, self.revision = model_path, None


class MockSGLang(EngineStandIn):
    """One SGLang server: its TP ranks' models, its reported state, and the faults it injects."""

    def __init__(self, model_path: Path, shape: ModelShape, *, tp_size: int = 1,
                 custom_weight_loader: list[str] | None = None, api_key: str | None = None,
                 speculative_algorithm: str | None = None, port: int = 0):
        super().__init__(model_path, tp_size=tp_size, api_key=api_key, speculative_algorithm=speculative_algorithm,
                         port=port, custom_weight_loader=[LOADER_PATH] if custom_weight_loader is None
                         else custom_weight_loader)
        self.faults = Faults()
        self.models = [TinySGLangLlama(shape, self.faults) for _ in range(tp_size)]
        self.runner_configs = [_RunnerConfig(str(model_path)) for _ in range(tp_size)]
        for model, config in zip(self.models, self.runner_configs):  # startup load from --model-path
            loader = DefaultModelLoader(LoadConfig())
            loader.load_weights_and_postprocess(
                model, loader._get_weights_iterator(DefaultModelLoader.Source.init_new(config, model)), "cpu")

    # -- lifecycle -------------------------------------------------------------------------------------

    def _relaunch(self) -> None:
        for model, config in zip(self.models, self.runner_configs):
            config.model_path = self.launch_path
            loader = DefaultModelLoader(LoadConfig())
            loader.load_weights_and_postprocess(
                model, loader._get_weights_iterator(DefaultModelLoader.Source.init_new(config, model)), "cpu")

    def tensors(self, rank: int = 0):
        return self.models[rank].hf_tensors()

    # -- HTTP plumbing: the stand-in's, with the tensor path and the faults ----------------------------

    def _routes(self) -> dict:
        return {**super()._routes(), ("POST", "/update_weights_from_tensor"): self._update_from_tensor,
                ("GET", "/get_weights_by_name"): self._get_weights_by_name,
                ("POST", "/get_weights_by_name"): self._get_weights_by_name}

    def _deliver(self, handler, path: str, status: int, payload) -> None:
        if path.startswith("/update_weights"):
            if self.faults.delay_s:
                time.sleep(self.faults.delay_s)
            if self.faults.drop:
                return self._drop(handler)
            if self.faults.malformed:
                return self._send_raw(handler, 200, b"<html>upstream proxy error</html>", "text/html")
        self._send(handler, status, payload)

    # -- endpoints (the others are the stand-in's) -------------------------------------------------------

    def _get_weights_by_name(self, body: dict):
        if not isinstance(body.get("name"), str):
            return self._invalid("name", "string_type")
        values = self.models[0].get_weights_by_name(body["name"], int(body.get("truncate_size", 100)))
        if values is None:
            return 400, {"error": {"message": "Get parameter by name failed"}}
        return 200, values

    def _update_from_tensor(self, body: dict):
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            return self._invalid("serialized_named_tensors", "list_type")
        load_format = body.get("load_format")
        if load_format is not None and not isinstance(load_format, str):
            return self._invalid("load_format", "string_type")
        if body.get("selector", "all") not in ("target", "draft", "all"):
            return self._invalid("selector", "literal_error")
        if self.faults.reject_status is not None:
            return self.faults.reject_status, {"success": False, "message": "injected rejection before loading"}
        with self._update_lock:
            unknown_format = load_format is not None and load_format not in self.custom_weight_loader
            if len(entries) < self.tp_size or unknown_format:
                self._crash()  # IndexError / NotImplementedError inside the scheduler
                return _DROP
            try:
                with ThreadPoolExecutor(self.tp_size) as pool:
                    list(pool.map(lambda r: self._run_tensor_update(r, entries[r], load_format), range(self.tp_size)))
            except Exception:
                self._crash()
                return _DROP
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Success"}

    def _run_tensor_update(self, rank: int, entry: str, load_format: str | None) -> None:
        named_tensors = _deserialize(entry)
        with engine_context(rank, self.faults):
            if load_format is None:
                self.models[rank].load_weights(named_tensors)
            else:
                _dynamic_import(load_format)(self.models[rank], named_tensors)

    def _update_from_disk(self, body: dict):
        if not isinstance(body.get("model_path"), str):
            return self._invalid("model_path", "missing")
        if self.faults.reject_status is not None:
            return self.faults.reject_status, {"success": False, "message": "injected rejection before loading",
                                               "num_paused_requests": 0}
        model_path, load_format = body["model_path"], body.get("load_format") or self.load_format
        with self._update_lock:
            success, message = True, "Succeeded to update model weights."
            try:
                for rank in range(self.tp_size):
                    with engine_context(rank, self.faults):
                        success, message = self._disk_update_rank(rank, model_path, load_format)
                    if not success:
                        break
            except Exception:  # the "rollback" failed too: SGLang does not catch that
                self._crash()
                return _DROP
            if success:
                self.model_path = self.served_model_name = model_path  # _update_model_path_info
                self.load_format = load_format
                if body.get("weight_version") is not None:
                    self.weight_version = body["weight_version"]
                    message += f" Weight version updated to {self.weight_version}."
        return (200 if success else 400), {"success": success, "message": message, "num_paused_requests": 0}

    def _disk_update_rank(self, rank: int, model_path: str, load_format: str) -> tuple[bool, str]:
        """``WeightUpdater.update_weights_from_disk`` step by step (notes, section 2b)."""
        model, config = self.models[rank], self.runner_configs[rank]
        config.model_path = model_path  # step 3: overwritten before anything is loaded
        try:
            loader = DefaultModelLoader(LoadConfig(load_format=load_format))
        except Exception as exc:
            return False, f"Failed to get model loader: {exc}."

        def weight_iter():
            return loader._get_weights_iterator(DefaultModelLoader.Source.init_new(config, model))

        try:
            weights = weight_iter()
        except Exception as exc:
            return False, f"Failed to get weights iterator: {exc}."
        try:
            DefaultModelLoader.restore_weights_before_loading(model, "cpu")
            loader.load_weights_and_postprocess(model, weights, "cpu")
        except Exception as exc:
            # SGLang's "rollback": rebuilds the iterator from config, whose model_path is already the NEW one
            loader.load_weights_and_postprocess(model, weight_iter(), "cpu")
            return False, f"Failed to update weights: {exc}.\nRolling back to original weights."
        return True, "Succeeded to update model weights."
