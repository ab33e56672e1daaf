"""Synthetic transformer-shaped bf16 checkpoints for the demo, the tests and the benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage.format.checkpoint import INDEX_FILE
from storage.format.safetensors import write_safetensors


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's tensor shapes."""

    vocab: int = 4096
    hidden: int = 256
    intermediate: int = 688
    layers: int = 4
    shards: int = 2

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        h, i = self.hidden, self.intermediate
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (h, h)),
                (p + "self_attn.v_proj.weight", (h, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * 2 for _, s in self.tensors())

    def specs(self) -> list["TensorSpec"]:
        return [TensorSpec(name, "BF16", dims) for name, dims in self.tensors()]


def to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def write_checkpoint(folder: Path, tensors: dict[str, np.ndarray], shards: int = 2,
                     config: dict | None = None) -> Path:
    """Write ``{name: bf16 uint16 array}`` as HF-style shards with an index and a config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    groups = [names[k::shards] for k in range(shards)] if shards > 1 else [names]
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        with open(folder / file, "wb") as fh:
            write_safetensors(fh, [(n, "BF16", tensors[n].shape, tensors[n]) for n in sorted(group)],
                              {"format": "pt"})
        weight_map.update({n: file for n in group})
    if len(groups) > 1:
        total = sum(a.nbytes for a in tensors.values())
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                     "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama"}, indent=2))
    return folder


def random_model(shape: ModelShape, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, dims in shape.tensors():
        if name.endswith("norm.weight"):
            values = np.ones(dims, dtype=np.float32)
        else:
            values = rng.standard_normal(dims, dtype=np.float32) * (1.0 / np.sqrt(dims[-1]))
        out[name] = to_bf16(values)
    return out


def train_step(tensors: dict[str, np.ndarray], seed: int, *, fraction: float = 1.0, lr: float = 1e-2,
               skip: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """An optimizer-step-like perturbation: ``fraction`` of elements move by a relative ``lr``.

    Tensors whose name contains one of ``skip`` stay unchanged (frozen parameters).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, bits in tensors.items():
        if any(s in name for s in skip):
            out[name] = bits.copy()
            continue
        values = from_bf16(bits)
        step = rng.standard_normal(values.shape, dtype=np.float32) * lr * (np.abs(values) + 1e-3)
        if fraction < 1.0:
            step *= rng.random(values.shape, dtype=np.float32) < fraction
        out[name] = to_bf16(values + step)
    return out


class RLTrainer:
    """An optimizer step on bf16 weights kept in fp32 master copies, calibrated to a share of changed elements.

    RL post-training updates are tiny: most of each step vanishes when the
    fp32 master weights are rounded to the published bf16. Each step moves
    every master weight by ``share`` of its bf16 ulp, in a random direction,
    so the bf16 export changes where the rounding flips — ``share`` of the
    elements, each by one ulp — which is what measured RL runs publish
    (1–3 % of bf16 elements per step). ``share=None`` is the dense case: a
    step of ``dense_lr`` relative to each weight (``dense_lr=3e-3`` changes
    about 40 % of the elements, like ``train_step``'s default benchmark step).

    Memory: the fp32 masters (twice the bf16 model) plus one tensor's
    temporaries; a step costs a few vectorized passes per tensor.
    """

    def __init__(self, tensors: dict[str, np.ndarray], seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.master = {name: self._inside(bits) for name, bits in tensors.items()}

    def _inside(self, bits: np.ndarray) -> np.ndarray:
        """fp32 masters anywhere strictly inside the rounding interval of each bf16 value (so they export to
        ``bits`` exactly; the interval is narrower below a power of two, whose lower neighbour is closer)."""
        values = from_bf16(bits)
        below = from_bf16((bits - np.uint16(1)).astype(np.uint16))
        above = from_bf16((bits + np.uint16(1)).astype(np.uint16))
        low = (values + below) * np.float32(0.5)  # midpoints of adjacent bf16 values are exact in fp32
        width = (values + above) * np.float32(0.5) - low
        where = self.rng.random(values.shape, dtype=np.float32) * np.float32(0.9998) + np.float32(0.0001)
        master = low + width * where  # never exactly on a rounding tie
        plain = ((bits & np.uint16(0x7FFF)) == 0) | ((bits & np.uint16(0x7F80)) == 0x7F80) | \
            ((bits & np.uint16(0x7FFF)) == 0x7F7F)  # zeros, inf/nan, the largest finite: stay as they are
        master[plain] = values[plain]
        return master

    def step(self, share: float | None = 0.02, *, dense_lr: float = 1e-2) -> dict[str, np.ndarray]:
        """Advance one step and return the bf16 export ``{name: uint16 array}``."""
        out = {}
        for name, values in self.master.items():
            if share is None:
                values += self.rng.standard_normal(values.shape, dtype=np.float32) * dense_lr * (np.abs(values)
                                                                                                 + 1e-3)
            else:
                step = bf16_ulp(values)
                step *= np.float32(share)
                step.view(np.uint32)[...] ^= self._random_signs(values.shape)  # +-share ulp, half each way
                values += step
            out[name] = to_bf16(values)
        return out

    def _random_signs(self, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 sign bit (0 or 0x80000000 as uint32) per element, each set with probability 1/2."""
        count = int(np.prod(shape))
        bits = np.unpackbits(self.rng.integers(0, 256, -(-count // 8), dtype=np.uint8))[:count]
        return (bits.astype(np.uint32) << np.uint32(31)).reshape(shape)

    def export(self) -> dict[str, np.ndarray]:
        return {name: to_bf16(values) for name, values in self.master.items()}


def bf16_ulp(values: np.ndarray) -> np.ndarray:
    """The spacing of bf16 numbers at each value (float32): 2**(exponent - 7); 2**-133 for subnormals."""
    exponent = values.view(np.uint32) & np.uint32(0x7F800000)
    tiny = exponent < np.uint32(8 << 23)  # the spacing is itself subnormal in float32: rare, done exactly
    exponent -= np.uint32(7 << 23)
    ulp = exponent.view(np.float32)
    if tiny.any():
        raw = (values[tiny].view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)
        ulp[tiny] = np.ldexp(np.float32(1.0), np.maximum(raw.astype(np.int32), 1) - 134).astype(np.float32)
    return ulp


def changed_share(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> float:
    """Share of elements whose bits differ between two bf16 exports."""
    changed = sum(int(np.count_nonzero(before[n] != after[n])) for n in before)
    return changed / max(1, sum(a.size for a in before.values()))


# -- real checkpoint layouts, at tiny per-tensor sizes ------------------------------------------------------------
#
# What matters in these checkpoints is the tensor COUNT, the names and the dtypes of real MoE checkpoints (the
# per-tensor costs of publishing and refitting), not their bytes: every tensor is a few hundred bytes, except
# gpt-oss's fused expert blocks (few large tensors at a moderate total size). Bytes are random; a step changes
# one byte of every tensor plus ``share`` of all bytes, so every tensor is in the delta (the worst case).

SHAPES = ("dense", "deepseek-v3", "deepseek-r1-nvfp4", "kimi-k3", "gpt-oss")

# the small mode of each shape (the suite's, and the benchmarks' --small): a few hundred tensors, every dtype
SMALL_SCALES = {"dense": 0.01, "deepseek-v3": 0.002, "deepseek-r1-nvfp4": 0.002, "kimi-k3": 0.0005, "gpt-oss": 0.01}

DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPE_BYTES[self.dtype]


def _linear(name: str, out: int, inp: int, quant: str) -> list[TensorSpec]:
    """One linear layer's weight stored as ``quant``: bf16; block-scaled FP8 (DeepSeek's ``weight_scale_inv``, one
    F32 per 128x128 block); or NVFP4 (two FP4 values a byte in U8, an F8_E4M3 scale per 16 values, F32 globals)."""
    if quant == "BF16":
        return [TensorSpec(name + ".weight", "BF16", (out, inp))]
    if quant in ("F8_E4M3", "F8_E5M2"):
        return [TensorSpec(name + ".weight", quant, (out, inp)),
                TensorSpec(name + ".weight_scale_inv", "F32", (-(-out // 128), -(-inp // 128)))]
    if quant == "NVFP4":
        return [TensorSpec(name + ".weight", "U8", (out, inp // 2)),
                TensorSpec(name + ".weight_scale", "F8_E4M3", (out, inp // 16)),
                TensorSpec(name + ".weight_scale_2", "F32", ()),
                TensorSpec(name + ".input_scale", "F32", ())]
    raise ValueError(f"unknown quantization {quant!r}")


def _deepseek_like(*, layers: int, dense_layers: int, experts: int, mtp: bool, attn: str, expert_quant: str,
                   dense_quant: str, h: int = 32, inter: int = 64, moe_inter: int = 16) -> list[TensorSpec]:
    """DeepSeek-V3's layout (MLA attention, ``dense_layers`` dense MLPs then routed experts with a shared
    expert, an MTP layer after the last if ``mtp``), every dimension tiny."""
    bf = lambda name, *shape: TensorSpec(name, "BF16", shape)  # noqa: E731
    out = [bf("model.embed_tokens.weight", 64, h)]

    def layer(n: int) -> list[TensorSpec]:
        p = f"model.layers.{n}."
        a = p + "self_attn."
        specs = [bf(p + "input_layernorm.weight", h), bf(p + "post_attention_layernorm.weight", h),
                 bf(a + "q_a_layernorm.weight", 16), bf(a + "kv_a_layernorm.weight", 16)]
        specs += _linear(a + "q_a_proj", 16, h, attn) + _linear(a + "q_b_proj", h, 16, attn)
        specs += _linear(a + "kv_a_proj_with_mqa", 24, h, attn) + _linear(a + "kv_b_proj", h, 16, attn)
        specs += _linear(a + "o_proj", h, h, attn)
        if n < dense_layers:
            for proj, (o, i) in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                specs += _linear(p + "mlp." + proj, o, i, dense_quant)
            return specs
        specs += [bf(p + "mlp.gate.weight", experts, h),
                  TensorSpec(p + "mlp.gate.e_score_correction_bias", "F32", (experts,))]
        for e in range(experts):
            for proj, (o, i) in (("gate_proj", (moe_inter, h)), ("up_proj", (moe_inter, h)),
                                 ("down_proj", (h, moe_inter))):
                specs += _linear(f"{p}mlp.experts.{e}.{proj}", o, i, expert_quant)
        for proj, (o, i) in (("gate_proj", (moe_inter, h)), ("up_proj", (moe_inter, h)),
                             ("down_proj", (h, moe_inter))):
            specs += _linear(f"{p}mlp.shared_experts.{proj}", o, i, dense_quant)
        return specs

    for n in range(layers):
        out += layer(n)
    if mtp:  # the multi-token-prediction layer: a MoE layer and its own embedding, projection and head
        p = f"model.layers.{layers}."
        out += layer(layers) + [bf(p + "enorm.weight", h), bf(p + "hnorm.weight", h), bf(p + "eh_proj.weight", h, 2 * h),
                                bf(p + "embed_tokens.weight", 64, h), bf(p + "shared_head.norm.weight", h),
                                bf(p + "shared_head.head.weight", 64, h)]
    out += [bf("model.norm.weight", h), bf("lm_head.weight", 64, h)]
    return out


def _gpt_oss_like(*, layers: int, experts: int, h: int, inter: int) -> list[TensorSpec]:
    """gpt-oss's layout: attention with biases and sinks, a router, and each layer's experts fused into a few
    large MXFP4 tensors (U8 blocks of 32 FP4 values in 16 bytes, a U8 scale per block) with bf16 biases."""
    bf = lambda name, *shape: TensorSpec(name, "BF16", shape)  # noqa: E731
    out = [bf("model.embed_tokens.weight", 256, h)]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [bf(p + "input_layernorm.weight", h), bf(p + "post_attention_layernorm.weight", h)]
        for proj, rows in (("q_proj", h), ("k_proj", h // 4), ("v_proj", h // 4), ("o_proj", h)):
            out += [bf(p + f"self_attn.{proj}.weight", rows, h), bf(p + f"self_attn.{proj}.bias", rows)]
        out += [bf(p + "self_attn.sinks", 8), bf(p + "mlp.router.weight", experts, h),
                bf(p + "mlp.router.bias", experts)]
        e = p + "mlp.experts."
        out += [TensorSpec(e + "gate_up_proj_blocks", "U8", (experts, 2 * inter, h // 32, 16)),
                TensorSpec(e + "gate_up_proj_scales", "U8", (experts, 2 * inter, h // 32)),
                bf(e + "gate_up_proj_bias", experts, 2 * inter),
                TensorSpec(e + "down_proj_blocks", "U8", (experts, h, inter // 32, 16)),
                TensorSpec(e + "down_proj_scales", "U8", (experts, h, inter // 32)),
                bf(e + "down_proj_bias", experts, h)]
    out += [bf("model.norm.weight", h), bf("lm_head.weight", 256, h)]
    return out


def shape_layout(shape: str, scale: float = 1.0) -> list[TensorSpec]:
    """The tensors of a ``shape`` checkpoint; ``scale`` < 1 shrinks its tensor count about proportionally.

    Full size: ``dense`` 8,157 tensors (a Llama-like stack of 906 layers);
    ``deepseek-v3`` 91,991 (61 layers: 3 dense and 58 of 256 routed experts,
    and the MTP layer; FP8 E4M3 weights with F32 block scales);
    ``deepseek-r1-nvfp4`` about 180k (U8-packed FP4 weights with F8_E4M3
    scales and F32 global scales, bf16 attention); ``kimi-k3`` about 497k (93
    layers of 896 experts with F8_E5M2 weights); ``gpt-oss`` 24 layers of 32
    experts fused into 12 MiB of MXFP4 blocks a layer (few large tensors,
    ~320 MB). Scaling cuts routed experts first (at least two), then layers.
    """
    if not 0 < scale <= 1:
        raise ValueError(f"a tensor-count scale is in (0, 1], not {scale}")

    def moe(layers: int, experts: int, dense: int) -> tuple[int, int]:
        if experts * scale >= 2:
            return layers, max(2, round(experts * scale))
        return max(dense + 1, round(layers * experts * scale / 2)), 2

    if shape == "dense":
        return ModelShape(vocab=64, hidden=32, intermediate=64, layers=max(1, round(906 * scale))).specs()
    if shape == "deepseek-v3":
        layers, experts = moe(61, 256, 3)
        return _deepseek_like(layers=layers, dense_layers=3, experts=experts, mtp=True, attn="F8_E4M3",
                              expert_quant="F8_E4M3", dense_quant="F8_E4M3")
    if shape == "deepseek-r1-nvfp4":
        layers, experts = moe(61, 256, 3)
        return _deepseek_like(layers=layers, dense_layers=3, experts=experts, mtp=False, attn="BF16",
                              expert_quant="NVFP4", dense_quant="NVFP4")
    if shape == "kimi-k3":
        layers, experts = moe(93, 896, 1)
        return _deepseek_like(layers=layers, dense_layers=1, experts=experts, mtp=False, attn="F8_E4M3",
                              expert_quant="F8_E5M2", dense_quant="F8_E4M3")
    if shape == "gpt-oss":
        experts = max(1, round(32 * scale))
        return _gpt_oss_like(layers=24 if scale >= 0.25 else 2, experts=experts, h=512, inter=512)
    raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")


@dataclass
class ShapedCheckpoint:
    """A shaped checkpoint's bytes: every tensor a slice of one buffer, in layout order."""

    specs: list[TensorSpec]
    blob: np.ndarray  # uint8
    starts: np.ndarray  # int64, each tensor's offset in ``blob``; ``starts[-1]`` is its length

    @classmethod
    def random(cls, specs: list[TensorSpec], seed: int = 0) -> "ShapedCheckpoint":
        sizes = np.array([s.nbytes for s in specs], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        blob = np.random.default_rng(seed).integers(0, 256, int(starts[-1]), dtype=np.uint8)
        return cls(specs, blob, starts)

    def step(self, seed: int, share: float = 0.02) -> "ShapedCheckpoint":
        """The next revision: one byte of every non-empty tensor changes, and ``share`` of all bytes."""
        rng = np.random.default_rng(seed)
        blob = self.blob.copy()
        sizes = np.diff(self.starts)
        if share > 0 and blob.size:
            where = rng.integers(0, blob.size, int(blob.size * share))
            blob[where] ^= rng.integers(1, 256, where.size, dtype=np.uint8)
        firsts = self.starts[:-1][sizes > 0] + (rng.random(int((sizes > 0).sum())) * sizes[sizes > 0]).astype(np.int64)
        blob[firsts] = self.blob[firsts] ^ rng.integers(1, 256, firsts.size, dtype=np.uint8)  # never back to r0
        return ShapedCheckpoint(self.specs, blob, self.starts)

    def tensor_bytes(self, i: int) -> bytes:
        return self.blob[self.starts[i]: self.starts[i + 1]].tobytes()

    def write(self, folder: Path, *, shard_tensors: int = 600, shard_bytes: int = 4 << 30) -> Path:
        """HF-style shards of consecutive tensors (at most ``shard_tensors`` tensors or ``shard_bytes`` bytes a
        shard, as real checkpoints group a layer's tensors) with their index and a config.json."""
        from storage.format.safetensors import encode_header

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        groups: list[tuple[int, int]] = []
        first = 0
        for i in range(1, len(self.specs) + 1):
            if i == len(self.specs) or i - first >= shard_tensors or \
                    self.starts[i + 1] - self.starts[first] > shard_bytes:
                groups.append((first, i))
                first = i
        weight_map = {}
        for k, (a, b) in enumerate(groups):
            file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            header, _ = encode_header(((s.name, s.dtype, s.shape, s.nbytes) for s in self.specs[a:b]),
                                      {"format": "pt"})
            with open(folder / file, "wb") as fh:
                fh.write(header)
                fh.write(memoryview(self.blob[self.starts[a]: self.starts[b]]))
            weight_map.update((s.name, file) for s in self.specs[a:b])
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": int(self.starts[-1])},
                                                     "weight_map": weight_map}))
        (folder / "config.json").write_text(json.dumps({"model_type": "synthetic"}))
        return folder
