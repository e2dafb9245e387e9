"""Zamba2 decode step (Zyphra's Mamba-2 backbone with shared attention blocks), written for export: forward(tokens,
pos, *state) -> (logits, *state).

Mirrors transformers' Zamba2ForCausalLM (models/zamba2/modeling_zamba2.py). Every layer is a Mamba-2 layer
(Zamba2MambaDecoderLayer: x = x + mamba(input_layernorm(x))); a "hybrid" layer (Zamba2HybridLayer) first runs one of
num_mem_blocks shared transformer blocks (Zamba2AttentionDecoderLayer; hybrid layer n uses block n % num_mem_blocks)
on the concatenation of the stream and the original embeddings, and adds its output, through the layer's own
`linear`, to the Mamba layer's input (not to the residual):
  t = input_layernorm([x | e])                          (width 2d)
  a = pre_ff_layernorm(attention(t))                    GQA over 2d inputs, head dim Dz = 2d / H, scores scaled by
                                                        (Dz / 2)^-1/2, RoPE only with use_mem_rope; with
                                                        use_shared_attention_adapter each hybrid layer adds its own
                                                        LoRA (A then B) to the shared q, k and v projections
  f = down(act(g) * u), [g | u] = gate_up(a) + lora(a)  each hybrid layer's own LoRA on the shared gate_up projection
  x = x + mamba(input_layernorm(x + linear(f)))
The Mamba-2 mixer (Zamba2MambaMixer) gates with the gated RMSNorm after the gate (eps 1e-5), clamps dt below at
time_step_min, and always has a conv bias.

Shape symbols:
  C   tokens in this call        T  KV cache slots (the StateLayout's ctx)     d  hidden size     V  vocabulary
  H, Hkv, Dz    query heads, KV heads, head dim of the shared attention (2d / H)    I  MLP width    r  adapter rank
  Hm, P, N, Gm  Mamba heads, Mamba head dim, state size, groups;  Di = Hm * P = mamba_expand * d
  Dc = Di + 2 * Gm * N   conv channels        K  conv kernel (mamba_d_conv)

State: exactly the planner's StateLayout (edgekv.strategies.build_layout), per layer i in order:
  hybrid layer only   past_key_values.{i}.key / .value [1, Hkv, T, Dz] (hybrid: dtype; hybrid:dtype=int8/int4: codes
                      + .scale (+ .zero)): a shared block's weights, but each hybrid layer's own cache
  every layer         past_conv.{i} [1, Dc, K-1] fp32, past_ssm.{i} [1, Hm, P, N] (hybrid: state_dtype)
Only the hybrid layers' KV grows with the context. All zeros is the empty state.

Weights: the checkpoint's names (transformers' module tree) are renamed when read (read_zamba2) to the planner's
(edgekv.arch._zamba2): model.layers.{i}.mamba_decoder.* -> model.layers.{i}.*; a hybrid layer's shared_transformer.*
-> model.blocks.{j}.* (stored once per block, as transformers ties them); the adapter lists inside the shared block,
indexed by hybrid layer n, -> model.layers.{i}.ffn_adapter / attn_adapter_{q,k,v} of that layer. The shared blocks'
weights are kept once, as in the checkpoint.

Where this differs from transformers, and why the numbers are the same: the Mamba layers are
edgekv.models.ssm.Mamba2Mixer (mamba.py's notes apply: the conv as shifted multiply-adds, the SSD recurrence stepped
token by token where transformers' prefill runs the chunked form; dt is clamped at time_step_min in every call, where
transformers' single-token path leaves it unclamped, which differs only where softplus(dt) < time_step_min) and the
shared attention edgekv.models.attention.Attention over a fixed cache (one-hot writes, a position mask), its
adapters added to the projections through its delta argument.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import Cfg
from ..arch import model_types
from ..errors import EdgekvError
from ..strategies import StateLayout
from .attention import Attention
from .base import DecoderShell
from .layers import RMSNorm, rope_cos_sin, rope_inv_freq
from .cache import cache_plan, hybrid_kv_format
from .llama import LlamaArgs, attention_args
from .ssm import Mamba2Mixer, MambaArgs, check_ssm_layout

ACTS = {"gelu": F.gelu, "silu": F.silu, "swish": F.silu}  # transformers' ACT2FN for the names Zamba2 configs use


@dataclass
class Zamba2Args:
    vocab: int
    hidden: int
    n_layers: int
    kinds: list  # "mamba" | "hybrid" per layer
    n_heads: int
    n_kv_heads: int
    head_dim: int  # attention_head_dim: 2 * hidden / heads
    intermediate: int
    n_mem_blocks: int
    adapter_rank: int
    attn_adapters: bool  # use_shared_attention_adapter
    m_heads: int
    m_head_dim: int
    m_groups: int
    d_state: int
    d_conv: int
    eps: float = 1e-5
    add_bias: bool = False  # add_bias_linear: Mamba in/out projections and the shared MLP
    act: str = "gelu"
    dt_min: float = 0.001  # time_step_min: dt's lower clamp
    rope: bool = False  # use_mem_rope
    rope_theta: float = 10000.0
    tied: bool = True
    max_position: int | None = None
    model_type: str = "zamba2"

    @property
    def hybrid_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "hybrid"]

    def attention_args(self) -> LlamaArgs:
        """The shared attention as edgekv.models.attention's Attention takes it: inputs of width 2d (the stream and
        the embeddings), scores scaled by (Dz / 2)^-1/2, one RoPE base, no biases."""
        return attention_args(self, hidden=2 * self.hidden, attn_scale=(self.head_dim / 2) ** -0.5)

    def ssm_args(self) -> MambaArgs:
        return MambaArgs(2, self.vocab, self.hidden, self.n_layers, self.m_heads * self.m_head_dim, self.d_state,
                         self.d_conv, n_heads=self.m_heads, head_dim=self.m_head_dim, n_groups=self.m_groups)

    def to_json(self) -> dict:
        return asdict(self)


def zamba2_args(cfg: dict, arch, where: str = "config.json") -> Zamba2Args:
    """Zamba2Config's fields and defaults; the layer kinds and shapes as the planner's reader read them. What this
    module does not run is refused in one line: another activation or RoPE type, use_long_context, attention
    adapters on a GQA block (transformers cannot add them either)."""
    if cfg.get("model_type") != model_types.Zamba2.model_type:
        raise EdgekvError(f"{where}: model_type {cfg.get('model_type')!r} is not {model_types.Zamba2.model_type}")
    c = Cfg(cfg, where)
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTS:
        raise EdgekvError(f"{where}: hidden_act {act!r} is not supported by the zamba2 export module "
                          f"({', '.join(ACTS)})")
    if cfg.get("use_long_context"):
        raise EdgekvError(f"{where}: use_long_context is not supported by the zamba2 export module")
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise EdgekvError(f"{where}: rope type {kind!r} is not supported by the zamba2 export module (default)")
    kinds = ["hybrid" if len(b.mixers) == 2 else "mamba" for b in arch.blocks]
    attn = next((m for b in arch.blocks for m in b.mixers if m.kind == "attention"), None)
    ssm = next(m for b in arch.blocks for m in b.mixers if m.kind == "ssm")
    if attn is None:
        raise EdgekvError(f"{where}: no hybrid layer: not a hybrid")
    adapters = bool(cfg.get("use_shared_attention_adapter", False))
    if adapters and attn.n_kv_heads != attn.n_heads:
        raise EdgekvError(f"{where}: use_shared_attention_adapter with {attn.n_kv_heads} KV heads for "
                          f"{attn.n_heads} query heads: the adapters' width is that of full attention")
    return Zamba2Args(
        vocab=arch.vocab, hidden=arch.hidden, n_layers=arch.n_layers, kinds=kinds, n_heads=attn.n_heads,
        n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim,
        intermediate=c.int("intermediate_size", default=4 * arch.hidden), n_mem_blocks=c.int("num_mem_blocks",
                                                                                            default=1),
        adapter_rank=c.int("adapter_rank", default=128), attn_adapters=adapters, m_heads=ssm.n_heads,
        m_head_dim=ssm.head_dim, m_groups=ssm.n_groups, d_state=ssm.d_state, d_conv=ssm.d_conv,
        eps=float(cfg.get("rms_norm_eps", 1e-5)), add_bias=bool(cfg.get("add_bias_linear", False)), act=act,
        dt_min=float(cfg.get("time_step_min", 0.001)), rope=bool(cfg.get("use_mem_rope", False)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        tied=bool(cfg.get("tie_word_embeddings", True)), max_position=cfg.get("max_position_embeddings"))


def _lora(d_in: int, rank: int, d_out: int) -> nn.Sequential:
    """A low-rank adapter B(A x), no biases (transformers' nn.Sequential of two Linears: .0 = A, .1 = B)."""
    return nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))


class SharedBlock(nn.Module):
    """Zamba2AttentionDecoderLayer's shared weights: the attention (o_proj back to width d), the MLP's gate_up and down
    projections and the two norms. A hybrid layer's adapters live in the layer (Zamba2Layer)."""

    def __init__(self, a: Zamba2Args):
        super().__init__()
        self.self_attn = Attention(a.attention_args())
        self.self_attn.o_proj = nn.Linear(a.n_heads * a.head_dim, a.hidden, bias=False)
        self.feed_forward = nn.Module()
        self.feed_forward.gate_up_proj = nn.Linear(a.hidden, 2 * a.intermediate, bias=a.add_bias)
        self.feed_forward.down_proj = nn.Linear(a.intermediate, a.hidden, bias=a.add_bias)
        self.input_layernorm = RMSNorm(2 * a.hidden, a.eps)
        self.pre_ff_layernorm = RMSNorm(a.hidden, a.eps)


class Zamba2Layer(nn.Module):
    """One layer: its Mamba-2 mixer and norm; a hybrid layer also its linear and its own adapters, and the index of
    the shared block it runs."""

    def __init__(self, a: Zamba2Args, i: int):
        super().__init__()
        self.mamba = Mamba2Mixer(a.hidden, a.m_heads, a.m_head_dim, a.m_groups, a.d_state, a.d_conv, 1e-5, True,
                                 a.add_bias, (a.dt_min, math.inf))
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.hybrid = a.kinds[i] == "hybrid"
        if self.hybrid:
            self.block = a.hybrid_layers.index(i) % a.n_mem_blocks
            self.linear = nn.Linear(a.hidden, a.hidden, bias=False)
            self.ffn_adapter = _lora(a.hidden, a.adapter_rank, 2 * a.intermediate)
            if a.attn_adapters:
                w = 2 * a.hidden
                self.attn_adapter_q, self.attn_adapter_k, self.attn_adapter_v = (
                    _lora(w, a.adapter_rank, w) for _ in range(3))


class Zamba2(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state); state in the
    layout's order (module docstring). Callers keep pos + C <= T."""

    def __init__(self, args: Zamba2Args, layout: StateLayout):
        super().__init__(args, layout)
        every = {i: ("conv", "ssm") for i in range(args.n_layers)}
        self.kv = hybrid_kv_format(layout, args.hybrid_layers, args.n_kv_heads, args.head_dim, every)
        check_ssm_layout(args.ssm_args(), layout)
        self.make_body([Zamba2Layer(args, i) for i in range(args.n_layers)], RMSNorm(args.hidden, args.eps),
                       names=("embed_tokens", "layers", "final_layernorm"))
        self.model.blocks = nn.ModuleList(SharedBlock(args) for _ in range(args.n_mem_blocks))
        self.register_buffer("inv_freq", rope_inv_freq(args.attention_args()), persistent=False)

    def _shared(self, layer: Zamba2Layer, x, emb, cos, sin, plan, k_state, v_state):
        """The shared block for this hybrid layer -> (linear(its output) [1, C, d], new k_state, new v_state)."""
        a, blk = self.args, self.model.blocks[layer.block]
        t = blk.input_layernorm(torch.cat([x, emb], dim=-1))  # [1, C, 2d]
        delta = (layer.attn_adapter_q(t), layer.attn_adapter_k(t), layer.attn_adapter_v(t)) if a.attn_adapters \
            else None
        h, k, v = blk.self_attn.explicit(t, cos, sin, *plan, k_state, v_state, self.kv, delta=delta)
        h = blk.pre_ff_layernorm(h)
        ff = blk.feed_forward
        gate, up = (ff.gate_up_proj(h) + layer.ffn_adapter(h)).split(a.intermediate, dim=-1)
        return layer.linear(ff.down_proj(ACTS[a.act](gate) * up)), k, v

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        a, c = self.args, tokens.shape[1]
        positions, write, keep, mask = cache_plan(pos, c, self.layout.ctx, a.n_heads // a.n_kv_heads,
                                                  self.kv.dtype or torch.float32)
        cos = sin = None  # NoPE unless use_mem_rope
        if a.rope:
            cos, sin = rope_cos_sin(positions, self.inv_freq)
            cos, sin = cos[:, None, :], sin[:, None, :]  # [C, 1, Dz]
        emb = self.model.embed_tokens(tokens)
        x = emb
        n, s, new_state = self.kv.n, 0, []
        for layer in self.model.layers:
            h = x
            if layer.hybrid:
                t, k, v = self._shared(layer, x, emb, cos, sin, (write, keep, mask), state[s:s + n],
                                       state[s + n:s + 2 * n])
                new_state += [*k, *v]
                s += 2 * n
                h = x + t
            y, conv, ssm = layer.mamba(layer.input_layernorm(h), state[s], state[s + 1])
            new_state += [conv, ssm]
            s += 2
            x = x + y
        return (self.logits(x, rows), *new_state)


_ADAPTER = re.compile(r"(?:feed_forward\.gate_up_proj|self_attn\.linear_([qkv]))_adapter_list\.(\d+)\.([01])\.weight")


def renamed(sd: dict, args: Zamba2Args) -> dict:
    """The checkpoint's tensors under this module's (and the planner's) names (module docstring)."""
    hybrid = args.hybrid_layers
    out = {}
    for key, v in sd.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(mamba_decoder|shared_transformer)\.(.+)", key)
        if m is None:
            out[key] = v
            continue
        i, part, rest = int(m[1]), m[2], m[3]
        if part == "mamba_decoder":
            out[f"model.layers.{i}.{rest}"] = v
        elif (ad := _ADAPTER.fullmatch(rest)) is not None:
            name = "ffn_adapter" if ad[1] is None else f"attn_adapter_{ad[1]}"
            out[f"model.layers.{hybrid[int(ad[2])]}.{name}.{ad[3]}.weight"] = v
        elif i in hybrid:  # a tied copy of a block already read is the same tensor
            out.setdefault(f"model.blocks.{hybrid.index(i) % args.n_mem_blocks}.{rest}", v)
        else:
            raise EdgekvError(f"{key}: a shared block on layer {i}, which layers_block_type says is not hybrid")
    return out


def read_zamba2(spec: str, max_ctx: int):
    """An HF folder of a zamba2 model -> Source (edgekv.models.FAMILIES), its tensors under this module's names."""
    from .base import read_source
    return read_source(spec, max_ctx, zamba2_args, renamed)


def build_zamba2(src, layout: StateLayout) -> Zamba2:
    from .base import load_strict
    return load_strict(Zamba2(src.args, layout), src.sd, src.path, "zamba2")
