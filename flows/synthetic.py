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
