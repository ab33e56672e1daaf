"""The in-engine loader, called as SGLang calls it: ``fn(model, named_tensors)`` with a real torch module."""

from __future__ import annotations

import os
import shutil
import sys
import uuid

import numpy as np
import pytest
import torch

from tasks.installers.sglang_loader import (FAILED, OK, LoaderSettings, LoadRequest, load_prepared_checkpoint, read_reports,
                                 reports_dir, request_path, write_request)
from tests.support.lab import Lab, tiny_shape, tree_hash
from tests.support.sglang_support import DefaultModelLoader, Faults, LoadFormat, TinySGLangLlama, engine_context, engine_env
from tests.support.sglang_support import fake_sglang  # noqa: F401  (fixture)
from storage.store.local_store import LocalStore, now_ms
from storage.store.flush import wait_for_flushes


def as_torch(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


def engine_model(lab, version: str) -> TinySGLangLlama:
    """A model holding ``version``, loaded through its own SGLang-style ``load_weights``."""
    model = TinySGLangLlama(lab.shape)
    model.load_weights((name, as_torch(bits)) for name, bits in lab.expected(version).items())
    return model


def assert_holds(model: TinySGLangLlama, lab, version: str) -> None:
    got, want = model.hf_tensors(), lab.expected(version)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


def make_request(store: LocalStore, **changes) -> LoadRequest:
    current = store.current()
    fields = dict(request_id=uuid.uuid4().hex, model=store.model, version=current.version,
                  digest=current.target_digest, format_digest=current.format_digest, path=current.path,
                  files=current.files, installer="test", created_at_unix_ms=now_ms(),
                  deadline_unix_ms=now_ms() + 60_000)
    fields.update(changes)
    request = LoadRequest(**fields)
    write_request(store, request)
    return request


@pytest.fixture(scope="module")
def prepared_template(prefect_api, tmp_path_factory) -> Lab:
    """Published r0..r2 and a receiver store prepared to r2 (once per module; tests work on copies)."""
    lab = Lab(tmp_path_factory.mktemp("sglang-loader"), shape=tiny_shape())
    for kind in ("initial", "delta", "delta"):
        lab.publish(kind)
    state, result = lab.refit()
    assert state.name == "Ready", result.error
    assert wait_for_flushes(60)  # the write-back after Ready is done: the copies below see a still store
    return lab


@pytest.fixture
def prepared(prepared_template, tmp_path, fake_sglang, monkeypatch):
    """A store whose current checkpoint is a verified r2 (a delta chain), the engine still on r0."""
    shutil.copytree(prepared_template.root, tmp_path / "lab", symlinks=True)  # keeps mtimes: files stay verified
    lab = Lab(tmp_path / "lab", shape=prepared_template.shape, revisions=dict(prepared_template.revisions))
    engine_env(monkeypatch, lab)
    store = LocalStore(lab.cache, lab.model)
    assert store.current().version == "r2"
    return lab, store


def only_report(store: LocalStore, request: LoadRequest):
    reports = read_reports(store, request.request_id)
    assert len(reports) == 1
    return reports[0]


def test_loads_the_prepared_checkpoint_through_sglangs_loader(prepared):
    lab, store = prepared
    model = engine_model(lab, "r0")
    request = make_request(store)
    before = tree_hash(store.root / "materialized")

    assert load_prepared_checkpoint(model, []) is None

    assert_holds(model, lab, "r2")
    report = only_report(store, request)
    assert (report.status, report.mutation_started, report.version) == (OK, False, "r2")
    assert report.tensors == len(lab.expected("r2"))
    assert report.bytes == sum(a.nbytes for a in lab.expected("r2").values())
    assert report.tp_rank == 0 and report.pid == os.getpid()
    # SGLang's own DefaultModelLoader, configured for safetensors, read our folder through its own Source
    (loader,) = DefaultModelLoader.created
    assert loader.load_config.load_format == LoadFormat.SAFETENSORS
    assert loader.load_config.model_loader_extra_config == {}
    assert model.restored == 1  # restore_weights_before_loading ran before load_weights
    assert tree_hash(store.root / "materialized") == before  # the checkpoint was only read


def test_ranks_report_separately(prepared):
    lab, store = prepared
    request = make_request(store)
    models = [engine_model(lab, "r0") for _ in range(2)]
    for rank, model in enumerate(models):
        with engine_context(rank, Faults()):
            load_prepared_checkpoint(model, [])
    reports = read_reports(store, request.request_id)
    assert sorted(r.tp_rank for r in reports) == [0, 1]
    assert {r.status for r in reports} == {OK}
    for model in models:
        assert_holds(model, lab, "r2")


def _tamper_mtime(store: LocalStore) -> None:
    folder = store.absolute(store.current().path)
    path = next(folder.glob("*.safetensors"))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


BEFORE_MUTATION = {
    "wrong version": (lambda store: make_request(store, version="r1"), "validation", "version"),
    "wrong digest": (lambda store: make_request(store, digest="sha256:" + "0" * 64), "validation", "digest"),
    "wrong files": (lambda store: make_request(store, files={"model.safetensors": [1, 2]}), "validation", "files"),
    "expired": (lambda store: make_request(store, deadline_unix_ms=now_ms() - 1), "validation", "expired"),
    "files changed": (lambda store: (make_request(store), _tamper_mtime(store))[0], "validation",
                      "not verified and intact"),
    "store updating": (lambda store: (make_request(store), store.begin_update(
        "r3", store.absolute(store.current().path), "r2"))[0], "validation", "UPDATING"),
}


@pytest.mark.parametrize("case", sorted(BEFORE_MUTATION))
def test_validation_failures_leave_the_model_untouched(prepared, case):
    lab, store = prepared
    model = engine_model(lab, "r0")
    make, stage, words = BEFORE_MUTATION[case]
    request = make(store)

    load_prepared_checkpoint(model, [])

    assert_holds(model, lab, "r0")
    report = only_report(store, request)
    assert (report.status, report.mutation_started, report.stage) == (FAILED, False, stage)
    assert words in report.message
    assert "r2" in report.message or "r1" in report.message  # names the revision
    assert not report.may_have_mutated


def test_loader_setup_and_iterator_failures_come_before_mutation(prepared, monkeypatch):
    lab, store = prepared
    model = engine_model(lab, "r0")

    request = make_request(store)
    with engine_context(0, Faults(fail_iterator="cannot open shard")):
        load_prepared_checkpoint(model, [])
    report = only_report(store, request)
    assert (report.status, report.stage, report.mutation_started) == (FAILED, "iterator", False)
    assert "cannot open shard" in report.message

    request = make_request(store)
    monkeypatch.setitem(sys.modules, "sglang.srt.model_loader.loader", None)  # SGLang not importable
    load_prepared_checkpoint(model, [])
    report = only_report(store, request)
    assert (report.status, report.stage, report.mutation_started) == (FAILED, "loader setup", False)
    assert "ImportError" in report.message or "ModuleNotFoundError" in report.message
    assert_holds(model, lab, "r0")


def test_tensors_passed_by_sglang_are_refused(prepared):
    lab, store = prepared
    model = engine_model(lab, "r0")
    request = make_request(store)
    load_prepared_checkpoint(model, [("model.norm.weight", torch.ones(lab.shape.hidden, dtype=torch.bfloat16))])
    report = only_report(store, request)
    assert (report.status, report.mutation_started) == (FAILED, False)
    assert "1 tensors" in report.message
    assert_holds(model, lab, "r0")


def test_waits_for_the_shared_lock_and_gives_up_before_mutation(prepared):
    lab, store = prepared
    model = engine_model(lab, "r0")
    request = make_request(store)
    with store.exclusive(5, "preparation"):  # a preparation is changing the checkpoint
        load_prepared_checkpoint(model, [], settings=LoaderSettings(
            cache_dir=lab.cache, model=lab.model, loader_lock_timeout_s=0.3))
    report = only_report(store, request)
    assert (report.status, report.stage, report.mutation_started) == (FAILED, "validation", False)
    assert "StoreBusy" in report.message
    assert_holds(model, lab, "r0")


def test_the_receivers_shared_lock_does_not_block_the_engine(prepared):
    lab, store = prepared
    model = engine_model(lab, "r0")
    request = make_request(store)
    with store.shared(5, "installation"):  # what the receiver holds while the engine loads
        load_prepared_checkpoint(model, [])
    assert only_report(store, request).status == OK
    assert_holds(model, lab, "r2")


def test_failure_while_loading_is_reported_after_mutation(prepared):
    lab, store = prepared
    model = engine_model(lab, "r0")
    model.faults.fail_load_after = 3
    model.loaded_names.clear()
    request = make_request(store)

    load_prepared_checkpoint(model, [])  # never raises into SGLang's scheduler

    report = only_report(store, request)
    assert (report.status, report.stage, report.mutation_started) == (FAILED, "load", True)
    assert report.may_have_mutated
    assert "injected failure" in report.message
    got, r0, r2 = model.hf_tensors(), lab.expected("r0"), lab.expected("r2")
    changed = [n for n in model.loaded_names if got[n].tobytes() == r2[n].tobytes() != r0[n].tobytes()]
    assert len(changed) == 3  # the model now holds a mix of both revisions


def test_without_a_request_or_a_store_nothing_happens(prepared, monkeypatch):
    lab, store = prepared
    model = engine_model(lab, "r0")
    assert not request_path(store).exists()
    load_prepared_checkpoint(model, [])
    assert_holds(model, lab, "r0")

    request = make_request(store)
    monkeypatch.delenv("CANONICAL_REFIT_MODEL")
    load_prepared_checkpoint(model, [])
    assert not reports_dir(store, request.request_id).exists()
    assert_holds(model, lab, "r0")
