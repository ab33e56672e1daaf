"""Importing the product sets nothing up: no environment, no logging, no patched Prefect, no threads.

Each check runs in a fresh interpreter. ``flows.api`` (and the CLI's
module) import without Prefect and leave the process as it was. The flow
modules import Prefect, whose own import configures its logging; what is
checked against is therefore a process that imported Prefect first: the
flow modules then add nothing (no ``PREFECT_*`` variable, no handler on the
root or the product's logger, no level, Prefect's heartbeat sender
untouched, no new thread). ``flows.bootstrap.bootstrap()``, which the entry
points call, is what does all of that, and it is checked to.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.lab import ROOT_DIR

SNAPSHOT = """
import json, logging, os, sys, threading
def snapshot():
    product = logging.getLogger("canonical_refit")
    engine = sys.modules.get("prefect.flow_engine")
    return {"env": sorted(k + "=" + v for k, v in os.environ.items() if k.startswith("PREFECT_")),
            "root": [type(h).__name__ for h in logging.getLogger().handlers],
            "root_level": logging.getLogger().level,
            "product": [type(h).__name__ for h in product.handlers], "product_level": product.level,
            "heartbeats": getattr(getattr(engine, "_send_heartbeats", None), "__module__", None),
            "threads": sorted(t.name for t in threading.enumerate()),
            "prefect": "prefect" in sys.modules}
"""


def _run(body: str) -> dict:
    env_clean = "import os\nfor k in [k for k in os.environ if k.startswith('PREFECT_LOGGING')]: del os.environ[k]\n"
    done = subprocess.run([sys.executable, "-c", env_clean + SNAPSHOT + body], capture_output=True, text=True,
                          cwd=ROOT_DIR, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_python_api_and_the_cli_changes_nothing_and_imports_no_prefect():
    seen = _run("before = snapshot()\nimport flows.api, flows.cli, flows.bootstrap, flows.prefect_adapter\n"
                "print(json.dumps({'before': before, 'after': snapshot()}))")
    assert seen["after"] == seen["before"]
    assert seen["after"]["prefect"] is False


def test_importing_the_flows_adds_nothing_to_what_prefect_itself_set_up():
    seen = _run("import prefect, prefect.flow_engine\nbefore = snapshot()\n"
                "import flows.refit, flows.publish, flows.sharded, flows.demo, flows.api, deployments.serve, "
                "deployments.agent\nprint(json.dumps({'before': before, 'after': snapshot()}))")
    before, after = seen["before"], seen["after"]
    assert after == before
    assert not any(e.startswith("PREFECT_LOGGING_EXTRA_LOGGERS=") for e in after["env"])
    assert after["heartbeats"] == "prefect.flow_engine"  # Prefect's own sender: nothing patched at import


def test_the_bootstrap_is_what_sets_the_process_up():
    seen = _run("from flows.bootstrap import bootstrap\nbootstrap(log_to_stderr=True)\nimport flows.refit\n"
                "print(json.dumps(snapshot()))")
    assert "PREFECT_LOGGING_EXTRA_LOGGERS=canonical_refit" in seen["env"]
    assert seen["product_level"] == 20 and "APILogHandler" in seen["product"]
    assert seen["heartbeats"] == "flows.prefect_adapter"
    assert "StreamHandler" in seen["root"] or "PrefectConsoleHandler" in seen["root"]
