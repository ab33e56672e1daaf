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
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import pickle
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tasks.installers.sglang_loader import LOADER_PATH
from flows.synthetic import ModelShape
from sglang_support import DefaultModelLoader, Faults, LoadConfig, TinySGLangLlama, engine_context

_DROP = object()


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


class MockSGLang:
    """One SGLang server: its TP ranks' models, its reported state, and the faults it injects."""

    def __init__(self, model_path: Path, shape: ModelShape, *, tp_size: int = 1,
                 custom_weight_loader: list[str] | None = None, api_key: str | None = None,
                 speculative_algorithm: str | None = None, port: int = 0):
        self.faults = Faults()
        self.port = port
        self.tp_size = tp_size
        self.custom_weight_loader = [LOADER_PATH] if custom_weight_loader is None else custom_weight_loader
        self.api_key = api_key
        self.speculative_algorithm = speculative_algorithm
        self.launch_path = str(model_path)
        self.models = [TinySGLangLlama(shape, self.faults) for _ in range(tp_size)]
        self.runner_configs = [_RunnerConfig(str(model_path)) for _ in range(tp_size)]
        for model, config in zip(self.models, self.runner_configs):  # startup load from --model-path
            loader = DefaultModelLoader(LoadConfig())
            loader.load_weights_and_postprocess(
                model, loader._get_weights_iterator(DefaultModelLoader.Source.init_new(config, model)), "cpu")
        self.model_path = self.served_model_name = str(model_path)
        self.weight_version = "default"
        self.load_format = "auto"
        self.calls: Counter = Counter()
        self.bodies: list[tuple[str, dict]] = []
        self.alive = True
        self._update_lock = threading.Lock()  # SGLang serializes weight updates
        self._stop_lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> "MockSGLang":
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                engine._handle(self, "GET")

            def do_POST(self):
                engine._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self._url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="mock-sglang", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._stop_lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._thread.join(timeout=10)
                self._server = None

    def restart(self) -> "MockSGLang":
        """What restarting an SGLang server does: it comes back on the same port with its launch weights
        (``--model-path``), ``weight_version`` "default", whatever it ran before."""
        self.stop()
        self.port = int(self._url.rsplit(":", 1)[1])
        for model, config in zip(self.models, self.runner_configs):
            config.model_path = self.launch_path
            loader = DefaultModelLoader(LoadConfig())
            loader.load_weights_and_postprocess(
                model, loader._get_weights_iterator(DefaultModelLoader.Source.init_new(config, model)), "cpu")
        self.model_path = self.served_model_name = self.launch_path
        self.weight_version = "default"
        self.alive = True
        return self.start()

    def __enter__(self) -> "MockSGLang":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self._url

    def tensors(self, rank: int = 0):
        return self.models[rank].hf_tensors()

    def _crash(self) -> None:
        """What an exception in SGLang's scheduler does: the server goes away."""
        self.alive = False
        threading.Thread(target=self.stop, daemon=True).start()

    # -- HTTP plumbing ---------------------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = handler.path.split("?", 1)[0]
        self.calls[path] += 1
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        if not self.alive:
            return self._drop(handler)
        if self.api_key is not None and handler.headers.get("Authorization") != f"Bearer {self.api_key}":
            return self._send(handler, 401, {"error": "Unauthorized"})
        route = {("GET", "/health"): lambda body: (200, {}), ("POST", "/generate"): self._generate,
                 ("GET", "/server_info"): self._server_info, ("GET", "/model_info"): self._model_info,
                 ("GET", "/get_model_info"): self._model_info,
                 ("POST", "/update_weights_from_tensor"): self._update_from_tensor,
                 ("POST", "/update_weights_from_disk"): self._update_from_disk,
                 ("POST", "/update_weight_version"): self._update_weight_version,
                 ("GET", "/get_weights_by_name"): self._get_weights_by_name,
                 ("POST", "/get_weights_by_name"): self._get_weights_by_name}.get((method, path))
        if route is None:
            return self._send(handler, 404, {"detail": "Not Found"})
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return self._send(handler, 422, {"detail": [{"type": "json_invalid", "msg": "JSON decode error"}]})
        if not isinstance(body, dict):
            return self._send(handler, 422, {"detail": [{"type": "model_attributes_type", "loc": ["body"]}]})
        self.bodies.append((path, body))
        outcome = route(body)
        if outcome is _DROP:
            return self._drop(handler)
        status, payload = outcome
        if path.startswith("/update_weights"):
            if self.faults.delay_s:
                time.sleep(self.faults.delay_s)
            if self.faults.drop:
                return self._drop(handler)
            if self.faults.malformed:
                return self._send_raw(handler, 200, b"<html>upstream proxy error</html>", "text/html")
        self._send(handler, status, payload)

    def _send(self, handler, status: int, payload) -> None:
        self._send_raw(handler, status, json.dumps(payload).encode(), "application/json")

    @staticmethod
    def _send_raw(handler, status: int, data: bytes, content_type: str) -> None:
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:
            pass  # the client gave up (timeout); SGLang does not care either

    @staticmethod
    def _drop(handler) -> None:
        handler.close_connection = True
        try:
            handler.connection.shutdown(2)
        except OSError:
            pass

    @staticmethod
    def _invalid(field: str, kind: str):
        return 422, {"detail": [{"type": kind, "loc": ["body", field], "msg": f"{field} is invalid"}]}

    # -- endpoints ---------------------------------------------------------------------------------------

    def _server_info(self, body: dict):
        return 200, {
            "model_path": self.launch_path, "tokenizer_path": self.launch_path, "tp_size": self.tp_size,
            "dp_size": 1, "pp_size": 1, "enable_dp_attention": False, "load_format": "auto",
            "custom_weight_loader": self.custom_weight_loader or None,
            "speculative_algorithm": self.speculative_algorithm, "weight_version": "default",
            "internal_states": [{}], "version": "0.5.23",
        }

    def _model_info(self, body: dict):
        return 200, {
            "model_path": self.model_path, "tokenizer_path": self.launch_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": "llama",
            "architectures": ["LlamaForCausalLM"], "served_model_name": self.served_model_name,
            "load_format": self.load_format,
        }

    def _generate(self, body: dict):
        """Token ids in, token ids out (as with --skip-tokenizer-init); the mock does not run the model."""
        if not isinstance(body.get("input_ids"), list):
            return self._invalid("input_ids", "list_type")
        count = int((body.get("sampling_params") or {}).get("max_new_tokens", 1))
        return 200, {"output_ids": [0] * count, "meta_info": {"weight_version": self.weight_version}}

    def _update_weight_version(self, body: dict):
        if not isinstance(body.get("new_version"), str):
            return self._invalid("new_version", "string_type")
        self.weight_version = body["new_version"]
        return 200, {"success": True, "message": f"Weight version updated to {self.weight_version}",
                     "new_version": self.weight_version}

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
