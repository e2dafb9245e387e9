"""mla on a llama-family model: a GQA Llama whose stacked [W_k; W_v] is factorised by a truncated SVD into
W_up [2*Hkv*D, r] @ W_down [r, d]; the cache keeps the latent c = x W_down^T (pre-RoPE) per token, one
past_latent.{i} [1, T, r] per layer (the `mla` StateLayout). Shape symbols and the latent cache's rules as in
edgekv.models.mla.

Where this differs from the Llama it comes from: K is rebuilt for all T slots from the latent (RoPE needs each slot's
position, so W_UK cannot be absorbed into the query), W_UV is absorbed: out = (sum_t p_t c_t) W_UV^T + b_v. At a rank
that covers [W_k; W_v] the factorisation is exact, and so is the model.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import EdgekvError
from ..strategies import StateLayout
from . import MLA_CONVERTIBLE as CONVERTIBLE_TYPES  # the registry's list (the planner reads it without torch)
from .base import DecoderShell, load_strict
from .layers import MLP as LlamaMLP
from .layers import RMSNorm, rope_cos_sin, rope_inv_freq, rotate_half, slot_plan
from .mla import check_latent_layout


def factorise_kv(wk: torch.Tensor, wv: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Truncated SVD of W = [W_k; W_v] ([2*Hkv*D, d]) in float64 -> (W_down [r, d], W_up [2*Hkv*D, r], relative
    Frobenius error ||W - W_up W_down|| / ||W||). W_up carries the singular values. A rank above min(2*Hkv*D, d)
    is padded with zero columns (the factorisation is already exact there)."""
    w = torch.cat([wk, wv]).double()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    k = min(rank, s.shape[0])
    up, down = u[:, :k] * s[:k], vh[:k]
    if rank > k:
        up = torch.cat([up, up.new_zeros(up.shape[0], rank - k)], dim=1)
        down = torch.cat([down, down.new_zeros(rank - k, down.shape[1])], dim=0)
    err = (torch.linalg.norm(w - up @ down) / torch.linalg.norm(w)).item()
    return down.float(), up.float(), err


class ConvertedAttention(nn.Module):
    """GQA attention whose K and V come from a per-token latent c = x W_down^T [r]. Parameter names: q_proj,
    o_proj as LlamaAttention; kv_down [r, d], kv_up [2*Hkv*D, r] (rows: K heads then V heads), k_bias / v_bias."""

    def __init__(self, a, rank: int):
        super().__init__()
        self.h, self.hkv, self.dh = a.n_heads, a.n_kv_heads, a.head_dim
        kvd = a.n_kv_heads * a.head_dim
        self.q_proj = nn.Linear(a.hidden, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.hidden, bias=a.o_bias)
        self.kv_down = nn.Parameter(torch.zeros(rank, a.hidden))
        self.kv_up = nn.Parameter(torch.zeros(2 * kvd, rank))
        self.k_bias = nn.Parameter(torch.zeros(kvd)) if a.qkv_bias else None
        self.v_bias = nn.Parameter(torch.zeros(kvd)) if a.qkv_bias else None

    def forward(self, x, cos, sin, cos_t, sin_t, write, written, allowed, cache):
        """x [1, C, d]; cos, sin [C, D] (the queries' positions); cos_t, sin_t [T, D] (every slot's position);
        write [T, C]; written [T, 1]; allowed [G*C, T]; cache [1, T, r] -> out [1, C, d], new cache."""
        c, t_slots, kvd = x.shape[1], cache.shape[1], self.hkv * self.dh
        q = self.q_proj(x).view(1, c, self.h, self.dh).transpose(1, 2)  # [1, H, C, D]
        q = q * cos + rotate_half(q) * sin
        cache = torch.where(written, (write @ (x @ self.kv_down.t())).to(cache.dtype), cache)  # [1, T, r]
        lat = cache.float()
        k = lat @ self.kv_up[:kvd].t()  # [1, T, Hkv*D], pre-RoPE keys for every slot
        if self.k_bias is not None:
            k = k + self.k_bias
        k = k.view(1, t_slots, self.hkv, self.dh).transpose(1, 2)  # [1, Hkv, T, D]
        k = k * cos_t + rotate_half(k) * sin_t
        g = self.h // self.hkv
        qg = q.reshape(1, self.hkv, g * c, self.dh)
        scores = (qg @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.dh))  # [1, Hkv, G*C, T]
        p = torch.softmax(torch.where(allowed, scores, float("-inf")), dim=-1)
        o_lat = p @ lat[:, None]  # [1, Hkv, G*C, r]
        w_v = self.kv_up[kvd:].view(self.hkv, self.dh, -1)  # [Hkv, D, r]
        out = torch.einsum("bkcr,kdr->bkcd", o_lat, w_v)  # [1, Hkv, G*C, D]
        if self.v_bias is not None:  # softmax rows sum to 1, so the bias passes through unchanged
            out = out + self.v_bias.view(1, self.hkv, 1, self.dh)
        out = out.reshape(1, self.h, c, self.dh).transpose(1, 2).reshape(1, c, self.h * self.dh)
        return self.o_proj(out), cache


class _ConvertedBlock(nn.Module):
    def __init__(self, a, rank: int):
        super().__init__()
        self.self_attn = ConvertedAttention(a, rank)
        self.mlp = LlamaMLP(a)
        self.input_layernorm = RMSNorm(a.hidden, a.rms_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.rms_eps)


class ConvertedMLA(DecoderShell):
    """A Llama-family model (LlamaArgs) with a converted-MLA cache: forward(tokens [1, C], pos [1], *state) ->
    (logits [1, C, V], *new_state); state is one past_latent.{i} [1, T, r] per layer. `errors` holds the
    per-layer relative factorisation error (filled by the loader)."""

    def __init__(self, args, layout: StateLayout, rank: int):
        super().__init__(args, layout)
        self.rank = rank
        check_latent_layout(layout, args.n_layers, rank)
        self.make_body([_ConvertedBlock(args, rank) for _ in range(args.n_layers)], RMSNorm(args.hidden, args.rms_eps))
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.errors: list[float] = []

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        c, t_slots = tokens.shape[1], self.layout.ctx
        g = self.args.n_heads // self.args.n_kv_heads
        positions, write, written, allowed = slot_plan(pos, c, t_slots, repeat=g)
        slots = torch.arange(t_slots, dtype=torch.int64, device=pos.device)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        cos_t, sin_t = rope_cos_sin(slots, self.inv_freq)
        x = self.model.embed_tokens(tokens)
        new_state = []
        for i, blk in enumerate(self.model.layers):
            h, lat = blk.self_attn(blk.input_layernorm(x), cos, sin, cos_t, sin_t, write, written, allowed, state[i])
            x = x + h
            x = x + blk.mlp(blk.post_attention_layernorm(x))
            new_state.append(lat)
        return (self.logits(x, rows), *new_state)


def convert_state_dict(sd: dict, n_layers: int, rank: int) -> tuple[dict, list[float]]:
    """A Llama state dict -> the converted model's, and the per-layer relative factorisation errors."""
    out, errors = dict(sd), []
    for i in range(n_layers):
        p = f"model.layers.{i}.self_attn"
        down, up, err = factorise_kv(out.pop(f"{p}.k_proj.weight"), out.pop(f"{p}.v_proj.weight"), rank)
        out[f"{p}.kv_down"], out[f"{p}.kv_up"] = down, up
        for t in ("k", "v"):
            if f"{p}.{t}_proj.bias" in out:
                out[f"{p}.{t}_bias"] = out.pop(f"{p}.{t}_proj.bias")
        errors.append(err)
    return out, errors


def factorisation_errors(spec: str, rank: int) -> list[float]:
    """Per layer ||W - W_up W_down||_F / ||W||_F for W = [W_k; W_v] of a llama-family model at rank r."""
    from . import read_llama

    src = read_llama(spec)
    return [factorise_kv(src.sd[f"model.layers.{i}.self_attn.k_proj.weight"],
                         src.sd[f"model.layers.{i}.self_attn.v_proj.weight"], rank)[2]
            for i in range(src.args.n_layers)]


def build_converted(src, layout: StateLayout) -> "ConvertedMLA":
    """The family registry's builder for mla on a llama-family model (edgekv.models.FAMILIES): K/V factorised at
    the layout's rank. module.errors: per-layer factorisation error."""
    from ..strategies import mla_rank, parse_strategy

    if src.args.model_type not in CONVERTIBLE_TYPES:
        raise EdgekvError(f"mla (converted) supports {', '.join(CONVERTIBLE_TYPES)}, not {src.args.model_type} "
                          "(its attention has parts the converted module does not implement)")
    rank = mla_rank(src.arch, parse_strategy(layout.strategy))
    module = ConvertedMLA(src.args, layout, rank)
    sd, errors = convert_state_dict(src.sd, src.args.n_layers, rank)
    module = load_strict(module, sd, src.path, f"converted-MLA {src.args.model_type}")
    module.errors = errors
    return module


def load_converted_mla(spec: str, strategy, max_ctx: int):
    """A llama-family model (HF folder, GGUF or packaged name) -> Loaded with a ConvertedMLA module at the strategy's
    rank (mla:rank=r or mla:ratio=x; default Hkv*D, half the KV). module.errors: per-layer factorisation error."""
    from . import load_family
    return load_family("converted-mla", spec, strategy, max_ctx)
