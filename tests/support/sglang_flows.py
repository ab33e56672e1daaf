"""Fixtures and helpers shared by the SGLang flow tests: a published lab, engines, and what they hold."""

from __future__ import annotations

import json
import shutil
import socket
import urllib.request

import pytest

from tests.support.lab import Lab, tiny_shape
from tests.support.sglang_mock import MockSGLang
from tests.support.sglang_support import engine_env
from storage.store.local_store import LocalStore
from storage.settings import InstallerSettings


@pytest.fixture(scope="module")
def published(prefect_api, tmp_path_factory) -> Lab:
    """r0 (launch), r1 and r2 (deltas) published once per module; tests work on copies."""
    lab = Lab(tmp_path_factory.mktemp("sglang-published"), shape=tiny_shape())
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    return lab


@pytest.fixture
def engine_lab(published, tmp_path, fake_sglang, monkeypatch) -> Lab:
    """A private copy of the published lab, with the engine-side environment pointing at its store."""
    shutil.copytree(published.root, tmp_path / "lab", symlinks=True)
    lab = Lab(tmp_path / "lab", shape=published.shape, revisions=dict(published.revisions))
    engine_env(monkeypatch, lab)
    return lab


def sglang(*engines, kind: str = "sglang", **kw) -> InstallerSettings:
    urls = [e if isinstance(e, str) else e.url for e in engines]
    return InstallerSettings(kind=kind, engine_urls=urls, **kw)


def disk(*engines) -> InstallerSettings:
    """The ``sglang-disk`` installer for ``engines``."""
    return sglang(*engines, kind="sglang-disk")


def assert_engine_holds(engine: MockSGLang, lab: Lab, version: str) -> None:
    want = lab.expected(version)
    for rank in range(engine.tp_size):
        got = engine.tensors(rank)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].tobytes() == want[name].tobytes(), (rank, name)


def holds_exactly(engine: MockSGLang, lab: Lab, version: str) -> bool:
    got, want = engine.tensors(), lab.expected(version)
    return all(got[n].tobytes() == want[n].tobytes() for n in want)


def store_of(lab: Lab) -> LocalStore:
    return LocalStore(lab.cache, lab.model)


def http_json(url: str, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def closed_port_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def cli_args(lab: Lab, *engines, installer: str = "sglang") -> list[str]:
    args = ["--model", lab.model, "--cache-dir", str(lab.cache), "--installer", installer]
    for engine in engines:
        args += ["--engine-url", engine if isinstance(engine, str) else engine.url]
    return args
