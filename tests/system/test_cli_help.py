"""Every command line is built from the settings models: each flag is spelled on its field, and its help is the
field's description.

The entry points are run with ``--help`` as a user would; each flag they
list must show the description of the field it sets and the environment
variable that sets it too, so flags, settings and documentation cannot drift.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from flows.options import _field, env_name
from tests.support.lab import ROOT_DIR


def _entry_points():
    from deployments.serve import NODE_FLAGS, SERVE_FLAGS, ServeSettings
    from flows.cli import RECOVER_FLAGS, REFIT_FLAGS
    from flows.publish import PUBLISH_FLAGS
    from storage.settings import RecoverParams
    from storage.settings import PublishParams, RefitParams

    from flows.fleet import STATUS_FLAGS, WAIT_FLAGS, FleetParams

    return {
        "flows.fleet status": [(FleetParams, STATUS_FLAGS)],
        "flows.fleet wait": [(FleetParams, WAIT_FLAGS)],
        "flows.refit": [(RefitParams, REFIT_FLAGS)],
        "flows.refit recover": [(RecoverParams, RECOVER_FLAGS)],
        "flows.publish": [(PublishParams, PUBLISH_FLAGS)],
        "deployments.serve": [(RefitParams, NODE_FLAGS), (ServeSettings, SERVE_FLAGS)],
    }


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("command", ["flows.refit", "flows.refit recover", "flows.publish", "deployments.serve",
                                     "flows.fleet status", "flows.fleet wait"])
def test_help_shows_every_fields_description_and_variable(command):
    module, *sub = command.split()
    done = subprocess.run([sys.executable, "-m", module, *sub, "--help"], capture_output=True, text=True,
                          cwd=ROOT_DIR, timeout=120)
    assert done.returncode == 0, done.stderr
    text = _squash(done.stdout)
    for model, flags in _entry_points()[command]:
        for flag in flags:
            owner, name, info = _field(model, flag.path)
            assert flag.option() in text, flag
            assert info.description, f"{owner.__name__}.{name} has no description"
            assert _squash(info.description) in text, (flag.option(), info.description)
            assert env_name(owner, name) in text, (flag.option(), env_name(owner, name))
    assert "PydanticUndefined" not in text


def test_every_entry_point_spells_a_flag_as_its_field_defines_it():
    """No entry point renames a flag: each flag is the one its field (or the field holding its model) defines,
    and no two flags of one command set the same field."""
    from flows.options import flag_of

    for command, entries in _entry_points().items():
        for model, flags in entries:
            assert len({f.path for f in flags}) == len(flags), command
            for flag in flags:
                assert flag == flag_of(model, flag.path), (command, flag, flag_of(model, flag.path))


def test_flags_set_the_fields_they_name_and_nothing_else():
    from flows.cli import _run_parser, build_params

    args = _run_parser().parse_args(["--catalog", "/c", "--model", "a/b", "--installer", "sglang", "--engine-url",
                                     "http://e:1", "--engine-url", "http://e:2", "--no-activate",
                                     "--fetch-workers", "3", "--retries", "0"])
    params = build_params(args)
    assert (params.installer.kind, params.installer.engine_urls) == ("sglang", ["http://e:1", "http://e:2"])
    assert params.activate is False and params.storage.concurrency == 3 and params.retries == 0
    assert params.target == "latest" and params.only_if_newer is False  # not given: the defaults


def test_every_setting_is_in_the_configuration_reference():
    """docs/configuration.md names the environment variable of every field of every settings model."""
    from deployments.serve import ServeSettings
    from flows.fleet import FleetParams
    from flows.prefect_api import ApiSettings
    from storage.settings import InstallerSettings, ObjectStoreSettings, PublishParams, RecoverParams, RefitParams

    doc = (ROOT_DIR / "docs" / "configuration.md").read_text()
    nested = {"storage", "installer"}
    missing = [f"{model.__name__}.{name}" for model in (RefitParams, PublishParams, ObjectStoreSettings,
                                                        InstallerSettings, RecoverParams, ServeSettings,
                                                        FleetParams, ApiSettings)
               for name in model.model_fields
               if not (name in nested and model is not RecoverParams)
               and f"`{(model.model_config['env_prefix'] + name).upper()}`" not in doc]
    assert not missing, f"not in docs/configuration.md: {missing}"
