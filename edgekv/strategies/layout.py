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

DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "float8_e4m3fn": 1.0, "int8": 1.0, "uint8": 1.0}
KV_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}


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


def per_token_int8(bits: int | None, group: int | None, head_dim: int) -> bool:
    """Whether a cache is int8 with one scale per token and head (group 0 or head_dim): the cache a fused .pte
    reads back with ExecuTorch's one quantized kernel (edgekv.models.swaps.SdpaAttention), and that the planner
    counts as such (edgekv.memory._readback_source). One rule for both."""
    return bits == 8 and group in (0, head_dim)


def _kv_pair(i: int, hkv: int, t: int, d: int, strategy) -> list[StateTensor]:
    """K and V for one attention layer: plain dtype, or quantized codes plus per-group scale (and zero)."""
    from .base import ParamsDoNotFit

    out = []
    for role, (inp, outp) in (("key", (f"past_key_values.{i}.key", f"present.{i}.key")),
                              ("value", (f"past_key_values.{i}.value", f"present.{i}.value"))):
        bits = strategy.kv_bits
        if bits is None:
            out.append(StateTensor(inp, outp, (1, hkv, t, d), KV_DTYPES[strategy.params["dtype"]], i, role))
            continue
        g = strategy.params.get("group") or d
        if d % g:
            raise ParamsDoNotFit(f"{strategy.label}: head_dim {d} is not a multiple of group {g}")
        if bits == 8:
            out.append(StateTensor(inp, outp, (1, hkv, t, d), "int8", i, role))
            if strategy.static_scales:  # the scales are the graph's constants, not state
                continue
        else:
            per_byte = 8 // bits
            out.append(StateTensor(inp, outp, (1, hkv, t, d // per_byte), "uint8", i, role, packed_bits=bits))
        out.append(StateTensor(inp + ".scale", outp + ".scale", (1, hkv, t, d // g), "float16", i, role + ".scale"))
        if bits < 8:  # asymmetric below 8 bits: a zero point per group as well
            out.append(StateTensor(inp + ".zero", outp + ".zero", (1, hkv, t, d // g), "float16", i, role + ".zero"))
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
