"""Stand-ins for the parts of SGLang 0.5.23 that cannot run here (see docs/sglang.md).

- ``TinySGLangLlama``: a real CPU torch module laid out like SGLang's
  ``LlamaForCausalLM`` (fused ``qkv_proj`` and ``gate_up_proj``), whose
  ``load_weights`` maps Hugging Face names onto it through per-parameter
  ``weight_loader`` functions the way SGLang's models do, and whose
  ``get_weights_by_name`` answers like SGLang's.
- Fake ``sglang`` modules with the documented shapes of ``LoadConfig``,
  ``LoadFormat``, ``DefaultModelLoader`` (``Source``, ``_get_weights_iterator``,
  ``load_weights_and_postprocess``, ``restore_weights_before_loading``) and
  ``runtime_context.get_parallel`` (the TP rank), so the real adapter in
  ``tasks.installers.sglang_loader`` runs unchanged against them.
- ``Faults``: failures the mock engine injects before and after mutation.
"""

from __future__ import annotations

import enum
import glob
import json
import os
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np
import pytest
import torch
from torch import nn

from flows.synthetic import ModelShape


@dataclass
class Faults:
    """What the mock engine gets wrong, on purpose."""

    reject_status: int | None = None  # answer an update with this status before touching anything
    fail_iterator: str | None = None  # DefaultModelLoader._get_weights_iterator raises (before mutation)
    fail_load_after: int | None = None  # model.load_weights raises after this many tensors (after mutation)
    fail_load_times: int = 1  # how many loads fail that way (SGLang's disk "rollback" is the next load)
    delay_s: float = 0.0  # answer an update this late (after loading)
    malformed: bool = False  # answer an update 200 with a body that is not SGLang's
    drop: bool = False  # close the connection without an answer (after loading)


# -- which engine and rank the current thread is (one thread per TP rank in the mock) ------------------

_ENGINE = threading.local()


@contextmanager
def engine_context(rank: int, faults: Faults):
    previous = getattr(_ENGINE, "state", None)
    _ENGINE.state = (rank, faults)
    try:
        yield
    finally:
        _ENGINE.state = previous


def _current() -> tuple[int, Faults]:
    return getattr(_ENGINE, "state", None) or (0, Faults())


# -- a model shaped like SGLang's LlamaForCausalLM -----------------------------------------------------------


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _sharded_loader(offsets: dict):
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        start, size = offsets[shard_id]
        target = param.data.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard_id!r} {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)
    return weight_loader


class _Weight(nn.Module):
    def __init__(self, *shape: int, weight_loader=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16), requires_grad=False)
        self.weight.weight_loader = weight_loader or default_weight_loader


class _Layer(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.input_layernorm = _Weight(h)
        self.post_attention_layernorm = _Weight(h)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = _Weight(3 * h, h, weight_loader=_sharded_loader(
            {"q": (0, h), "k": (h, h), "v": (2 * h, h)}))
        self.self_attn.o_proj = _Weight(h, h)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = _Weight(2 * i, h, weight_loader=_sharded_loader({0: (0, i), 1: (i, i)}))
        self.mlp.down_proj = _Weight(h, i)


class TinySGLangLlama(nn.Module):
    """``ModelShape`` as SGLang lays a Llama out in memory; ``load_weights`` as SGLang's models do it."""

    stacked_params_mapping = [
        # (param_name, shard_name, shard_id), as in SGLang's llama.py
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, shape: ModelShape, faults: Faults | None = None):
        super().__init__()
        self.shape, self.faults = shape, faults or Faults()
        self.model = nn.Module()
        self.model.embed_tokens = _Weight(shape.vocab, shape.hidden)
        self.model.layers = nn.ModuleList(_Layer(shape.hidden, shape.intermediate) for _ in range(shape.layers))
        self.model.norm = _Weight(shape.hidden)
        self.lm_head = _Weight(shape.vocab, shape.hidden)
        self.loaded_names: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = 0
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.faults.fail_load_after is not None and loaded >= self.faults.fail_load_after \
                    and self.faults.fail_load_times > 0:
                self.faults.fail_load_times -= 1
                raise RuntimeError(f"injected failure loading {name} after {loaded} tensors")
            for param_name, shard_name, shard_id in self.stacked_params_mapping:
                if shard_name in name:
                    fused = name.replace(shard_name, param_name)
                    params[fused].weight_loader(params[fused], tensor, shard_id)
                    break
            else:
                if name not in params:
                    continue  # SGLang logs and skips names the model does not have
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded += 1
            self.loaded_names.append(name)

    def _resolve(self, name: str) -> torch.Tensor | None:
        params = dict(self.named_parameters())
        h, i = self.shape.hidden, self.shape.intermediate
        slices = {"q": (0, h), "k": (h, h), "v": (2 * h, h), 0: (0, i), 1: (i, i)}
        for param_name, shard_name, shard_id in self.stacked_params_mapping:
            if shard_name in name:
                fused = params.get(name.replace(shard_name, param_name))
                return None if fused is None else fused.data.narrow(0, *slices[shard_id])
        param = params.get(name)
        return None if param is None else param.data

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """As SGLang: the parameter as float32 nested lists, its first ``truncate_size`` rows."""
        tensor = self._resolve(name)
        return None if tensor is None else tensor.to(torch.float32).numpy().tolist()[:truncate_size]

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """Every Hugging Face tensor the model holds, as bf16 bit patterns (uint16)."""
        return {name: self._resolve(name).contiguous().view(torch.int16).numpy().view(np.uint16).copy()
                for name, _ in self.shape.tensors()}


# -- fake sglang modules -------------------------------------------------------------------------------------


class LoadFormat(str, enum.Enum):
    AUTO = "auto"
    PT = "pt"
    SAFETENSORS = "safetensors"
    NPCACHE = "npcache"
    DUMMY = "dummy"


@dataclass
class LoadConfig:
    load_format: Any = LoadFormat.AUTO
    download_dir: Optional[str] = None
    model_loader_extra_config: dict = field(default_factory=dict)
    ignore_patterns: Optional[list] = None
    load_group: Any = None

    def __post_init__(self):
        if isinstance(self.load_format, str):
            self.load_format = LoadFormat(self.load_format.lower())


class DefaultModelLoader:
    """The documented surface of SGLang's ``DefaultModelLoader``, reading safetensors with ``safe_open``."""

    created: list["DefaultModelLoader"] = []

    @dataclass
    class Source:
        model_or_path: str
        revision: Optional[str]
        prefix: str = ""
        fall_back_to_pt: bool = True
        allow_patterns_overrides: Optional[list] = None
        model_config: Any = None

        @classmethod
        def init_new(cls, model_config, model):
            return cls(model_config.model_path, model_config.revision, prefix="",
                       fall_back_to_pt=getattr(model, "fall_back_to_pt_during_load", True),
                       allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None),
                       model_config=model_config)

    def __init__(self, load_config: LoadConfig):
        unexpected = set(load_config.model_loader_extra_config) - {"enable_multithread_load", "num_threads"}
        if unexpected:
            raise ValueError(f"Unexpected extra config keys for load format {load_config.load_format}: {unexpected}")
        self.load_config = load_config
        DefaultModelLoader.created.append(self)

    def _prepare_weights(self, model_name_or_path, revision, fall_back_to_pt, allow_patterns_overrides=None):
        if not os.path.isdir(model_name_or_path):
            raise RuntimeError(f"{model_name_or_path} is not a local folder (the fake has no hub)")
        patterns = ["*.safetensors"] if self.load_config.load_format == LoadFormat.SAFETENSORS \
            else ["*.safetensors", "*.bin"]
        if fall_back_to_pt:
            patterns.append("*.pt")
        files: list[str] = []
        for pattern in patterns:
            files = glob.glob(os.path.join(model_name_or_path, pattern))
            if files:
                break
        index = os.path.join(model_name_or_path, "model.safetensors.index.json")
        if os.path.isfile(index):  # filter_duplicate_safetensors_files
            with open(index) as fh:
                listed = set(json.load(fh)["weight_map"].values())
            files = [f for f in files if os.path.basename(f) in listed]
        if not files:
            raise RuntimeError(f"Cannot find any model weights with `{model_name_or_path}`")
        return model_name_or_path, sorted(files), True

    def _get_weights_iterator(self, source, *, resolved_source=None, startup_prefetch_started=False,
                              startup_prefetch_active=False):
        _, faults = _current()
        if faults.fail_iterator:
            raise RuntimeError(faults.fail_iterator)
        _, files, _ = self._prepare_weights(source.model_or_path, source.revision, source.fall_back_to_pt,
                                            source.allow_patterns_overrides)

        def tensors():
            from safetensors import safe_open

            for path in files:
                with safe_open(path, framework="pt") as fh:
                    for name in fh.keys():
                        yield source.prefix + name, fh.get_tensor(name)
        return tensors()

    @staticmethod
    def restore_weights_before_loading(model, target_device) -> None:
        model.restored = getattr(model, "restored", 0) + 1

    @staticmethod
    def load_weights_and_postprocess(model, weights, target_device) -> None:
        model.load_weights(weights)
        for _, module in model.named_modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)


def get_parallel():
    """SGLang 0.5.23's runtime context of parallel sizes and ranks (``sglang.srt.runtime_context``)."""
    return types.SimpleNamespace(tp_rank=_current()[0])


def fake_sglang_modules() -> dict[str, types.ModuleType]:
    """``sys.modules`` entries that make ``import sglang.srt...`` find the fakes above."""
    names = ["sglang", "sglang.srt", "sglang.srt.configs", "sglang.srt.configs.load_config",
             "sglang.srt.model_loader", "sglang.srt.model_loader.loader", "sglang.srt.runtime_context"]
    modules = {name: types.ModuleType(name) for name in names}
    for name in names[:-1]:
        modules[name].__path__ = []
    modules["sglang"].__version__ = "0.5.23"
    modules["sglang.srt.configs.load_config"].LoadConfig = LoadConfig
    modules["sglang.srt.configs.load_config"].LoadFormat = LoadFormat
    modules["sglang.srt.model_loader.loader"].DefaultModelLoader = DefaultModelLoader
    modules["sglang.srt.runtime_context"].get_parallel = get_parallel
    return modules


@pytest.fixture
def fake_sglang(monkeypatch):
    """Make ``import sglang`` find the fakes for one test."""
    for name, module in fake_sglang_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    DefaultModelLoader.created.clear()
    return sys.modules["sglang"]


def engine_env(monkeypatch, lab) -> None:
    """The engine-side environment that tells the in-engine loader where the lab's store is."""
    monkeypatch.setenv("CANONICAL_REFIT_CACHE_DIR", str(lab.cache))
    monkeypatch.setenv("CANONICAL_REFIT_MODEL", lab.model)
    monkeypatch.setenv("CANONICAL_REFIT_LOADER_LOCK_TIMEOUT_S", "5")


def bf16_bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
