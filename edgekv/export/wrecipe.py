"""edgekv's own weight recipe for MatMulNBits from fp weights (--weights int4-mix): which bits each matrix gets, and
each block's scale and zero point chosen by search rather than taken from the block's minimum and maximum.

Bits per tensor: llama.cpp's Q4_K_M mix (llama-quant.cpp, llama_tensor_get_type), mapped onto the widths ONNX
Runtime's CPU MatMulNBits runs (2, 4 and 8 bits; 5 and 6 are refused at session load):
  the output head (the tied embedding when the model has no own output matrix)   Q6_K / Q8_0  -> 8 bits
  attn_v and ffn_down of the layers use_more_bits picks                           Q6_K         -> 8 bits
  (the ONNX graph's fused q/k/v is one matrix: it takes its v's bits, so q and k ride along at 8 in those layers)
  every other matrix                                                             Q4_K         -> 4 bits
  use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2   (C integer division)
The embedding table the Gather reads follows the head's bits when tied (llama.cpp quantizes the one tensor once).

Blocks: 32 along the input axis, a float scale and an integer zero point each (MatMulNBits' uint zero points). The
search (search_blocks) in the spirit of the k-quants' make_qkx2_quants: candidate scales around (max - min) / nmax,
for each the zero point nearest -min / scale and its neighbours, codes rounded, then the scale refit by (weighted)
least squares to those codes and the codes rounded once more; the candidate with the least (weighted) squared error
wins. The min/max block ONNX Runtime's quantizer writes is one of the candidates, so the search never does worse
than it on the error it minimizes. Weights per input channel: an importance matrix (the mean squared activation of
the matmul's input over calibration text, as llama.cpp's imatrix) when given, else uniform.
"""
from __future__ import annotations

import numpy as np

BLOCK = 32
FACTORS = np.linspace(0.80, 1.10, 10, dtype=np.float32)  # candidate scales, x (max - min) / nmax


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits (C integer division; i - n/8 may be negative: C's % keeps the sign)."""
    e = n_layers // 8
    d = i_layer - e
    rem = d - int(d / 3) * 3  # C truncation
    return i_layer < e or i_layer >= 7 * n_layers // 8 or rem == 2


def mix_bits(role: str, layer: int | None, n_layers: int) -> int:
    """Bits for a matrix by its role: "head", "embed" (tied with the head), "attn_v", "ffn_down", "attn_qkv" (the
    ONNX route's fused q/k/v, edgekv.models.swaps: one matrix, so the bits of the v it holds), or any other
    projection name; layer its decoder layer index."""
    if role in ("head", "embed"):
        return 8
    if role in ("attn_v", "attn_qkv", "ffn_down") and layer is not None and use_more_bits(layer, n_layers):
        return 8
    return 4


def minmax_blocks(w: np.ndarray, bits: int, block: int = BLOCK):
    """ONNX Runtime's asymmetric block (MlasQuantizeBlockwise, is_symmetric=False) for w [rows, K] along K:
    (codes uint8 [rows, K], scales [rows, K/block], zero points uint8 [rows, K/block])."""
    n = 2 ** bits - 1
    b = w.reshape(w.shape[0], -1, block).astype(np.float32)
    mn = np.minimum(b.min(-1), 0)
    mx = np.maximum(b.max(-1), 0)
    s = (mx - mn) / n
    s = np.where(s == 0, 1.0, s).astype(np.float32)
    z = np.clip(np.round(-mn / s), 0, n)
    q = np.clip(np.round(b / s[..., None]) + z[..., None], 0, n)
    return q.reshape(w.shape).astype(np.uint8), s, z.astype(np.uint8)


def search_blocks(w: np.ndarray, bits: int, block: int = BLOCK, importance: np.ndarray | None = None,
                  chunk: int = 1 << 15):
    """w [rows, K] -> (codes, scales, zero points) as minmax_blocks, each block's by the least weighted squared
    error among the candidates (module docstring). importance [K] >= 0: the weight of each input channel."""
    n = 2 ** bits - 1
    rows, k = w.shape
    x_all = w.reshape(-1, block).astype(np.float32)  # [B, block], blocks of consecutive K within a row
    if importance is None:
        imp_all = None
    else:
        imp = np.asarray(importance, np.float32).reshape(-1, block)  # [K/block, block]
        imp_all = np.broadcast_to(imp[None], (rows, k // block, block)).reshape(-1, block)
    q_mm, s_mm, z_mm = (a.reshape(-1, *a.shape[2:]) if a.ndim > 2 else a.reshape(-1)
                        for a in minmax_blocks(w, bits, block))
    q_mm = q_mm.reshape(-1, block)
    codes = np.empty_like(q_mm)
    scales = np.empty(x_all.shape[0], np.float32)
    zeros = np.empty(x_all.shape[0], np.uint8)
    for a in range(0, x_all.shape[0], chunk):
        x = x_all[a:a + chunk]
        wt = np.ones_like(x) if imp_all is None else imp_all[a:a + chunk] + 1e-12
        mn = np.minimum(x.min(-1, keepdims=True), 0)
        mx = np.maximum(x.max(-1, keepdims=True), 0)
        rng = np.where(mx - mn == 0, 1.0, mx - mn)
        # the min/max candidate first: the search keeps it unless another is strictly better
        best_q = q_mm[a:a + chunk].astype(np.float32)
        best_s = s_mm[a:a + chunk, None].copy()
        best_z = z_mm[a:a + chunk, None].astype(np.float32)
        best_e = (wt * (x - (best_q - best_z) * best_s) ** 2).sum(-1, keepdims=True)
        for f in FACTORS:
            s0 = rng / n * f
            z0 = np.round(-mn / s0)
            for dz in (-1.0, 0.0, 1.0):
                z = np.clip(z0 + dz, 0, n)
                q = np.clip(np.round(x / s0) + z, 0, n)  # round the codes, refit the scale to them, round again
                c = q - z
                den = (wt * c * c).sum(-1, keepdims=True)
                fit = (wt * x * c).sum(-1, keepdims=True) / np.maximum(den, 1e-30)
                s = np.where((den > 0) & (fit > 0), fit, s0)
                q = np.clip(np.round(x / s) + z, 0, n)
                e = (wt * (x - (q - z) * s) ** 2).sum(-1, keepdims=True)
                take = e < best_e
                best_e = np.where(take, e, best_e)
                best_q = np.where(take, q, best_q)
                best_s = np.where(take, s, best_s)
                best_z = np.where(take, z, best_z)
        codes[a:a + chunk] = best_q.astype(np.uint8)
        scales[a:a + chunk] = best_s[:, 0]
        zeros[a:a + chunk] = best_z[:, 0].astype(np.uint8)
    return codes.reshape(rows, k), scales.reshape(rows, k // block), zeros.reshape(rows, k // block)


def dequantize(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """(codes, scales, zero points) -> the values [rows, K] MatMulNBits computes with."""
    rows, k = codes.shape
    c = codes.reshape(rows, k // block, block).astype(np.float32) - zeros[..., None].astype(np.float32)
    return (c * scales[..., None]).reshape(rows, k)


def pack_matmul(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, block: int = BLOCK):
    """MatMulNBits' tensors for weight rows [N, K] (one row per output column): B uint8 [N, K/block, block*bits/8]
    (4 bits: two codes a byte, the lower first), scales fp32 [N * K/block], zero points uint8 (4 bits: packed two a
    byte along the blocks, [N, ceil(K/block / 2)], an odd last one beside 8 as ORT pads it; 8 bits: [N, K/block])."""
    n_rows, k = codes.shape
    kb = k // block
    if bits == 8:
        b = codes.reshape(n_rows, kb, block).astype(np.uint8)
        zp = zeros.astype(np.uint8)
    elif bits == 4:
        c = codes.reshape(n_rows, kb, block // 2, 2).astype(np.uint8)
        b = c[..., 0] | (c[..., 1] << 4)
        z = zeros.astype(np.uint8)
        if kb % 2:
            z = np.concatenate([z, np.full((n_rows, 1), 8, np.uint8)], 1)  # ORT pads with 8
        zp = z[:, 0::2] | (z[:, 1::2] << 4)
    else:
        raise ValueError(f"MatMulNBits on CPU takes 2, 4 or 8 bits here, not {bits}")
    return np.ascontiguousarray(b), np.ascontiguousarray(scales.reshape(-1), np.float32), np.ascontiguousarray(zp)
