"""Publishing from memory: the same objects and records as from a folder, and bad input refused cleanly.

Every test drives ``flows.api.publish``. A folder of the same tensors is
written the way docs/format.md (section 5.2) defines the in-memory layout:
one ``model.safetensors``, tensors in name order, ``{"format": "pt"}``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flows import api
from tests.support.s3_support import s3  # noqa: F401  (a fixture)
from storage.errors import CheckpointMismatch, FormatError
from storage.objects.store import ObjectStore
from storage.catalog.kept_base import PublisherCopy
from storage.format.safetensors import write_safetensors
from storage.format.tensor_source import as_bytes

MODEL = "org/tiny"


def step(seed: int) -> dict:
    """One revision: bf16 (torch), float32 (NumPy), int8 (torch and NumPy), a scalar and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(80, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(64).astype(np.float32),
        "model.layers.0.mlp.quant_scale": torch.randint(-128, 127, (32, 8), dtype=torch.int8, generator=g),
        "model.codebook": rng.integers(-128, 127, (16, 16), dtype=np.int8),
        "model.temperature": np.array(0.5 + seed, dtype=np.float32),
        "model.unused": np.zeros((0, 4), dtype=np.float32),
        "lm_head.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16) if seed < 2 else
        torch.zeros(96, 64, dtype=torch.bfloat16),
    }


def write_folder(folder, tensors: dict):
    """The folder a trainer would write: one shard, tensors in name order, ``{"format": "pt"}``."""
    folder.mkdir(parents=True)
    entries = []
    for name in sorted(tensors):
        raw, dtype, shape = as_bytes(name, tensors[name])
        entries.append((name, dtype, shape, raw.tobytes()))
    with open(folder / "model.safetensors", "wb") as fh:
        write_safetensors(fh, entries, {"format": "pt"})
    return folder


def objects_under(storage, root: str) -> dict[str, bytes]:
    """Every object under ``root`` (catalog and payloads), by path relative to it."""
    fs, path = ObjectStore(storage).locate(root)
    return {name[len(path):].lstrip("/"): fs.cat_file(name) for name in sorted(fs.find(path))}


KINDS = ["initial", "delta", "full", "delta"]


def test_memory_and_folder_publications_are_the_same_bytes(tmp_path, s3):  # noqa: F811
    folder_root = f"file://{tmp_path / 'from-folder'}"
    memory_root = s3.prefix("from-memory")
    settings = s3.settings()
    for n, kind in enumerate(KINDS):
        tensors = step(n)
        folder = write_folder(tmp_path / f"step-{n}", tensors)
        a = api.publish(folder, catalog=f"{folder_root}/catalog", model=MODEL, kind=kind,
                        state_dir=tmp_path / "state-folder", emit_event=False, workers=2)
        b = api.publish(tensors, catalog=f"{memory_root}/catalog", model=MODEL, kind=kind,
                        state_dir=tmp_path / "state-memory", emit_event=False, workers=2, storage=settings,
                        keep_base="memory" if n % 2 else "disk")
        assert (a.version, a.sequence, a.target_digest, a.bytes_written) == (b.version, b.sequence,
                                                                              b.target_digest, b.bytes_written)
        assert b.model_bytes == sum(as_bytes(k, v)[0].size for k, v in tensors.items()) and b.bytes_per_s > 0
    left, right = objects_under(None, folder_root), objects_under(settings, memory_root)
    assert sorted(left) == sorted(right)
    assert {"revisions/r1/bucket-00000.safetensors", "revisions/r2/model.safetensors",
            "catalog/sequences/000000000003.json", "catalog/r3.json"} <= set(left)
    for name in left:
        if name.startswith("catalog/r") and name.endswith(".json"):  # records: all but the time and the URI root
            x, y = json.loads(left[name]), json.loads(right[name])
            assert x.pop("created_at_unix_ms") > 0 and y.pop("created_at_unix_ms") > 0
            ux, uy = x.pop("uri"), y.pop("uri")
            assert (ux is None and uy is None) or (ux[len(folder_root):] == uy[len(memory_root):]), name
            assert x == y, name
        elif name.startswith("catalog/sequences/"):  # claims: all but the claiming publication's own token
            x, y = json.loads(left[name]), json.loads(right[name])
            assert x.pop("publication") != y.pop("publication") and x == y, name
        else:
            assert left[name] == right[name], name


def test_an_iterator_of_pairs_publishes_like_a_mapping(tmp_path):
    results = []
    for label, wrap in (("mapping", dict), ("iterator", lambda t: ((k, v) for k, v in t.items()))):
        catalog = f"file://{tmp_path / label}/catalog"
        for n, kind in enumerate(("initial", "delta")):
            results.append(api.publish(wrap(step(n)), catalog=catalog, model=MODEL, kind=kind,
                                       state_dir=tmp_path / f"state-{label}", emit_event=False, workers=1))
    assert [r.target_digest for r in results[:2]] == [r.target_digest for r in results[2:]]
    assert (tmp_path / "mapping/revisions/r1/bucket-00000.safetensors").read_bytes() == \
        (tmp_path / "iterator/revisions/r1/bucket-00000.safetensors").read_bytes()


def test_a_base_kept_in_memory_gives_the_delta_a_base_on_disk_gives(tmp_path):
    for keep in ("disk", "memory"):
        catalog = f"file://{tmp_path / keep}/catalog"
        tensors = step(0)
        api.publish(tensors, catalog=catalog, model=MODEL, kind="initial", keep_base=keep,
                    state_dir=tmp_path / f"state-{keep}", emit_event=False)
        tensors["lm_head.weight"] += 1  # the trainer's next step, in place: the kept base must not move with it
        api.publish(tensors, catalog=catalog, model=MODEL, keep_base=keep, state_dir=tmp_path / f"state-{keep}",
                    emit_event=False)
    assert PublisherCopy(tmp_path / "state-memory", MODEL).kept_version() is None  # the memory publisher wrote none
    assert (PublisherCopy(tmp_path / "state-disk", MODEL).checkpoint / "model.safetensors").is_file()
    assert PublisherCopy(tmp_path / "state-disk", MODEL).kept_version() == "r1"
    disk, memory = (sorted((tmp_path / keep / "revisions" / "r1").iterdir()) for keep in ("disk", "memory"))
    assert [p.name for p in disk] == [p.name for p in memory]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(disk, memory))


def _snapshot(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _bad_inputs():
    wrong_shape = step(1) | {"model.codebook": np.zeros((16, 8), dtype=np.int8)}
    wrong_dtype = step(1) | {"lm_head.weight": torch.zeros(96, 64, dtype=torch.float16)}
    missing = {k: v for k, v in step(1).items() if k != "model.codebook"}
    extra = step(1) | {"model.new": np.zeros(3, dtype=np.float32)}
    strided = step(1) | {"lm_head.weight": torch.zeros(64, 96, dtype=torch.bfloat16).t()}
    strided_np = step(1) | {"model.codebook": np.zeros((16, 32), dtype=np.int8)[:, ::2]}
    meta = step(1) | {"lm_head.weight": torch.zeros(96, 64, dtype=torch.bfloat16, device="meta")}
    not_a_tensor = step(1) | {"lm_head.weight": [[0.0] * 64] * 96}
    big_endian = step(1) | {"model.layers.0.input_layernorm.weight": np.zeros(64, dtype=">f4")}
    return [
        pytest.param(wrong_shape, CheckpointMismatch, "model.codebook", "shape", id="shape"),
        pytest.param(wrong_dtype, CheckpointMismatch, "lm_head.weight", "dtype F16", id="dtype"),
        pytest.param(missing, CheckpointMismatch, "model.codebook", "missing", id="missing"),
        pytest.param(extra, CheckpointMismatch, "model.new", "not in", id="extra"),
        pytest.param(strided, FormatError, "lm_head.weight", "contiguous", id="non-contiguous-torch"),
        pytest.param(strided_np, FormatError, "model.codebook", "contiguous", id="non-contiguous-numpy"),
        pytest.param(meta, FormatError, "lm_head.weight", "not the CPU", id="not-cpu"),
        pytest.param(not_a_tensor, FormatError, "lm_head.weight", "not a tensor", id="list"),
        pytest.param(big_endian, FormatError, "input_layernorm", "big-endian", id="big-endian"),
    ]


@pytest.mark.parametrize("keep", ["disk", "memory"])
@pytest.mark.parametrize("tensors, error, tensor, reason", _bad_inputs())
def test_bad_input_is_refused_by_name_and_changes_nothing(tmp_path, keep, tensors, error, tensor, reason):
    catalog = tmp_path / "catalog"
    api.publish(step(0), catalog=f"file://{catalog}", model=MODEL, kind="initial", keep_base=keep,
                state_dir=tmp_path / "state", emit_event=False)
    before = _snapshot(tmp_path)
    with pytest.raises(error, match=reason) as caught:
        api.publish(tensors, catalog=f"file://{catalog}", model=MODEL, version="r1", keep_base=keep,
                    state_dir=tmp_path / "state", emit_event=False)
    assert caught.value.revision == "r1" and tensor in caught.value.tensor
    assert _snapshot(tmp_path) == before  # no sequence claimed, no payload, kept base untouched
    good = api.publish(step(1), catalog=f"file://{catalog}", model=MODEL, keep_base=keep,
                       state_dir=tmp_path / "state", emit_event=False)
    assert (good.version, good.sequence) == ("r1", 1)


def test_the_memory_base_falls_back_to_the_disk_copy_in_a_new_process(tmp_path):
    catalog = f"file://{tmp_path}/catalog"
    api.publish(step(0), catalog=catalog, model=MODEL, kind="initial", state_dir=tmp_path / "state",
                emit_event=False)
    copy = PublisherCopy(tmp_path / "state", MODEL, keep_base="memory")
    assert copy.in_memory and (copy.checkpoint / "model.safetensors").is_file()
    result = api.publish(step(1), catalog=catalog, model=MODEL, keep_base="memory", state_dir=tmp_path / "state",
                         emit_event=False)  # no base in memory yet: the exact base on disk serves
    assert result.version == "r1" and result.changed_tensors > 0


def test_a_refused_tensor_names_the_version_it_would_have_had(tmp_path):
    catalog = f"file://{tmp_path}/catalog"
    api.publish(step(0), catalog=catalog, model=MODEL, kind="initial", state_dir=tmp_path / "state", emit_event=False)
    with pytest.raises(FormatError, match="contiguous") as caught:
        api.publish(step(1) | {"model.codebook": np.zeros((16, 32), dtype=np.int8)[:, ::2]}, catalog=catalog,
                    model=MODEL, state_dir=tmp_path / "state", emit_event=False)
    assert (caught.value.revision, caught.value.tensor) == ("r1", "model.codebook")
    with pytest.raises(ValueError, match="keep_base"):
        api.publish(step(1), catalog=catalog, model=MODEL, keep_base="gpu", state_dir=tmp_path / "state",
                    emit_event=False)
    assert sorted(p.name for p in (tmp_path / "catalog").rglob("*.json")) == ["000000000000.json", "head.json",
                                                                            "r0.json"]


def test_a_restarted_trainer_without_its_memory_base_is_told_in_python_terms_what_to_pass(tmp_path):
    """A trainer that kept its base in memory restarts: its next delta names the revision it publishes, the
    base apart, and Python's argument (base_checkpoint=), not a CLI flag; passing it publishes."""
    import subprocess
    import sys

    from tests.support.lab import ROOT_DIR
    from storage.errors import LineageError

    catalog, state = f"file://{tmp_path}/catalog", tmp_path / "state"
    script = ("import numpy as np, sys\nfrom flows import api\n"
              "def step(s): return {'w': np.random.default_rng(s).standard_normal((64, 64)).astype(np.float32)}\n"
              "kw = dict(catalog=sys.argv[1], model='org/tiny', keep_base='memory', state_dir=sys.argv[2], "
              "emit_event=False)\n"
              "api.publish(step(0), kind='initial', **kw)\napi.publish(step(1), **kw)\n")
    subprocess.run([sys.executable, "-c", script, catalog, str(state)], cwd=ROOT_DIR, check=True, timeout=120)

    def weights(seed):
        return {"w": np.random.default_rng(seed).standard_normal((64, 64)).astype(np.float32)}

    with pytest.raises(LineageError) as caught:  # this process is the restarted trainer: no base in memory
        api.publish(weights(2), catalog=catalog, model="org/tiny", keep_base="memory", state_dir=state,
                    emit_event=False)
    error = caught.value
    assert error.revision == "r2" and "base revision r1" in str(error), error
    assert "base_checkpoint=" in str(error) and "--base-checkpoint" not in str(error), error
    assert 'kind="full"' in str(error) and "--kind" not in str(error), error
    base = tmp_path / "base"
    write_safetensors_folder(base, weights(1))
    result = api.publish(weights(2), catalog=catalog, model="org/tiny", keep_base="memory", state_dir=state,
                         base_checkpoint=base, emit_event=False)
    assert (result.version, result.changed_tensors) == ("r2", 1)


def write_safetensors_folder(folder, tensors) -> None:
    """The in-memory layout on disk: one model.safetensors, tensors in name order (docs/format.md, 5.2)."""
    folder.mkdir(parents=True)
    with open(folder / "model.safetensors", "wb") as fh:
        write_safetensors(fh, [(n, "F32", list(a.shape), as_bytes(n, a)[0]) for n, a in sorted(tensors.items())],
                          {"format": "pt"})


def test_a_trainer_updating_its_tensors_in_place_publishes_each_step_exactly(tmp_path):
    """The kept base in memory is overwritten in its own buffers step after step (no fresh pages); a trainer
    that updates the same tensors in place between publishes still gets each step's exact delta: the records
    are those of a publisher reading each step from its own folder."""
    trainer = {name: (t.clone() if isinstance(t, torch.Tensor) else t.copy()) for name, t in step(0).items()}
    memory, folder = f"file://{tmp_path}/memory/catalog", f"file://{tmp_path}/folder/catalog"
    for n in range(5):
        for name, value in step(n).items():  # an optimizer step: the trainer's own buffers change in place
            trainer[name][...] = value
        kind = "initial" if n == 0 else "delta"
        a = api.publish(trainer, catalog=memory, model=MODEL, kind=kind, keep_base="memory",
                        state_dir=tmp_path / "state-memory", emit_event=False, workers=2)
        b = api.publish(write_folder(tmp_path / f"step-{n}", step(n)), catalog=folder, model=MODEL, kind=kind,
                        state_dir=tmp_path / "state-folder", emit_event=False, workers=2)
        assert (a.version, a.target_digest, a.encoded_bytes) == (b.version, b.target_digest, b.encoded_bytes), n
        if n:
            assert (tmp_path / f"memory/revisions/r{n}/bucket-00000.safetensors").read_bytes() == \
                (tmp_path / f"folder/revisions/r{n}/bucket-00000.safetensors").read_bytes()
