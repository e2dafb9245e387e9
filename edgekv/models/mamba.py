"""Mamba-1 and Mamba-2 decode steps with explicit state: forward(tokens, pos, *state) -> (logits, *new_state).

Mirrors transformers' MambaForCausalLM (modeling_mamba.py, the torch path: causal_conv1d_fn + mamba_selective_scan /
mamba_selective_state_update) and Mamba2ForCausalLM (modeling_mamba2.py: mamba2_chunk_scan for prefill,
mamba2_selective_state_update for decode), which follow the papers' reference code (state-spaces/mamba,
`selective_state_update` and `ssd_minimal.py`).

Shape symbols:
  C   tokens in this call (chunked prefill: C > 1; decode: C = 1)
  d   hidden size        V  vocabulary
  Di  inner width (expand * d)          N  SSM state size      K  conv kernel      R  dt rank (Mamba-1)
  H   heads (Mamba-2)   P  head dim (H * P = Di)                G  groups (B and C shared by H / G heads each)
  Dc  conv channels: Di for Mamba-1, Di + 2 * G * N for Mamba-2 (x, B and C all pass through the conv)

The state is exactly the StateLayout of the `ssm` strategy (edgekv.strategies._ssm_pair), per block i in this order:
  past_conv.{i}  [1, Dc, K - 1]   the last K - 1 conv INPUTS (pre-activation), oldest first; fp32
  past_ssm.{i}   [1, Di, N]       Mamba-1: h per channel
                 [1, H, P, N]     Mamba-2: h per head
All zeros is the empty state (no tokens seen), exactly as transformers' cache starts.

Where this differs from transformers, and why the numbers are the same:
  - the causal conv is written as K shifted multiply-adds over [conv_state | new inputs] instead of F.conv1d with
    padding K - 1: the same sum w_0 x_{t-K+1} + ... + w_{K-1} x_t (+ bias), with zero padding coming from the zero
    initial state. Identical up to the order of fp32 additions (~1e-7 relative).
  - prefill runs the recurrence token by token (scan_tokens: a python loop over a fixed C, which torch.export
    unrolls; torch's scan, i.e. an ONNX Scan node, over the ONNX graph's dynamic token axis), where transformers'
    Mamba-2 uses the chunked SSD form (exp of segment sums). The SSD form is an exact re-association of the same
    recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, so the two agree to fp32 rounding (~1e-6).
  - Mamba-2 B and C are broadcast from G groups to H heads with expand + reshape instead of repeat_interleave (the
    same mapping: head h reads group h // (H / G)).
  - a state in fp16/bf16 (strategy dtype) is read into fp32, updated in fp32, and rounded when written back.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..arch import Cfg
from ..arch.model_types import SSM_LAYERS, Mamba, model_type
from ..errors import EdgekvError
from ..quant import dequantize, quantize
from ..strategies import StateLayout
from .base import DecoderShell, load_strict, read_source
from .layers import RMSNorm
from .ssm import GatedRMSNorm, Mamba1Mixer, Mamba2Mixer, MambaArgs, check_ssm_layout  # noqa: F401  (shared)


def args_from_hf_config(cfg: dict, where: str = "config.json") -> MambaArgs:
    mt = cfg.get("model_type")
    decl = model_type(mt)
    if decl is None or not issubclass(decl, Mamba):
        names = ", ".join(t.model_type for t in SSM_LAYERS.values())
        raise EdgekvError(f"{where}: model_type {mt!r} is not a mamba model ({names})")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise EdgekvError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (Mamba uses silu)")

    need = Cfg(cfg, where).int  # a required non-negative integer, one line naming it if missing

    hidden = need("hidden_size")
    common = dict(vocab=need("vocab_size"), hidden=hidden, n_layers=need("num_hidden_layers"),
                  eps=float(cfg.get("layer_norm_epsilon", 1e-5)), conv_bias=bool(cfg.get("use_conv_bias", True)),
                  proj_bias=bool(cfg.get("use_bias", False)), model_type=mt)
    if not decl.heads:  # MambaConfig: intermediate_size = expand * hidden, time_step_rank "auto" = ceil(hidden / 16)
        rank = cfg.get("time_step_rank", "auto")
        return MambaArgs(version=1, d_inner=int(cfg.get("intermediate_size") or cfg.get("expand", 2) * hidden),
                         d_state=int(cfg.get("state_size", decl.state_size)), d_conv=int(cfg.get("conv_kernel", 4)),
                         dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
                         tied=bool(cfg.get("tie_word_embeddings", True)), **common)
    heads, hd = need("num_heads"), int(cfg.get("head_dim", 64))
    if heads * hd != int(cfg.get("expand", 2) * hidden):
        raise EdgekvError(f"{where}: num_heads x head_dim ({heads} x {hd}) != expand x hidden_size")
    groups = int(cfg.get("n_groups", 8))
    if heads % groups:
        raise EdgekvError(f"{where}: num_heads {heads} is not a multiple of n_groups {groups}")
    return MambaArgs(version=2, d_inner=heads * hd, d_state=int(cfg.get("state_size", decl.state_size)),
                     d_conv=int(cfg.get("conv_kernel", 4)), n_heads=heads, head_dim=hd, n_groups=groups,
                     dt_limit=tuple(float(v) for v in cfg.get("time_step_limit", (0.0, math.inf))),
                     tied=bool(cfg.get("tie_word_embeddings", False)), **common)


class Block(nn.Module):
    def __init__(self, a: MambaArgs):
        super().__init__()
        self.norm = RMSNorm(a.hidden, a.eps)
        if a.version == 1:
            self.mixer = Mamba1Mixer(a.hidden, a.d_inner, a.d_state, a.d_conv, a.dt_rank, a.conv_bias, a.proj_bias)
        else:
            self.mixer = Mamba2Mixer(a.hidden, a.n_heads, a.head_dim, a.n_groups, a.d_state, a.d_conv, a.eps,
                                     a.conv_bias, a.proj_bias, a.dt_limit)


class MambaLM(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state).

    pos is accepted for the common signature and unused: a recurrent state needs no positions. state is the tensors
    of `layout` in its order (per block: past_conv, past_ssm). Parameter names as transformers' MambaModel /
    Mamba2Model (prefix `backbone`)."""

    def __init__(self, args: MambaArgs, layout: StateLayout):
        super().__init__(args, layout)
        roles = [(t.layer, t.role) for t in layout.tensors]
        self.quantized = any(r == "ssm.scale" for _, r in roles)
        per_block = ("conv", "ssm", "ssm.scale") if self.quantized else ("conv", "ssm")
        if roles != [(i, r) for i in range(args.n_layers) for r in per_block]:
            raise EdgekvError(f"strategy {layout.strategy}: the mamba module keeps {per_block} per block")
        check_ssm_layout(args, layout)
        self.rounding, self.generator = "nearest", None  # analyze sets stochastic rounding and a generator
        self.make_body([Block(args) for _ in range(args.n_layers)], RMSNorm(args.hidden, args.eps), "backbone",
                       ("embeddings", "layers", "norm_f"))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        x = self.backbone.embeddings(tokens)  # [1, C, d]
        new_state = []
        k = 3 if self.quantized else 2
        for i, blk in enumerate(self.backbone.layers):
            conv, ssm = state[k * i], state[k * i + 1]
            if self.quantized:  # int8 codes x fp32 scale per (channel|head, dim) row -> fp32 state for this call
                ssm = dequantize(ssm, state[k * i + 2], None, 8)  # scale [.., 1]: one group per row
            y, conv, ssm = blk.mixer(blk.norm(x), conv, ssm)
            x = x + y
            if self.quantized:  # stored back quantized: the error a call leaves is what the next call reads
                codes, scale, _ = quantize(ssm, 8, 0, self.rounding, self.generator, torch.float32)
                new_state += [conv, codes, scale]
            else:
                new_state += [conv, ssm]
        return (self.logits(x, rows), *new_state)


def read_mamba(spec: str, max_ctx: int):
    """An HF folder of a mamba / mamba2 model -> Source (the family registry's reader, edgekv.models.FAMILIES)."""
    return read_source(spec, max_ctx, lambda cfg, arch, where: args_from_hf_config(cfg, where),
                       lambda sd, args: {k.replace("backbone.embedding.", "backbone.embeddings."): v  # old checkpoints
                                         for k, v in sd.items()})


def build_mamba(src, layout: StateLayout) -> "MambaLM":
    return load_strict(MambaLM(src.args, layout), src.sd, src.path, src.args.model_type)


def load_mamba(spec: str, strategy, max_ctx: int):
    """An HF folder of a mamba / mamba2 model -> Loaded (module, args, arch, layout). max_ctx only names the layout:
    the state does not grow with the context."""
    from . import load_family
    return load_family("mamba", spec, strategy, max_ctx)
