"""LFM2 decode step (Liquid AI's LFM2 / LFM2.5), written for export: forward(tokens, pos, *state) -> (logits, *state).

Mirrors transformers' Lfm2ForCausalLM (models/lfm2/modeling_lfm2.py). Each layer is either
  - a gated short convolution (Lfm2ShortConv): B, C, x = in_proj(h) split in three; y = C * conv(B * x), a depthwise
    causal conv of kernel K = conv_L_cache (3 in the published models) over the hidden channels; out_proj(y); or
  - GQA attention (Lfm2Attention): RMSNorm over each head of q and k (q_layernorm / k_layernorm), RoPE, out_proj;
and then a SwiGLU MLP w2(silu(w1 h) * w3 h). Norms are pre-norms (operator_norm, ffn_norm); the final norm is
called embedding_norm. Which layer is which: layer_types (or full_attn_idxs), read by the planner's reader
(edgekv.arch._lfm2), so this module and its StateLayout agree.

Shape symbols:
  C   tokens in this call (chunked prefill: C > 1; decode: C = 1)
  T   KV cache slots (the StateLayout's ctx)          d  hidden size       V  vocabulary
  H, Hkv, D, G   query heads, KV heads, head dim, H / Hkv                  K  conv kernel (conv_L_cache)

State: exactly the planner's StateLayout (edgekv.strategies.build_layout), in layer order:
  conv layer i        past_conv.{i} [1, d, K-1] fp32: the last K - 1 conv inputs (B * x), oldest first
  attention layer i   past_key_values.{i}.key / .value [1, Hkv, T, D] (hybrid: its dtype; kv-int8/int4/int2:
                      codes + .scale (+ .zero) as edgekv.quant writes them)
Only the attention layers' state grows with the context; all zeros is the empty state.

Where this differs from transformers, and why the numbers are the same:
  - the conv is edgekv.models.mamba.causal_conv_step (K shifted multiply-adds over [conv state | new inputs]) where
    transformers runs F.conv1d with K - 1 zeros of padding (prefill) or over its [1, d, K] conv cache (decode): the
    same sum, with the zero padding coming from the zero initial state;
  - attention is edgekv.models.llama.Attention over a fixed [1, Hkv, T, D] cache (its notes apply: one-hot
    writes, a position mask, qk-norm before RoPE, quantized caches through KVFormat), so a quantized KV on the
    attention layers of this hybrid is the same code as on a Llama. The checkpoint's out_proj / q_layernorm /
    k_layernorm / w1 / w3 / w2 load into that module's o_proj / q_norm / k_norm / gate_proj / up_proj / down_proj
    (read_lfm2 renames them).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..arch import Cfg
from ..arch import model_types
from ..errors import EdgekvError
from ..strategies import StateLayout
from .base import DecoderShell
from .layers import MLP, RMSNorm, causal_conv_step, rope_cos_sin, rope_inv_freq
from .attention import Attention
from .cache import cache_plan, hybrid_kv_format
from .llama import LlamaArgs, attention_args


@dataclass
class Lfm2Args:
    vocab: int
    hidden: int
    n_layers: int
    kinds: list  # "conv" | "attention" per layer
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int  # the MLP width after Lfm2MLP's block_auto_adjust_ff_dim
    d_conv: int
    conv_bias: bool = False
    eps: float = 1e-5
    rope_theta: float = 1e6
    tied: bool = True
    max_position: int | None = None
    model_type: str = "lfm2"

    def attention_args(self) -> LlamaArgs:
        """The numbers edgekv.models.llama's Attention and MLP take: qk-norm, one RoPE base, no biases."""
        return attention_args(self, qk_norm="head")

    def to_json(self) -> dict:
        return asdict(self)


def lfm2_args(cfg: dict, arch, where: str = "config.json") -> Lfm2Args:
    """Lfm2Config's fields and defaults; the layer kinds and MLP width as the planner's reader derived them."""
    if cfg.get("model_type") != model_types.Lfm2.model_type:
        raise EdgekvError(f"{where}: model_type {cfg.get('model_type')!r} is not {model_types.Lfm2.model_type}")
    c = Cfg(cfg, where)
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise EdgekvError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported (default)")
    kinds = ["attention" if m.kind == "attention" else "conv" for b in arch.blocks for m in b.mixers]
    attn = next((m for b in arch.blocks for m in b.mixers if m.kind == "attention"), None)
    conv = next((m for b in arch.blocks for m in b.mixers if m.kind == "conv"), None)
    heads = c.int("num_attention_heads")
    inter = next(w.shape[0] for w in arch.weights if w.name.endswith("feed_forward.w1.weight"))
    return Lfm2Args(
        vocab=arch.vocab, hidden=arch.hidden, n_layers=arch.n_layers, kinds=kinds, n_heads=heads,
        n_kv_heads=attn.n_kv_heads if attn else heads, head_dim=attn.head_dim if attn else arch.hidden // heads,
        intermediate=inter, d_conv=conv.d_conv if conv else c.int("conv_L_cache", default=3),
        conv_bias=bool(cfg.get("conv_bias", False)), eps=float(cfg.get("norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e6))),
        tied=bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
        max_position=cfg.get("max_position_embeddings"))


# ---- the module ----


class ShortConv(nn.Module):
    """Lfm2ShortConv: out_proj(C * conv(B * x)) with B, C, x = in_proj(h). Parameter names as transformers'."""

    def __init__(self, d: int, k: int, bias: bool):
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, groups=d, bias=bias, padding=k - 1)  # weights only: [d, 1, K]
        self.in_proj = nn.Linear(d, 3 * d, bias=bias)
        self.out_proj = nn.Linear(d, d, bias=bias)

    def forward(self, x, conv_state):
        """x [1, C, d]; conv_state [1, d, K-1] -> y [1, C, d], new conv_state."""
        b, gate, xs = self.in_proj(x).transpose(1, 2).chunk(3, dim=1)  # [1, d, C] each
        y, conv_state = causal_conv_step(b * xs, conv_state, self.conv.weight[:, 0], self.conv.bias)
        return self.out_proj((gate * y).transpose(1, 2)), conv_state


class Lfm2Layer(nn.Module):
    def __init__(self, a: Lfm2Args, i: int):
        super().__init__()
        self.kind = a.kinds[i]
        if self.kind == "conv":
            self.conv = ShortConv(a.hidden, a.d_conv, a.conv_bias)
        else:
            self.self_attn = Attention(a.attention_args())
        self.feed_forward = MLP(a.attention_args())
        self.operator_norm = RMSNorm(a.hidden, a.eps)
        self.ffn_norm = RMSNorm(a.hidden, a.eps)


class Lfm2(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state); state in the
    layout's order (module docstring). Callers keep pos + C <= T."""

    def __init__(self, args: Lfm2Args, layout: StateLayout):
        super().__init__(args, layout)
        attn = [i for i, k in enumerate(args.kinds) if k == "attention"]
        convs = {i: ("conv",) for i, k in enumerate(args.kinds) if k == "conv"}
        self.kv = hybrid_kv_format(layout, attn, args.n_kv_heads, args.head_dim, convs)
        for t in layout.tensors:
            if t.role == "conv" and (t.shape != (1, args.hidden, args.d_conv - 1) or t.dtype != "float32"):
                raise EdgekvError(f"{t.name}: {t.shape} {t.dtype} is not [1, {args.hidden}, {args.d_conv - 1}] fp32")
        self.make_body([Lfm2Layer(args, i) for i in range(args.n_layers)], RMSNorm(args.hidden, args.eps),
                       names=("embed_tokens", "layers", "embedding_norm"))
        self.register_buffer("inv_freq", rope_inv_freq(args.attention_args()), persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        c = tokens.shape[1]
        g = self.args.n_heads // self.args.n_kv_heads
        positions, write, keep, mask = cache_plan(pos, c, self.layout.ctx, g, self.kv.dtype or torch.float32)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [C, 1, D]
        x = self.model.embed_tokens(tokens)
        n, s, new_state = self.kv.n, 0, []
        for blk in self.model.layers:
            h = blk.operator_norm(x)
            if blk.kind == "conv":
                h, conv = blk.conv(h, state[s])
                new_state.append(conv)
                s += 1
            else:
                h, k, v = blk.self_attn(h, cos, sin, write, keep, mask, state[s:s + n], state[s + n:s + 2 * n], self.kv)
                new_state += [*k, *v]
                s += 2 * n
            x = x + h
            x = x + blk.feed_forward(blk.ffn_norm(x))
        return (self.logits(x, rows), *new_state)


RENAMES = {".self_attn.out_proj.": ".self_attn.o_proj.", ".self_attn.q_layernorm.": ".self_attn.q_norm.",
           ".self_attn.k_layernorm.": ".self_attn.k_norm.", ".feed_forward.w1.": ".feed_forward.gate_proj.",
           ".feed_forward.w3.": ".feed_forward.up_proj.", ".feed_forward.w2.": ".feed_forward.down_proj."}


def _renamed(key: str) -> str:
    for a, b in RENAMES.items():
        if a in key:
            return key.replace(a, b)
    return key


def read_lfm2(spec: str, max_ctx: int):
    """An HF folder of an lfm2 model -> Source (edgekv.models.FAMILIES), its tensors under this module's names."""
    from .base import read_source
    return read_source(spec, max_ctx, lfm2_args, lambda sd, args: {_renamed(k): v for k, v in sd.items()})


def build_lfm2(src, layout: StateLayout) -> Lfm2:
    from .base import load_strict
    return load_strict(Lfm2(src.args, layout), src.sd, src.path, "lfm2")
