"""An engine stand-in: an HTTP server that answers SGLang's weight-update API as the installers use it.

    python -m deployments.engine_standin --model-path /models/launch --port 30000

For trying a fleet without a GPU (docs/fleet.md, "Trying a fleet without a
GPU"): a node agent started with ``--installer sglang-disk --engine-url
http://127.0.0.1:30000`` installs into it as into a stock SGLang server. The
requests and responses follow SGLang 0.5.23 (docs/sglang.md):

- ``GET /health``; ``GET /server_info`` (``tp_size``, ``custom_weight_loader``,
  ``version``, ...); ``GET /model_info`` (``model_path``, ``weight_version``,
  ``load_format``, ...);
- ``POST /update_weights_from_disk`` ``{"model_path", "load_format"?,
  "weight_version"?}`` -> ``{"success", "message", "num_paused_requests"}``,
  200 or 400;
- ``POST /update_weight_version`` ``{"new_version", "abort_all_requests"}`` ->
  ``{"success", "message", "new_version"}``;
- ``POST /generate`` ``{"input_ids": [...]}``: zeros (no model runs).

It runs no model: a load reads every ``*.safetensors`` header under the path
and checks that each tensor's bytes are in the file (a folder that is not a
checkpoint is refused with 400, nothing changed). Like every SGLang restart,
starting it again brings it back on its launch weights (``--model-path``),
``weight_version`` "default": that is how a drift is tried (started while the
old process still holds the port, it waits up to 10 s for it). A malformed body
gets FastAPI's 422. ``--load-seconds S`` makes each load take S seconds, as a
real engine's does: killing it meanwhile is how a poisoned node is tried.
The in-engine loader (``--installer sglang``) needs SGLang itself; the
stand-in serves ``sglang-disk``.

The tests' engine (``tests/support/sglang_mock.py``) is this server with real weights
loaded into a small model and faults to inject.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import signal
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

log = logging.getLogger("canonical_refit.engine_standin")
SGLANG_VERSION = "0.5.23"  # the version whose API the stand-in answers
DROP = object()  # an endpoint's answer: drop the connection (the server went away)


class EngineStandIn:
    """One engine: what it reports (launch path, loaded path, ``weight_version``) and its HTTP server."""

    def __init__(self, model_path: Path | str, *, tp_size: int = 1, custom_weight_loader: list[str] | None = None,
                 api_key: str | None = None, speculative_algorithm: str | None = None, port: int = 0,
                 host: str = "127.0.0.1"):
        self.port, self.host = port, host
        self.load_s = 0.0  # how long a load takes (a real engine takes seconds to minutes): a kill can land in it
        self.tp_size = tp_size
        self.custom_weight_loader = [] if custom_weight_loader is None else custom_weight_loader
        self.api_key = api_key
        self.speculative_algorithm = speculative_algorithm
        self.launch_path = str(model_path)
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
        self._url = ""

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> "EngineStandIn":
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                engine._handle(self, "GET")

            def do_POST(self):
                engine._handle(self, "POST")

        self._server = _bind((self.host, self.port), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self._url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="engine-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._stop_lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._thread.join(timeout=10)
                self._server = None

    def restart(self) -> "EngineStandIn":
        """What restarting an SGLang server does: it comes back on the same port with its launch weights
        (``--model-path``), ``weight_version`` "default", whatever it ran before."""
        self.stop()
        self.port = int(self._url.rsplit(":", 1)[1])
        self._relaunch()
        self.model_path = self.served_model_name = self.launch_path
        self.weight_version = "default"
        self.alive = True
        return self.start()

    def _relaunch(self) -> None:
        """Load the launch weights again (the stand-in holds none)."""

    def __enter__(self) -> "EngineStandIn":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self._url

    def _crash(self) -> None:
        """What an exception in SGLang's scheduler does: the server goes away."""
        self.alive = False
        threading.Thread(target=self.stop, daemon=True).start()

    # -- HTTP plumbing ---------------------------------------------------------------------------------

    def _routes(self) -> dict:
        return {("GET", "/health"): lambda body: (200, {}), ("POST", "/generate"): self._generate,
                ("GET", "/server_info"): self._server_info, ("GET", "/model_info"): self._model_info,
                ("GET", "/get_model_info"): self._model_info,
                ("POST", "/update_weights_from_disk"): self._update_from_disk,
                ("POST", "/update_weight_version"): self._update_weight_version}

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = handler.path.split("?", 1)[0]
        self.calls[path] += 1
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        if not self.alive:
            return self._drop(handler)
        if self.api_key is not None and handler.headers.get("Authorization") != f"Bearer {self.api_key}":
            return self._send(handler, 401, {"error": "Unauthorized"})
        route = self._routes().get((method, path))
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
        if outcome is DROP:
            return self._drop(handler)
        status, payload = outcome
        self._deliver(handler, path, status, payload)

    def _deliver(self, handler, path: str, status: int, payload) -> None:
        """Send an endpoint's answer (the tests' engine injects its faults here)."""
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
            "internal_states": [{}], "version": SGLANG_VERSION,
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
        """Token ids in, token ids out (as with --skip-tokenizer-init); no model runs."""
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

    def _update_from_disk(self, body: dict):
        if not isinstance(body.get("model_path"), str):
            return self._invalid("model_path", "missing")
        model_path, load_format = body["model_path"], body.get("load_format") or self.load_format
        with self._update_lock:
            problem = checkpoint_problem(Path(model_path))
            if problem is None and self.load_s:
                time.sleep(self.load_s)  # loading: the weights are being overwritten
            if problem is not None:  # SGLang fails to build its weights iterator: nothing was loaded
                return 400, {"success": False, "message": f"Failed to get weights iterator: {problem}.",
                             "num_paused_requests": 0}
            self.model_path = self.served_model_name = model_path
            self.load_format = load_format
            message = "Succeeded to update model weights."
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
                message += f" Weight version updated to {self.weight_version}."
        return 200, {"success": True, "message": message, "num_paused_requests": 0}


def _bind(address: tuple[str, int], handler, wait_s: float = 10.0) -> ThreadingHTTPServer:
    """The server on ``address``; a port still held by a stand-in that is exiting (a restart) is waited for."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ThreadingHTTPServer(address, handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a loadable safetensors checkpoint (None: it is): each file's header parses and
    every tensor's bytes lie inside the file (``storage.format.safetensors.read_header``)."""
    from storage.errors import SafetensorsError
    from storage.format.safetensors import read_header

    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return f"no *.safetensors files in {folder}"
    for file in files:
        try:
            read_header(file)
        except (OSError, SafetensorsError) as exc:
            return str(exc)  # names the file (and the tensor at fault)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.engine_standin",
        description="An engine stand-in that answers SGLang's weight-update API (update_weights_from_disk, "
                    "model_info, ...) without a GPU or a model: for trying a fleet with --installer sglang-disk. "
                    "Restarting it brings it back on --model-path with weight_version 'default', as SGLang does.")
    parser.add_argument("--model-path", required=True, type=Path, help="the launch checkpoint (a folder)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0: any free port (printed)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY', as SGLang's --api-key")
    parser.add_argument("--load-seconds", type=float, default=0.0,
                        help="each update_weights_from_disk takes this long (the engine killed meanwhile leaves "
                             "the node poisoned: how to try recover)")
    args = parser.parse_args(argv)
    engine = EngineStandIn(args.model_path, api_key=args.api_key, port=args.port, host=args.host)
    engine.load_s = args.load_seconds
    engine.start()
    print(f"engine stand-in on {engine.url}, model_path {engine.model_path}, weight_version default", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
