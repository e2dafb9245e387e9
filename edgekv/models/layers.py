"""The torch layers the export modules share (llama, mla, mamba, recurrent, hybrid and the families added beside them).

  RMSNorm            x / rms(x) * w in fp32; offset 1 for Gemma's (1 + w) form (LlamaRMSNorm, Gemma3RMSNorm)
  MLP                SwiGLU / GeGLU with optional biases, parameter names gate_proj / up_proj / down_proj
  SwiGLU             the bias-free SwiGLU (DeepSeek, Jamba)
  gelu_tanh          gelu's tanh approximation written out (transformers' gelu_pytorch_tanh)
  rope_inv_freq      RoPE inverse frequencies (default, linear, llama3, llama.cpp factors); rope_cos_sin, rotate_half
  Experts, MoE       top-k routed experts stored stacked; stack_experts loads them (DeepSeekMoE, Jamba)
  scan_tokens        a recurrence over the call's tokens (a Python loop, or torch's scan for a symbolic token count)
  causal_conv_step   a depthwise causal conv continuing from the last K - 1 inputs (Mamba; short convolutions)
  slot_plan          one-hot writes and the causal mask of a cache with one slot per position

Shape symbols as in the modules: C tokens in the call, T cache slots, d hidden, D head dim.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import EdgekvError


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in fp32 (transformers' LlamaRMSNorm); with offset 1, x / rms(x) * (1 + weight)
    (Gemma3RMSNorm, whose stored weight is the difference from 1)."""

    def __init__(self, d: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.offset = offset

    def forward(self, x):  # [..., d] -> [..., d]
        x32 = x.float()
        w = self.weight + self.offset if self.offset else self.weight
        sq = x32.pow(2)
        if sq.dim() == 3:  # [1, C, d] -> [1, C, 1, d]: a mean over the two innermost dims of a 4-D tensor is the
            b, c, d = sq.shape  # only mean XNNPACK delegates
            # -1, not c: XNNPACK delegates a reshape with one inferred dim, not one with a symbolic (dynamic) dim
            ms = sq.view(b, -1, 1, d).mean((2, 3), keepdim=True).view(b, -1, 1)
        else:
            ms = sq.mean(-1, keepdim=True)
        return w * (x32 * torch.rsqrt(ms + self.eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [C] -> cos, sin [C, D] for rotate_half RoPE (each frequency twice: the first and second halves)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [C, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rope_inv_freq(a) -> torch.Tensor:
    """[D/2] inverse frequencies from a's head_dim, rope_theta, rope_scaling, max_position and rope_freq_factors
    (LlamaArgs' fields), computed as transformers' ROPE_INIT_FUNCTIONS do (modeling_rope_utils.py)."""
    d = a.head_dim
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = a.rope_scaling or {}
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":  # _compute_llama3_parameters
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s.get("original_max_position_embeddings") or a.max_position)
        lo_wl, hi_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < hi_wl) * ~(wavelen > lo_wl)
        inv = torch.where(medium, smoothed, inv_l)
    if a.rope_freq_factors is not None:  # llama.cpp: theta / freq_factor (llama3 rope as written by convert_hf_to_gguf)
        inv = inv / torch.tensor(a.rope_freq_factors, dtype=torch.float32)
    return inv


def rotate_half(x):
    """x [..., D] -> cat(-x[..., D/2:], x[..., :D/2]), the rotation RoPE applies (transformers' rotate_half)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU (Gemma) with gelu's tanh approximation for silu. Reads a's hidden,
    intermediate, mlp_bias and act (LlamaArgs' fields; act defaults to silu)."""

    def __init__(self, a):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden, a.intermediate, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden, a.intermediate, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate, a.hidden, bias=a.mlp_bias)
        self.gelu = getattr(a, "act", "silu") == "gelu_tanh"  # other modules reuse this MLP with their own args

    def forward(self, x):
        g = self.gate_proj(x)
        return self.down_proj((gelu_tanh(g) if self.gelu else F.silu(g)) * self.up_proj(x))


GELU_BETA = math.sqrt(2.0 / math.pi)


def gelu_tanh(x):
    """gelu with the tanh approximation (transformers' gelu_pytorch_tanh), written out as torch computes it:
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Not F.gelu(approximate="tanh"): ExecuTorch's XNNPACK delegate
    lowers that to the erf gelu, while it runs this form's tanh, mul and add as written."""
    return 0.5 * x * (1.0 + torch.tanh(GELU_BETA * (x + 0.044715 * (x * x * x))))


class Experts(nn.Module):
    """E SwiGLU experts stored stacked. forward(x [N, d], weights [N, E] (zero off the top-k), idx [N, k] top-k ids,
    topw [N, k] their weights) -> [N, d]."""

    def __init__(self, n_experts: int, d: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(n_experts, inter, d))
        self.up_proj = nn.Parameter(torch.zeros(n_experts, inter, d))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, d, inter))

    def forward(self, x, dense_w, idx, topw):
        if isinstance(x.shape[0], int) and x.shape[0] == 1:  # decode: read only the k chosen experts (a symbolic
            # token count, the ONNX graph's dynamic axis, takes the dense path, which is right for every C)
            g, u, dn = self.gate_proj[idx[0]], self.up_proj[idx[0]], self.down_proj[idx[0]]  # [k, I, d] / [k, d, I]
            h = F.silu(torch.einsum("kid,d->ki", g, x[0])) * torch.einsum("kid,d->ki", u, x[0])  # [k, I]
            return (torch.einsum("kdi,ki->kd", dn, h) * topw[0, :, None]).sum(0, keepdim=True)
        h = F.silu(torch.einsum("eid,nd->nei", self.gate_proj, x)) * torch.einsum("eid,nd->nei", self.up_proj, x)
        out = torch.einsum("edi,nei->ned", self.down_proj, h)  # [N, E, d]
        return (out * dense_w[:, :, None]).sum(1)


class MoE(nn.Module):
    """Top-k of softmax(router logits), weights not renormalised, times routed_scaling_factor (transformers'
    DeepseekV2TopkRouter: greedy or group_limited_greedy), plus shared experts (a plain SwiGLU of width
    n_shared * I) when n_shared > 0. Jamba's sparse MoE is the case n_shared = 0, scaling 1, greedy."""

    def __init__(self, d: int, inter: int, n_experts: int, top_k: int, n_shared: int = 0, scaling: float = 1.0,
                 topk_method: str = "greedy", n_group: int | None = None, topk_group: int | None = None):
        super().__init__()
        self.e, self.k, self.scaling = n_experts, top_k, scaling
        self.topk_method, self.n_group, self.topk_group = topk_method, n_group, topk_group
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise EdgekvError(f"MoE topk_method {topk_method!r} is not supported (greedy, group_limited_greedy)")
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = Experts(n_experts, d, inter)
        self.shared_experts = SwiGLU(d, inter * n_shared) if n_shared else None

    def forward(self, x):  # [1, C, d] -> [1, C, d]
        c, d = x.shape[1], x.shape[2]
        flat = x.reshape(c, d)
        scores = torch.softmax(F.linear(flat.float(), self.gate.weight.float()), dim=-1)  # [C, E]
        if self.topk_method == "group_limited_greedy":
            grp = scores.view(c, self.n_group, self.e // self.n_group).amax(-1)  # [C, n_group]
            keep = torch.topk(grp, self.topk_group, dim=-1).indices
            group = torch.arange(self.n_group, device=x.device)
            gmask = (group[None, :, None] == keep[:, None, :]).any(-1)  # [C, n_group]
            scores = torch.where(gmask.repeat_interleave(self.e // self.n_group, dim=-1), scores, 0.0)
        topw, idx = torch.topk(scores, self.k, dim=-1)  # [C, k]
        topw = topw * self.scaling
        expert = torch.arange(self.e, device=x.device)
        dense = ((expert[None, None, :] == idx[:, :, None]) * topw[:, :, None]).sum(1)  # [C, E]
        out = self.experts(flat, dense, idx, topw).reshape(1, c, d)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) without biases: DeepSeek's dense and shared-expert MLPs, Jamba's dense MLP."""

    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def stack_experts(sd: dict, prefix: str, n_experts: int) -> dict:
    """Checkpoint expert tensors under prefix (e.g. 'model.layers.3.mlp.experts') -> the stacked parameters.
    Accepts per-expert tensors ({prefix}.{e}.gate_proj.weight ...) or transformers' fused {prefix}.gate_up_proj
    [E, 2I, d] (gate first, then up) and {prefix}.down_proj [E, d, I]."""
    if f"{prefix}.gate_up_proj" in sd:
        gu = sd.pop(f"{prefix}.gate_up_proj")
        g, u = gu.chunk(2, dim=1)
        return {f"{prefix}.gate_proj": g.contiguous(), f"{prefix}.up_proj": u.contiguous(),
                f"{prefix}.down_proj": sd.pop(f"{prefix}.down_proj")}
    out = {}
    for part in ("gate_proj", "up_proj", "down_proj"):
        keys = [f"{prefix}.{e}.{part}.weight" for e in range(n_experts)]
        if all(k in sd for k in keys):
            out[f"{prefix}.{part}"] = torch.stack([sd.pop(k) for k in keys])
    return out


def scan_tokens(step, carry: tuple, xs: tuple) -> tuple[tuple, tuple]:
    """Run step(carry, x_t) -> (carry, y_t) over the token axis (dim 0) of every tensor in xs; stack the y_t.

    carry: tuple of tensors; xs: tuple of [C, ...] tensors -> (final carry, tuple of [C, ...] stacked outputs).
    With a concrete C (eager, and the fixed-shape .pte methods) this is a Python loop, which torch.export unrolls.
    With a symbolic C (the ONNX graph's dynamic token axis, which no unrolled loop can serve) it is torch's scan
    operator, exported as one ONNX Scan node. Both run the same step on the same values in the same order."""
    c = xs[0].shape[0]
    if isinstance(c, int):
        ys = []
        for t in range(c):
            carry, y = step(carry, tuple(x[t] for x in xs))
            ys.append(y)
        return carry, tuple(torch.stack(parts) for parts in zip(*ys))
    from torch._higher_order_ops.scan import scan

    def body(cr, x):  # scan wants outputs that alias neither its inputs nor each other
        cr, y = step(tuple(cr), tuple(x))
        return [t.clone() for t in cr], [t.clone() for t in y]

    init = [t.clone(memory_format=torch.contiguous_format) for t in carry]  # its strides must be the body's
    carry, ys = scan(body, init, list(xs))
    return tuple(carry), tuple(ys)


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Depthwise causal conv over new inputs, continuing from the previous K - 1 inputs.

    x [1, Dc, C]; conv_state [1, Dc, K-1]; weight [Dc, K]; bias [Dc] or None
    -> y [1, Dc, C] (before the activation), new conv_state [1, Dc, K-1] (the last K - 1 inputs)."""
    k, c = weight.shape[-1], x.shape[-1]
    window = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # [1, Dc, K-1+C]
    y = window[:, :, 0:c] * weight[:, 0:1]
    for j in range(1, k):
        y = y + window[:, :, j:j + c] * weight[:, j:j + 1]
    if bias is not None:
        y = y + bias[:, None]
    return y, window[:, :, c:]


def slot_plan(pos, c: int, t_slots: int, repeat: int = 1):
    """A cache with one slot per position, a call of c tokens at pos -> positions [C]; write [T, C] one-hot (slot
    t <- token c); written [T, 1]; allowed [repeat*C, T]."""
    positions = pos + torch.arange(c, dtype=torch.int64, device=pos.device)
    slots = torch.arange(t_slots, dtype=torch.int64, device=pos.device)
    write = (slots[:, None] == positions[None, :]).float()
    written = ((slots >= pos) & (slots < pos + c))[:, None]
    allowed = slots[None, :] <= positions.repeat(repeat)[:, None]
    return positions, write, written, allowed
