"""moto's S3 server for the lab: ``python -m moto.server`` as a subprocess on 127.0.0.1, stopped by its group.

``MotoServer`` (``moto[server]``'s standalone server) binds a free loopback
port, logs to ``log_path``, waits (bounded) until it answers HTTP, and creates
``bucket`` if one is given (``create_bucket`` makes more). moto enforces
``If-None-Match: *`` (412), which is what publication semantics need. It
checks no signatures; its environment carries no ``AWS_`` variables.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from pathlib import Path

from testbed.processes import free_port, stop_group, tail


class MotoServer:
    """moto's S3 server in a subprocess (its own session) on 127.0.0.1; ``stop`` ends its process group."""

    def __init__(self, log_path: Path, bucket: str | None = None):
        self.log_path = Path(log_path)
        self.bucket = bucket
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "MotoServer":
        """Start the server, wait (bounded) until it answers HTTP, then create ``bucket`` (if given)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        for _ in range(3):  # the port may be taken between free_port() and the bind
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                )
            if self._wait_ready(timeout_s):
                if self.bucket:
                    self.create_bucket(self.bucket)
                return self
            self.stop()
        raise RuntimeError(f"moto server did not start; log: {tail(self.log_path, 2000) or '(no log)'}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/")
                conn.getresponse().read()
                conn.close()
                return True
            except OSError:
                time.sleep(0.1)
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server, SIGKILL its process group if it has not exited within ``timeout_s`` (idempotent)."""
        proc, self.process = self.process, None
        stop_group(proc, timeout_s)

    def create_bucket(self, name: str) -> None:
        """CreateBucket with a plain path-style PUT (moto checks no signature)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("PUT", f"/{name}", body=b"")
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status not in (200, 409):
            raise RuntimeError(f"CreateBucket {name}: {response.status} {body[:300]!r}")
