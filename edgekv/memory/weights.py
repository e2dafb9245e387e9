"""Stored and per-token read bytes of a model's weights at a precision, or in a runtime's own quantization scheme."""
from __future__ import annotations

import functools
import json
import math
import re

from ..arch import Arch, Weight

# --weights gguf in edgekv's ONNX: the form each GGUF type's blocks are carried in (edgekv.export.gguf_codec.pack,
# docs/export.md "The file's own blocks"): (bits per code, elements per fp32 scale, a uint zero point per block, an
# fp32 remainder per block). The carried form is larger than the file: fp32 scales for fp16 ones, 5- and 6-bit codes
# stored in 8 bits, and Q4_1 / Q4_K's fractional minimum as an integer zero point plus an fp32 remainder term.
CARRIED_FORM = {
    "Q4_0": (4, 32, False, False),  # default zero point 8
    "Q8_0": (8, 32, False, False),  # default zero point 128
    "Q5_0": (8, 32, False, False),
    "Q6_K": (8, 16, False, False),  # its int8 sub-scales folded into one fp32 scale per 16
    "Q4_1": (4, 32, True, True),
    "Q4_K": (4, 32, True, True),
    "Q5_1": (8, 32, True, True),
    "Q5_K": (8, 32, True, True),
}
# the scheme (weight_bytes' `scheme`) that prices --weights gguf as edgekv's ONNX carries it; without it a GGUF's
# weights are the file's own bytes (llama.cpp runs them as they are)
GGUF_CARRIED = {"gguf_blocks": "onnx"}


def carried_matrix_bytes(type_name: str, n: int, k: int) -> int | None:
    """Bytes of one GGUF matrix [n, k] (n output rows) as MatMulNBits holds it: codes (4-bit two to a byte), fp32
    scales, zero points (4-bit ones two to a byte per row, an odd last block padded) and fp32 remainders, as
    gguf_codec.nbits_b / nbits_zero_points write them. None: a type that is not carried (a float type, or a quant
    type gguf_codec does not read: the graph keeps its fp32 copy)."""
    if type_name not in CARRIED_FORM:
        return None
    bits, block, zp, rem = CARRIED_FORM[type_name]
    nb = k // block
    out = n * k * bits // 8 + 4 * n * nb
    if zp:
        out += n * (nb if bits == 8 else math.ceil(nb / 2))
    return out + (4 * n * nb if rem else 0)


def carried_form_name(type_name: str) -> str | None:
    """The name of the MatMulNBits form a GGUF type is carried in (CARRIED_FORM), as the weights kernel is timed per
    form (benchmarks/attention_rates.py --matmul-forms; edgekv/costs/attention_rates.json onnxruntime weights.gguf):
    "4-bit/32" (Q4_0), "8-bit/32" (Q8_0, Q5_0), "8-bit/16" (Q6_K), "4-bit/32 zp+rem" (Q4_1, Q4_K: zero points and the
    fp32 block-sum remainder), "8-bit/32 zp+rem" (Q5_1, Q5_K). None: not carried (the graph's fp32 MatMul)."""
    if type_name not in CARRIED_FORM:
        return None
    bits, block, zp, rem = CARRIED_FORM[type_name]
    return f"{bits}-bit/{block}" + (" zp+rem" if zp and rem else " zp" if zp else " rem" if rem else "")


def carried_matrices(arch: Arch) -> list[tuple[str, str | None, float, float, tuple[int, int]]]:
    """The matrices one decode step of edgekv's --weights gguf ONNX multiplies (the linear rows, the output layer, or
    the tied table as the head): (tensor name, carried form or None for a fp32 MatMul, bytes as carried, read
    fraction, (K inputs, N outputs)), as _carried_onnx counts them. The gathered embedding row is left out (one row of the table a step
    reads: GatherBlockQuantized's, or the fp32 table's). Each GGUF tensor is its own matrix: where the export fuses
    q, k and v into one MatMulNBits, they are counted apart."""
    tied = not any(w.cls == "lm_head" for w in arch.weights)
    out = []
    for w in arch.weights:
        if w.cls not in ("linear", "lm_head") and not (w.cls == "embedding" and tied):
            continue
        if w.gguf_type is None:
            raise ValueError("gguf precision needs a GGUF-read Arch")
        n, k = w.shape[0], math.prod(w.shape[1:])
        mm = carried_matrix_bytes(w.gguf_type, n, k) if len(w.shape) == 2 else None
        out.append((w.name, carried_form_name(w.gguf_type) if mm is not None else None,
                    float(mm if mm is not None else 4 * w.numel), w.read_fraction, (k, n)))
    return out


def gathered_bytes(type_name: str, n: int, k: int) -> tuple[int, bool]:
    """(bytes of an embedding table [n, k] as edgekv's ONNX gathers it, whether its codes are shared with a tied
    head's MatMulNBits). An 8-bit type with no remainder (Q8_0, Q5_0, Q6_K) is read by GatherBlockQuantized: its own
    fp32 scales [n, k / block, 1] beside the codes; any other table stays the fp32 dequantized table."""
    form = CARRIED_FORM.get(type_name)
    if form is None or form[0] != 8 or form[3]:
        return 4 * n * k, False
    return n * k + 4 * n * (k // form[1]), True


def weight_bytes_one(w: Weight, precision: str, n_layers: int | None = None) -> float:
    """Stored bytes of one tensor. int8: 1 B + fp16 scale per output row. int4: group 32, 0.5 B + fp16 scale per
    group (ExecuTorch 8da4w / SpinQuant layout: int4 linear, int8 embedding). Norms, conv, A, D, biases stay fp32.
    int4-mix (edgekv.export.wrecipe): each matrix at int8's or int4's bytes by the bits its rule gives it (the
    output head and a tied table at 8, whose rows the head reads; attn_v / ffn_down of the layers llama.cpp's
    use_more_bits picks at 8, given n_layers; the rest 4, plus their float minimum's fp32 remainder per block)."""
    n = w.numel
    if precision == "int4-mix" and w.cls != "small":
        if w.cls in ("embedding", "lm_head") or _mix_wide(w.name, n_layers):
            precision = "int8"
        else:  # the float minimum's fp32 remainder, 4 B per block of 32 (wrecipe.split_minimum)
            return weight_bytes_one(w, "int4") + 4 * (n / 32)
    if precision == "gguf":
        if w.gguf_bytes is None:
            raise ValueError("gguf precision needs a GGUF-read Arch")
        return w.gguf_bytes
    if w.cls == "small" or precision == "fp32":
        return 4 * n
    rows = w.shape[0]
    if precision == "fp16":
        return 2 * n
    if precision == "int8" or (precision == "int4" and w.cls == "embedding"):
        return n + 2 * rows
    if precision == "int4":
        return n / 2 + (n / 32) * 2
    raise ValueError(f"unknown weight precision {precision!r}")


def _mix_wide(name: str, n_layers: int | None) -> bool:
    """Whether int4-mix holds this linear at 8 bits (edgekv.export.wrecipe.mix_bits, by its module name)."""
    import re

    from ..export.wrecipe import mix_bits
    m = re.search(r"layers\.(\d+)\..*\b(v|qkv|down)_proj\.weight$", name)
    if m is None or n_layers is None:
        return False
    return mix_bits({"down": "ffn_down", "qkv": "attn_qkv"}.get(m.group(2), "attn_v"), int(m.group(1)), n_layers) == 8


def _scheme_bytes(w: Weight, spec: dict) -> float:
    """Stored bytes of one tensor under a runtime's quantization scheme ({bits, group (0 = per row), scale_bytes})."""
    n, rows = w.numel, w.shape[0]
    groups = n / spec["group"] if spec.get("group") else rows
    return n * spec["bits"] / 8 + groups * spec["scale_bytes"]


def scheme_part(w: Weight, scheme: dict) -> dict:
    """The spec of a runtime's scheme that stores tensor w: "output" for the output layer, "embedding" for the table,
    for a decoder-layer linear "linear_kept" where its layer is one of the scheme's kept_layers (an int4 .pte that
    keeps some layers int8: edgekv.arch.variants.pte_int8_kept), else "linear"."""
    if w.cls == "lm_head":
        return scheme["output"]
    if w.cls == "linear" and scheme.get("kept_layers"):
        m = re.search(r"layers\.(\d+)\.", w.name)
        if m and int(m[1]) in scheme["kept_layers"]:
            return scheme["linear_kept"]
    return scheme[w.cls]


def weight_bytes(arch: Arch, precision: str, scheme: dict | None = None) -> dict[str, float]:
    """Bytes by tensor class (embedding, linear, lm_head, small), stored, and 'read' per decode token. scheme: a
    runtime's own layout for this precision (edgekv/costs/runtimes.json weights: ExecuTorch's Llama export keeps
    fp32 group scales, an int8 embedding and its own int8 output layer, tied or not); None = edgekv's layout."""
    key = None if scheme is None else json.dumps(scheme, sort_keys=True)
    return dict(_weight_bytes(arch, precision, key))  # a copy: the cached dict is never handed out


@functools.lru_cache(maxsize=512)  # an Arch hashes by identity and is not changed once built; a plan asks per row
def _weight_bytes(arch: Arch, precision: str, scheme_key: str | None) -> dict[str, float]:
    scheme = None if scheme_key is None else json.loads(scheme_key)
    if precision == "gguf" and scheme and scheme.get("gguf_blocks") == "onnx":
        return _carried_onnx(arch)
    out: dict[str, float] = {}
    read = 0.0
    for w in arch.weights:
        if scheme and w.cls in ("linear", "embedding", "lm_head"):
            b = _scheme_bytes(w, scheme_part(w, scheme))
        else:
            b = weight_bytes_one(w, precision, arch.n_layers)
        out[w.cls] = out.get(w.cls, 0) + b
        # a decode step reads one embedding row, not the table; routed experts top_k of n
        read += (b / w.shape[0] if w.cls == "embedding" else b) * w.read_fraction
    if "lm_head" not in out and scheme and "output" in scheme:  # the runtime stores its own output layer
        head = sum(_scheme_bytes(Weight("output", w.shape, "lm_head"), scheme["output"])
                   for w in arch.weights if w.cls == "embedding")
        out["lm_head"] = head
        read += head
    elif "lm_head" not in out:  # tied embeddings: the output projection reads the whole table every token
        read += out.get("embedding", 0) - sum(weight_bytes_one(w, precision) / w.shape[0]
                                               for w in arch.weights if w.cls == "embedding")
    out["total"] = sum(v for k, v in out.items())
    out["read_per_token"] = read
    return out


def _carried_onnx(arch: Arch) -> dict[str, float]:
    """weight_bytes for --weights gguf as edgekv's ONNX carries the file (CARRIED_FORM): every matrix of a carried
    type as MatMulNBits, others (and norms, biases) as fp32. A tied table is the head's MatMulNBits plus what the
    Gather reads: GatherBlockQuantized's own scales on the head's codes, or the fp32 table. A projection the export
    fuses from parts of different forms (q/k/v of mixed types) is priced part by part: the fused matrix's widest
    bits, smallest block and explicit zero points are not counted."""
    out: dict[str, float] = {}
    read = 0.0
    tied = not any(w.cls == "lm_head" for w in arch.weights)
    for w in arch.weights:
        if w.gguf_type is None:
            raise ValueError("gguf precision needs a GGUF-read Arch")
        n, k = (w.shape[0], math.prod(w.shape[1:])) if len(w.shape) >= 2 else (1, w.numel)
        mm = carried_matrix_bytes(w.gguf_type, n, k) if len(w.shape) == 2 else None
        if w.cls == "embedding":
            table, shared = gathered_bytes(w.gguf_type, n, k)
            b = table / n  # a decode step gathers one row
            if tied:  # the output head reads the whole matrix every token, from the gather's codes when shared
                head = mm if mm is not None else 4 * w.numel
                table -= n * k if shared else 0
                b, table = b + head, table + head
            out[w.cls] = out.get(w.cls, 0) + table
            read += b * w.read_fraction
            continue
        b = mm if mm is not None and w.cls != "small" else 4 * w.numel
        out[w.cls] = out.get(w.cls, 0) + b
        read += b * w.read_fraction
    out["total"] = sum(out.values())
    out["read_per_token"] = read
    return out
