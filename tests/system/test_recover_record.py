"""Commands as printed, and a recovery the fleet sees at once.

A failed or poisoned run's ``next:`` command names the node and the options
the run had (never a deprecated flag), so pasting it changes exactly that
node; the recovery it prints rewrites the node's status record, so
``flows.fleet wait`` and ``status`` stop counting the node poisoned without
waiting for its agent's next heartbeat. Errors below the command line name
the settings' fields; the command line names its flags.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from flows.cli import RECOVER_FLAGS, _run_parser, _sub_parser, build_params
from flows.cli import main as cli_main
from flows.options import build, given
from storage.catalog.nodes import nodes_url
from storage.settings import RecoverParams, default_node_name
from storage.store.local_store import LocalStore
from tests.support.fleet_cli import fleet, record_of


def _command(next_step: str) -> list[str]:
    return shlex.split(next_step.split("  (")[0])


def _poisoned_node(lab, node: str = "b"):
    """Node ``node`` ready at r0 in its own store, then poisoned; a refit to r1 refused, its record POISONED."""
    lab.publish("initial")
    lab.publish("delta")
    cache = lab.root / f"cache-{node}"
    assert lab.run(target="r0", node=node, cache_dir=cache).status == "READY"
    LocalStore(cache, lab.model).mark_poisoned("test: the engine failed mid-load", "r0", "none")
    result = lab.run(target="r1", node=node, cache_dir=cache, stage_retries=0)
    assert result.status == "POISONED" and record_of(lab, node)["status"] == "POISONED"
    return cache, result


def test_a_poisoned_runs_recovery_pasted_as_printed_rewrites_that_nodes_record_at_once(lab, capsys):
    cache, result = _poisoned_node(lab)
    code, waited = fleet(capsys, lab, "wait", "--version", "r0", "--timeout", "5")
    assert (code, waited["poisoned"]) == (3, ["b"])

    printed = result.next_step.split("  (")[0]
    assert f"run `{printed}` first" in result.error  # the refused install names the same command as next:
    argv = _command(result.next_step)
    assert argv[:4] == ["python", "-m", "flows.refit", "recover"] and "--stage-retries" not in argv
    args = _sub_parser("recover").parse_args(argv[4:])
    pasted = build(RecoverParams, given(args, RECOVER_FLAGS))
    assert (pasted.node, pasted.catalog, pasted.model, pasted.cache_dir) == ("b", lab.catalog, lab.model, cache)

    capsys.readouterr()
    assert cli_main(argv[3:]) == 0
    out = capsys.readouterr().out
    assert "cleared the poisoned mark" in out and "status record now says READY" in out, out
    record = record_of(lab, "b")
    # the prepared r1, re-installed: READY at once (no heartbeat ran)
    assert (record["status"], record["version"]) == ("READY", "r1") and "cleared the poisoned mark" in out
    code, waited = fleet(capsys, lab, "wait", "--version", "r1", "--timeout", "5")
    assert (code, waited["reached"], waited["poisoned"]) == (0, ["b"], [])


def test_a_recovery_without_the_catalog_leaves_the_record_and_never_registers_a_node(lab, capsys):
    cache, _ = _poisoned_node(lab)
    other = ["recover", "--model", lab.model, "--cache-dir", str(cache)]
    assert cli_main(other) == 0 and LocalStore(cache, lab.model).poisoned() is None
    assert record_of(lab, "b")["status"] == "POISONED"  # not told where the record is: the next beat says it

    LocalStore(cache, lab.model).mark_poisoned("test: again", "r0", "none")
    assert cli_main(other + ["--catalog", lab.catalog, "--node", "elsewhere"]) == 0
    nodes = Path(nodes_url(lab.catalog, lab.model).removeprefix("file://"))
    assert sorted(p.stem for p in nodes.glob("*.json")) == ["b"]  # no phantom node, by that name or the host's
    assert record_of(lab, "b")["status"] == "POISONED" and default_node_name() != "b"


def test_a_failed_runs_refit_command_carries_the_node_and_the_runs_options_and_no_deprecated_flag(lab):
    lab.publish("initial")
    lab.publish("delta")
    bucket = lab.root / "revisions" / "r1" / "bucket-00000.safetensors"
    good = bucket.read_bytes()
    bucket.write_bytes(good[:-64] + bytes(b ^ 0xFF for b in good[-64:]))  # r1's payload is corrupt
    cache = lab.root / "gpu-7"
    result = lab.run(node="gpu-7", cache_dir=cache, stage_retries=0, stage_retry_delay_s=0.5, cache_max_gb=90)
    assert result.status == "FAILED"
    argv = _command(result.next_step)
    assert argv[:3] == ["python", "-m", "flows.refit"] and not any(a.startswith("--stage-retr") for a in argv)
    again = build_params(_run_parser().parse_args(argv[3:]))
    assert (again.node, again.catalog, again.model, again.cache_dir) == ("gpu-7", lab.catalog, lab.model, cache)
    assert (again.cache_max_gb, again.seed_checkpoint) == (90, str(lab.launch))
    assert build_params(_run_parser().parse_args(argv[3:] + ["--stage-retries", "3"])).stage_retries == 3  # parses


def test_errors_name_fields_through_the_api_and_flags_through_the_command_line(lab, capsys):
    from flows import api
    from flows.cli import REFIT_FLAGS
    from flows.recover import run_recover
    from flows.report import print_result

    lab.publish("initial")
    result = api.refit(catalog=lab.catalog, model=lab.model, cache_dir=lab.cache, check=False)  # no launch snapshot
    assert result.status == "FAILED" and "seed_checkpoint=" in result.error and "--seed" not in result.error
    capsys.readouterr()
    print_result(result, REFIT_FLAGS)  # what python -m flows.refit prints for it
    error = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("error: "))
    assert "pass --seed-checkpoint with" in error and "seed_checkpoint" not in error

    launch_files = sum(p.stat().st_size for p in lab.launch.iterdir() if p.suffix != ".safetensors")
    result = api.refit(catalog=lab.catalog, model=lab.model, cache_dir=lab.root / "small",
                       seed_checkpoint=lab.launch, cache_max_gb=launch_files / 2 / 1e9, check=False)
    assert result.error_detail["type"] == "CapacityError" and "raise cache_max_gb= or" in result.error
    print_result(result, REFIT_FLAGS)
    assert "raise --cache-max-gb or free disk" in capsys.readouterr().out

    missing = run_recover(RecoverParams(model="org/none", cache_dir=lab.cache))
    assert "check model= and cache_dir=" in missing.error
    assert cli_main(["recover", "--model", "org/none", "--cache-dir", str(lab.cache)]) == 1
    assert "check --model and --cache-dir" in capsys.readouterr().out
