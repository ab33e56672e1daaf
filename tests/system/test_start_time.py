"""Commands that run no flow start without Prefect; a refit still runs its Prefect flow.

Each command runs as a user runs it, in a fresh ``python -X importtime``
process: the interpreter names every module it imports on stderr, so the
Prefect modules a command loaded are read from there (whatever thread
imported them, even when the command ends with ``os._exit``). ``--help`` of
every entry point, ``status``, ``recover`` (installer ``none`` or ``sglang``:
it talks to the engines over HTTP), ``activate``, ``flows.fleet status`` and
``import flows.api`` load none, nor the heavy libraries a command needs only when
it moves bytes or talks to a server (``HEAVY``: pydantic-settings, fsspec and
the S3 stack, the codecs and digests, NumPy, httpx, asyncio; ``flows.fleet
status`` on a ``file://`` catalog lists and reads its records without fsspec, and without the object
store's transfer modules, ``TRANSFER``); a refit loads
Prefect and its flow run works (also ``tests/system/test_receiver_cli.py``: the demo and the JSON CLI runs),
with Prefect's environment defaults set before Prefect was imported
(``flows.bootstrap``). How fast they start is measured by
``python -m benchmarks.start_time``, run here once as a command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.lab import ROOT_DIR, Lab, tiny_shape
from tests.support.sglang_flows import cli_args, sglang
from tests.support.sglang_mock import MockSGLang
from tests.support.sglang_support import engine_env, fake_sglang  # noqa: F401  (fixture)
from storage.catalog.nodes import NodeRecord, write_node_record
from storage.format.status import READY
from storage.objects.store import ObjectStore
from storage.store.local_store import LocalStore

HEAVY = ("pydantic_settings", "fsspec", "s3fs", "aiobotocore", "botocore", "aiohttp", "zstandard", "xxhash", "blake3",
         "isal", "numpy", "httpx", "asyncio", "cryptography", "safetensors", "torch")
TRANSFER = ("storage.objects.transfer", "storage.objects.partial", "storage.objects.conditional",
            "storage.objects.multipart", "storage.objects.localcopy")  # what only moving bytes needs
HELP = ["flows.refit", "flows.refit status", "flows.refit recover", "flows.refit activate", "flows.publish",
        "flows.publish orphans", "flows.publish keygen", "flows.fleet", "flows.fleet status", "flows.fleet wait",
        "flows.fleet forget", "deployments.serve", "flows.local_server", "flows.local_server status"]


def run(args: list[str], env: dict | None = None, timeout: float = 300) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``python -X importtime ARGS``; the finished process (its stderr without the import lines; ``.heavy``:
    the ``HEAVY`` packages it imported; ``.imported``: every module it imported) and the Prefect modules it
    imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True,
                          cwd=ROOT_DIR, env=env, timeout=timeout)
    lines = done.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    done.stderr = "\n".join(line for line in lines if not line.startswith("import time:"))
    done.heavy = sorted(m for m in imported if m in HEAVY)
    done.imported = imported
    assert any(m.split(".")[0] in ("flows", "deployments") for m in imported), "no import lines read"
    return done, sorted(m for m in imported if m.split(".")[0] == "prefect")


@pytest.mark.parametrize("command", HELP)
def test_every_help_starts_without_prefect_or_the_heavy_libraries(command):
    module, *sub = command.split()
    done, prefect = run(["-m", module, *sub, "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: python -m ") and " ".join(command.split()) in done.stdout.splitlines()[0]
    assert prefect == []
    assert done.heavy == ([] if command != "flows.publish keygen" else ["cryptography"])  # keygen's: the key types


def test_the_python_api_imports_without_prefect_or_the_heavy_libraries(tmp_path):
    done, prefect = run(["-c", "import json, flows.api as api; "
                               f"print(json.dumps(api.status(model='org/m', cache_dir={str(tmp_path)!r})))"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["state"] is None
    assert prefect == [] and done.heavy == []
    done, prefect = run(["-c", "import flows.api as api; print(api.Revision.__name__, api.FleetView.__name__)"])
    assert done.returncode == 0 and done.stdout.split() == ["Revision", "FleetView"], done.stderr[-2000:]


def test_an_empty_store_and_an_empty_fleet_answer_without_prefect_or_the_heavy_libraries(tmp_path):
    done, prefect = run(["-m", "flows.refit", "status", "--model", "org/m", "--cache-dir", str(tmp_path)])
    assert done.returncode == 1 and "no store for org/m" in done.stderr and prefect == [] and done.heavy == []
    done, prefect = run(["-m", "flows.refit", "recover", "--model", "org/m", "--cache-dir", str(tmp_path)])
    assert done.returncode == 1 and prefect == [] and done.heavy == [], done.stdout + done.stderr[-2000:]
    (tmp_path / "catalog").mkdir()
    done, prefect = run(["-m", "flows.fleet", "status", "--catalog", f"file://{tmp_path}/catalog", "--model",
                         "org/m", "--json"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["nodes"] == [] and prefect == []
    assert done.heavy == [] and not done.imported & set(TRANSFER), (done.heavy, done.imported & set(TRANSFER))


def test_fleet_status_reads_a_file_catalogs_records_without_fsspec_or_the_transfer_modules(tmp_path):
    """A ``file://`` catalog's node records are listed and read without fsspec: every record shown, a folder
    and other names left out, what cannot be read (not JSON, another node's record under a link, a FIFO)
    named, unread where it is no regular file."""
    catalog, model = f"file://{tmp_path}/catalog", "org/m"
    for node in ("gpu0", "gpu1"):
        write_node_record(ObjectStore.shared(None), catalog, NodeRecord(node=node, model=model, version="r1",
                                                                        digest="sha256:00", status=READY))
    folder = tmp_path / "nodes" / "org--m"
    (folder / "broken.json").write_text("{not json")
    (folder / "folder.json").mkdir()
    (folder / "notes.txt").write_text("not a record")
    (folder / "alias.json").symlink_to(folder / "gpu0.json")
    os.mkfifo(folder / "fifo.json")
    done, prefect = run(["-m", "flows.fleet", "status", "--catalog", catalog, "--model", model, "--json"])
    assert done.returncode == 0, done.stderr[-2000:]
    view = json.loads(done.stdout)
    assert [(n["node"], n["version"], n["status"]) for n in view["nodes"]] == [("gpu0", "r1", "READY"),
                                                                               ("gpu1", "r1", "READY")]
    named = sorted(p.split(": ", 1)[0].rsplit("/", 1)[-1] for p in view["problems"])
    assert named == ["alias.json", "broken.json", "fifo.json"], view["problems"]
    assert any("not a regular file" in p for p in view["problems"]), view["problems"]
    assert prefect == [] and done.heavy == [] and not done.imported & set(TRANSFER), done.heavy


@pytest.fixture
def cli_env(prefect_api, tmp_path):
    """Environment for CLI subprocesses: the test session's Prefect API, a private PREFECT_HOME."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith("CANONICAL_REFIT_")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_HOME=str(tmp_path / "prefect-home"),
               PYTHONPATH=str(ROOT_DIR))
    return env


def test_a_refit_runs_its_flow_and_status_recover_and_activate_read_the_store_without_prefect(flow_lab, cli_env):
    lab = flow_lab
    lab.publish("initial")
    lab.publish("delta")
    done, prefect = run(["-m", "flows.refit", "--catalog", lab.catalog, "--model", lab.model, "--cache-dir",
                         str(lab.cache), "--seed-checkpoint", str(lab.launch), "--json"], cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["status"], result["version"]) == ("READY", "r1")
    assert {"prefect", "prefect.flows", "prefect.flow_engine"} <= set(prefect)  # the embedded default: a flow run

    store = LocalStore(lab.cache, lab.model)
    store.mark_poisoned("test: engine died mid-load", "r1", "none")
    where = ["--model", lab.model, "--cache-dir", str(lab.cache), "--json"]
    done, prefect = run(["-m", "flows.refit", "status", *where], cli_env)
    info = json.loads(done.stdout)
    assert done.returncode == 0 and (info["active"]["version"], info["poisoned"]["version"]) == ("r1", "r1")
    assert prefect == []
    done, prefect = run(["-m", "flows.refit", "activate", "--version", "r9", *where], cli_env)
    assert done.returncode == 1 and json.loads(done.stdout)["status"] == "FAILED" and prefect == []
    done, prefect = run(["-m", "flows.refit", "recover", *where], cli_env)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert json.loads(done.stdout)["status"] == "READY" and prefect == []
    assert store.poisoned() is None and store.active().version == "r1"


def test_recovery_through_sglang_engines_runs_without_prefect(tmp_path, fake_sglang, monkeypatch):  # noqa: F811
    lab = Lab(tmp_path, shape=tiny_shape())
    engine_env(monkeypatch, lab)
    lab.publish("initial")
    lab.publish("delta")
    with MockSGLang(lab.launch, lab.shape) as engine:
        engine.faults.drop = True  # the server goes away after loading, without answering: the node is poisoned
        state, result = lab.refit(target="r1", installer=sglang(engine))
        assert state.name == "Poisoned", result.error
    with MockSGLang(lab.launch, lab.shape) as restarted:  # the operator restarts it, on another port
        done, prefect = run(["-m", "flows.refit", "recover", *cli_args(lab, restarted), "--override-installer",
                             "--json"])
        assert done.returncode == 0, done.stdout + done.stderr[-2000:]
        assert json.loads(done.stdout)["installer"] == "sglang"
        assert restarted.calls and prefect == []
    store = LocalStore(lab.cache, lab.model)
    assert store.poisoned() is None and store.active().version == "r1"


def test_prefect_gets_its_environment_defaults_before_it_is_imported(tmp_path):
    """After the quick commands' modules (the CLI, the API), the entry points' bootstrap sets the defaults before
    Prefect is imported: Prefect's logging set-up reads them, and hands the product's logger its API handler."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_LOGGING_", "CANONICAL_REFIT_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"))
    code = ("import logging, os, sys, flows.cli, flows.api; assert 'prefect' not in sys.modules; "
            "from flows.bootstrap import bootstrap; bootstrap(); import flows.refit; "
            "print(os.environ['PREFECT_LOGGING_EXTRA_LOGGERS'], logging.getLogger('canonical_refit').level, "
            "[type(h).__name__ for h in logging.getLogger('canonical_refit').handlers])")
    done, prefect = run(["-c", code], env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().split(maxsplit=2) == ["canonical_refit", "20", "['APILogHandler']"]
    assert "prefect.logging.handlers" in prefect


def test_the_start_time_benchmark_runs_and_finds_no_prefect(tmp_path):
    """``python -m benchmarks.start_time`` as documented, one round (its figures are in docs/benchmarks.md)."""
    out = tmp_path / "start.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.start_time", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT_DIR, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["schema"] == "canonical-refit.benchmark.start-time.v1" and result["reference"] == "import numpy"
    assert {"flows.refit --help", "flows.refit status (empty store)", "flows.fleet status (empty catalog)",
            "import flows.api"} <= set(result["commands"])
    assert all(row["prefect_modules"] == 0 for row in result["commands"].values())
    assert "goal: each command's start <= 2x" in done.stdout
