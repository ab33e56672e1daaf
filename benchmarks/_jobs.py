"""Measured jobs of the refit benchmark, each in a fresh child process (``benchmarks._child``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from testbed.prefect_server import prefect_env

ROOT = Path(__file__).resolve().parents[1]


class Jobs:
    """Builds job specs for one workspace and runs them with a bounded wait."""

    def __init__(self, ws, *, apply_workers: int, fetch_workers: int, timeout_s: float,
                 after: Callable[[], None] = lambda: None):
        self.ws = ws
        self.apply_workers, self.fetch_workers, self.timeout_s = apply_workers, fetch_workers, timeout_s
        self.after = after

    def params(self) -> dict:
        ws = self.ws
        return {"catalog": ws.catalog, "model": ws.model, "seed_checkpoint": str(ws.launch),
                "cache_dir": str(ws.cache), "apply_workers": self.apply_workers, "lock_timeout_s": 120,
                "installer": {"kind": "none"}, "storage": {"concurrency": self.fetch_workers}}

    def child(self, name: str, spec: dict, env: dict | None = None) -> dict:
        """Run one job in a fresh interpreter; returns its JSON (raises with the tail of its stderr)."""
        spec = {"pristine": str(self.ws.pristine), "cache": str(self.ws.cache)} | spec
        spec_path, out = self.ws.scratch / f"{name}.spec.json", self.ws.scratch / f"{name}.out.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        # reproducible: no receiver or Prefect settings leak in from the caller's environment
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CANONICAL_REFIT_", "PREFECT_"))}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks._child", str(spec_path), str(out)], cwd=ROOT,
                                  env=base | {"PYTHONPATH": str(ROOT)} | (env or {}), capture_output=True,
                                  text=True, timeout=self.timeout_s)
        finally:
            self.after()
        if proc.returncode != 0:
            raise RuntimeError(f"job {name} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
        data["process_s"] = round(time.perf_counter() - t0, 3)
        return data

    def plain(self, name: str, targets: list[str], *, restore: bool, catalog: str | None = None,
              throttle: float = 0) -> dict:
        """Refits without Prefect (``flows.refit.run_refit``, the flow's body), one after the other in one process."""
        runs = [{"target": t, "restore": restore and i == 0, "catalog": catalog} for i, t in enumerate(targets)]
        return self.child(name, {"mode": "plain", "params": self.params(), "runs": runs,
                                 "throttle_bytes_per_s": throttle})

    def flow(self, name: str, home: Path, *, api_url: str | None = None, runs: list[dict],
             throttle: float = 0) -> dict:
        """Refits through the Prefect flow with an isolated ``PREFECT_HOME`` (and a server if ``api_url``)."""
        return self.child(name, {"mode": "flow", "params": self.params(), "runs": runs,
                                 "throttle_bytes_per_s": throttle}, env=prefect_env(home, api_url))

    def baseline(self, name: str, version: str, catalog: str, throttle: float = 0) -> dict:
        """The straightforward receiver on a fresh copy of the base checkpoint."""
        ws = self.ws
        download, work = ws.scratch / f"{name}-download", ws.scratch / f"{name}-checkpoint"
        shutil.rmtree(download, ignore_errors=True)
        try:
            data = self.child(name, {
                "mode": "baseline", "runs": [{"target": version}], "catalog": catalog, "model": ws.model,
                "base_checkpoint": str(ws.checkpoint_of(ws.info(version).base_version)), "work": str(work),
                "download": str(download), "workers": self.apply_workers, "concurrency": self.fetch_workers,
                "throttle_bytes_per_s": throttle})
        finally:
            shutil.rmtree(download, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
        keys = ("max_rss_bytes", "peak_anon_bytes", "peak_file_bytes", "throttled_bytes")
        return data["runs"][0] | {k: data[k] for k in keys}
