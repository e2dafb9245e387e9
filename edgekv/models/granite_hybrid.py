"""Granite-4.0-H decode step (IBM's Mamba-2 + attention hybrids), written for export: forward(tokens, pos, *state)
-> (logits, *state).

Mirrors transformers' GraniteMoeHybridForCausalLM (models/granitemoehybrid/modeling_granitemoehybrid.py) for the
dense configs (num_local_experts 0: granite-4.0-h-350m, granite-4.0-h-1b). Each layer is either
  - a Mamba-2 mixer (GraniteMoeHybridMambaLayer: in_proj -> z, xBC, dt; causal conv over xBC; SSD recurrence per
    head; gated RMSNorm per group; out_proj), or
  - GQA attention (GraniteMoeHybridAttention): scores scaled by attention_multiplier (not D^-1/2), RoPE only when
    position_embedding_type is "rope" (the published Granite-4.0-H configs: none, i.e. NoPE);
each followed by the shared SwiGLU MLP (input_linear -> [gate | up], output_linear). Granite's multipliers: the
embeddings times embedding_multiplier, every residual branch times residual_multiplier, the logits divided by
logits_scaling. Which layer is which: layer_types, read by the planner's reader (edgekv.arch._granite_hybrid).

Shape symbols:
  C   tokens in this call        T  KV cache slots (the StateLayout's ctx)     d  hidden size     V  vocabulary
  H, Hkv, D     query heads, KV heads, head dim (d / H)
  Hm, P, N, Gm  Mamba heads, Mamba head dim, state size, groups   Dc = Hm * P + 2 * Gm * N   K  conv kernel

State: exactly the planner's StateLayout (edgekv.strategies.build_layout), in layer order:
  mamba layer i       past_conv.{i} [1, Dc, K-1] fp32, past_ssm.{i} [1, Hm, P, N] (hybrid: state_dtype; fp32 under
                      kv-int8/int4/int2)
  attention layer i   past_key_values.{i}.key / .value [1, Hkv, T, D] (hybrid: dtype; kv-int8/int4/int2: codes +
                      .scale (+ .zero))
Only the attention layers' state grows with the context.

Where this differs from transformers, and why the numbers are the same: the Mamba layers are
edgekv.models.ssm.Mamba2Mixer (mamba.py's notes apply: the conv as shifted multiply-adds, the SSD recurrence stepped
token by token where transformers' prefill runs the chunked form) and the attention layers edgekv.models.llama.Attention
over a fixed cache (one-hot writes, a position mask; NoPE layers pass no rotation), both loaded under transformers' own
parameter names; the shared MLP's stacked input_linear is split into its two halves by a view, not copied.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import Cfg
from ..arch import model_types
from ..errors import EdgekvError
from ..strategies import StateLayout
from .base import DecoderShell
from .layers import RMSNorm, rope_cos_sin, rope_inv_freq
from .attention import Attention
from .cache import cache_plan, hybrid_kv_format
from .llama import LlamaArgs, attention_args
from .ssm import Mamba2Mixer, MambaArgs, check_ssm_layout


@dataclass
class GraniteHybridArgs:
    vocab: int
    hidden: int
    n_layers: int
    kinds: list  # "mamba" | "attention" per layer
    n_heads: int
    n_kv_heads: int
    shared_intermediate: int
    m_heads: int
    m_head_dim: int
    m_groups: int
    d_state: int
    d_conv: int
    eps: float = 1e-6
    conv_bias: bool = True
    proj_bias: bool = False
    attention_bias: bool = False
    dt_limit: tuple = (0.0, math.inf)
    rope: bool = False  # position_embedding_type == "rope"
    rope_theta: float = 10000.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    tied: bool = False
    max_position: int | None = None
    model_type: str = "granitemoehybrid"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def attention_args(self) -> LlamaArgs:
        """The numbers edgekv.models.llama's Attention takes: attention_multiplier as the scale, one RoPE base."""
        return attention_args(self, intermediate=self.shared_intermediate, attn_scale=self.attention_multiplier)

    def ssm_args(self) -> MambaArgs:
        return MambaArgs(2, self.vocab, self.hidden, self.n_layers, self.m_heads * self.m_head_dim, self.d_state,
                         self.d_conv, n_heads=self.m_heads, head_dim=self.m_head_dim, n_groups=self.m_groups)

    def to_json(self) -> dict:
        return asdict(self)


def granite_args(cfg: dict, arch, where: str = "config.json") -> GraniteHybridArgs:
    """GraniteMoeHybridConfig's fields and defaults; the layer kinds and Mamba shapes as the planner's reader read
    them. MoE configs (num_local_experts > 0) are refused in one line: this module runs the dense configs."""
    if cfg.get("model_type") != model_types.GraniteMoeHybrid.model_type:
        raise EdgekvError(f"{where}: model_type {cfg.get('model_type')!r} is not "
                          f"{model_types.GraniteMoeHybrid.model_type}")
    c = Cfg(cfg, where)
    if c.int("num_local_experts", default=8) > 0:
        raise EdgekvError(f"{where}: num_local_experts {cfg.get('num_local_experts', 8)}: the granite export module "
                          "runs the dense Granite-4.0-H configs (num_local_experts 0: h-350m, h-1b), not MoE ones")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise EdgekvError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    use_rope = cfg.get("position_embedding_type") == "rope"
    if use_rope and rope.get("rope_type", rope.get("type", "default")) != "default":
        raise EdgekvError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
    kinds = [m.kind for b in arch.blocks for m in b.mixers]
    kinds = ["mamba" if k == "ssm" else "attention" for k in kinds]
    attn = next((m for b in arch.blocks for m in b.mixers if m.kind == "attention"), None)
    ssm = next((m for b in arch.blocks for m in b.mixers if m.kind == "ssm"), None)
    heads = c.int("num_attention_heads")
    if ssm is None:
        raise EdgekvError(f"{where}: no Mamba layer: not a hybrid")
    return GraniteHybridArgs(
        vocab=arch.vocab, hidden=arch.hidden, n_layers=arch.n_layers, kinds=kinds, n_heads=heads,
        n_kv_heads=attn.n_kv_heads if attn else heads, shared_intermediate=c.int("shared_intermediate_size",
                                                                                 default=1024),
        m_heads=ssm.n_heads, m_head_dim=ssm.head_dim, m_groups=ssm.n_groups, d_state=ssm.d_state, d_conv=ssm.d_conv,
        eps=float(cfg.get("rms_norm_eps", 1e-6)), conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)), attention_bias=bool(cfg.get("attention_bias", False)),
        dt_limit=tuple(float(v) for v in (cfg.get("time_step_limit") or (0.0, math.inf))), rope=use_rope,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)), tied=bool(cfg.get("tie_word_embeddings", False)),
        max_position=cfg.get("max_position_embeddings"))


class SharedMLP(nn.Module):
    """GraniteMoeHybridMLP: output_linear(silu(gate) * up) with [gate | up] = input_linear(x)."""

    def __init__(self, d: int, inter: int):
        super().__init__()
        self.inter = inter
        self.input_linear = nn.Linear(d, 2 * inter, bias=False)
        self.output_linear = nn.Linear(inter, d, bias=False)

    def forward(self, x):
        gate, up = self.input_linear(x).split(self.inter, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class GraniteLayer(nn.Module):
    def __init__(self, a: GraniteHybridArgs, i: int):
        super().__init__()
        self.kind = a.kinds[i]
        if self.kind == "mamba":
            self.mamba = Mamba2Mixer(a.hidden, a.m_heads, a.m_head_dim, a.m_groups, a.d_state, a.d_conv, a.eps,
                                     a.conv_bias, a.proj_bias, a.dt_limit)
        else:
            self.self_attn = Attention(a.attention_args())
        self.shared_mlp = SharedMLP(a.hidden, a.shared_intermediate)
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.eps)



class GraniteHybrid(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state); state in the
    layout's order (module docstring). Callers keep pos + C <= T."""

    def __init__(self, args: GraniteHybridArgs, layout: StateLayout):
        super().__init__(args, layout)
        attn = [i for i, k in enumerate(args.kinds) if k == "attention"]
        mamba = [i for i, k in enumerate(args.kinds) if k == "mamba"]
        self.kv = hybrid_kv_format(layout, attn, args.n_kv_heads, args.head_dim, {i: ("conv", "ssm") for i in mamba})
        check_ssm_layout(args.ssm_args(), layout, mamba)
        self.make_body([GraniteLayer(args, i) for i in range(args.n_layers)], RMSNorm(args.hidden, args.eps))
        self.register_buffer("inv_freq", rope_inv_freq(args.attention_args()), persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        a, c = self.args, tokens.shape[1]
        positions, write, keep, mask = cache_plan(pos, c, self.layout.ctx, a.n_heads // a.n_kv_heads,
                                                  self.kv.dtype or torch.float32)
        cos = sin = None  # NoPE
        if a.rope:
            cos, sin = rope_cos_sin(positions, self.inv_freq)
            cos, sin = cos[:, None, :], sin[:, None, :]  # [C, 1, D]
        x = self.model.embed_tokens(tokens) * a.embedding_multiplier
        n, s, new_state = self.kv.n, 0, []
        for blk in self.model.layers:
            h = blk.input_layernorm(x)
            if blk.kind == "mamba":
                h, conv, ssm = blk.mamba(h, state[s], state[s + 1])
                new_state += [conv, ssm]
                s += 2
            else:
                h, k, v = blk.self_attn(h, cos, sin, write, keep, mask, state[s:s + n], state[s + n:s + 2 * n], self.kv)
                new_state += [*k, *v]
                s += 2 * n
            x = x + h * a.residual_multiplier
            x = x + blk.shared_mlp(blk.post_attention_layernorm(x)) * a.residual_multiplier
        return (self.logits(x, rows) / a.logits_scaling, *new_state)


def read_granite_hybrid(spec: str, max_ctx: int):
    """An HF folder of a granitemoehybrid model -> Source (edgekv.models.FAMILIES)."""
    from .base import read_source
    return read_source(spec, max_ctx, granite_args)


def build_granite_hybrid(src, layout: StateLayout) -> GraniteHybrid:
    from .base import load_strict
    return load_strict(GraniteHybrid(src.args, layout), src.sd, src.path, "granitemoehybrid")
