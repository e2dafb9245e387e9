"""StateLayout: the list of state tensors one decode step reads and writes (name, shape at a given ctx, dtype),
including the scale/zero tensors of quantized caches, and the builders of one layer's tensors.

Shape symbols: T = tokens kept (ctx, or min(ctx, window)), Hkv = KV heads, D = head dim, G = quantization group,
r = MLA latent rank, R = decoupled RoPE dim, Di = SSM inner width, N = SSM state size, K = conv kernel.

Names follow ONNX Runtime GenAI / transformers.js: past_key_values.{i}.key -> present.{i}.key, past_latent.{i},
past_ssm.{i}, past_conv.{i}, past_recurrent.{i}; quantized tensors add .scale (and .zero). {i} is the block index.
"""
from __future__ import annotations

import functools

import math
from dataclasses import dataclass

from ..arch import SSM, Linear, ShortConv
from .storage import DTYPE_BYTES, KV_DTYPES, per_token_int8  # noqa: F401 (per_token_int8: re-exported)


@dataclass(frozen=True)
class StateTensor:
    name: str  # the program input, e.g. past_key_values.3.key
    output: str  # the program output, e.g. present.3.key
    shape: tuple[int, ...]
    dtype: str
    layer: int
    role: str  # key | value | latent | ssm | conv | recurrent, with .scale / .zero for quantization parameters
    packed_bits: int | None = None  # int4/int2 codes packed into uint8 along the last axis

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape) * DTYPE_BYTES[self.dtype])

    def to_json(self) -> dict:
        d = {"input": self.name, "output": self.output, "shape": list(self.shape), "dtype": self.dtype,
             "layer": self.layer, "role": self.role, "bytes": self.nbytes}
        if self.packed_bits:
            d["packed_bits"] = self.packed_bits
        return d


@dataclass(frozen=True)
class StateLayout:
    strategy: str
    ctx: int
    tensors: tuple[StateTensor, ...]

    @functools.cached_property  # frozen: the sum never changes, and a plan reads it several times per row
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def bytes_by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.role] = out.get(t.role, 0) + t.nbytes
        return out

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "ctx": self.ctx, "bytes": self.nbytes,
                "tensors": [t.to_json() for t in self.tensors]}


def _short_conv_state(i: int, m: ShortConv) -> list[StateTensor]:
    """LFM2's short conv: its last K - 1 inputs, fp32 as a Mamba conv state."""
    return [StateTensor(f"past_conv.{i}", f"present_conv.{i}", (1, m.width, m.d_conv - 1), "float32", i, "conv")]


def _kv_pair(i: int, hkv: int, t: int, d: int, strategy) -> list[StateTensor]:
    """K and V for one attention layer: each the parts its storage declares (strategy.kv_storage: plain values, or
    codes plus per-group scale and zero), [1, Hkv, T, width]."""
    storage = strategy.kv_storage
    storage.check(strategy.label, d)
    out = []
    for role, (inp, outp) in (("key", (f"past_key_values.{i}.key", f"present.{i}.key")),
                              ("value", (f"past_key_values.{i}.value", f"present.{i}.value"))):
        out += [StateTensor(inp + p.suffix, outp + p.suffix, (1, hkv, t, p.width(d)), p.dtype, i, role + p.suffix,
                            packed_bits=p.packed_bits) for p in storage.parts(d)]
    return out


def _ssm_pair(i: int, m: SSM, dtype: str) -> list[StateTensor]:
    state_shape = (1, m.d_inner, m.d_state) if m.version == 1 else (1, m.n_heads, m.head_dim, m.d_state)
    dt = "int8" if dtype == "int8" else KV_DTYPES[dtype]
    out = [StateTensor(f"past_conv.{i}", f"present_conv.{i}", (1, m.conv_dim, m.d_conv - 1), "float32", i, "conv"),
           StateTensor(f"past_ssm.{i}", f"present_ssm.{i}", state_shape, dt, i, "ssm")]
    if dtype == "int8":  # per (channel|head, dim) scales, as vLLM PR #52962 does for SSM state
        out.append(StateTensor(f"past_ssm.{i}.scale", f"present_ssm.{i}.scale", state_shape[:-1] + (1,), "float32",
                               i, "ssm.scale"))
    return out


def _linear_state(i: int, m: Linear, dtype: str) -> list[StateTensor]:
    """One block's recurrent state. Linear attention: [1, H, Dk, Dv] in the strategy's dtype, after the conv state
    [1, conv_dim, K - 1] fp32 of a layer with a causal conv (Gated DeltaNet).

    RWKV-4 (n_vectors rows of width d, rows: ffn shift, att shift, num, den, max) is fp32 unless dtype is int8 (the
    module has no fp16/bf16 path, so those stay fp32). int8 splits the rows:
      past_recurrent.{i}        [1, 4, d] int8   ffn shift, att shift, num, den (symmetric codes, edgekv.quant)
      past_recurrent.{i}.scale  [1, 4, 1] fp32   one scale per row (fp32 as the int8 SSM state's scales)
      past_recurrent.{i}.max    [1, 1, d] fp32   the WKV exponent offset, kept exact
    The shifts are last-token LayerNorm outputs and num/den are decayed sums with den >= 1: bounded rows that a
    per-row scale covers. max is a log-domain offset: an absolute error e in it scales the whole history's num and
    den by exp(e) against the new token, and its range is that of the keys, not of anything a per-row grid fits;
    it is 1/5 of the state, so it stays fp32 (the edgekv.models.recurrent docstring says more)."""
    if not m.n_vectors:
        dt = "int8" if dtype == "int8" else KV_DTYPES[dtype]
        # a Gated DeltaNet layer (Qwen3.5) also keeps its conv's last K - 1 inputs, fp32 as an SSM's conv state
        conv = [StateTensor(f"past_conv.{i}", f"present_conv.{i}", (1, m.conv_dim, m.d_conv - 1), "float32", i,
                            "conv")] if m.d_conv else []
        return conv + [StateTensor(f"past_recurrent.{i}", f"present_recurrent.{i}", (1, m.n_heads, m.d_k, m.d_v),
                                   dt, i, "recurrent")]
    if dtype != "int8":  # RWKV-4's exp sums in fp32
        return [StateTensor(f"past_recurrent.{i}", f"present_recurrent.{i}", (1, m.n_vectors, m.width), "float32", i,
                            "recurrent")]
    rows = m.n_vectors - 1  # every row but max
    return [StateTensor(f"past_recurrent.{i}", f"present_recurrent.{i}", (1, rows, m.width), "int8", i, "recurrent"),
            StateTensor(f"past_recurrent.{i}.scale", f"present_recurrent.{i}.scale", (1, rows, 1), "float32", i,
                        "recurrent.scale"),
            StateTensor(f"past_recurrent.{i}.max", f"present_recurrent.{i}.max", (1, 1, m.width), "float32", i,
                        "recurrent.max")]
