"""One definition per option: the flag is spelled on the settings field, errors below the command line name the
field, and only the command line renders a field as its flag.

The same invalid value is given once through a command line (the error names
its flag, ``--catalog``) and once through ``flows.api`` (the error names the
keyword, ``catalog``): nothing rewrites one into the other on the way.
"""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from flows import api
from flows.options import flag_of
from storage.errors import LineageError
from storage.settings import PublishParams, RecoverParams, RefitParams

MODEL = "org/tiny"


def _usage_error(capsys, call) -> str:
    with pytest.raises(SystemExit) as exited:
        call()
    assert exited.value.code == 2
    return capsys.readouterr().err


def step(seed: int) -> dict:
    return {"w": np.random.default_rng(seed).standard_normal((32, 32)).astype(np.float32)}


def test_an_invalid_value_names_the_flag_on_the_command_line_and_the_keyword_in_python(tmp_path, capsys):
    from flows.publish_cli import parse_args

    bad = "s3://bucket//double"
    err = _usage_error(capsys, lambda: parse_args(["--catalog", bad, "--model", MODEL, "--checkpoint",
                                                  str(tmp_path)]))
    assert "--catalog: " in err and "empty path segment" in err, err

    with pytest.raises(ValidationError) as caught:
        api.publish(str(tmp_path), catalog=bad, model=MODEL)
    assert [e["loc"] for e in caught.value.errors()] == [("catalog",)]
    assert "--catalog" not in str(caught.value) and "empty path segment" in str(caught.value)


def test_a_nested_setting_is_named_by_the_flag_its_holder_gives_it(tmp_path, capsys):
    from flows.publish_cli import parse_args

    err = _usage_error(capsys, lambda: parse_args(["--catalog", f"file://{tmp_path}/c", "--model", MODEL,
                                                  "--checkpoint", str(tmp_path), "--upload-workers", "0"]))
    assert "--upload-workers: " in err and "storage.concurrency" not in err, err
    with pytest.raises(ValidationError) as caught:
        api.publish(str(tmp_path), catalog=f"file://{tmp_path}/c", model=MODEL, storage={"concurrency": 0})
    assert [e["loc"] for e in caught.value.errors()] == [("concurrency",)]  # ObjectStoreSettings' own field
    # one setting, two spellings: each defined once, on the field that holds the storage settings
    assert flag_of(RefitParams, "storage.concurrency").option() == "--fetch-workers"
    assert flag_of(PublishParams, "storage.concurrency").option() == "--upload-workers"


def test_the_receivers_commands_name_the_flag_of_an_invalid_value(capsys):
    from flows.cli import main

    err = _usage_error(capsys, lambda: main(["recover", "--model", "not a model"]))
    assert "--model: " in err, err
    err = _usage_error(capsys, lambda: main(["--catalog", "file:///tmp/c", "--model", MODEL, "--fetch-workers", "0"]))
    assert "--fetch-workers: " in err, err
    with pytest.raises(ValidationError) as caught:
        RecoverParams(model="not a model")
    assert [e["loc"] for e in caught.value.errors()] == [("model",)]


def test_an_error_of_the_publication_names_keywords_in_python_and_flags_on_the_command_line(tmp_path):
    """A delta with no kept base: Python is told ``base_checkpoint=`` and ``kind="full"`` as raised, the command
    line ``--base-checkpoint`` and ``--kind full`` (flows.publish prints ``cli_error``)."""
    from flows.publish_cli import cli_error

    kw = dict(catalog=f"file://{tmp_path}/catalog", model=MODEL, state_dir=tmp_path / "state", emit_event=False)
    api.publish(step(0), kind="initial", keep_copy=False, **kw)
    with pytest.raises(LineageError) as caught:
        api.publish(step(1), **kw)
    raised = str(caught.value)
    assert "base_checkpoint=" in raised and 'kind="full"' in raised, raised
    assert "--base-checkpoint" not in raised and "--kind" not in raised, raised
    shown = cli_error(caught.value)
    assert "--base-checkpoint" in shown and "--kind full" in shown and "base_checkpoint" not in shown, shown
    assert caught.value.revision == "r1"


def test_a_value_starting_with_a_dash_is_the_flags_value(tmp_path):
    """``--name-suffix -gpu3`` (docs/operations.md) and ``--zstd-level -3``: a flag that takes a value takes the
    next word, in every entry point; ``--flag=value`` works too."""
    from deployments.serve import parse_args as serve_args
    from flows.publish_cli import parse_args as publish_args

    base = ["--catalog", f"file://{tmp_path}/c", "--model", MODEL]
    assert serve_args(base + ["--node", "gpu3", "--name-suffix", "-gpu4"])[1].name_suffix == "-gpu4"
    assert serve_args(base + ["--name-suffix=-gpu5"])[1].name_suffix == "-gpu5"
    assert serve_args(base + ["--name-suffix", "gpu6"])[1].name_suffix == "-gpu6"
    params, _ = publish_args(base + ["--checkpoint", str(tmp_path), "--zstd-level", "-3", "--version", "r7"])
    assert (params.zstd_level, params.version) == (-3, "r7")
    with pytest.raises(SystemExit):  # a flag is never taken for a value
        serve_args(base + ["--name-suffix", "--node", "x"])



def test_a_refused_launch_revision_says_kind_in_python_and_the_flag_on_the_command_line(tmp_path):
    from flows.publish_cli import cli_error

    kw = dict(catalog=f"file://{tmp_path}/catalog", model=MODEL, state_dir=tmp_path / "state", emit_event=False)
    api.publish(step(0), kind="initial", **kw)
    with pytest.raises(LineageError) as caught:
        api.publish(step(1), kind="initial", version="again", **kw)
    assert 'kind="initial" only starts an empty catalog' in str(caught.value), caught.value
    assert 'as kind="full" or kind="delta"' in str(caught.value), caught.value
    shown = cli_error(caught.value)
    assert "--kind initial only starts an empty catalog" in shown and "--kind full or --kind delta" in shown, shown
