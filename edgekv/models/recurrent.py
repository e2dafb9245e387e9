"""Linear recurrences with a fixed-size state, written for export: forward(tokens, pos, *state) -> (logits, *state).

Two mixers:
  LinearAttention  decayed linear attention with a matrix state per head (Katharopoulos et al. 2020, "Transformers
                   are RNNs", with a per-head learned decay as in RetNet / Lightning Attention):
                       S_t = a S_{t-1} + phi(k_t)^T [v_t | 1],    [num | den] = phi(q_t) S_t,    o_t = num / den
                   phi = elu + 1 (positive, so den > 0), a = sigmoid(decay) in (0, 1) per head. Written out, this is
                       o_t = sum_{s<=t} a^(t-s) (phi(q_t) . phi(k_s)) v_s / sum_{s<=t} a^(t-s) (phi(q_t) . phi(k_s))
                   i.e. causal attention with decayed, non-negative weights that sum to one. No transformers model
                   exists for it; tests compare it with that O(T^2) formula.
  RWKV-4           transformers' RwkvForCausalLM (modeling_rwkv.py, the CPU path rwkv_linear_attention_cpu): time-mix
                   with the numerically safe (num, den, max) WKV recurrence, channel-mix, token shift.

Shape symbols:
  C   tokens in this call     d  hidden size     V  vocabulary     F  MLP / channel-mix width
  H   heads                   Dk key dim per head                  Dv value dim per head

State per block i (edgekv.strategies._linear_state):
  LinearAttention  past_recurrent.{i} [1, H, Dk, Dv + 1]: the last column is the running normaliser
                   z_t = sum a^(t-s) phi(k_s) (the "| 1" appended to v), so numerator and denominator are one
                   recurrence and one tensor. The layout's d_v is therefore Dv + 1: see linear_arch().
  RWKV-4           past_recurrent.{i} [1, 5, d], fp32, rows in transformers' state order:
                   0 channel-mix token shift (last ln2 output), 1 time-mix token shift (last ln1 output),
                   2 num, 3 den, 4 max (the WKV exponent offset).
                   With linear:dtype=int8, three tensors per block instead:
                     past_recurrent.{i}        [1, 4, d] int8  rows 0-3 as above, symmetric codes (edgekv.quant)
                     past_recurrent.{i}.scale  [1, 4, 1] fp32  one scale per row (as the int8 SSM state's scales)
                     past_recurrent.{i}.max    [1, 1, d] fp32  row 4, exact
                   read as fp32 for the call (dequantize), updated in fp32, quantized again when written back.
All zeros is the empty state for both. For RWKV, transformers starts `max` at -1e30; here a den of 0 (which only the
empty state has: after one token den >= 1 in the shifted-exponent form) reads max as -1e30, so the zeros a runtime
allocates are a valid start and the numbers are exactly transformers'.

Which RWKV rows are int8, and why:
  - the two token shifts are LayerNorm outputs of the last token (a bounded range) and are replaced every token:
    their rounding is a one-token input error, like int8 activations, and cannot pile up by itself.
  - num and den are the decayed sums sum_s e^(w (t-s) + k_s - max) [v_s | 1]. max is the largest exponent, so every
    term is <= 1 and one is exactly 1: den >= 1, and the decay w < 0 keeps it small; num / den is a weighted mean
    of v, so |num| <= den * max|v|. Both stay in a modest range, which a per-row scale covers; its step den_max / 127
    is coarsest for the den = 1 channels, and those are the fast-decaying channels, which forget it quickly. This is
    the error that accumulates: the analyzer measures how.
    A den code that rounds to 0 (only when a row's den spread exceeds 254x) reads as that channel's empty state:
    the channel restarts instead of dividing by ~0.
  - max is a log-domain offset (a gauge: (num, den, max) and (num e^c, den e^c, max - c) are the same state). An
    absolute error e in it multiplies the channel's whole history against the new token by e^e, with a per-row
    step set by the largest |max| in the row, which follows the keys' range and has no bound the grid knows. It is
    1/5 of the state, so it stays fp32: per block the int8 state is 4d (codes) + 16 (scales) + 4d (max) = 8d + 16
    bytes against 20d in fp32.

Where RWKV differs from transformers, and why the numbers are the same:
  - in eval mode transformers rescales the model (rescale_every): block b's attention.output and feed_forward.value
    weights are divided by 2^(b // rescale_every) and the residual stream is halved after every rescale_every-th
    block. The loader divides the weights the same way and forward halves the stream at the same places, so this
    module computes what RwkvForCausalLM computes in eval mode.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import Cfg
from ..arch import model_types
from ..errors import EdgekvError
from ..quant import dequantize, quantize
from ..strategies import StateLayout
from .base import DecoderShell, load_strict, read_source, state_dtype
from .layers import MLP as LlamaMLP
from .layers import RMSNorm, scan_tokens

# ---- decayed linear attention ----


def phi(x):
    """The feature map: elu(x) + 1 > 0."""
    return F.elu(x) + 1.0


class LinearAttention(nn.Module):
    """Multi-head decayed linear attention with a [Dk, Dv + 1] state per head.

    forward(x [1, C, d], state [1, H, Dk, Dv+1]) -> (out [1, C, d], new state)."""

    def __init__(self, d: int, n_heads: int, d_k: int, d_v: int):
        super().__init__()
        self.h, self.dk, self.dv = n_heads, d_k, d_v
        self.q_proj = nn.Linear(d, n_heads * d_k, bias=False)
        self.k_proj = nn.Linear(d, n_heads * d_k, bias=False)
        self.v_proj = nn.Linear(d, n_heads * d_v, bias=False)
        self.o_proj = nn.Linear(n_heads * d_v, d, bias=False)
        self.decay = nn.Parameter(torch.zeros(n_heads))  # a = sigmoid(decay)

    def decays(self) -> torch.Tensor:
        return torch.sigmoid(self.decay)  # [H]

    def forward(self, x, state):
        c = x.shape[1]
        q = phi(self.q_proj(x).view(1, c, self.h, self.dk))  # [1, C, H, Dk]
        k = phi(self.k_proj(x).view(1, c, self.h, self.dk))
        v = self.v_proj(x).view(1, c, self.h, self.dv)
        v1 = torch.cat((v, torch.ones_like(v[..., :1])), dim=-1)  # [1, C, H, Dv+1]
        a = self.decays()[None, :, None, None]  # [1, H, 1, 1]
        dv = self.dv

        def step(carry, inp):  # s [1, H, Dk, Dv+1]; q_t, k_t [H, Dk]; v_t [H, Dv+1]
            (s,), (q_t, k_t, v_t) = carry, inp
            s = a * s + k_t[:, :, None] * v_t[:, None, :]  # [1, H, Dk, Dv+1]
            nd = (q_t[:, None, :] @ s)[:, :, 0]  # [1, H, Dv+1]
            return (s,), (nd[..., :dv] / nd[..., dv:],)

        (s,), (outs,) = scan_tokens(step, (state.float(),), (q[0], k[0], v1[0]))  # outs [C, 1, H, Dv]
        o = outs.transpose(0, 1).reshape(1, c, self.h * self.dv)
        return self.o_proj(o), s.to(state.dtype)


@dataclass
class LinearArgs:
    """A small decoder: per block RMSNorm -> LinearAttention -> residual, RMSNorm -> SwiGLU MLP -> residual."""
    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    d_k: int
    d_v: int
    intermediate: int
    rms_eps: float = 1e-6
    tied: bool = False
    mlp_bias: bool = False  # read by the SwiGLU MLP (edgekv.models.layers.MLP)

    def to_json(self) -> dict:
        return asdict(self)


class _LinearBlock(nn.Module):
    def __init__(self, a: LinearArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden, a.rms_eps)
        self.attn = LinearAttention(a.hidden, a.n_heads, a.d_k, a.d_v)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.rms_eps)
        self.mlp = LlamaMLP(a)


def linear_arch(a: LinearArgs, name: str = "linear-attention"):
    """The Arch of a LinearLM, so build_layout can size its state: Linear(H, Dk, Dv + 1) per block (the extra value
    column holds the normaliser)."""
    from ..arch import Arch, Block, Linear, Weight

    ws = [Weight(n, tuple(p.shape), "embedding" if "embed" in n else "lm_head" if "lm_head" in n else
                 "small" if p.dim() < 2 else "linear")
          for n, p in LinearLM._param_shapes(a)]
    blocks = tuple(Block((Linear(a.n_heads, a.d_k, a.d_v + 1),)) for _ in range(a.n_layers))
    return Arch(name=name, model_type="linear", family="linear", hidden=a.hidden, vocab=a.vocab, blocks=blocks,
                weights=tuple(ws), source="edgekv.models.recurrent.linear_arch")


class LinearLM(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V], *new_state); one
    past_recurrent.{i} [1, H, Dk, Dv + 1] per block. pos is unused (the state carries no positions)."""

    def __init__(self, args: LinearArgs, layout: StateLayout):
        super().__init__(args, layout)
        want = [(i, "recurrent", (1, args.n_heads, args.d_k, args.d_v + 1)) for i in range(args.n_layers)]
        if [(t.layer, t.role, t.shape) for t in layout.tensors] != want:
            raise EdgekvError(f"strategy {layout.strategy}: the linear-attention module keeps one [1, H, Dk, Dv+1] "
                              "state per block")
        for t in layout.tensors:
            state_dtype(layout, t)
        self.make_body([_LinearBlock(args) for _ in range(args.n_layers)], RMSNorm(args.hidden, args.rms_eps), None)

    @staticmethod
    def _param_shapes(a: LinearArgs):
        """(name, tensor) for every parameter, on the meta device (no memory)."""
        with torch.device("meta"):
            m = nn.Module()
            m.embed_tokens = nn.Embedding(a.vocab, a.hidden)
            m.layers = nn.ModuleList(_LinearBlock(a) for _ in range(a.n_layers))
            m.norm = RMSNorm(a.hidden, a.rms_eps)
            if not a.tied:
                m.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)
        return list(m.named_parameters())

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        x = self.embed_tokens(tokens)
        new_state = []
        for i, blk in enumerate(self.layers):
            h, s = blk.attn(blk.input_layernorm(x), state[i])
            x = x + h
            x = x + blk.mlp(blk.post_attention_layernorm(x))
            new_state.append(s)
        return (self.logits(x, rows), *new_state)


# ---- RWKV-4 ----


@dataclass
class RwkvArgs:
    vocab: int
    hidden: int
    n_layers: int
    intermediate: int
    eps: float = 1e-5
    rescale_every: int = 6
    tied: bool = False
    model_type: str = "rwkv"

    def to_json(self) -> dict:
        return asdict(self)


def rwkv_args(cfg: dict, where: str = "config.json") -> RwkvArgs:
    if cfg.get("model_type") != model_types.Rwkv.model_type:
        raise EdgekvError(f"{where}: model_type {cfg.get('model_type')!r} is not {model_types.Rwkv.model_type}")
    need = Cfg(cfg, where).int  # a required non-negative integer, one line naming it if missing
    hidden = need("hidden_size")
    att = int(cfg.get("attention_hidden_size") or hidden)
    if att != hidden:
        raise EdgekvError(f"{where}: attention_hidden_size {att} != hidden_size {hidden} is not supported "
                          "(the state layout keeps hidden-sized vectors)")
    return RwkvArgs(vocab=need("vocab_size"), hidden=hidden, n_layers=need("num_hidden_layers"),
                    intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
                    eps=float(cfg.get("layer_norm_epsilon", 1e-5)), rescale_every=int(cfg.get("rescale_every", 6)),
                    tied=bool(cfg.get("tie_word_embeddings", False)))


class RwkvTimeMix(nn.Module):
    """transformers' RwkvSelfAttention. forward(x [1, C, d] (after ln1), shift [1, d], num, den, mx [1, d])
    -> (out [1, C, d], new shift, num, den, mx)."""

    def __init__(self, d: int):
        super().__init__()
        self.time_decay = nn.Parameter(torch.zeros(d))
        self.time_first = nn.Parameter(torch.zeros(d))
        self.time_mix_key = nn.Parameter(torch.zeros(1, 1, d))
        self.time_mix_value = nn.Parameter(torch.zeros(1, 1, d))
        self.time_mix_receptance = nn.Parameter(torch.zeros(1, 1, d))
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.output = nn.Linear(d, d, bias=False)

    def forward(self, x, shift, num, den, mx):
        # [1, C, d]: the previous token's x (the slice after the cat: x[:, :-1] made torch.export specialize C = 2)
        shifted = torch.cat((shift[:, None], x), dim=1)[:, :-1]
        k = self.key(x * self.time_mix_key + shifted * (1 - self.time_mix_key))
        v = self.value(x * self.time_mix_value + shifted * (1 - self.time_mix_value))
        r = torch.sigmoid(self.receptance(x * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)))
        w = -torch.exp(self.time_decay)
        u = self.time_first
        mx = torch.where(den == 0, -1e30, mx)  # the empty state: transformers starts max at -1e30

        def step(carry, inp):  # num, den, mx [1, d]; kt, vt [d]
            (num, den, mx), (kt, vt) = carry, inp
            m_out = torch.maximum(mx, kt + u)
            e1, e2 = torch.exp(mx - m_out), torch.exp(kt + u - m_out)
            out = (e1 * num + e2 * vt) / (e1 * den + e2)
            m_st = torch.maximum(mx + w, kt)
            e1, e2 = torch.exp(mx + w - m_st), torch.exp(kt - m_st)
            return (e1 * num + e2 * vt, e1 * den + e2, m_st), (out,)

        (num, den, mx), (outs,) = scan_tokens(step, (num, den, mx), (k[0].float(), v[0]))  # outs [C, 1, d]
        return self.output(r * outs.transpose(0, 1)), x[:, -1], num, den, mx


class RwkvChannelMix(nn.Module):
    """transformers' RwkvFeedForward. forward(x [1, C, d] (after ln2), shift [1, d]) -> (out [1, C, d], new shift)."""

    def __init__(self, d: int, inter: int):
        super().__init__()
        self.time_mix_key = nn.Parameter(torch.zeros(1, 1, d))
        self.time_mix_receptance = nn.Parameter(torch.zeros(1, 1, d))
        self.key = nn.Linear(d, inter, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(inter, d, bias=False)

    def forward(self, x, shift):
        shifted = torch.cat((shift[:, None], x), dim=1)[:, :-1]
        k = torch.square(torch.relu(self.key(x * self.time_mix_key + shifted * (1 - self.time_mix_key))))
        r = torch.sigmoid(self.receptance(x * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)))
        return r * self.value(k), x[:, -1]


class RwkvBlock(nn.Module):
    def __init__(self, a: RwkvArgs, i: int):
        super().__init__()
        if i == 0:
            self.pre_ln = nn.LayerNorm(a.hidden, eps=a.eps)
        self.ln1 = nn.LayerNorm(a.hidden, eps=a.eps)
        self.ln2 = nn.LayerNorm(a.hidden, eps=a.eps)
        self.attention = RwkvTimeMix(a.hidden)
        self.feed_forward = RwkvChannelMix(a.hidden, a.intermediate)


class Rwkv4(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V], *new_state); per block one
    past_recurrent.{i} [1, 5, d] fp32 (rows: ffn shift, att shift, num, den, max), or with an int8 layout
    (past_recurrent.{i} [1, 4, d] int8, .scale [1, 4, 1] fp32, .max [1, 1, d] fp32): see the module docstring.
    pos is unused. rounding / generator: how the int8 writes round (analyze sets stochastic and a generator).
    Parameter names as transformers' RwkvForCausalLM (prefix `rwkv`, output matrix `head`)."""

    def __init__(self, args: RwkvArgs, layout: StateLayout):
        super().__init__(args, layout)
        d = args.hidden
        got = [(t.layer, t.role, t.shape, t.dtype) for t in layout.tensors]
        self.quantized = any(t.dtype == "int8" for t in layout.tensors)
        per_block = ([("recurrent", (1, 4, d), "int8"), ("recurrent.scale", (1, 4, 1), "float32"),
                      ("recurrent.max", (1, 1, d), "float32")] if self.quantized else
                     [("recurrent", (1, 5, d), "float32")])
        if got != [(i, *t) for i in range(args.n_layers) for t in per_block]:
            raise EdgekvError(f"strategy {layout.strategy}: the RWKV-4 module keeps per block one fp32 [1, 5, d] "
                              "state, or an int8 [1, 4, d] state with its [1, 4, 1] scales and an fp32 [1, 1, d] max")
        self.rounding, self.generator = "nearest", None
        # transformers' ln_out: default eps 1e-5, not layer_norm_epsilon
        self.make_body([RwkvBlock(args, i) for i in range(args.n_layers)], nn.LayerNorm(args.hidden), "rwkv",
                       ("embeddings", "blocks", "ln_out"), "head")

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        x = self.rwkv.embeddings(tokens)
        every = self.args.rescale_every
        new_state = []
        k = 3 if self.quantized else 1
        for i, blk in enumerate(self.rwkv.blocks):
            s = state[k * i]
            if self.quantized:  # int8 rows x fp32 scale per row, and the exact max -> the fp32 [1, 5, d] state
                s = torch.cat((dequantize(s, state[k * i + 1], None, 8), state[k * i + 2]), dim=1)
            if i == 0:
                x = blk.pre_ln(x)
            att, att_shift, num, den, mx = blk.attention(blk.ln1(x), s[:, 1], s[:, 2], s[:, 3], s[:, 4])
            x = x + att
            ffn, ffn_shift = blk.feed_forward(blk.ln2(x), s[:, 0])
            x = x + ffn
            if every > 0 and (i + 1) % every == 0:
                x = x / 2
            if self.quantized:  # stored back quantized: the error a call leaves is what the next call reads
                codes, scale, _ = quantize(torch.stack((ffn_shift, att_shift, num, den), dim=1), 8, 0, self.rounding,
                                           self.generator, torch.float32)
                new_state += [codes, scale, mx[:, None]]
            else:
                new_state.append(torch.stack((ffn_shift, att_shift, num, den, mx), dim=1))
        return (self.logits(x, rows), *new_state)


def read_rwkv(spec: str, max_ctx: int):
    """An HF folder of a transformers 'rwkv' (RWKV-4) model -> Source (edgekv.models.FAMILIES)."""
    return read_source(spec, max_ctx, lambda cfg, arch, where: rwkv_args(cfg, where), _rescale, head="head.weight")


def _rescale(sd: dict, args: "RwkvArgs") -> dict:
    """What RwkvModel._rescale_layers does on entering eval mode."""
    if args.rescale_every > 0:
        for b in range(args.n_layers):
            f = 2 ** (b // args.rescale_every)
            for k in (f"rwkv.blocks.{b}.attention.output.weight", f"rwkv.blocks.{b}.feed_forward.value.weight"):
                sd[k] = sd[k] / f
    return sd


def build_rwkv(src, layout: StateLayout) -> "Rwkv4":
    return load_strict(Rwkv4(src.args, layout), src.sd, src.path, "rwkv")


def load_rwkv(spec: str, strategy, max_ctx: int):
    """An HF folder of a transformers 'rwkv' (RWKV-4) model -> Loaded. strategy: linear (fp32) or linear:dtype=int8."""
    from . import load_family
    return load_family("rwkv-4", spec, strategy, max_ctx)
