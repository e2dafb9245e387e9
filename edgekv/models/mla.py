"""Multi-head latent attention (MLA) decode steps, written for export: forward(tokens, pos, *state) -> (logits, *state).

Two models share the idea "cache one small latent per token, rebuild keys and values from it" (the second lives in
edgekv.models.converted_mla):
  DeepseekV2     native MLA (DeepSeek-V2 paper, section 2.1), as transformers' DeepseekV2ForCausalLM builds it:
                 optional low-rank query (q_a_proj -> q_a_layernorm -> q_b_proj), kv_a_proj_with_mqa -> a latent of
                 width r plus one shared RoPE key of width R, kv_a_layernorm, kv_b_proj; the DeepSeekMoE MLP (routed
                 experts with softmax top-k gating, shared experts, the first first_k_dense_replace layers dense).
  ConvertedMLA   a GQA Llama-family model whose stacked [W_k; W_v] is factorised by a truncated SVD into
                 W_up [2*Hkv*D, r] @ W_down [r, d]; the cache keeps c = x W_down^T (pre-RoPE) per token.

Shape symbols:
  C   tokens in this call (chunked prefill: C > 1; decode: C = 1)
  T   cache slots per layer (the StateLayout's ctx, i.e. max_ctx)
  d   hidden size        V  vocabulary        H  query heads
  r   latent width (kv_lora_rank, or the converted rank)        R  decoupled RoPE width (qk_rope_head_dim)
  Dn  qk_nope_head_dim   Dv  v_head_dim       E  routed experts  k  experts per token   I  expert width
  Hkv, D, G  KV heads, head dim, H / Hkv (converted models)

State, per block i, exactly the `mla` StateLayout (edgekv.strategies.build_layout):
  DeepseekV2    past_latent.{i} [1, T, r + R]  = [kv_a_layernorm(latent) | RoPE(k_pe) at the slot's position]
  ConvertedMLA  past_latent.{i} [1, T, r]      = x W_down^T, before any RoPE
Slot t holds position t. Writes use a one-hot [T, C] matrix and torch.where (layers.slot_plan); unwritten
and future slots are masked, so they contribute exp(-inf) = 0 exactly.

Where this differs from transformers, and why the numbers are the same:
  - DeepseekV2 attends in the "absorbed" form (DeepSeek-V2 paper, section 2.1.2): W_UK is folded into the query and
    W_UV applied after the softmax-weighted sum of latents, so keys and values are never expanded per head:
      score = (q_nope W_UK[h]) . c_t + q_pe . k_pe_t,    out[h] = W_UV[h] (sum_t p_t c_t).
    transformers expands K = [c W_UK^T | k_pe], V = c W_UV^T first. Same bilinear forms, re-associated: equal up to
    fp32 rounding (~1e-6 relative). This is what makes the latent cache cheap to read on a phone.
  - RoPE on pairs (x[2j], x[2j+1]) is written with real cos/sin instead of transformers' complex view_as_complex
    (which exporters reject); the same rotation.
  - routed experts (MoE): a decode step (C = 1) gathers only the top-k experts' weights from stacked [E, ...] tensors;
    a prefill (C > 1) runs all experts densely and weights them by the (mostly zero) gate. Both are the same sum
    sum_{e in top-k} g_e * expert_e(x) transformers computes with its per-expert loop.
  - expert weights are stored stacked (experts.gate_proj [E, I, d], experts.up_proj [E, I, d], experts.down_proj
    [E, d, I]); the loader stacks the per-expert tensors of a checkpoint (experts.{e}.gate_proj.weight ...) or
    splits transformers' fused experts.gate_up_proj.
  - ConvertedMLA rebuilds K for all T slots from the latent (RoPE needs each slot's position, so W_UK cannot be
    absorbed into the query) but absorbs W_UV: out = (sum_t p_t c_t) W_UV^T + b_v.
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
from .base import STATE_DTYPES, DecoderShell, load_strict, read_source
from .layers import MoE, RMSNorm, SwiGLU, slot_plan, stack_experts

# ---- RoPE for DeepSeek: default or YaRN, on interleaved pairs ----


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_rope(rope: dict, dim: int, max_position: int | None) -> tuple[torch.Tensor, float, float]:
    """-> (inv_freq [R/2], attention_factor multiplying cos/sin, softmax scale factor), as transformers'
    ROPE_INIT_FUNCTIONS (default, _compute_yarn_parameters) and yarn_apply_mscale compute them."""
    base = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0, 1.0
    if kind != "yarn":
        raise EdgekvError(f"rope type {kind!r} is not supported for MLA (default, yarn)")
    factor = rope.get("factor")
    orig = rope["original_max_position_embeddings"]
    if factor is None:
        factor = max_position / orig
    factor = float(factor)
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attn = rope.get("attention_factor")
    if attn is None:
        attn = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)) if (mscale and mscale_all) \
            else yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def corr_dim(n_rot):
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra = 1 - ramp  # 1 = keep the original frequency (extrapolate), 0 = divide it by factor (interpolate)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    softmax_factor = yarn_mscale(factor, mscale_all) ** 2 if mscale_all else 1.0
    return inv, float(attn), softmax_factor


def rope_pairs(x, cos, sin):
    """Rotate pairs (x[2j], x[2j+1]) by angle j: x [..., C, R]; cos, sin [C, R/2] -> [..., C, R]."""
    xr = x.reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


@dataclass
class DeepseekArgs:
    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate: int
    moe_intermediate: int
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    first_k_dense_replace: int
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    rms_eps: float = 1e-6
    rope: dict | None = None
    attention_bias: bool = False
    tied: bool = False
    max_position: int | None = None
    model_type: str = "deepseek_v2"

    def to_json(self) -> dict:
        return asdict(self)


def rope_params(cfg: dict) -> dict:
    """transformers >= 5 rope_parameters, or the legacy rope_theta + rope_scaling most hub checkpoints carry."""
    rope = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    rope.update(legacy)
    if "type" in legacy and "rope_type" not in legacy:
        rope["rope_type"] = legacy["type"]
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    return rope


def deepseek_args(cfg: dict, where: str = "config.json") -> DeepseekArgs:
    if cfg.get("model_type") != model_types.DeepseekV2.model_type:
        raise EdgekvError(f"{where}: model_type {cfg.get('model_type')!r} has no MLA module "
                          f"({model_types.DeepseekV2.model_type})")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise EdgekvError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU/silu)")

    need = Cfg(cfg, where).int  # a required non-negative integer, one line naming it if missing

    n_routed = int(cfg.get("n_routed_experts") or 0)
    return DeepseekArgs(
        vocab=need("vocab_size"), hidden=need("hidden_size"), n_layers=need("num_hidden_layers"),
        n_heads=need("num_attention_heads"), kv_lora_rank=need("kv_lora_rank"),
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"), intermediate=need("intermediate_size"),
        moe_intermediate=int(cfg.get("moe_intermediate_size") or 0), n_routed_experts=n_routed,
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        top_k=int(cfg.get("num_experts_per_tok") or 0) if n_routed else 0,
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        topk_method=cfg.get("topk_method") or "greedy", n_group=cfg.get("n_group"), topk_group=cfg.get("topk_group"),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=rope_params(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)), tied=bool(cfg.get("tie_word_embeddings", False)),
        max_position=cfg.get("max_position_embeddings"))


class MLAttention(nn.Module):
    """DeepSeek-V2 attention over a latent cache, absorbed form. Parameter names as DeepseekV2Attention."""

    def __init__(self, a: DeepseekArgs):
        super().__init__()
        self.h, self.r, self.rd = a.n_heads, a.kv_lora_rank, a.qk_rope_head_dim
        self.dn, self.dv = a.qk_nope_head_dim, a.v_head_dim
        qd = a.n_heads * (self.dn + self.rd)
        if a.q_lora_rank:
            self.q_a_proj = nn.Linear(a.hidden, a.q_lora_rank, bias=a.attention_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, 1e-6)  # transformers builds it with the default eps
            self.q_b_proj = nn.Linear(a.q_lora_rank, qd, bias=False)
        else:
            self.q_proj = nn.Linear(a.hidden, qd, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden, self.r + self.rd, bias=a.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)  # default eps, as transformers
        self.kv_b_proj = nn.Linear(self.r, a.n_heads * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(a.n_heads * self.dv, a.hidden, bias=a.attention_bias)
        self.q_lora = bool(a.q_lora_rank)

    def forward(self, x, cos, sin, write, written, allowed, scale, cache):
        """x [1, C, d]; cos, sin [C, R/2]; write [T, C] one-hot; written [T, 1] bool; allowed [C, T] bool;
        cache [1, T, r + R] -> out [1, C, d], new cache."""
        c = x.shape[1]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(1, c, self.h, self.dn + self.rd).transpose(1, 2)  # [1, H, C, Dn + R]
        q_nope, q_pe = q[..., :self.dn], rope_pairs(q[..., self.dn:], cos, sin)
        kv = self.kv_a_proj_with_mqa(x)  # [1, C, r + R]
        entry = torch.cat((self.kv_a_layernorm(kv[..., :self.r]), rope_pairs(kv[..., self.r:], cos, sin)), -1)
        cache = torch.where(written, (write @ entry).to(cache.dtype), cache)  # [1, T, r + R]
        lat, pe = cache[..., :self.r].float(), cache[..., self.r:].float()  # [1, T, r], [1, T, R]
        wkv = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.r)
        q_abs = torch.einsum("bhcn,hnr->bhcr", q_nope, wkv[:, :self.dn])  # [1, H, C, r]
        scores = (q_abs @ lat[:, None].transpose(-1, -2) + q_pe @ pe[:, None].transpose(-1, -2)) * scale
        scores = torch.where(allowed, scores, float("-inf"))  # [1, H, C, T]
        o_lat = torch.softmax(scores, dim=-1) @ lat[:, None]  # [1, H, C, r]
        out = torch.einsum("bhcr,hvr->bchv", o_lat, wkv[:, self.dn:])  # [1, C, H, Dv]
        return self.o_proj(out.reshape(1, c, self.h * self.dv)), cache


class DeepseekBlock(nn.Module):
    def __init__(self, a: DeepseekArgs, i: int):
        super().__init__()
        self.self_attn = MLAttention(a)
        if a.n_routed_experts and i >= a.first_k_dense_replace:
            self.mlp = MoE(a.hidden, a.moe_intermediate, a.n_routed_experts, a.top_k, a.n_shared_experts,
                           a.routed_scaling_factor, a.topk_method, a.n_group, a.topk_group)
        else:
            self.mlp = SwiGLU(a.hidden, a.intermediate)
        self.input_layernorm = RMSNorm(a.hidden, a.rms_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.rms_eps)


def check_latent_layout(layout: StateLayout, n_layers: int, width: int) -> torch.dtype:
    """The layout must be one latent [1, ctx, width] per layer in fp32 or fp16; returns its torch dtype."""
    want = [(i, "latent") for i in range(n_layers)]
    if [(t.layer, t.role) for t in layout.tensors] != want:
        raise EdgekvError(f"strategy {layout.strategy}: the MLA module keeps one latent per layer "
                          f"(state roles {sorted({t.role for t in layout.tensors})})")
    dtypes = {t.dtype for t in layout.tensors}
    if len(dtypes) != 1 or not dtypes <= {"float32", "float16"}:
        raise EdgekvError(f"strategy {layout.strategy}: latent dtype {', '.join(sorted(dtypes))} is not supported "
                          "by the export yet (fp32, fp16)")
    for t in layout.tensors:
        if t.shape != (1, layout.ctx, width):
            raise EdgekvError(f"{t.name}: shape {t.shape} is not [1, {layout.ctx}, {width}] (sliding-window layers "
                              "need a rolling cache, not implemented)")
    return STATE_DTYPES[dtypes.pop()]


class DeepseekV2(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state); state is one
    past_latent.{i} [1, T, r + R] per layer. Callers keep pos + C <= T."""

    def __init__(self, args: DeepseekArgs, layout: StateLayout):
        super().__init__(args, layout)
        check_latent_layout(layout, args.n_layers, args.kv_lora_rank + args.qk_rope_head_dim)
        self.make_body([DeepseekBlock(args, i) for i in range(args.n_layers)], RMSNorm(args.hidden, args.rms_eps))
        inv, self.attn_factor, sm = deepseek_rope(args.rope, args.qk_rope_head_dim, args.max_position)
        self.scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5 * sm
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        c = tokens.shape[1]
        positions, write, written, allowed = slot_plan(pos, c, self.layout.ctx)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [C, R/2]
        cos, sin = freqs.cos() * self.attn_factor, freqs.sin() * self.attn_factor
        x = self.model.embed_tokens(tokens)
        new_state = []
        for i, blk in enumerate(self.model.layers):
            h, lat = blk.self_attn(blk.input_layernorm(x), cos, sin, write, written, allowed, self.scale, state[i])
            x = x + h
            x = x + blk.mlp(blk.post_attention_layernorm(x))
            new_state.append(lat)
        return (self.logits(x, rows), *new_state)


def read_deepseek(spec: str, max_ctx: int):
    """An HF folder of a deepseek_v2 model -> Source (edgekv.models.FAMILIES)."""
    return read_source(spec, max_ctx, lambda cfg, arch, where: deepseek_args(cfg, where))


def build_deepseek(src, layout: StateLayout) -> "DeepseekV2":
    module = DeepseekV2(src.args, layout)
    sd = dict(src.sd)
    for i in range(src.args.n_layers):
        if isinstance(module.model.layers[i].mlp, MoE):
            sd.update(stack_experts(sd, f"model.layers.{i}.mlp.experts", src.args.n_routed_experts))
    return load_strict(module, sd, src.path, "deepseek_v2")


def load_deepseek(spec: str, strategy, max_ctx: int):
    """An HF folder of a deepseek_v2 model -> Loaded. strategy: mla (dtype fp32 or fp16)."""
    from . import load_family
    return load_family("deepseek-v2", spec, strategy, max_ctx)
