"""Prefect environments for the overhead measurement: an isolated home, and a local server by PID.

``prefect_env`` gives a child process its own ``PREFECT_HOME`` (so nothing
touches a developer's database) with analytics off. ``PrefectServer`` runs
``prefect server start`` on 127.0.0.1 in its own session, waits (bounded) for
``/api/health``, and stops it by its PID's process group: SIGTERM, a bounded
wait, then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def prefect_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """Environment overrides for a process that runs Prefect flows in isolation."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectServer:
    """``prefect server start`` on 127.0.0.1 for the duration of a ``with`` block."""

    def __init__(self, home: Path, *, startup_timeout_s: float = 180.0):
        self.home = home
        self.port = _free_port()
        self.startup_timeout_s = startup_timeout_s
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.log_path = home / "server.log"

    def __enter__(self) -> "PrefectServer":
        env = os.environ | prefect_env(self.home)
        env.pop("PREFECT_API_URL", None)
        env["PREFECT_UI_ENABLED"] = "false"
        prefect = Path(sys.executable).with_name("prefect")
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )
        deadline = t0 + self.startup_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"prefect server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.api_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.startup_s = time.perf_counter() - t0
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"prefect server not healthy after {self.startup_timeout_s:.0f}s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group (it runs in its own session), SIGKILL if it lingers."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the group we created: the server and its children only
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=timeout_s)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # any child of the server left in its group
        except ProcessLookupError:
            pass
