"""Qwen3.5 decode step (Gated DeltaNet + gated full attention), written for export:
forward(tokens, pos, *state) -> (logits, *new_state).

Mirrors transformers' Qwen3_5ForCausalLM (modeling_qwen3_5.py; the text model of Qwen3_5ForConditionalGeneration,
whose checkpoints keep it under model.language_model). Layers are layer_types[i]: linear_attention (every layer but
each full_attention_interval-th, default 4) or full_attention. Each layer: x + mixer(input_layernorm(x)), then
x + MLP(post_attention_layernorm(x)) (SwiGLU); RMSNorms scale by (1 + w) (Qwen3_5RMSNorm); tied head optional.

Shape symbols:
  C   tokens in this call (chunked prefill: C > 1; decode: C = 1)     d  hidden size     V  vocabulary
  T   KV cache slots (the StateLayout's ctx)
  H, Hkv, D, R   full attention: query heads, KV heads, head dim, rotated channels (partial_rotary_factor * D)
  Hk, Hv, Dk, Dv  Gated DeltaNet: key heads, value heads (Hv / Hk value heads share a key head), key / value head dim
  Dc = 2 Hk Dk + Hv Dv (q, k, v through the causal conv), K conv kernel

State: exactly the `hybrid` StateLayout (edgekv.strategies.build_layout), in layer order:
  full attention layer i   past_key_values.{i}.key, past_key_values.{i}.value  [1, Hkv, T, D]  (strategy dtype)
  linear layer i           past_conv.{i} [1, Dc, K-1] fp32 (the last K-1 conv inputs, oldest first),
                           past_recurrent.{i} [1, Hv, Dk, Dv] (state_dtype; read into fp32, rounded when written)
Only the full attention layers' state grows with the context. All zeros is the empty state.

The Gated DeltaNet layer (Qwen3_5GatedDeltaNet; Yang et al. 2024, "Gated Delta Networks"): q, k, v = silu(causal
depthwise conv(in_proj_qkv(x))); q, k L2-normalised per head (eps 1e-6), q scaled by Dk^-1/2; beta = sigmoid(in_proj_b
x), g = -exp(A_log) softplus(in_proj_a x + dt_bias); per token t and value head h, with S [Dk, Dv]:
    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
then o = RMSNorm(o) * w * silu(in_proj_z x) per head (Qwen3_5RMSNormGated: plain w) and out_proj.
Where this differs from transformers, and why the numbers are the same:
  - the recurrence runs token by token for every call (edgekv.models.layers.scan_tokens: unrolled over a fixed C in
    the .pte's prefill and decode methods, an ONNX Scan over the ONNX graph's dynamic token axis), where transformers
    prefills with the chunked form (torch_chunk_gated_delta_rule, chunks of 64: the WY representation of the same
    products) and decodes with this recurrence (torch_recurrent_gated_delta_rule); equal to fp32 rounding. ExecuTorch's
    own recipe (examples/models/llama/attention.py AttentionGatedDeltaNet) also steps it per token, its state in
    module buffers; here the state is explicit input/output.
  - the conv is edgekv.models.layers.causal_conv_step (K shifted multiply-adds over [conv state | new inputs]).
  - value heads read key head h // (Hv / Hk) through expand + reshape (repeat_interleave's mapping).
The full attention layer (Qwen3_5Attention) is edgekv.models.llama's Attention (its explicit graph; kv-int8/int4 via
its KVFormat) with three things done at load time or around it:
  - q_proj's rows are [q (D), gate (D)] per head: split into q_proj and gate_proj; the output is
    o_proj(attention * sigmoid(gate_proj(x))): the llama Attention's own o_proj is an identity here and o_proj runs
    after the gate.
  - partial RoPE (R of D channels, pairs j, j + R/2) as the llama module's full rotation (pairs j, j + D/2) of
    permuted q/k channels with frequency 0 on the pass-through ones (edgekv.models.phi3.rope_layout: the same
    permutation of q, k and their norms' weights leaves q.k unchanged). Qwen3.5's M-RoPE sections coincide for text
    (the same position on all three axes), so it is plain RoPE on the first R channels.
  - q_norm / k_norm are (1 + w) RMSNorms over D, as the llama Attention's Gemma-style qk-norm.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import Cfg
from ..arch.model_types import model_type
from ..errors import EdgekvError
from ..strategies import StateLayout
from .attention import Attention
from .base import DecoderShell, load_strict, read_source, state_dtype
from .cache import KVFormat, layout_storage
from .layers import MLP, RMSNorm, causal_conv_step, rope_cos_sin, rope_inv_freq, scan_tokens
from .llama import LlamaArgs, attention_args



@dataclass
class Qwen35Args:
    vocab: int
    hidden: int
    n_layers: int
    kinds: list  # "linear_attention" | "full_attention" per layer
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary: int  # R: channels of a q/k head that rotate
    rope_theta: float
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    rms_eps: float = 1e-6
    tied: bool = False
    max_position: int | None = None
    attention_bias: bool = False
    model_type: str = "qwen3_5_text"

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def to_json(self) -> dict:
        return asdict(self)

    def attention_args(self) -> LlamaArgs:
        """The llama module's args for the full attention layers (qk-norm with (1 + w) weights, D^-1/2 scale); RoPE
        over all D channels with zero frequencies past R/2 (rope_freq_factors inf), q/k permuted at load."""
        d, r = self.head_dim, self.rotary
        factors = [self.rope_theta ** (2 * j / r - 2 * j / d) if j < r // 2 else float("inf") for j in range(d // 2)]
        return attention_args(self, qk_norm="head", norm_offset=1.0, rope_freq_factors=factors)


def text_config(cfg: dict) -> dict:
    """The Qwen3_5TextConfig fields of a config.json: itself (qwen3_5_text) or the text_config of a qwen3_5 wrapper
    (tie_word_embeddings falls back to the wrapper's)."""
    wrapper = model_type(cfg.get("model_type"))
    if wrapper is not None and wrapper.text_model and isinstance(cfg.get("text_config"), dict):
        return {**{f: cfg.get(f) for f in wrapper.wrapper_fields}, **cfg["text_config"]}
    return cfg


def qwen3_5_args(cfg: dict, where: str = "config.json") -> Qwen35Args:
    """Qwen3_5TextConfig's fields and defaults (layer_types from full_attention_interval, partial_rotary_factor 0.25,
    head_dim 256, the linear heads 16 / 32 of dims 128, kernel 4), as configuration_qwen3_5.py has them."""
    cfg = text_config(cfg)
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise EdgekvError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    c = Cfg(cfg, where)
    n, hidden, heads = c.int("num_hidden_layers"), c.int("hidden_size"), c.int("num_attention_heads")
    kinds = cfg.get("layer_types") or ["linear_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4))
                                       else "full_attention" for i in range(n)]
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise EdgekvError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported (default)")
    d = c.int("head_dim", default=256)
    r = int(d * float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))))
    if r % 2 or not 0 < r <= d:
        raise EdgekvError(f"{where}: partial_rotary_factor gives {r} rotated channels of {d}: not an even number")
    a = Qwen35Args(
        vocab=c.int("vocab_size"), hidden=hidden, n_layers=n, kinds=list(kinds), intermediate=c.int("intermediate_size"),
        n_heads=heads, n_kv_heads=c.int("num_key_value_heads", default=heads), head_dim=d, rotary=r,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        k_heads=c.int("linear_num_key_heads", default=16), v_heads=c.int("linear_num_value_heads", default=32),
        k_dim=c.int("linear_key_head_dim", default=128), v_dim=c.int("linear_value_head_dim", default=128),
        conv_kernel=c.int("linear_conv_kernel_dim", default=4), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied=bool(cfg.get("tie_word_embeddings", False)), max_position=cfg.get("max_position_embeddings"),
        attention_bias=bool(cfg.get("attention_bias", False)))
    if a.v_heads % a.k_heads or a.n_heads % a.n_kv_heads:
        raise EdgekvError(f"{where}: value heads must be a multiple of key heads, query heads of KV heads")
    return a


class GatedDeltaNet(nn.Module):
    """Qwen3_5GatedDeltaNet with explicit state (module docstring). Parameter names as transformers'."""

    def __init__(self, a: Qwen35Args):
        super().__init__()
        self.hk, self.hv, self.dk, self.dv = a.k_heads, a.v_heads, a.k_dim, a.v_dim
        self.eps = a.rms_eps
        self.in_proj_qkv = nn.Linear(a.hidden, a.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(a.hidden, a.v_heads * a.v_dim, bias=False)
        self.in_proj_b = nn.Linear(a.hidden, a.v_heads, bias=False)
        self.in_proj_a = nn.Linear(a.hidden, a.v_heads, bias=False)
        self.conv1d = nn.Conv1d(a.conv_dim, a.conv_dim, a.conv_kernel, groups=a.conv_dim, bias=False,
                                padding=a.conv_kernel - 1)  # weights only: [Dc, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(a.v_heads))
        self.A_log = nn.Parameter(torch.zeros(a.v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(a.v_dim))  # Qwen3_5RMSNormGated's weight (plain, not 1 + w)
        self.out_proj = nn.Linear(a.v_heads * a.v_dim, a.hidden, bias=False)

    def forward(self, x, conv_state, rec_state):
        """x [1, C, d]; conv_state [1, Dc, K-1] fp32; rec_state [1, Hv, Dk, Dv] -> y [1, C, d], new states."""
        c = x.shape[1]
        mixed, conv_state = causal_conv_step(self.in_proj_qkv(x).transpose(1, 2), conv_state,
                                             self.conv1d.weight[:, 0], None)
        mixed = F.silu(mixed)[0].t()  # [C, Dc]
        q, k, v = torch.split(mixed, [self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        rep = self.hv // self.hk

        def heads(t):  # [C, Hk*Dk] -> [C, Hv, Dk], L2-normalised (value head h reads key head h // rep)
            t = t.reshape(-1, self.hk, 1, self.dk).expand(-1, self.hk, rep, self.dk).reshape(-1, self.hv, self.dk)
            return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)

        q, k = heads(q) * (self.dk ** -0.5), heads(k)
        v = v.reshape(-1, self.hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x)[0])  # [C, Hv]
        decay = torch.exp(-torch.exp(self.A_log.float()) * F.softplus(self.in_proj_a(x)[0].float() + self.dt_bias))

        def step(carry, inp):  # S [Hv, Dk, Dv]; decay_t, beta_t [Hv]; q_t, k_t [Hv, Dk]; v_t [Hv, Dv]
            s = carry[0] * inp[0][:, None, None]
            q_t, k_t, v_t, b_t = inp[1], inp[2], inp[3], inp[4]
            kv_mem = (s * k_t[:, :, None]).sum(1)  # [Hv, Dv]: S^T k
            s = s + k_t[:, :, None] * ((v_t - kv_mem) * b_t[:, None])[:, None, :]
            return (s,), ((s * q_t[:, :, None]).sum(1),)

        (s,), (o,) = scan_tokens(step, (rec_state[0].float(),), (decay, q, k, v, beta))  # o [C, Hv, Dv]
        z = self.in_proj_z(x).reshape(-1, self.hv, self.dv)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.weight * F.silu(z)
        return self.out_proj(o.reshape(1, c, self.hv * self.dv)), conv_state, s[None].to(rec_state.dtype)


class GatedAttention(Attention):
    """Qwen3_5Attention: the llama Attention (qk-norm, RoPE, GQA over the fixed cache) with its output gated per
    channel before o_proj. The parent's o_proj is an identity; `out` is the checkpoint's o_proj."""

    def __init__(self, a: LlamaArgs):
        super().__init__(a)
        self.gate_proj = nn.Linear(a.hidden, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.out = nn.Linear(a.n_heads * a.head_dim, a.hidden, bias=a.o_bias)
        self.o_proj = nn.Identity()

    def gated(self, x, *args):
        """forward(x, *args) of the llama Attention, its output times sigmoid(gate_proj(x)), then o_proj."""
        h, k, v = self.forward(x, *args)
        return self.out(h * torch.sigmoid(self.gate_proj(x))), k, v


class Layer(nn.Module):
    def __init__(self, a: Qwen35Args, la: LlamaArgs, i: int):
        super().__init__()
        self.kind = a.kinds[i]
        if self.kind == "full_attention":
            self.self_attn = GatedAttention(la)
        else:
            self.linear_attn = GatedDeltaNet(a)
        self.mlp = MLP(la)
        self.input_layernorm = RMSNorm(a.hidden, a.rms_eps, 1.0)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.rms_eps, 1.0)



def kv_format(a: Qwen35Args, layout: StateLayout) -> KVFormat:
    """The layout must hold, in layer order, (key, value) for full attention layers (the parts the strategy's KV
    storage declares: float, or edgekv.quant codes with scales) and (conv, recurrent) for linear ones, in the shapes
    this module keeps; returns how the KV is stored."""
    st = layout_storage(layout)
    kv_roles = st.roles(a.head_dim)
    want = [(i, r) for i, k in enumerate(a.kinds) for r in (kv_roles if k == "full_attention" else
                                                            ("conv", "recurrent"))]
    if [(t.layer, t.role) for t in layout.tensors] != want:
        raise EdgekvError(f"strategy {layout.strategy}: the qwen3_5 module keeps (key, value) per full attention layer "
                          f"and (conv, recurrent) per linear layer (roles {sorted({t.role for t in layout.tensors})})")
    stored = st.stored_width(a.head_dim)
    shapes = {"key": (1, a.n_kv_heads, layout.ctx, stored), "value": (1, a.n_kv_heads, layout.ctx, stored),
              "conv": (1, a.conv_dim, a.conv_kernel - 1), "recurrent": (1, a.v_heads, a.k_dim, a.v_dim)}
    for t in layout.tensors:
        if t.role in shapes and t.shape != shapes[t.role]:
            raise EdgekvError(f"{t.name}: shape {t.shape} is not {list(shapes[t.role])}")
        if t.role in ("conv", "recurrent"):
            state_dtype(layout, t)
            if t.role == "conv" and t.dtype != "float32" or t.dtype == "int8":
                raise EdgekvError(f"{t.name}: the qwen3_5 module keeps its {t.role} state in a float dtype, not "
                                  f"{t.dtype}")
    if not st.exportable:
        dtypes = {t.dtype for t in layout.tensors if t.role in ("key", "value")}
        raise EdgekvError(f"strategy {layout.strategy}: KV dtype {', '.join(sorted(dtypes))} is not supported "
                          "(fp32, fp16)")
    return KVFormat(st)


class Qwen35(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state); state in the
    layout's order. Callers keep pos + C <= T."""

    def __init__(self, args: Qwen35Args, layout: StateLayout):
        super().__init__(args, layout)
        self.kv = kv_format(args, layout)
        self.cache_dtype = self.kv.dtype or torch.float32
        la = args.attention_args()
        self.make_body([Layer(args, la, i) for i in range(args.n_layers)], RMSNorm(args.hidden, args.rms_eps, 1.0))
        self.register_buffer("inv_freq", rope_inv_freq(la), persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        c, t_slots = tokens.shape[1], self.layout.ctx
        g = self.args.n_heads // self.args.n_kv_heads
        positions = pos + torch.arange(c, dtype=torch.int64, device=pos.device)  # [C]
        # the llama module's plain-cache plan (Llama.forward): one-hot writes, kept slots, causal additive mask
        slots = torch.arange(t_slots, dtype=torch.int64, device=pos.device)  # [T]
        write = (slots[:, None] == positions[None, :]).float()  # [T, C]
        keep = ((slots < pos) | (slots >= pos + c)).to(self.cache_dtype)[:, None]  # [T, 1]
        mask = torch.where(slots[None, :] <= positions.repeat(g)[:, None], 0.0, float("-inf"))  # [G*C, T]
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [C, 1, D]

        x = self.model.embed_tokens(tokens)
        new_state, j, n = [], 0, self.kv.n
        for layer in self.model.layers:
            h = layer.input_layernorm(x)
            if layer.kind == "full_attention":
                ks, vs = state[j:j + n], state[j + n:j + 2 * n]
                h, ks, vs = layer.self_attn.gated(h, cos, sin, write, keep, mask, ks, vs, self.kv)
                new_state += [*ks, *vs]
                j += 2 * n
            else:
                h, conv, rec = layer.linear_attn(h, state[j], state[j + 1])
                new_state += [conv, rec]
                j += 2
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return (self.logits(x, rows), *new_state)


def _permuted(w: torch.Tensor, n: int, d: int, perm: list[int] | None) -> torch.Tensor:
    """Rows [n*D, ...] (or a [D] norm weight, n = 1) with each head's channels in perm's order."""
    if perm is None:
        return w
    return w.reshape(n, d, *w.shape[1:])[:, perm].reshape(w.shape).clone()


def convert(sd: dict, a: Qwen35Args) -> dict:
    """A Qwen3_5ForCausalLM (or Qwen3_5ForConditionalGeneration: model.language_model.*) state dict -> this module's:
    the vision tower and multi-token-prediction weights dropped, q_proj split into q_proj and gate_proj, o_proj
    renamed out, q/k rows and their norms permuted for the partial RoPE (edgekv.models.phi3.rope_layout)."""
    from .phi3 import rope_layout
    cfg = {"hidden_size": a.n_heads * a.head_dim, "num_attention_heads": a.n_heads,
           "rope_parameters": {"rope_theta": a.rope_theta, "partial_rotary_factor": a.rotary / a.head_dim}}
    _, _, perm, _ = rope_layout(cfg, None, "qwen3_5")
    out = {}
    for name, w in sd.items():
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        elif name.startswith(("model.visual.", "mtp.", "model.mtp.")):
            continue
        if not name.startswith(("model.", "lm_head.")):
            continue
        d, h, hkv = a.head_dim, a.n_heads, a.n_kv_heads
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            both = w.reshape(h, 2 * d, *w.shape[1:])
            q, gate = both[:, :d].reshape(h * d, *w.shape[1:]), both[:, d:].reshape(h * d, *w.shape[1:])
            out[name] = _permuted(q, h, d, perm)
            out[name.replace("q_proj", "gate_proj")] = gate.clone()
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            out[name] = _permuted(w, hkv, d, perm)
        elif name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            out[name] = _permuted(w, 1, d, perm)
        elif ".self_attn.o_proj." in name:
            out[name.replace(".o_proj.", ".out.")] = w
        else:
            out[name] = w
    if a.tied:
        out.pop("lm_head.weight", None)
    return out


def read_qwen3_5(spec: str, max_ctx: int):
    """An HF folder of a Qwen3.5 model (qwen3_5_text, or the qwen3_5 image-text wrapper's text model) -> Source
    (edgekv.models.FAMILIES)."""
    return read_source(spec, max_ctx, lambda cfg, arch, where: qwen3_5_args(cfg, where), convert)


def build_qwen3_5(src, layout: StateLayout) -> Qwen35:
    return load_strict(Qwen35(src.args, layout), src.sd, src.path, "qwen3_5")
