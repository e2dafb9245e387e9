"""Stored and per-token read bytes of a model's weights at a precision, or in a runtime's own quantization scheme."""
from __future__ import annotations

import functools
import json

from ..arch import Arch, Weight


def weight_bytes_one(w: Weight, precision: str) -> float:
    """Stored bytes of one tensor. int8: 1 B + fp16 scale per output row. int4: group 32, 0.5 B + fp16 scale per
    group (ExecuTorch 8da4w / SpinQuant layout: int4 linear, int8 embedding). Norms, conv, A, D, biases stay fp32."""
    n = w.numel
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


def _scheme_bytes(w: Weight, spec: dict) -> float:
    """Stored bytes of one tensor under a runtime's quantization scheme ({bits, group (0 = per row), scale_bytes})."""
    n, rows = w.numel, w.shape[0]
    groups = n / spec["group"] if spec.get("group") else rows
    return n * spec["bits"] / 8 + groups * spec["scale_bytes"]


def weight_bytes(arch: Arch, precision: str, scheme: dict | None = None) -> dict[str, float]:
    """Bytes by tensor class (embedding, linear, lm_head, small), stored, and 'read' per decode token. scheme: a
    runtime's own layout for this precision (edgekv/costs/runtimes.json weights: ExecuTorch's Llama export keeps
    fp32 group scales, an int8 embedding and its own int8 output layer, tied or not); None = edgekv's layout."""
    key = None if scheme is None else json.dumps(scheme, sort_keys=True)
    return dict(_weight_bytes(arch, precision, key))  # a copy: the cached dict is never handed out


@functools.lru_cache(maxsize=512)  # an Arch hashes by identity and is not changed once built; a plan asks per row
def _weight_bytes(arch: Arch, precision: str, scheme_key: str | None) -> dict[str, float]:
    scheme = None if scheme_key is None else json.loads(scheme_key)
    out: dict[str, float] = {}
    read = 0.0
    for w in arch.weights:
        if scheme and w.cls in ("linear", "embedding", "lm_head"):
            b = _scheme_bytes(w, scheme["output" if w.cls == "lm_head" else w.cls])
        else:
            b = weight_bytes_one(w, precision)
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
