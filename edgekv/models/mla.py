"""Multi-head latent attention (MLA) decode steps, written for export: forward(tokens, pos, *state) -> (logits, *state).

Two models share the idea "cache one small latent per token, rebuild keys and values from it":
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
Slot t holds position t. Writes use a one-hot [T, C] matrix and torch.where, as edgekv.models.llama does; unwritten
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
from ..errors import EdgekvError
from ..strategies import StateLayout
from . import MLA_CONVERTIBLE as CONVERTIBLE_TYPES  # the registry's list (the planner reads it without torch)
from .head import head, output_weight
from .base import STATE_DTYPES, empty_state, load_strict, read_folder
from .layers import MLP as LlamaMLP
from .layers import MoE, RMSNorm, SwiGLU, rope_cos_sin, rope_inv_freq, rotate_half, slot_plan, stack_experts

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
    if cfg.get("model_type") != "deepseek_v2":
        raise EdgekvError(f"{where}: model_type {cfg.get('model_type')!r} has no MLA module (deepseek_v2)")
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


class _Body(nn.Module):
    """embed_tokens, layers (block(a, i) each), norm: transformers' *Model names. a: DeepseekArgs or LlamaArgs."""

    def __init__(self, a, block):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(block(a, i) for i in range(a.n_layers))
        self.norm = RMSNorm(a.hidden, a.rms_eps)


def _latent_layout(layout: StateLayout, n_layers: int, width: int) -> torch.dtype:
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


class DeepseekV2(nn.Module):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state); state is one
    past_latent.{i} [1, T, r + R] per layer. Callers keep pos + C <= T."""

    def __init__(self, args: DeepseekArgs, layout: StateLayout):
        super().__init__()
        self.args, self.layout = args, layout
        _latent_layout(layout, args.n_layers, args.kv_lora_rank + args.qk_rope_head_dim)
        self.model = _Body(args, DeepseekBlock)
        self.lm_head = None if args.tied else nn.Linear(args.hidden, args.vocab, bias=False)
        inv, self.attn_factor, sm = deepseek_rope(args.rope, args.qk_rope_head_dim, args.max_position)
        self.scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5 * sm
        self.register_buffer("inv_freq", inv, persistent=False)

    def empty_state(self) -> list[torch.Tensor]:
        return empty_state(self.layout)

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
        w = output_weight(self.model.embed_tokens, self.lm_head)
        return (head(x, self.model.norm, w, rows), *new_state)


def read_deepseek(spec: str, max_ctx: int):
    """An HF folder of a deepseek_v2 model -> Source (edgekv.models.FAMILIES)."""
    from . import Source

    path, cfg, sd, arch = read_folder(spec, max_ctx)
    args = deepseek_args(cfg, str(path / "config.json"))
    if args.max_position and max_ctx > args.max_position:
        raise EdgekvError(f"max_ctx {max_ctx} exceeds the model's trained context {args.max_position}")
    if args.tied:
        sd.pop("lm_head.weight", None)
    return Source(path, "safetensors", cfg, sd, args, arch)


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


# ---- converted MLA: a GQA Llama with its K/V projections factorised ----


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


class ConvertedMLA(nn.Module):
    """A Llama-family model (LlamaArgs) with a converted-MLA cache: forward(tokens [1, C], pos [1], *state) ->
    (logits [1, C, V], *new_state); state is one past_latent.{i} [1, T, r] per layer. `errors` holds the
    per-layer relative factorisation error (filled by the loader)."""

    def __init__(self, args, layout: StateLayout, rank: int):
        super().__init__()
        self.args, self.layout, self.rank = args, layout, rank
        _latent_layout(layout, args.n_layers, rank)
        self.model = _Body(args, lambda a, i: _ConvertedBlock(a, rank))
        self.lm_head = None if args.tied else nn.Linear(args.hidden, args.vocab, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.errors: list[float] = []

    def empty_state(self) -> list[torch.Tensor]:
        return empty_state(self.layout)

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
        w = output_weight(self.model.embed_tokens, self.lm_head)
        return (head(x, self.model.norm, w, rows), *new_state)


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
