"""The deployment definitions without a server: what serve.py registers, and that prefect.yaml says the same.

The trigger's matching is checked with Prefect's own server-side matcher and
the yaml's ``{{ $VAR }}`` placeholders with Prefect's own templating, the two
steps a server and ``prefect deploy`` apply. ``test_deployments_server.py``
runs both definitions against a real server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from uuid import uuid4

import pytest
import yaml

from deployments.serve import EVENT, build_deployments, main, on_publish_trigger, parse_args, resource_id
from storage.settings import RefitParams

ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = "{{ event.payload.version }}"
FLAGS = ["--catalog", "file:///srv/catalog", "--model", "org/name", "--seed-checkpoint", "/models/launch",
         "--cache-dir", "/var/cache/refit"]
PUBLISHING = ["--serve-publish", "--publish-checkpoint-root", "/srv/checkpoints"]  # the publish deployment's opt-in
CONFIGURED = {"catalog": "file:///srv/catalog", "model": "org/name", "seed_checkpoint": "/models/launch",
              "cache_dir": "/var/cache/refit"}


def as_event(params: dict, version: str) -> dict:
    """Deployment parameters as the server renders them for an event announcing ``version``."""
    return {k: (version if v == TEMPLATE else v) for k, v in params.items()}


def covers(trigger, event: str, resource: str) -> bool:
    """Whether Prefect's server-side matcher fires ``trigger`` for this event."""
    from prefect.server.events.schemas.automations import EventTrigger
    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.types._datetime import now

    fields = {"type", "match", "match_related", "after", "expect", "for_each", "posture", "threshold", "within"}
    server_trigger = EventTrigger.model_validate(trigger.model_dump(mode="json", include=fields))
    received = ReceivedEvent(event=event, resource={"prefect.resource.id": resource}, occurred=now("UTC"),
                             id=uuid4(), payload={"version": resource.rsplit(".", 1)[-1]})
    return server_trigger.covers(received)


def test_serve_builds_three_deployments_from_the_cli_settings():
    params, settings, _ = parse_args(FLAGS + PUBLISHING + ["--interval", "600", "--node", "GPU_3"])
    latest, on_publish, trainer = build_deployments(params, settings)

    # each node its own deployments, named after it (two nodes never claim each other's runs)
    assert [latest.name, on_publish.name, trainer.name] == ["refit-latest-gpu-3", "refit-on-publish-gpu-3",
                                                             "publish-gpu-3"]
    assert [latest.flow_name, on_publish.flow_name, trainer.flow_name] == ["refit", "refit", "publish"]
    assert latest.schedules[0].schedule.interval == timedelta(minutes=10)  # the configured schedule
    assert latest.parameters == {"params": {**CONFIGURED, "node": "GPU_3", "target": "latest",
                                            "only_if_newer": True}}
    # no server automation: the agent's reconcile loop creates refit-on-publish's runs (prefect.yaml keeps the trigger)
    assert not on_publish.schedules and not latest.triggers and not on_publish.triggers
    trigger = on_publish_trigger(params, settings.suffix_for(params.node))
    assert trigger.expect == {EVENT}
    assert trigger.parameters == {"params": {**CONFIGURED, "node": "GPU_3", "target": TEMPLATE, "only_if_newer": True}}
    rendered = RefitParams.model_validate(as_event(trigger.parameters["params"], "r7"))
    assert (rendered.target, rendered.only_if_newer, rendered.catalog) == ("r7", True, "file:///srv/catalog")
    assert rendered.cache_dir == Path("/var/cache/refit")


def test_the_trigger_fires_for_the_configured_model_only():
    params, settings, _ = parse_args(FLAGS)
    trigger = on_publish_trigger(params)  # prefect.yaml's, for a stock worker

    assert covers(trigger, EVENT, resource_id("org/name", "r7"))
    assert covers(trigger, EVENT, resource_id("org/name", "step-100.final"))
    assert not covers(trigger, EVENT, resource_id("org/name2", "r7"))
    assert not covers(trigger, EVENT, resource_id("org/other", "r7"))
    assert not covers(trigger, "canonical-refit.revision.deleted", resource_id("org/name", "r7"))


def test_the_environment_fills_in_what_the_flags_do_not_give(monkeypatch):
    monkeypatch.setenv("CANONICAL_REFIT_CATALOG", "s3://bucket/catalog")
    monkeypatch.setenv("CANONICAL_REFIT_MODEL", "org/from-env")
    monkeypatch.setenv("CANONICAL_REFIT_SERVE_INTERVAL_S", "120")
    monkeypatch.setenv("CANONICAL_REFIT_SERVE_NAME_SUFFIX", "-gpu3")
    params, settings, _ = parse_args(["--model", "org/flag"])  # a flag beats the environment

    deployments = build_deployments(params, settings)
    assert [d.name for d in deployments] == ["refit-latest-gpu3", "refit-on-publish-gpu3"]  # no publish by default
    assert deployments[0].schedules[0].schedule.interval == timedelta(minutes=2)
    assert deployments[0].parameters["params"]["catalog"] == "s3://bucket/catalog"
    trigger = on_publish_trigger(params)
    assert covers(trigger, EVENT, resource_id("org/flag", "r1"))
    assert not covers(trigger, EVENT, resource_id("org/from-env", "r1"))


def test_secrets_stay_in_the_environment(monkeypatch):
    monkeypatch.setenv("CANONICAL_REFIT_INSTALLER_API_KEY", "not-in-the-database")
    params, settings, _ = parse_args(FLAGS + ["--installer", "sglang", "--engine-url", "http://127.0.0.1:30000"])
    latest, on_publish = build_deployments(params, settings)

    stored = json.dumps([latest.parameters, on_publish.parameters, on_publish_trigger(params).parameters])
    assert "not-in-the-database" not in stored
    installer = latest.parameters["params"]["installer"]
    assert installer == {"kind": "sglang", "engine_urls": ["http://127.0.0.1:30000"]}
    # the flow run's process reads the key from its own environment when it validates its parameters
    assert RefitParams.model_validate(latest.parameters["params"]).installer.api_key == "not-in-the-database"


def test_print_params_gives_the_parameters_of_a_hand_triggered_refit(capsys):
    assert main(FLAGS + ["--print-params", "--target", "r3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"params": {**CONFIGURED, "target": "r3", "only_if_newer": False}}  # a rollback is allowed
    assert RefitParams.model_validate(printed["params"]).target == "r3"


@pytest.mark.parametrize("fan_out", ["automation", "agent"])
def test_the_fan_out_flag_still_parses_and_automation_says_what_replaced_it(fan_out, capsys):
    params, settings, _ = parse_args(FLAGS + ["--fan-out", fan_out])
    warned = capsys.readouterr().err
    assert [d.triggers for d in build_deployments(params, settings)] == [[], []]  # one path either way
    if fan_out == "agent":
        assert warned == ""
    else:
        assert "--fan-out automation is deprecated" in warned and "reconcile loop" in warned


def test_bad_settings_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--catalog", "file:///srv/catalog", "--model", "not a model id"])
    assert exit_info.value.code == 2
    assert "model" in capsys.readouterr().err


def test_serve_refuses_to_start_without_a_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), DO_NOT_TRACK="1")
    done = subprocess.run([sys.executable, "-m", "deployments.serve", *FLAGS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "PREFECT_API_URL is not set" in done.stderr
    assert not (tmp_path / "home" / "prefect.db").exists()  # no private ephemeral server was started


def _yaml_config() -> dict:
    """deployments/prefect.yaml with ``{{ $VAR }}`` filled in from the environment, as ``prefect deploy`` does."""
    from prefect.utilities.templating import apply_values

    raw = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    applied = [apply_values(d, dict(os.environ), remove_notset=False) for d in raw["deployments"]]
    return {d["name"]: d for d in applied}


@pytest.mark.parametrize("suffix", [["--name-suffix", "-gpu3"], ["--name-suffix", "gpu3"], ["--name-suffix=-gpu3"],
                                    ["--node", "gpu3"]])
def test_the_documented_name_suffix_forms_name_the_deployments_after_the_node(suffix):
    params, settings, _ = parse_args(FLAGS + PUBLISHING + suffix)
    assert [d.name for d in build_deployments(params, settings)] == ["refit-latest-gpu3", "refit-on-publish-gpu3",
                                                                      "publish-gpu3"]


def test_prefect_yaml_defines_what_serve_defines(monkeypatch):
    monkeypatch.setenv("CANONICAL_REFIT_CATALOG", "file:///srv/catalog")
    monkeypatch.setenv("CANONICAL_REFIT_MODEL", "org/name")
    monkeypatch.setenv("CANONICAL_REFIT_NODE", "gpu3")
    config = _yaml_config()
    params, settings, _ = parse_args(["--catalog", "file:///srv/catalog", "--model", "org/name", *PUBLISHING])
    latest, on_publish, trainer = build_deployments(params, settings)

    assert list(config) == [latest.name, on_publish.name, trainer.name]
    for served in (latest, on_publish, trainer):
        path, name = config[served.name]["entrypoint"].split(":")
        assert (ROOT / path).is_file()
        module = __import__(path.removesuffix(".py").replace("/", "."), fromlist=[name])
        assert getattr(module, name).name == served.flow_name
    assert config["refit-latest-gpu3"]["parameters"] == latest.parameters
    assert config["refit-latest-gpu3"]["schedules"] == [{"interval": settings.interval_s}]
    assert config["refit-on-publish-gpu3"]["parameters"] == on_publish.parameters
    (spec,) = config["refit-on-publish-gpu3"]["triggers"]  # a stock worker has no agent: the server's trigger
    trigger = on_publish_trigger(params, settings.suffix_for(params.node))
    assert (spec["name"], set(spec["expect"])) == (trigger.name, trigger.expect)
    assert spec["match"] == trigger.match.model_dump() == {"prefect.resource.id": resource_id("org/name", "*")}
    assert spec["parameters"] == trigger.parameters  # the event template is left for the server
    assert spec["enabled"] is True
    queues = {name: d["work_pool"]["work_queue_name"] for name, d in config.items()}
    assert queues == {"refit-latest-gpu3": "refit", "refit-on-publish-gpu3": "refit", "publish-gpu3": "publish"}


# -- what a run may choose (deployments/pinning.py); tests/system/fleet/test_control_plane.py runs the agent ------------------


def _changed(name: str, value):
    """A valid value of a RefitParams field other than ``value``."""
    return {"catalog": "file:///elsewhere", "model": "org/other", "node": "someone-else", "initial_version": "r9",
            "seed_checkpoint": "/tmp/other", "cache_dir": "/tmp/other", "verify": "full", "rollbacks": "allow",
            "trusted_keys": ["/tmp/other.pub"]}.get(name, (not value) if isinstance(value, bool) else
                                                    (value + 1) if isinstance(value, (int, float)) else "other")


def test_a_refit_run_chooses_its_target_and_nothing_else(monkeypatch):
    from deployments.pinning import RUN_CHOOSES, RunRefused
    from deployments.serve import run_vetting

    monkeypatch.setenv("CANONICAL_REFIT_INSTALLER_API_KEY", "the-admin-key")
    params, settings, _ = parse_args(FLAGS + ["--installer", "sglang", "--engine-url", "http://127.0.0.1:30000"])
    vet = run_vetting(params, settings)["refit"]
    own = params.model_dump(mode="json", exclude={"storage", "installer"})
    for name in RefitParams.model_fields:
        if name in RUN_CHOOSES or name in ("storage", "installer"):
            continue
        with pytest.raises(RunRefused) as refused:
            vet({"params": {"catalog": params.catalog, "model": params.model, name: _changed(name, own.get(name))}})
        assert refused.value.offending == [f"params.{name}"], name
    for nested, values in (("storage", {"endpoint_url": "http://127.0.0.1:1", "region": "x", "anonymous": True}),
                           ("installer", {"kind": "sglang-disk", "engine_urls": ["http://127.0.0.1:1"],
                                          "api_key": "the-admin-key", "timeout_s": 1.0})):
        with pytest.raises(RunRefused) as refused:
            vet({"params": {**CONFIGURED, nested: values}})
        assert refused.value.offending == [f"params.{nested}.{k}" for k in values]  # the key: even when equal
    with pytest.raises(RunRefused) as refused:
        vet({"params": {**CONFIGURED, "target": "r1", "catalogue": "x"}, "other": 1})
    assert refused.value.offending == ["other (unknown)", "params.catalogue (unknown)"]

    # the node's own values are no change; the run gets the node's settings object, the key and the policy included
    ran = vet({"params": {**CONFIGURED, "cache_dir": "/var/cache/refit/", "installer": {"kind": "sglang"},
                          "target": "r3", "only_if_newer": True}})["params"]
    assert (ran.target, ran.only_if_newer, ran.installer.api_key, ran.rollbacks) == ("r3", True, "the-admin-key",
                                                                                     "refuse")
    assert ran.installer.engine_urls == ["http://127.0.0.1:30000"] and ran.cache_dir == Path("/var/cache/refit")
    with pytest.raises(RunRefused, match=r"params\.target"):
        vet({"params": {**CONFIGURED, "target": "../r1"}})


def test_the_agent_opens_fields_and_rollbacks_only_when_told(monkeypatch):
    from deployments.pinning import RunRefused
    from deployments.serve import run_vetting

    monkeypatch.setenv("CANONICAL_REFIT_ROLLBACKS", "allow")  # the environment does not decide for the agent
    params, settings, _ = parse_args(FLAGS + ["--run-may-set", "verify", "--allow-remote-rollback"])
    ran = run_vetting(params, settings)["refit"]({"params": {**CONFIGURED, "verify": "full", "target": "r1"}})
    assert (ran["params"].verify, ran["params"].rollbacks) == ("full", "allow")
    params, settings, _ = parse_args(FLAGS)
    assert run_vetting(params, settings)["refit"]({"params": CONFIGURED})["params"].rollbacks == "refuse"
    with pytest.raises(RunRefused):
        run_vetting(params, settings)["refit"]({"params": {**CONFIGURED, "verify": "full"}})
    assert "publish" not in run_vetting(params, settings)


@pytest.mark.parametrize("flags", [["--run-may-set", "catalog"], ["--run-may-set", "cache_dir"], ["--serve-publish"]])
def test_opening_a_pinned_setting_or_publishing_without_roots_is_a_usage_error(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(FLAGS + flags)
    assert exit_info.value.code == 2
    assert ("run_may_set" in capsys.readouterr().err) if "--run-may-set" in flags else True


def test_a_publish_run_reads_only_under_the_checkpoint_roots(tmp_path):
    from deployments.pinning import RunRefused
    from deployments.serve import run_vetting

    root, elsewhere = tmp_path / "checkpoints", tmp_path / "node-store"
    (root / "step-1").mkdir(parents=True)
    (root / "step-1" / "model.safetensors").write_bytes(b"x")
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"secret weights")
    (root / "link").symlink_to(elsewhere, target_is_directory=True)
    (root / "step-2").mkdir()
    (root / "step-2" / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    params, settings, _ = parse_args(FLAGS + ["--serve-publish", "--publish-checkpoint-root", str(root)])
    vet = run_vetting(params, settings)["publish"]
    mine = {"catalog": params.catalog, "model": params.model}
    ran = vet({"params": {**mine, "checkpoint": str(root / "step-1"), "kind": "full"}})["params"]
    assert (ran.checkpoint, ran.kind, ran.state_dir) == (root / "step-1", "full", Path("/var/cache/refit/publisher"))
    for checkpoint in (elsewhere, root / "link", root / "step-2", root / ".." / "node-store"):
        with pytest.raises(RunRefused) as refused:
            vet({"params": {**mine, "checkpoint": str(checkpoint)}})
        assert refused.value.offending == ["params.checkpoint (outside the checkpoint roots)"], checkpoint
    with pytest.raises(RunRefused) as refused:
        vet({"params": {**mine, "catalog": "file:///elsewhere", "checkpoint": str(root / "step-1"),
                        "state_dir": str(tmp_path), "payload_url": "file:///elsewhere/payload"}})
    assert refused.value.offending == ["params.catalog", "params.state_dir", "params.payload_url"]


def test_the_agent_pins_the_keys_it_was_given_as_flags(tmp_path):
    import base64

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from deployments.pinning import RunRefused
    from deployments.serve import node_environment, run_vetting

    def public() -> str:
        raw = Ed25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.Raw,
                                                                     serialization.PublicFormat.Raw)
        return base64.b64encode(raw).decode()

    mine, theirs = public(), public()
    params, settings, _ = parse_args(FLAGS + ["--trusted-key", mine])
    assert params.trusted_keys == [mine]
    assert json.loads(node_environment(params)["CANONICAL_REFIT_TRUSTED_KEYS"]) == [mine]
    vet = run_vetting(params, settings)["refit"]
    assert vet({"params": {**CONFIGURED, "target": "r2"}})["params"].trusted_keys == [mine]
    for keys in ([theirs], [], [mine, theirs]):  # a run can neither swap, drop nor add a key
        with pytest.raises(RunRefused) as refused:
            vet({"params": {**CONFIGURED, "trusted_keys": keys}})
        assert refused.value.offending == ["params.trusted_keys"]
