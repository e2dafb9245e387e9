"""The quantizers for state tensors: the ONE place that turns a KV cache or an SSM state into codes and back.

Export (the cache writes inside the exported program), analyze (the error-propagation runs) and the planner's byte
counts (strategies/layout.py: the .scale / .zero tensors and the packed last axis) all mean exactly this layout:

  bits 8  symmetric:  codes int8 in [-127, 127],            scale = amax / 127 per group          (no zero)
  bits 4  asymmetric: codes in [0, 15], two per uint8,      scale = (max - min) / 15, zero = min  per group
  bits 2  asymmetric: codes in [0, 3], four per uint8,      scale = (max - min) / 3,  zero = min  per group
  static  symmetric:  codes int8 in [-128, 127],            scale a constant per channel, set at export (kv-int8c:
                      edgekv.export.calibrate), not stored with the codes

Groups run along the last axis (head_dim for a KV cache: one group = `group` consecutive channels of one token of one
head; group 0 means the whole last axis). Scales and zeros are stored in fp16, as the StateLayout says.
Packing uses integer arithmetic (c0 + 16*c1), not bit operations, so ONNX and ExecuTorch lower it without custom ops.

Rounding: "nearest" (round half to even, torch.round) or "stochastic" (floor(x + u), u ~ U[0,1), unbiased), the
latter for analyze only (it needs a random generator).
"""
from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
EPS = 1e-8


def _groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    d = x.shape[-1]
    g = group or d
    if d % g:
        raise ValueError(f"last axis {d} is not a multiple of group {g}")
    return x.reshape(*x.shape[:-1], d // g, g), g


def _round(x: torch.Tensor, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    if rounding == "nearest":
        return torch.round(x)
    if rounding == "stochastic":
        u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        return torch.floor(x + u)
    raise ValueError(f"rounding must be nearest or stochastic, got {rounding!r}")


def quantize(x: torch.Tensor, bits: int, group: int = 0, rounding: str = "nearest",
             generator: torch.Generator | None = None, scale_dtype: torch.dtype = SCALE_DTYPE
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [..., D] float -> (codes, scale [..., D/g], zero [..., D/g] or None).
    codes: int8 [..., D] for 8 bits; uint8 [..., D*bits/8] (packed) for 4 and 2 bits.
    scale_dtype: fp16 for KV caches; SSM states keep fp32 scales (vLLM PR #52962's per-(head, dim) scales)."""
    xg, g = _groups(x.float(), group)
    if bits == 8:
        scale = (xg.abs().amax(-1, keepdim=True) / 127).clamp_min(EPS).to(scale_dtype)
        q = _round(xg / scale.float(), rounding, generator).clamp(-127, 127)
        return q.reshape(x.shape).to(torch.int8), scale.squeeze(-1), None
    if bits not in (4, 2):
        raise ValueError(f"bits must be 8, 4 or 2, got {bits}")
    levels = 2**bits - 1
    lo = xg.amin(-1, keepdim=True)
    hi = xg.amax(-1, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(EPS).to(scale_dtype)
    zero = lo.to(scale_dtype)
    q = _round((xg - zero.float()) / scale.float(), rounding, generator).clamp(0, levels)
    return pack(q.reshape(x.shape), bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
               group: int = 0) -> torch.Tensor:
    """The inverse of quantize, in fp32: [..., D]."""
    q = codes.float() if bits == 8 else unpack(codes, bits)
    qg, _ = _groups(q, group)
    out = qg * scale.float().unsqueeze(-1)
    if zero is not None:
        out = out + zero.float().unsqueeze(-1)
    return out.reshape(q.shape)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in [0, 2^bits) along the last axis -> uint8, 8/bits codes per byte, lowest code in the low bits."""
    per = 8 // bits
    d = q.shape[-1]
    if d % per:
        raise ValueError(f"last axis {d} is not a multiple of {per}")
    q = q.reshape(*q.shape[:-1], d // per, per).to(torch.int32)
    weights = torch.tensor([2 ** (bits * i) for i in range(per)], dtype=torch.int32, device=q.device)
    return (q * weights).sum(-1).to(torch.uint8)


def _planes(p: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """uint8 [..., D*bits/8] -> 8/bits fp32 planes [..., D*bits/8]; plane i holds the codes of channels i, i + 8/bits,
    ... (exact small integers). Each code is masked out of its byte (bitwise_and on uint8) and scaled down by its bit
    offset in fp32: no integer division, which the ONNX export turns into Cast-Div-Floor-Cast through fp32 and int32
    planes (about 3 layer-sized temporaries per unpacked cache in ONNX Runtime), and no shift, which is not in the
    Core ATen opset ExecuTorch lowers."""
    mask = 2**bits - 1
    return [torch.bitwise_and(p, mask << (bits * i)).float() * (1.0 / 2 ** (bits * i)) for i in range(8 // bits)]


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., D*bits/8] -> fp32 codes [..., D], in channel order (the planes interleaved)."""
    return torch.stack(_planes(p, bits), -1).reshape(*p.shape[:-1], p.shape[-1] * (8 // bits))


def planar_order(d: int, bits: int) -> torch.Tensor:
    """[D] int64: the channel at each position of dequantize_planar's last axis (0, per, 2*per, ..., 1, per+1, ...,
    per = 8/bits)."""
    per = 8 // bits
    return torch.arange(d).view(d // per, per).t().reshape(-1)


def dequantize_planar(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                      group: int = 0) -> torch.Tensor:
    """dequantize() of packed codes with the last axis in planar_order: each plane is dequantized whole and the
    planes are concatenated, with no interleave (unpack's stack is a per-value copy, a portable cat in ExecuTorch: the
    kv-int4 .pte read-back in benchmarks/log/decode_speed.md). The same products as dequantize(). group must be a multiple of
    8/bits (a group then spans the same positions of every plane)."""
    per = 8 // bits
    lead, d = codes.shape[:-1], codes.shape[-1] * per
    g = group or d
    if g % per:
        raise ValueError(f"group {g} is not a multiple of {per} codes per byte")
    sc, zp = scale.float()[..., None], zero.float()[..., None]  # [..., D/g, 1]
    return torch.cat([(plane.reshape(*lead, d // g, g // per) * sc + zp).reshape(*lead, d // per)
                      for plane in _planes(codes, bits)], -1)


def roundtrip(x: torch.Tensor, bits: int, group: int = 0, rounding: str = "nearest",
              generator: torch.Generator | None = None) -> torch.Tensor:
    """quantize then dequantize: what a state looks like after one trip through the cache."""
    codes, scale, zero = quantize(x, bits, group, rounding, generator)
    return dequantize(codes, scale, zero, bits, group)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] fp32, scale [Hkv, D] -> int8 codes clip(round(x / scale), -128, 127), round half to even: what
    ONNX Runtime's GroupQueryAttention writes into a PER_CHANNEL int8 cache (checked against it in
    tests/test_kv_int8c.py)."""
    return torch.round(x / scale).clamp(-128, 127).to(torch.int8)


def dequantize_static(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """quantize_static's codes -> fp32; scale broadcast against the codes ([Hkv, D] for [C, Hkv, D] rows,
    [Hkv, 1, D] for a cache [Hkv, T, D])."""
    return codes.float() * scale


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] fp32 rounded as ExecuTorch's QuantizedSDPA rounds the query it hands llama::custom_quantized_sdpa:
    int8, asymmetric, one scale and zero point per row of D (torch's quantized_decomposed reference ops
    choose_qparams_per_token_asymmetric and quantize_per_token, whose kernels the .pte runs), then back to fp32."""
    from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401 (registers the ops)
    ops = torch.ops.quantized_decomposed
    scale, zero = ops.choose_qparams_per_token_asymmetric(x, torch.int8)
    codes = ops.quantize_per_token(x, scale, zero, -128, 127, torch.int8)
    return ((codes.to(torch.float64) - zero) * scale).to(x.dtype)
