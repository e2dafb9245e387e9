"""Phi-3 / Phi-3.5 / Phi-4-mini (transformers' Phi3ForCausalLM) as a llama-family model: a checkpoint and config
rewritten at load time so that edgekv.models.llama's module computes the same function.

Phi3ForCausalLM (modeling_phi3.py) is a Llama decoder with three differences, each mapped onto what the llama module
already has:
  - fused projections: self_attn.qkv_proj [(H + 2 Hkv) D, d] holds q, k and v stacked (in that order), mlp.gate_up_proj
    [2F, d] holds gate then up (Phi3MLP: gate, up = chunk(2)); they are split into q/k/v_proj and gate/up_proj.
  - partial rotary (partial_rotary_factor, Phi-4-mini 0.75): only the first R = D * factor channels of each head
    rotate, as rotate_half over those R (pairs j, j + R/2). The llama module rotates all D channels in pairs
    (j, j + D/2). Permuting each q and k head's channels (rows of q_proj / k_proj) so that channel j < R/2 lands at j
    and channel R/2 + j at D/2 + j, with the D - R pass-through channels in the slots left over, and giving those
    slots frequency 0 (cos 1, sin 0: unrotated), is the same attention: q.k is unchanged when both are permuted
    alike, and the values (unpermuted) are what the output mixes. The frequencies travel as the llama module's
    per-frequency factors (LlamaArgs.rope_freq_factors: inv_freq_j / factor_j; factor inf gives 0).
  - longrope ("su" / "longrope" rope_scaling, _compute_longrope_parameters in transformers' modeling_rope_utils.py):
    inv_freq_j = 1 / (ext_j * theta^(2j/R)) with ext = short_factor, or long_factor when the context exceeds
    original_max_position_embeddings (transformers switches per forward call by the longest position seen; an export
    has one context, max_ctx, so it picks by max_ctx: short at or below the original context, long above it), and
    cos/sin scaled by attention_factor (default sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings /
    original_max_position_embeddings; 1 when s <= 1). Rotation is linear, so the scale is folded into the rotated rows
    of q_proj and k_proj.
Phi-3's sliding_window (every layer; Phi-3-mini-4k 2047, Phi-4-mini 262144) is the llama module's native window, read
by edgekv.arch.layer_windows as for Mistral.

Shapes: H, Hkv query / KV heads, D head dim (hidden / H: Phi3Config has no head_dim), R rotated channels,
F MLP width, d hidden size.
"""
from __future__ import annotations

import math

import torch

from ..errors import EdgekvError


def rope_layout(cfg: dict, max_ctx: int | None, where: str) -> tuple[list[float] | None, float, list[int] | None, int]:
    """Phi3Config's rope fields -> (per-frequency factors for LlamaArgs.rope_freq_factors [D/2] or None, the factor
    to scale rotated q/k rows by, the channel permutation of a head [D] or None when every channel rotates, R)."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    d = hidden // heads
    rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5 nests them here
    legacy = cfg.get("rope_scaling") or {}
    rope.update(legacy)
    rtype = rope.get("rope_type", rope.get("type", "default"))
    rtype = "longrope" if rtype in ("su", "yarn") else rtype  # Phi3Config's legacy names
    if rtype not in ("default", "longrope"):
        raise EdgekvError(f"{where}: rope type {rtype!r} is not a Phi-3 rope (default, longrope)")
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    r = int(d * factor)
    if r % 2 or not 0 < r <= d:
        raise EdgekvError(f"{where}: partial_rotary_factor {factor} gives {r} rotated channels of {d}: not an even "
                          "number in 1..head_dim")
    ext, scale = [1.0] * (r // 2), 1.0
    if rtype == "longrope":
        orig = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if not orig:
            raise EdgekvError(f"{where}: longrope needs original_max_position_embeddings")
        orig = int(orig)
        long = max_ctx is not None and max_ctx > orig
        ext = rope.get("long_factor" if long else "short_factor")
        if not isinstance(ext, list) or len(ext) != r // 2:
            raise EdgekvError(f"{where}: longrope {'long' if long else 'short'}_factor must list {r // 2} numbers")
        s = rope.get("factor") or int(cfg.get("max_position_embeddings", orig)) / orig
        scale = rope.get("attention_factor")
        if scale is None:
            scale = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig))
        scale = float(scale)
    if r == d and rtype == "default":
        return None, 1.0, None, r
    # the llama module's inv_freq_j = theta^(-2j/D) / factor_j; wanted: 1 / (ext_j theta^(2j/R)) for j < R/2, else 0
    factors = [float(ext[j]) * theta ** (2 * j / r - 2 * j / d) if j < r // 2 else math.inf for j in range(d // 2)]
    h, rh = d // 2, r // 2
    perm = [0] * d  # new channel p <- original channel perm[p]
    rest = iter(range(r, d))
    for p in range(d):
        if p < rh:
            perm[p] = p
        elif h <= p < h + rh:
            perm[p] = rh + (p - h)
        else:
            perm[p] = next(rest)
    return factors, scale, (None if r == d else perm), r


def split_fused(sd: dict, cfg: dict, scale: float, perm: list[int] | None, rotated: int) -> dict:
    """A Phi3ForCausalLM state dict -> the llama module's names: qkv_proj split into q/k/v_proj, gate_up_proj into
    gate/up_proj; q and k rows of each head scaled on their `rotated` channels and permuted (rope_layout)."""
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    d = hidden // heads
    out = {}
    for name, w in sd.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            p = name[: -len("qkv_proj.weight")]
            q, k, v = torch.split(w, [heads * d, kv * d, kv * d])
            out[p + "q_proj.weight"] = _head_rows(q, heads, d, scale, perm, rotated)
            out[p + "k_proj.weight"] = _head_rows(k, kv, d, scale, perm, rotated)
            out[p + "v_proj.weight"] = v.clone()
        elif name.endswith("mlp.gate_up_proj.weight"):
            p = name[: -len("gate_up_proj.weight")]
            gate, up = w.chunk(2, dim=0)
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = gate.clone(), up.clone()
        elif name.endswith(("qkv_proj.bias", "gate_up_proj.bias")):
            raise EdgekvError(f"{name}: Phi-3 projections have no bias (Phi3Attention / Phi3MLP)")
        else:
            out[name] = w
    return out


def _head_rows(w: torch.Tensor, n: int, d: int, scale: float, perm: list[int] | None, rotated: int) -> torch.Tensor:
    """w [n*D, d_in] -> the same rows with each head's first `rotated` channels times scale, then permuted."""
    w = w.reshape(n, d, -1).clone()
    if scale != 1.0:
        w[:, :rotated] *= scale
    if perm is not None:
        w = w[:, perm]
    return w.reshape(n * d, -1)


def to_llama(cfg: dict, sd: dict, max_ctx: int | None, where: str) -> tuple[dict, dict, list[float] | None]:
    """(Phi-3 config, Phi-3 state dict) -> (the config args_from_hf_config reads as the llama module's, its state dict,
    LlamaArgs.rope_freq_factors). The config keeps model_type phi3 (its sliding_window rule, edgekv.arch)."""
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise EdgekvError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    if cfg.get("head_dim") not in (None, int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])):
        raise EdgekvError(f"{where}: head_dim {cfg['head_dim']} is not hidden_size / num_attention_heads "
                          "(Phi3Attention's head width)")
    factors, scale, perm, rotated = rope_layout(cfg, max_ctx, where)
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    plain = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters", "partial_rotary_factor")}
    plain["rope_theta"] = theta
    return plain, split_fused(sd, cfg, scale, perm, rotated), factors
