"""edgekv's own weight recipe for MatMulNBits from fp weights (--weights int4-mix): which bits each matrix gets, and
each block's values chosen by search rather than taken from the block's minimum and maximum.

Bits per tensor: llama.cpp's Q4_K_M mix (llama-quant.cpp, llama_tensor_get_type), mapped onto the widths ONNX
Runtime's CPU MatMulNBits runs (2, 4 and 8 bits; 5 and 6 are refused at session load):
  the output head (the tied embedding when the model has no own output matrix)   Q6_K / Q8_0  -> 8 bits
  attn_v and ffn_down of the layers use_more_bits picks                           Q6_K         -> 8 bits
  (the ONNX graph's fused q/k/v is one matrix: it takes its v's bits, so q and k ride along at 8 in those layers)
  every other matrix                                                             Q4_K         -> 4 bits
  use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2   (C integer division)

8-bit tensors: llama.cpp's Q8_0 (q8_blocks), the default zero point; a tied embedding table is gathered from the
head's own codes (GatherBlockQuantized), one copy at 8 bits.

4-bit blocks of 32 along the input axis: scale * code + a float minimum (search_blocks_fmin, as the k-quants'
make_qkx2_quants: candidate scales, a joint least-squares refit of scale and minimum to the codes), each block's
squared error weighted per input channel by an importance matrix (llama.cpp's imatrix: the mean squared activation
reaching the matrix over calibration text, eager_importance). MatMulNBits holds the float minimum on its fast path
as an integer zero point plus an fp32 remainder added from the input's block sums (split_minimum,
remainder_nodes; edgekv.export.gguf_blocks carries Q4_1 the same way). On a perturbed SmolLM2-135M fp16 source the
importance matrix and the float minimum each take about a third off the KL of integer zero points with uniform
weights, and together 3.5x (benchmarks/README.md, "From fp16 weights"). search_blocks (integer zero point) is the
earlier recipe, kept for that comparison (experiments/weight_recipe_search.py).
"""
from __future__ import annotations

import contextlib

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


def search_blocks_fmin(w: np.ndarray, bits: int, block: int = BLOCK, importance: np.ndarray | None = None,
                       chunk: int = 1 << 15):
    """w [rows, K] -> (codes uint8 [rows, K], scales fp32 [rows, K/block], minimums fp32 [rows, K/block]): each
    block as scale * code + minimum with a float minimum (Q4_1's and the k-quants' form; MatMulNBits holds it on its
    fast path as an integer zero point plus an fp32 remainder, split_minimum), searched as llama.cpp's
    make_qkx2_quants does: for candidate inverse scales (nmax + 0.1 * j) / (max - min), j = -10..10 (its rmin
    -1, rdelta 0.1, nstep 20), codes round((x - min) * iscale), then scale and minimum refit together by weighted least
    squares to those codes (a 2 x 2 solve) and the codes rounded again; the candidate with the least weighted squared
    error wins, the min/max block (iscale = nmax / (max - min)) the first. Unlike make_qkx2_quants the minimum is not
    held at or below 0 (the remainder stores any value). importance [K] >= 0 weights each input channel."""
    n = 2 ** bits - 1
    rows, k = w.shape
    x_all = w.reshape(-1, block).astype(np.float32)
    if importance is not None:
        imp = np.asarray(importance, np.float32).reshape(-1, block)
        imp_all = np.broadcast_to(imp[None], (rows, k // block, block)).reshape(-1, block)
    codes = np.empty(x_all.shape, np.uint8)
    scales = np.empty(x_all.shape[0], np.float32)
    mins = np.empty(x_all.shape[0], np.float32)
    for a in range(0, x_all.shape[0], chunk):
        x = x_all[a:a + chunk]
        wt = np.ones_like(x) if importance is None else imp_all[a:a + chunk] + np.float32(1e-12)
        lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
        rng = np.where(hi - lo == 0, 1.0, hi - lo)
        sw, sx = wt.sum(-1, keepdims=True), (wt * x).sum(-1, keepdims=True)

        def err(q, s, m):
            return (wt * (x - q * s - m) ** 2).sum(-1, keepdims=True)

        best_q = np.clip(np.round((x - lo) * (n / rng)), 0, n)
        best_s, best_m = rng / n, lo.copy()
        best_e = err(best_q, best_s, best_m)
        for j in range(-10, 11):
            iscale = (n + 0.1 * j) / rng
            q = np.clip(np.round((x - lo) * iscale), 0, n)
            for _ in range(2):  # refit to the codes, round the codes to the fit, refit once more
                sl, sl2, sxl = (wt * q).sum(-1, keepdims=True), (wt * q * q).sum(-1, keepdims=True), \
                    (wt * x * q).sum(-1, keepdims=True)
                det = sw * sl2 - sl * sl
                ok = det > 1e-30 * np.maximum(sw * sl2, 1e-30)
                s = np.where(ok, (sw * sxl - sx * sl) / np.where(ok, det, 1.0), rng / n)
                m = np.where(ok, (sl2 * sx - sl * sxl) / np.where(ok, det, 1.0), lo)
                s = np.where(s > 0, s, rng / n)
                e = err(q, s, m)
                take = e < best_e
                best_e = np.where(take, e, best_e)
                best_q = np.where(take, q, best_q)
                best_s = np.where(take, s, best_s)
                best_m = np.where(take, m, best_m)
                q = np.clip(np.round((x - m) / s), 0, n)
        codes[a:a + chunk] = best_q.astype(np.uint8)
        scales[a:a + chunk] = best_s[:, 0]
        mins[a:a + chunk] = best_m[:, 0]
    return codes.reshape(rows, k), scales.reshape(rows, k // block), mins.reshape(rows, k // block)


def split_minimum(scales: np.ndarray, mins: np.ndarray, bits: int):
    """A float minimum as MatMulNBits' fast-path form (edgekv.export.gguf_blocks, Q4_1): the integer zero point
    z = clip(round(-min / scale), 0, 2^bits - 1) and the fp32 remainder r = min + scale * z, so that
    scale * code + min = scale * (code - z) + r; the remainder is added as sum over blocks of r times the input's
    block sums. Returns (zero points uint8, remainders fp32), each [rows, K/block]."""
    top = 2 ** bits - 1
    z = np.clip(np.rint(-mins / scales), 0, top).astype(np.float32)
    return z.astype(np.uint8), (mins + scales * z).astype(np.float32)


def dequantize_fmin(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """(codes, scales, minimums) -> scale * code + minimum [rows, K]."""
    rows, k = codes.shape
    c = codes.reshape(rows, k // block, block).astype(np.float32)
    return (c * scales[..., None] + mins[..., None]).reshape(rows, k)


# Calibration text for the importance matrix: docstrings of standard-library modules, on every machine and in no
# download; never textwrap's or argparse's, which are verify-quant's evaluation text (edgekv.export.quality).
CALIBRATION_MODULES = ("collections/__init__.py", "functools.py", "json/__init__.py", "json/decoder.py",
                       "logging/__init__.py", "subprocess.py", "shutil.py", "inspect.py", "tarfile.py", "typing.py")


def calibration_text() -> str:
    """Every module, class and function docstring of CALIBRATION_MODULES (those present), in file order."""
    import ast
    import sysconfig
    from pathlib import Path

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for rel in CALIBRATION_MODULES:
        f = stdlib / rel
        if not f.is_file():
            continue
        tree = ast.parse(f.read_text(errors="replace"))
        docs += [ast.get_docstring(n) for n in ast.walk(tree)
                 if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return "\n\n".join(d for d in docs if d)


def calibration_ids(encode, n: int) -> list[int]:
    """The first n tokens of calibration_text under encode (text -> ids), fewer if the text is shorter."""
    return list(encode(calibration_text()))[:n]


@contextlib.contextmanager
def _mean_squared_inputs(module):
    """Yields a dict that, once the block exits, holds {each torch.nn.Linear's weight name: the mean over every token
    its forward saw of the squared input, per input channel [K] (fp32 numpy)}; the hooks come off either way."""
    import torch

    sums, counts, hooks, means = {}, {}, [], {}

    def hook(name):
        def f(_m, args, _out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return f

    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_hook(hook(name + ".weight")))
    try:
        yield means
    finally:
        for h in hooks:
            h.remove()
    means.update({k: (sums[k] / counts[k]).float().numpy() for k in sums})


def importance(module, ids: list[int], window: int = 512) -> dict:
    """llama.cpp's importance matrix (imatrix) for every torch.nn.Linear in module: {its weight's name: the mean over
    tokens of the squared input, per input channel [K]}, module run on ids a window at a time (each window from
    position 0, as llama-imatrix runs its chunks). module(input_ids) is a transformers-style forward."""
    import torch

    with _mean_squared_inputs(module) as means:
        with torch.no_grad():
            for a in range(0, len(ids), window):
                module(torch.tensor([ids[a:a + window]]))
    return means


def q8_blocks(w: np.ndarray, block: int = BLOCK):
    """llama.cpp's Q8_0 for w [rows, K] as MatMulNBits' 8-bit blocks with the default zero point 128: d = max|x| / 127,
    codes round(x / d) (half away from zero, ggml's roundf) + 128, the scale d as its fp16 value (Q8_0 stores d in
    fp16; the codes are rounded with the fp32 d, as ggml-quants.c does). Returns (codes uint8 [rows, K], scales fp32
    [rows, K/block]); the values are bit for bit gguf's Q8_0 dequantized."""
    rows, k = w.shape
    b = w.reshape(rows, k // block, block).astype(np.float32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = b * inv
    q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))
    codes = (q + 128).astype(np.uint8).reshape(rows, k)
    return codes, d[..., 0].astype(np.float16).astype(np.float32)


def remainder_nodes(x: str, y: str, out: str, r_name: str, k: int, block: int, sums: dict, const) -> list:
    """The float minimum's remainder term after a MatMulNBits whose output is y: out = y + blocksums(x) @ R, where
    blocksums(x) [..., K/block] sums each block of `block` inputs (Reshape, ReduceSum) and R [K/block, N] (r_name, an
    initializer already written) holds each block's remainder (split_minimum). The block sums of one input are computed
    once and shared by every projection that reads it (sums: {(x, K, block): their name}, filled here); const(name,
    array) writes a small initializer and returns its name. The same form as edgekv.export.gguf_blocks' carry of
    Q4_1 / Q4_K."""
    from onnx import helper
    nb = k // block
    nodes = []
    key = (x, k, block)
    if key not in sums:
        s = f"{x}.blocksums{block}"
        nodes += [
            helper.make_node("Shape", [x], [s + ".xs"], name=s + ".shape"),
            helper.make_node("Slice", [s + ".xs", const(s + ".0", np.array([0], np.int64)),
                                       const(s + ".-1", np.array([-1], np.int64))], [s + ".lead"], name=s + ".slice"),
            helper.make_node("Concat", [s + ".lead", const(s + ".tail", np.array([nb, block], np.int64))],
                             [s + ".shape"], name=s + ".concat", axis=0),
            helper.make_node("Reshape", [x, s + ".shape"], [s + ".blocks"], name=s + ".reshape"),
            helper.make_node("ReduceSum", [s + ".blocks", const(s + ".axes", np.array([-1], np.int64))], [s],
                             name=s, keepdims=0)]
        sums[key] = s
    nodes += [helper.make_node("MatMul", [sums[key], r_name], [out + ".rem"], name=out + ".remainder"),
              helper.make_node("Add", [y, out + ".rem"], [out], name=out + ".add")]
    return nodes


CALIBRATION_TOKENS = 1024  # llama-imatrix's default is 512-token chunks over a larger text; 4 windows of 256 here
CALIBRATION_WINDOW = 256  # positions per eager call: Gemma-3's 262144-wide logits are 0.27 GB at 256


def eager_importance(module, state_for, stepper_for, ids: list[int], window: int = CALIBRATION_WINDOW) -> dict:
    """importance() through an export's eager module and its stepper (edgekv.export.runtime.EagerStepper): each window
    of ids prefilled from position 0 in a state of that length (state_for(n), a context manager, as verify-quant's
    fp32 side runs; stepper_for(state) the stepper). The keys are the eager module's Linear weights' names, plus the
    names the ONNX graph gives the projections it fuses (edgekv.models.swaps: q/k/v -> qkv_proj, gate/up ->
    gate_up_proj), which read the same input."""
    with _mean_squared_inputs(module) as out:
        for a in range(0, len(ids), window):
            part = ids[a:a + window]
            with state_for(len(part)) as state:
                st = stepper_for(state)
                st.reset()
                st.prefill(part)
    for k in list(out):
        for one, fused in ((".q_proj.", ".qkv_proj."), (".gate_proj.", ".gate_up_proj.")):
            if one in k:
                out.setdefault(k.replace(one, fused), out[k])
    return out
