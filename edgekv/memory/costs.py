"""What each runtime does with attention, a quantized KV cache, the state and the weights while loading: the cost
models the workspace and load terms apply (edgekv/costs/workspace.json, every measured figure with its source) and
what `plan --runtime R` assumes R does (edgekv/costs/runtimes.json)."""
from __future__ import annotations

import json
from pathlib import Path

from ..arch import Arch
from ..arch.types import Attention
from ..models import fused_attention_type  # the family registry (torch-free)
from ..strategies import StateLayout, Strategy

_COSTS = Path(__file__).resolve().parent.parent / "costs"
_WORKSPACE = json.loads((_COSTS / "workspace.json").read_text())
# per cost model: its traits (edgekv/costs/workspace.json `fields` says what each means and how it was measured)
RUNTIMES = _WORKSPACE["runtimes"]
MEASURED = _WORKSPACE["measured"]  # how each numeric trait was measured; shown by --explain next to the number
# fp32 [chunk, d_inner, d_state] tensors alive in a prefill call of edgekv's Mamba export
SCAN_COPIES = _WORKSPACE["scan_copies"]["value"]
# fp32 [T, Hkv*D] tensors alive while a converted-MLA layer rebuilds and rotates its keys
MLA_REBUILD_COPIES = _WORKSPACE["mla_rebuild_copies"]["value"]
# fp32 [Hkv, T, D] tensors a sub-byte (int4/int2) cache adds to the layer's fp32 K and V while it is unpacked
UNPACK_EXTRA_COPIES = _WORKSPACE["unpack_extra_copies"]["value"]
# model types whose export writes a float cache with torch.where, which ONNX Runtime casts to fp32 for a fp16 cache
WHERE_WRITTEN_TYPES = tuple(_WORKSPACE["where_written_types"]["value"])
# the traits of edgekv's fused-attention graphs over the runtime's: ONNX Runtime's GroupQueryAttention, ExecuTorch's
# custom_sdpa (fused_gqa decides where they apply)
GQA = _WORKSPACE["fused"]["onnxruntime"]["value"]
ET_SDPA = _WORKSPACE["fused"]["executorch"]["value"]


def _rt(runtime: str) -> dict:
    return RUNTIMES.get(runtime, RUNTIMES["executorch"])


# What `edgekv plan --runtime R` assumes R does, each fact with its source: edgekv/costs/runtimes.json. Keyed by the
# name users pass; `cost_model` is the RUNTIMES entry above that models it ("executorch" and "onnxruntime" there are
# edgekv's own artifacts, which export and profile plan with).
PLAN_RUNTIMES = {k: v for k, v in json.loads((_COSTS / "runtimes.json")
                                               .read_text()).items() if not k.startswith("_")}
KV_READ = {v["cost_model"]: v["kv_read"]["value"] for v in PLAN_RUNTIMES.values()}


def cache_key(strategy: Strategy) -> str:
    """The cache's kind as runtimes.json names it (kv_read, cannot_build): its storage's kv_read_key (int8-channel
    for kv-int8c's static scales, int8 / int4 / int2, fp8-group, or the float dtype)."""
    st = strategy.kv_storage
    return st.kv_read_key if st else strategy.params.get("dtype", "fp32")


def kv_read(runtime: str, strategy: Strategy) -> str:
    """How the runtime's attention reads this strategy's cache: 'in place', 'cast' or 'dequantized copy'
    (edgekv/costs/runtimes.json kv_read, keyed by the storage's kv_read_key; a runtime or storage not listed there
    casts a float cache and dequantizes quantized codes whole)."""
    st = strategy.kv_storage
    table = KV_READ.get(runtime, {})
    return st.kv_read(runtime, table) if st else table.get(strategy.params.get("dtype", "fp32"), "cast")


def fused_gqa(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str) -> bool:
    """Whether edgekv's export of this (model, strategy) for this runtime attends through a fused op in place
    (ONNX Runtime's GroupQueryAttention, ExecuTorch's custom_sdpa): a float cache with one slot per position in
    every layer (`kv`, or a window that covers the context) of a model whose family attends through the fused op
    (edgekv.models.FAMILIES: fused_attention); for ONNX Runtime also a layer that keeps exactly its native sliding
    window (a window-sized GroupQueryAttention cache); for ExecuTorch also a quantized cache
    (kv-int8/int4/int2), whose written rows it dequantizes for custom_sdpa (edgekv.models.llama
    Llama.pte_in_place, the same rule); a layer that keeps exactly its native sliding window is a window-sized cache
    for both (ExecuTorch: the eager ring written in place beside custom_sdpa layers, swaps.RingSdpaAttention). A window whose W + S covers the context keeps a slot per position: a plain
    cache (its measurement: edgekv/costs/workspace.json fused.onnxruntime)."""
    if runtime not in ("onnxruntime", "executorch") or not fused_attention_type(arch.model_type):
        return False
    if not strategy.fused_attention(runtime):
        return False
    return all(t.shape[2] == layout.ctx or _native_window(arch, strategy, t)
               for t in layout.tensors if t.role == "key")


def _native_window(arch: Arch, strategy: Strategy, key) -> bool:
    """A key cache of exactly its layer's native sliding window, with no window strategy over it: ONNX Runtime's
    GroupQueryAttention keeps it as a window-sized cache, ExecuTorch's .pte a ring written in place
    (edgekv.models.swaps, _native_window: the same rule)."""
    windows = [m.window for b in arch.blocks for m in b.mixers if isinstance(m, Attention)]
    return (strategy.recent_tokens is None and key.layer < len(windows)
            and windows[key.layer] is not None and key.shape[2] == windows[key.layer])


def _traits(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str) -> dict:
    """The runtime's RUNTIMES entry, with the fused graph's own traits over it (GQA for ONNX Runtime, ET_SDPA for
    ExecuTorch) where edgekv's export of this model and strategy attends through the fused op (fused_gqa)."""
    rt = _rt(runtime)
    if fused_gqa(arch, layout, strategy, runtime):
        rt = {**rt, **(GQA if runtime == "onnxruntime" else ET_SDPA)}
    if runtime == "executorch-llama" and strategy is not None and kv_read(runtime, strategy) == "dequantized copy":
        rt = {**rt, "kv_dequant": "layer"}  # a cache the recipe has no kernel for: rows dequantized to fp32 first
    return rt
