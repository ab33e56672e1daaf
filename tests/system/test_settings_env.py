"""The settings read their environment as they did on pydantic-settings (``storage.settings.Settings``).

Each variable is ``{prefix}{field}`` in any case; a model, list or dict
field's value is JSON (a field marked ``NoDecode`` takes it as written, a
union with a model keeps a value that is not JSON); a keyword given wins
over the environment, a nested dict merged into the environment's; an
invalid value is the model's ``ValidationError`` naming the field.
"""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from storage.settings import InstallerSettings, ObjectStoreSettings, RecoverParams, RefitParams

CATALOG = "file:///tmp/catalog"


@pytest.fixture
def env(monkeypatch):
    for name in [n for n in os.environ if n.upper().startswith("CANONICAL_REFIT_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_a_variable_is_read_in_any_case_and_a_keyword_wins(env):
    env.setenv("canonical_refit_catalog", CATALOG)
    env.setenv("Canonical_Refit_Model", "org/m")
    env.setenv("CANONICAL_REFIT_ACTIVATE", "false")
    env.setenv("CANONICAL_REFIT_S3_CONCURRENCY", "4")
    params = RefitParams(model="org/other")
    assert (params.catalog, params.model, params.activate) == (CATALOG, "org/other", False)
    assert params.storage.concurrency == 4  # the nested model reads its own prefix


def test_lists_and_models_are_json_and_a_nested_keyword_merges_into_the_environment(env):
    env.setenv("CANONICAL_REFIT_INSTALLER_KIND", "sglang")
    env.setenv("CANONICAL_REFIT_INSTALLER_ENGINE_URLS", '["http://e:1", "http://e:2"]')
    assert InstallerSettings().engine_urls == ["http://e:1", "http://e:2"]
    env.setenv("CANONICAL_REFIT_STORAGE", '{"region": "eu", "concurrency": 2}')
    params = RefitParams(catalog=CATALOG, model="org/m", storage={"concurrency": 3})
    assert (params.storage.region, params.storage.concurrency) == ("eu", 3)
    env.setenv("CANONICAL_REFIT_INSTALLER_ENGINE_URLS", "http://e:1")
    with pytest.raises(ValueError, match='field "engine_urls".*CANONICAL_REFIT_INSTALLER_ENGINE_URLS is not JSON'):
        InstallerSettings()


def test_a_union_with_a_model_reads_json_and_an_invalid_value_names_its_field(env):
    env.setenv("CANONICAL_REFIT_INSTALLER", '{"kind": "none"}')
    assert RecoverParams(model="org/m").installer == InstallerSettings(kind="none")
    env.setenv("CANONICAL_REFIT_INSTALLER", "not json")
    with pytest.raises(ValidationError) as caught:
        RecoverParams(model="org/m")
    assert caught.value.errors()[0]["loc"] == ("installer",)
    env.delenv("CANONICAL_REFIT_INSTALLER")
    env.setenv("CANONICAL_REFIT_S3_RETRY_ATTEMPTS", "many")
    with pytest.raises(ValidationError) as caught:
        ObjectStoreSettings()
    assert caught.value.errors()[0]["loc"] == ("retry_attempts",)


def test_trusted_keys_come_from_the_environment_as_written_json_or_commas(env):
    import base64
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    keys = [base64.b64encode(Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
            .decode() for _ in range(2)]
    env.setenv("CANONICAL_REFIT_CATALOG", CATALOG)
    env.setenv("CANONICAL_REFIT_MODEL", "org/m")
    assert RefitParams().trusted_keys == []
    env.setenv("CANONICAL_REFIT_TRUSTED_KEYS", ",".join(keys))  # not JSON: the field's own validator splits it
    assert RefitParams().trusted_keys == keys
    env.setenv("CANONICAL_REFIT_TRUSTED_KEYS", json.dumps(keys))
    assert RefitParams().trusted_keys == keys
    env.setenv("CANONICAL_REFIT_TRUSTED_KEYS", "not a key")
    with pytest.raises(ValidationError) as caught:
        RefitParams()
    assert caught.value.errors()[0]["loc"] == ("trusted_keys",)
