"""Processes of the lab: free ports, bounded waits, log tails, clean environments, stopping, CPU and RSS.

Every child the lab starts runs in a session of its own and is stopped by its
process group (``stop_group``: SIGTERM, a bounded wait, SIGKILL); every wait
is bounded (``wait_until``) and fails with diagnostics.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages (what ``uptime`` prints)."""
    return [round(x, 2) for x in os.getloadavg()]


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_until(what: str, check: Callable[[], object], timeout_s: float, *, every_s: float = 0.2,
               diagnostics: Callable[[], str] = lambda: ""):
    """Poll ``check`` until it returns something truthy; ``TimeoutError`` with ``diagnostics`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{diagnostics()}")
        time.sleep(every_s)


def quiet_env(**extra: str) -> dict[str, str]:
    """This process's environment without receiver, AWS or Prefect settings, analytics off, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CANONICAL_REFIT_", "AWS_", "PREFECT_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1",
               PREFECT_LOGGING_EXTRA_LOGGERS="canonical_refit")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def stop_group(proc: subprocess.Popen | None, timeout_s: float = 15.0) -> None:
    """SIGTERM, a bounded wait, then SIGKILL to the process group ``proc`` leads (started in its own session)."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def process_rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def machine() -> dict:
    """What the measurements ran on: CPU model, cores, Python, Prefect and PostgreSQL versions."""
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    import prefect

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "prefect": prefect.__version__,
            "postgres": _postgres_version()}


def _postgres_version() -> str | None:
    try:
        return subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-Atc", "SHOW server_version"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None

