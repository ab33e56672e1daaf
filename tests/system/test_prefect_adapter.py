"""The Prefect adapter: the supported Prefect is checked at start-up, loudly; stage reports are injected.

``flows/prefect_adapter.py`` is the one module that touches Prefect's
internals. These tests drive its own entry points: the capability check
against the installed Prefect, against an unsupported version and against a
Prefect that lacks one of the internals; the pin in pyproject.toml against
the range the check enforces; ``python -m flows.refit`` failing with the
typed error on an unsupported Prefect before any flow runs; a failed stage
report logged at WARNING; and the stages reported only under the reporter a
flow injected (the null one elsewhere, Prefect never imported).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import tomllib

import pytest

from tests.support.lab import ROOT_DIR
from tests.support.logs import emitted
from flows import prefect_adapter
from flows.prefect_adapter import SUPPORTED, UnsupportedPrefect, check_prefect
from storage.errors import RefitError


def test_the_installed_prefect_is_supported():
    import prefect

    check_prefect()  # the suite runs on a supported Prefect: nothing raised
    assert SUPPORTED[0] <= tuple(int(p) for p in prefect.__version__.split(".")[:2]) < SUPPORTED[1]
    assert prefect_adapter.missing_internals() == []


@pytest.mark.parametrize("version", ["3.8.5", "3.10.0", "4.0.0"])
def test_a_version_outside_the_supported_range_fails_with_a_typed_error_naming_it(version):
    with pytest.raises(UnsupportedPrefect) as raised:
        check_prefect(version)
    assert isinstance(raised.value, RefitError)
    assert f"Prefect {version} is not supported" in str(raised.value)
    assert prefect_adapter.PINNED in str(raised.value) and raised.value.missing == []


def test_a_prefect_without_an_internal_fails_naming_the_missing_api(monkeypatch):
    import prefect
    import prefect.flow_engine

    monkeypatch.delattr(prefect.flow_engine, "_send_heartbeats")
    with pytest.raises(UnsupportedPrefect) as raised:
        check_prefect()
    assert raised.value.missing == ["prefect.flow_engine._send_heartbeats"]
    assert f"Prefect {prefect.__version__} is not supported" in str(raised.value)
    assert "it lacks prefect.flow_engine._send_heartbeats" in str(raised.value)


def test_pyproject_pins_the_range_the_check_enforces():
    project = tomllib.loads((ROOT_DIR / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["dependencies"] if re.match(r"prefect\s*[<>=]", d)]
    assert pins == [prefect_adapter.PINNED]
    low, high = SUPPORTED
    assert prefect_adapter.PINNED == f"prefect>={low[0]}.{low[1]},<{high[0]}.{high[1]}"


def test_a_refit_on_an_unsupported_prefect_stops_at_start_up_naming_the_version(tmp_path):
    """The CLI's bootstrap runs the check before any flow: the run ends with the typed error, nothing moved."""
    code = ("import sys, prefect; prefect.__version__ = '3.99.0'; from flows.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "--catalog", f"file://{tmp_path}/catalog", "--model", "o/m",
                           "--cache-dir", str(tmp_path / "cache"), "--installer", "none"],
                          capture_output=True, text=True, cwd=ROOT_DIR, timeout=300)
    assert done.returncode == 1
    assert "error: Prefect 3.99.0 is not supported: its version is outside" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "cache").exists()


def test_a_failed_stage_report_is_logged_at_warning():
    class Context:  # a flow run context whose run the report cannot be built for
        flow_run = object()

    class Task:
        task_key, version, tags = "k", None, ()

    with emitted("canonical_refit.prefect") as records:
        sent = prefect_adapter.report_task_run(Task(), "fetch index", Context(), None, None, None, interrupted=False)
    assert sent is False
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fetch index" in warnings[0].getMessage()


def test_stages_run_plain_under_the_null_reporter_and_report_under_the_injected_one():
    from tasks.stage import NULL_STAGES, Stage, reporting_stages, stage_reporter

    class Run:
        stop = None
        attempt = 2

        def stage(self, name):
            from contextlib import nullcontext
            from tasks.stage import StageRecord

            return nullcontext(StageRecord(name))

    class Heard:
        reporting = True

        def __init__(self):
            self.names = []

        def run(self, stage, run, body):
            self.names.append(stage.run_name(run))
            return body()

    double = Stage("double", lambda run, x: x * 2, interruptible=False)
    assert stage_reporter() is NULL_STAGES and double(Run(), 2) == 4
    heard = Heard()
    with reporting_stages(heard):
        assert double(Run(), 3) == 6
        assert double.start(Run(), 4).result() == 8  # a stage in a thread is heard by the same reporter
    assert heard.names == ["double (attempt 2)", "double (attempt 2)"]
    assert stage_reporter() is NULL_STAGES


def test_prefect_internals_are_touched_only_by_the_adapter_and_the_core_never_asks_for_a_flow_run():
    """Every ``prefect._internal``, engine-internal import and monkeypatch of Prefect is in the adapter; the
    core (``storage/``, ``tasks/``) never branches on being in a flow run (its stage reporter is injected)."""
    internal = re.compile(r"prefect\._internal|prefect\.utilities\.engine|prefect\.flow_engine|_send_heartbeats")
    core = re.compile(internal.pattern + r"|in_flow_run|FlowRunContext")
    offenders = []
    for package in ("storage", "tasks", "flows", "deployments"):
        for path in sorted((ROOT_DIR / package).rglob("*.py")):
            if path.name == "prefect_adapter.py":
                continue
            text = path.read_text()
            pattern = core if package in ("storage", "tasks") else internal
            for match in pattern.finditer(text):
                line = text[:match.start()].count("\n") + 1
                offenders.append(f"{path.relative_to(ROOT_DIR)}:{line}: {match.group().strip()}")
    assert offenders == []
