"""The helpers the deployment tests drive a real ``prefect server`` with.

The server is ``testbed.prefect_server.PrefectServer`` on SQLite, on
127.0.0.1 with its own ``PREFECT_HOME``; every process the tests start gets
``PREFECT_API_URL`` of that server explicitly (``PrefectServer.client_env``),
and every one is stopped by its process group with a bounded wait
(``testbed.processes.stop_group``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from uuid import UUID

from testbed.prefect_server import FINAL_STATE_TYPES, PrefectServer, target_of
from testbed.processes import PYTHON, ROOT, wait_until


def run(cmd: list[str], env: dict[str, str], *, timeout_s: float = 120.0, cwd: Path = ROOT) -> str:
    """Run a command to completion; its combined output, or an assertion error that shows it."""
    done = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stdout[-4000:]}"
    return done.stdout


def spawn(cmd: list[str], env: dict[str, str], log: Path, *, cwd: Path = ROOT) -> subprocess.Popen:
    """Start a long-running command in its own session (so it can be stopped with its children)."""
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def publish(env: dict[str, str], catalog: str, model: str, checkpoint: Path, state_dir: Path, *extra: str) -> dict:
    """``python -m flows.publish ... --json``: the publication's result."""
    out = run([PYTHON, "-m", "flows.publish", "--catalog", catalog, "--model", model,
               "--checkpoint", str(checkpoint), "--state-dir", str(state_dir), "--json", *extra], env)
    return json.loads(out.strip().splitlines()[-1])


def emit_published(env: dict[str, str], catalog: str, model: str, *versions: str) -> None:
    """Announce already-published versions, in order, from one process (the publisher's own emitter)."""
    code = (
        "import sys\n"
        "from flows.publish import emit_published\n"
        "from storage.catalog.records import Catalog\n"
        "from storage.objects.store import ObjectStore\n"
        "from storage.settings import ObjectStoreSettings\n"
        "catalog = Catalog(ObjectStore(ObjectStoreSettings()), sys.argv[1], sys.argv[2])\n"
        "for version in sys.argv[3:]:\n"
        "    emit_published(catalog.read(version), catalog)\n"
    )
    run([PYTHON, "-c", code, catalog, model, *versions], env)


def flip_tensor_byte(bucket: Path, tensor: str) -> None:
    """Flip one byte in the middle of ``tensor``'s frame in a delta bucket (a safetensors file)."""
    from storage.format.safetensors import read_header

    header = read_header(bucket)
    info = header.tensors[tensor]
    position = header.data_offset + (info.start + info.end) // 2
    data = bytearray(bucket.read_bytes())
    data[position] ^= 0xFF
    bucket.write_bytes(bytes(data))


def refit_runs(client, deployment_id: UUID) -> list:
    """Flow runs of one deployment, oldest first."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    return sorted(runs, key=lambda r: r.created)


def wait_for_final_run(client, deployment_id: UUID, target: str, timeout_s: float, diagnostics) -> object:
    """The first run of ``deployment_id`` for ``target`` once it reached a final state."""
    def final():
        for run in refit_runs(client, deployment_id):
            if target_of(run) == target and run.state_type and run.state_type.value in FINAL_STATE_TYPES:
                return run
        return None

    return wait_until(f"a final run to {target}", final, timeout_s, every_s=1.0, diagnostics=diagnostics)


def artifacts_of(client, flow_run_id: UUID) -> dict[str, object]:
    """The run's artifacts by key."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    wanted = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    found = client.read_artifacts(artifact_filter=wanted)
    return {a.key: a for a in found}


def delete_deployments(server: PrefectServer, names: list[str]) -> None:
    """Delete deployments by name (and with them their triggers), leaving the names free on the server."""
    from prefect.exceptions import ObjectNotFound

    with server.client() as client:
        for name in names:
            try:
                client.delete_deployment(client.read_deployment_by_name(name).id)
            except ObjectNotFound:
                pass


class Listener:
    """An outsider's HTTP endpoint on 127.0.0.1 that records every connection and request made to it (method,
    path, headers) and answers 200: where a leaked URL or credential would arrive. A context manager."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        listener = self
        self.connections = 0
        self.requests: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _record(self):
                length = int(self.headers.get("Content-Length") or 0)
                listener.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                          "body": self.rfile.read(length) if length else b""})
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _record

        class Server(ThreadingHTTPServer):
            def verify_request(self, request, client_address):  # every connection, even one that sends nothing
                listener.connections += 1
                return True

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "Listener":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def files_under(folder: Path) -> list[Path]:
    """Every file below ``folder`` (none if it does not exist)."""
    return sorted(p for p in Path(folder).rglob("*") if not p.is_dir()) if Path(folder).exists() else []


def start_run(server: PrefectServer, deployment: str, params: dict) -> UUID:
    """Create a flow run of ``deployment`` (its full name) with ``{"params": params}``, as anyone with access to
    the API can; its id."""
    with server.client() as client:
        deployment_id = client.read_deployment_by_name(deployment).id
        return client.create_flow_run_from_deployment(deployment_id, parameters={"params": params}).id


def final_run(server: PrefectServer, run_id: UUID, timeout_s: float, diagnostics) -> object:
    """The flow run once it reached a final state."""
    def final():
        with server.client() as client:
            flow_run = client.read_flow_run(run_id)
        return flow_run if flow_run.state_type and flow_run.state_type.value in FINAL_STATE_TYPES else None

    return wait_until(f"flow run {run_id} to end", final, timeout_s, every_s=0.5, diagnostics=diagnostics)
