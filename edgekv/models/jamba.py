"""Hybrid attention + Mamba decode step (Jamba), written for export: forward(tokens, pos, *state) -> (logits, *state).

Mirrors transformers' JambaForCausalLM (modeling_jamba.py): blocks are either attention (GQA, NO positional
encoding: Jamba relies on its Mamba layers for order) or Mamba-1 with RMSNorms on dt, B and C; each block then runs a
SwiGLU MLP or a sparse MoE (every expert_layer_period-th block from expert_layer_offset; top-k of the router's
softmax, weights not renormalised). Which block is which comes from attn_layer_period / attn_layer_offset.

Shape symbols:
  C   tokens in this call (chunked prefill: C > 1; decode: C = 1)
  T   KV cache slots (the StateLayout's ctx)          d  hidden size       V  vocabulary
  H, Hkv, D, G   query heads, KV heads, head dim, H / Hkv
  Di, N, K       Mamba inner width, state size, conv kernel

State: exactly the `hybrid` StateLayout (edgekv.strategies.build_layout), in block order:
  attention block i   past_key_values.{i}.key, past_key_values.{i}.value  [1, Hkv, T, D]  (strategy dtype)
  mamba block i       past_conv.{i} [1, Di, K-1] fp32, past_ssm.{i} [1, Di, N] (state_dtype)
Only the attention blocks' state grows with the context.

Where this differs from transformers, and why the numbers are the same:
  - the Mamba blocks are edgekv.models.ssm.Mamba1Mixer (mamba.py's notes apply: conv as shifted multiply-adds, the scan
    stepped token by token); the attention blocks keep a fixed [1, Hkv, T, D] cache written with a one-hot matrix
    and torch.where and masked by position (edgekv.models.layers.slot_plan);
  - the sparse MoE is edgekv.models.layers.MoE (gather the top-k experts at decode, dense-weighted at prefill); its
    router weight is loaded from feed_forward.router.weight into feed_forward.gate.weight, and the per-expert
    checkpoint tensors are stacked.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..arch import Cfg
from ..arch import model_types
from ..errors import EdgekvError
from ..strategies import StateLayout
from .base import DecoderShell, load_strict, read_source, state_dtype
from .layers import MoE, RMSNorm, SwiGLU, slot_plan, stack_experts
from .ssm import Mamba1Mixer, MambaArgs, check_ssm_layout


@dataclass
class JambaArgs:
    vocab: int
    hidden: int
    n_layers: int
    kinds: list  # "attention" | "mamba" per block
    n_experts_per_block: list  # 1 = plain MLP
    n_heads: int
    n_kv_heads: int
    intermediate: int
    top_k: int
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool = True
    proj_bias: bool = False
    rms_eps: float = 1e-6
    tied: bool = False
    model_type: str = "jamba"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def to_json(self) -> dict:
        return asdict(self)


def jamba_args(cfg: dict, where: str = "config.json") -> JambaArgs:
    """JambaConfig's fields and defaults (layers_block_type and layers_num_experts are derived, as there)."""
    if cfg.get("model_type") != model_types.Jamba.model_type:
        raise EdgekvError(f"{where}: model_type {cfg.get('model_type')!r} is not {model_types.Jamba.model_type}")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise EdgekvError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    need = Cfg(cfg, where).int  # a required non-negative integer, one line naming it if missing
    hidden, n = need("hidden_size"), need("num_hidden_layers")
    period, off = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
    kinds = cfg.get("layers_block_type") or ["attention" if i % period == off else "mamba" for i in range(n)]
    e_period, e_off = int(cfg.get("expert_layer_period", 2)), int(cfg.get("expert_layer_offset", 1))
    n_exp = int(cfg.get("num_experts", 16))
    heads = need("num_attention_heads")
    rank = cfg.get("mamba_dt_rank", "auto")
    return JambaArgs(
        vocab=need("vocab_size"), hidden=hidden, n_layers=n, kinds=list(kinds),
        n_experts_per_block=[n_exp if i % e_period == e_off else 1 for i in range(n)], n_heads=heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or heads), intermediate=need("intermediate_size"),
        top_k=int(cfg.get("num_experts_per_tok", 2)), d_inner=int(cfg.get("mamba_expand", 2) * hidden),
        d_state=int(cfg.get("mamba_d_state", 16)), d_conv=int(cfg.get("mamba_d_conv", 4)),
        dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)), proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), tied=bool(cfg.get("tie_word_embeddings", False)))


class NoPEAttention(nn.Module):
    """GQA attention without positional encoding over a fixed KV cache. Parameter names as JambaAttention."""

    def __init__(self, a: JambaArgs):
        super().__init__()
        self.h, self.hkv, self.dh = a.n_heads, a.n_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden, a.n_heads * self.dh, bias=False)
        self.k_proj = nn.Linear(a.hidden, a.n_kv_heads * self.dh, bias=False)
        self.v_proj = nn.Linear(a.hidden, a.n_kv_heads * self.dh, bias=False)
        self.o_proj = nn.Linear(a.n_heads * self.dh, a.hidden, bias=False)

    def forward(self, x, write, written, allowed, k_cache, v_cache):
        """x [1, C, d]; write [T, C]; written [T, 1]; allowed [G*C, T]; k_cache, v_cache [1, Hkv, T, D]
        -> out [1, C, d], k_cache, v_cache."""
        c = x.shape[1]
        q = self.q_proj(x).view(1, c, self.h, self.dh).transpose(1, 2)  # [1, H, C, D]
        k = self.k_proj(x).view(1, c, self.hkv, self.dh).transpose(1, 2)  # [1, Hkv, C, D]
        v = self.v_proj(x).view(1, c, self.hkv, self.dh).transpose(1, 2)
        k_cache = torch.where(written, (write @ k).to(k_cache.dtype), k_cache)
        v_cache = torch.where(written, (write @ v).to(v_cache.dtype), v_cache)
        g = self.h // self.hkv
        qg = q.reshape(1, self.hkv, g * c, self.dh)  # query head kv*G + g -> row g*C + c of KV head kv
        scores = (qg @ k_cache.float().transpose(-1, -2)) * (1.0 / math.sqrt(self.dh))
        out = torch.softmax(torch.where(allowed, scores, float("-inf")), dim=-1) @ v_cache.float()
        out = out.reshape(1, self.h, c, self.dh).transpose(1, 2).reshape(1, c, self.h * self.dh)
        return self.o_proj(out), k_cache, v_cache


class JambaBlock(nn.Module):
    def __init__(self, a: JambaArgs, i: int):
        super().__init__()
        self.kind = a.kinds[i]
        if self.kind == "attention":
            self.self_attn = NoPEAttention(a)
        else:
            self.mamba = Mamba1Mixer(a.hidden, a.d_inner, a.d_state, a.d_conv, a.dt_rank, a.conv_bias, a.proj_bias,
                                     bcdt_norm_eps=a.rms_eps)
        n_exp = a.n_experts_per_block[i]
        self.feed_forward = MoE(a.hidden, a.intermediate, n_exp, a.top_k) if n_exp > 1 else \
            SwiGLU(a.hidden, a.intermediate)
        self.input_layernorm = RMSNorm(a.hidden, a.rms_eps)
        self.pre_ff_layernorm = RMSNorm(a.hidden, a.rms_eps)


def check_hybrid_layout(a: JambaArgs, layout: StateLayout) -> None:
    """The layout must hold, in block order, (key, value) for attention blocks and (conv, ssm) for mamba blocks."""
    want = [(i, r) for i, k in enumerate(a.kinds) for r in (("key", "value") if k == "attention" else ("conv", "ssm"))]
    if [(t.layer, t.role) for t in layout.tensors] != want:
        raise EdgekvError(f"strategy {layout.strategy}: the jamba module keeps plain (key, value) / (conv, ssm) "
                          f"state (roles {sorted({t.role for t in layout.tensors})})")
    ssm_args = MambaArgs(1, a.vocab, a.hidden, a.n_layers, a.d_inner, a.d_state, a.d_conv)
    check_ssm_layout(ssm_args, layout, [i for i, k in enumerate(a.kinds) if k == "mamba"])
    for t in layout.tensors:
        state_dtype(layout, t)
        if t.role in ("key", "value") and t.shape != (1, a.n_kv_heads, layout.ctx, a.head_dim):
            raise EdgekvError(f"{t.name}: shape {t.shape} is not [1, {a.n_kv_heads}, {layout.ctx}, {a.head_dim}]")


class Jamba(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state); state in the
    layout's order (2 tensors per block). Callers keep pos + C <= T."""

    def __init__(self, args: JambaArgs, layout: StateLayout):
        super().__init__(args, layout)
        check_hybrid_layout(args, layout)
        self.make_body([JambaBlock(args, i) for i in range(args.n_layers)], RMSNorm(args.hidden, args.rms_eps),
                       names=("embed_tokens", "layers", "final_layernorm"))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        c = tokens.shape[1]
        g = self.args.n_heads // self.args.n_kv_heads
        _, write, written, allowed = slot_plan(pos, c, self.layout.ctx, repeat=g)
        x = self.model.embed_tokens(tokens)
        new_state = []
        for i, blk in enumerate(self.model.layers):
            s0, s1 = state[2 * i], state[2 * i + 1]
            h = blk.input_layernorm(x)
            if blk.kind == "attention":
                h, s0, s1 = blk.self_attn(h, write, written, allowed, s0, s1)
            else:
                h, s0, s1 = blk.mamba(h, s0, s1)
            x = x + h
            x = x + blk.feed_forward(blk.pre_ff_layernorm(x))
            new_state += [s0, s1]
        return (self.logits(x, rows), *new_state)


def read_jamba(spec: str, max_ctx: int):
    """An HF folder of a jamba model -> Source (edgekv.models.FAMILIES), experts stacked as the module keeps them."""
    return read_source(spec, max_ctx, lambda cfg, arch, where: jamba_args(cfg, where), _stack_jamba_experts)


def _stack_jamba_experts(sd: dict, args: "JambaArgs") -> dict:
    for i, n_exp in enumerate(args.n_experts_per_block):
        if n_exp > 1:
            p = f"model.layers.{i}.feed_forward"
            sd.update(stack_experts(sd, f"{p}.experts", n_exp))
            if f"{p}.router.weight" in sd:
                sd[f"{p}.gate.weight"] = sd.pop(f"{p}.router.weight")
    return sd


def build_jamba(src, layout: StateLayout) -> "Jamba":
    return load_strict(Jamba(src.args, layout), src.sd, src.path, "jamba")


def load_jamba(spec: str, strategy, max_ctx: int):
    """An HF folder of a jamba model -> Loaded. strategy: hybrid (dtype fp32/fp16 for KV, state_dtype for SSM)."""
    from . import load_family
    return load_family("jamba", spec, strategy, max_ctx)
