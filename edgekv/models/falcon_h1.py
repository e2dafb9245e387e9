"""Falcon-H1 decode step (TII's parallel attention + Mamba-2 hybrids), written for export: forward(tokens, pos,
*state) -> (logits, *state).

Mirrors transformers' FalconH1ForCausalLM (models/falcon_h1/modeling_falcon_h1.py). Every layer (FalconH1DecoderLayer)
runs two mixers side by side on the same normed input h = input_layernorm(x):
  - GQA attention (FalconH1Attention) on h * attention_in_multiplier, keys times key_multiplier before RoPE, scores
    scaled by D^-1/2, its output times attention_out_multiplier;
  - a Mamba-2 mixer (FalconH1Mixer) on h * ssm_in_multiplier: in_proj -> [z | x | B | C | dt], each part times its
    ssm_multipliers entry (transformers' mup_vector), causal conv over xBC, SSD recurrence per head, then the gate:
    y * silu(z) (mamba_rms_norm false), or the gated RMSNorm per group (mamba_rms_norm true; mamba_norm_before_gate
    says whether the norm comes before the gate); out_proj; its output times ssm_out_multiplier;
  x = x + attention + mamba, then x = x + MLP(pre_ff_layernorm(x)) with the SwiGLU MLP's muP multipliers
  (down(up(h) * silu(gate(h) * mlp_multipliers[0])) * mlp_multipliers[1]).
The embeddings are multiplied by embedding_multiplier and the logits by lm_head_multiplier.

Shape symbols:
  C   tokens in this call        T  KV cache slots (the StateLayout's ctx)     d  hidden size     V  vocabulary
  H, Hkv, D     query heads, KV heads, head dim (config head_dim; d / H without it)
  Hm, P, N, Gm  Mamba heads, Mamba head dim, state size, groups;  Di = Hm * P (mamba_d_ssm)
  Dc = Di + 2 * Gm * N   conv channels        K  conv kernel (mamba_d_conv)

State: exactly the planner's StateLayout (edgekv.strategies.build_layout), per layer i, every layer alike:
  past_key_values.{i}.key / .value [1, Hkv, T, D]  (hybrid: dtype; hybrid:dtype=int8/int4: codes + .scale (+ .zero))
  past_conv.{i} [1, Dc, K-1] fp32, past_ssm.{i} [1, Hm, P, N] (hybrid: state_dtype)
Both halves of every layer keep state; only the KV grows with the context. All zeros is the empty state.

Where this differs from transformers, and why the numbers are the same:
  - the Mamba half is edgekv.models.ssm.Mamba2Mixer (mamba.py's notes apply: the conv as shifted multiply-adds, the SSD
    recurrence stepped token by token where transformers' prefill runs the chunked form) and the attention half
    edgekv.models.attention.Attention over a fixed cache (one-hot writes, a position mask), both under transformers'
    own parameter names;
  - three multipliers that act inside those shared layers are folded into the weights when the checkpoint is read
    (fold_multipliers): key_multiplier into k_proj's rows, the five ssm_multipliers into in_proj's rows (the
    mup_vector, per output channel), mlp_multipliers[0] into gate_proj's rows (with their biases). A scalar or
    per-row factor on a linear layer's output is the same factor on its weight rows, exact up to one fp32 rounding
    of each weight (~1e-7 relative). The other multipliers are applied where transformers applies them (forward).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..arch import Cfg
from ..arch import model_types
from ..errors import EdgekvError
from ..strategies import StateLayout
from .attention import Attention
from .base import DecoderShell
from .layers import MLP, RMSNorm, rope_cos_sin, rope_inv_freq
from .cache import cache_plan, hybrid_kv_format
from .llama import LlamaArgs, attention_args
from .ssm import Mamba2Mixer, MambaArgs, check_ssm_layout


@dataclass
class FalconH1Args:
    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    m_heads: int
    m_head_dim: int
    m_groups: int
    d_state: int
    d_conv: int
    eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False
    conv_bias: bool = True
    proj_bias: bool = False  # mamba_proj_bias: in_proj
    projectors_bias: bool = False  # out_proj
    rms_norm: bool = False  # mamba_rms_norm
    norm_before_gate: bool = True  # mamba_norm_before_gate
    dt_limit: tuple = (0.0, math.inf)
    rope_theta: float = 10000.0
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0  # folded into k_proj (fold_multipliers)
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: list = field(default_factory=lambda: [1.0] * 5)  # z, x, B, C, dt; folded into in_proj
    mlp_multipliers: list = field(default_factory=lambda: [1.0, 1.0])  # gate (folded into gate_proj), down
    tied: bool = False
    max_position: int | None = None
    model_type: str = "falcon_h1"

    def attention_args(self) -> LlamaArgs:
        """The numbers edgekv.models.attention's Attention and layers' MLP take (D^-1/2 scores, one RoPE base)."""
        return attention_args(self, mlp_bias=self.mlp_bias)

    def ssm_args(self) -> MambaArgs:
        return MambaArgs(2, self.vocab, self.hidden, self.n_layers, self.m_heads * self.m_head_dim, self.d_state,
                         self.d_conv, n_heads=self.m_heads, head_dim=self.m_head_dim, n_groups=self.m_groups)

    def to_json(self) -> dict:
        return asdict(self)


def _multipliers(cfg: dict, key: str, n: int, where: str) -> list[float]:
    v = cfg.get(key)
    if v is None:
        return [1.0] * n
    if not isinstance(v, (list, tuple)) or len(v) != n:
        raise EdgekvError(f"{where}: {key} must list {n} numbers, got {v!r}")
    return [float(x) for x in v]


def falcon_h1_args(cfg: dict, arch, where: str = "config.json") -> FalconH1Args:
    """FalconH1Config's fields and defaults; the attention and Mamba shapes as the planner's reader read them.
    What this module does not run is refused in one line: another activation or RoPE type."""
    if cfg.get("model_type") != model_types.FalconH1.model_type:
        raise EdgekvError(f"{where}: model_type {cfg.get('model_type')!r} is not {model_types.FalconH1.model_type}")
    c = Cfg(cfg, where)
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise EdgekvError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported by the falcon-h1 export "
                          "module (silu)")
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise EdgekvError(f"{where}: rope type {kind!r} is not supported by the falcon-h1 export module (default)")
    attn = next(m for m in arch.blocks[0].mixers if m.kind == "attention")
    ssm = next(m for m in arch.blocks[0].mixers if m.kind == "ssm")
    inter = next(w.shape[0] for w in arch.weights if w.name.endswith("feed_forward.gate_proj.weight"))
    return FalconH1Args(
        vocab=arch.vocab, hidden=arch.hidden, n_layers=arch.n_layers, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
        head_dim=attn.head_dim, intermediate=inter, m_heads=ssm.n_heads, m_head_dim=ssm.head_dim,
        m_groups=ssm.n_groups, d_state=ssm.d_state, d_conv=ssm.d_conv, eps=float(cfg.get("rms_norm_eps", 1e-5)),
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)), proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        projectors_bias=bool(cfg.get("projectors_bias", False)), rms_norm=bool(cfg.get("mamba_rms_norm", False)),
        norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
        dt_limit=tuple(float(v) for v in (cfg.get("time_step_limit") or (0.0, math.inf))),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        embedding_multiplier=float(c.get("embedding_multiplier", default=1.0)),
        lm_head_multiplier=float(c.get("lm_head_multiplier", default=1.0)),
        attention_in_multiplier=float(c.get("attention_in_multiplier", default=1.0)),
        attention_out_multiplier=float(c.get("attention_out_multiplier", default=1.0)),
        key_multiplier=float(c.get("key_multiplier", default=1.0)),
        ssm_in_multiplier=float(c.get("ssm_in_multiplier", default=1.0)),
        ssm_out_multiplier=float(c.get("ssm_out_multiplier", default=1.0)),
        ssm_multipliers=_multipliers(cfg, "ssm_multipliers", 5, where),
        mlp_multipliers=_multipliers(cfg, "mlp_multipliers", 2, where),
        tied=bool(cfg.get("tie_word_embeddings", False)), max_position=cfg.get("max_position_embeddings"))


def mup_vector(a: FalconH1Args) -> torch.Tensor:
    """transformers' compute_mup_vector: in_proj's per-output-channel factors [Di + Dc + Hm], the five
    ssm_multipliers over its parts z [Di], x [Di], B [Gm*N], C [Gm*N], dt [Hm]."""
    di, gn = a.m_heads * a.m_head_dim, a.m_groups * a.d_state
    sizes = (di, di, gn, gn, a.m_heads)
    return torch.cat([torch.full((n,), m, dtype=torch.float32) for n, m in zip(sizes, a.ssm_multipliers)])


def fold_multipliers(sd: dict, a: FalconH1Args) -> dict:
    """The state dict with the multipliers that act inside shared layers folded into their weight rows (module
    docstring): k_proj x key_multiplier, in_proj x mup_vector, gate_proj x mlp_multipliers[0]."""
    rows = {".self_attn.k_proj.": torch.tensor(a.key_multiplier), ".mamba.in_proj.": mup_vector(a),
            ".feed_forward.gate_proj.": torch.tensor(a.mlp_multipliers[0])}
    out = {}
    for k, v in sd.items():
        f = next((m for part, m in rows.items() if part in k and k.startswith("model.layers.")), None)
        if f is not None:
            v = v * (f[:, None] if v.dim() == 2 and f.dim() == 1 else f)
        out[k] = v
    return out


class FalconH1Layer(nn.Module):
    """FalconH1DecoderLayer's parameters: self_attn, mamba, feed_forward and the two norms."""

    def __init__(self, a: FalconH1Args):
        super().__init__()
        self.self_attn = Attention(a.attention_args())
        self.mamba = Mamba2Mixer(a.hidden, a.m_heads, a.m_head_dim, a.m_groups, a.d_state, a.d_conv, a.eps,
                                 a.conv_bias, a.proj_bias, a.dt_limit, norm=a.rms_norm,
                                 norm_before_gate=a.norm_before_gate, out_bias=a.projectors_bias)
        self.feed_forward = MLP(a.attention_args())
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.pre_ff_layernorm = RMSNorm(a.hidden, a.eps)


class FalconH1(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state); state in the
    layout's order (module docstring). Callers keep pos + C <= T."""

    def __init__(self, args: FalconH1Args, layout: StateLayout):
        super().__init__(args, layout)
        layers = list(range(args.n_layers))
        self.kv = hybrid_kv_format(layout, layers, args.n_kv_heads, args.head_dim, {i: ("conv", "ssm") for i in layers})
        check_ssm_layout(args.ssm_args(), layout)
        self.make_body([FalconH1Layer(args) for _ in layers], RMSNorm(args.hidden, args.eps),
                       names=("embed_tokens", "layers", "final_layernorm"))
        self.register_buffer("inv_freq", rope_inv_freq(args.attention_args()), persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        a, c = self.args, tokens.shape[1]
        positions, write, keep, mask = cache_plan(pos, c, self.layout.ctx, a.n_heads // a.n_kv_heads,
                                                  self.kv.dtype or torch.float32)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [C, 1, D]
        x = self.model.embed_tokens(tokens) * a.embedding_multiplier
        n, s, new_state = self.kv.n, 0, []
        for blk in self.model.layers:
            h = blk.input_layernorm(x)
            att, k, v = blk.self_attn(h * a.attention_in_multiplier, cos, sin, write, keep, mask, state[s:s + n],
                                      state[s + n:s + 2 * n], self.kv)
            s += 2 * n
            ssm, conv, hs = blk.mamba(h * a.ssm_in_multiplier, state[s], state[s + 1])
            s += 2
            new_state += [*k, *v, conv, hs]
            x = x + (ssm * a.ssm_out_multiplier + att * a.attention_out_multiplier)
            x = x + blk.feed_forward(blk.pre_ff_layernorm(x)) * a.mlp_multipliers[1]
        return (self.logits(x, rows) * a.lm_head_multiplier, *new_state)


def read_falcon_h1(spec: str, max_ctx: int):
    """An HF folder of a falcon_h1 model -> Source (edgekv.models.FAMILIES), its multipliers folded where
    fold_multipliers says."""
    from .base import read_source
    return read_source(spec, max_ctx, falcon_h1_args, fold_multipliers)


def build_falcon_h1(src, layout: StateLayout) -> FalconH1:
    from .base import load_strict
    return load_strict(FalconH1(src.args, layout), src.sd, src.path, "falcon_h1")
