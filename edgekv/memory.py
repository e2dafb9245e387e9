"""Bytes, bandwidth, throughput, concurrency and cost: pure functions, no torch, no I/O.

Every function returns numbers together with the formula that produced them (an `Item`), so `--explain` can print
exactly what the planner computed. Units: bytes (int), seconds, FLOP, FLOP/s, bytes/s.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .arch import LLAMA_EXPORT_TYPES, MLA, SSM, Arch, Attention, Linear, ShortConv, Weight
from .strategies import StateLayout, Strategy, mla_rank, per_token_int8

WEIGHT_PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")

# What a runtime does with attention, with a quantized KV cache, with the state and with the weights while loading.
# Sources: anchors.md section 2 (scores, kv_dequant); the numeric fields were measured on this host (2 vCPU Zen 4,
# onnxruntime 1.32.0, executorch 1.5.1 pybindings, 2026-11-30) with edgekv's own exports, each in a fresh process,
# RSS (VmRSS/VmHWM) minus the RSS right after importing the runtime; the probe scripts and numbers are in
# benchmarks/plan_accuracy.py's docstring.
#   session_bytes: memory the runtime adds for any model beyond its weights (graph, kernel registry, code pages
#     touched on the first call, thread pool), measured with the tiny Llama fixture (7.28 MB fp32 weights).
#   score_copies: fp32 [H, chunk, T] score-sized tensors alive at once in a prefill call (a producer and its consumer:
#     scores -> masked -> softmax, each freed after its one use), from the slope of the peak over the chunk length.
#     T is every slot of a static cache (edgekv's graphs write the chunk into the max_ctx slots, then attend over all
#     of them, masked); a rolling window attends over its slots + the chunk.
#   mask_copies: fp32 [chunk, T] tensors shared by all layers and alive for the whole call (the additive attention
#     mask and the one-hot slot-write matrix, Cast(Equal(...)) in the ONNX graph).
#   state_copies: copies of the whole state alive at the peak of a call (the caller's inputs + the runtime's outputs,
#     + the runtime's own input buffers where it copies inputs in).
#   load_transient_tied: the runtime holds the tied table beside the packed weights while it loads, before the
#     state exists (ORT packs the head from the table's mapped pages; workspace_bytes). Once loaded, a tied head
#     costs no second table in either runtime: the runtime packs the lm_head for its GEMM (ORT's
#     FusedMatMul(transB) over the table, edgekv.export.wquant.fuse_tied_head; XNNPACK's own copy in its
#     delegate), and the gather reads the table from the mapped file (model.onnx.data; the .pte's constant segment),
#     whose pages edgekv gives back once loading is done and then reads page by page
#     (edgekv.export.runtime.release_file_pages, sparse): the table costs the rows a run reads. Before that, each
#     row the gather read mapped back the 64 KiB around it (the kernel's fault-around), so real text brought back
#     most of the table (SmolLM2 .pte, kv fp16, 8k slots: +77 MiB over a 2048-token prompt of 448 distinct tokens,
#     +98 MiB at 8184 tokens), which the planner counted as a second table.
#   packs_per_method: XNNPACK packs the delegated weights (linear + lm_head) once per method it initialises.
#   pack_transient: while XNNPACK packs (as a method loads) it holds one delegate's unpacked weights beside the
#     packed ones: the largest delegated matrix more, with the methods' planned buffers but before the caller's
#     state is resident (workspace_bytes).
#   rolling_attends_first: a rolling (window) layer's attention runs before the state it writes exists, so a call
#     peaks at the larger of the two, not their sum (workspace_bytes).
#   where_casts_fp16: no fp16 Where kernel, so a Where-written fp16 cache is cast to fp32 (WHERE_WRITTEN_TYPES).
RUNTIMES = {
    "executorch": {"scores": True, "kv_dequant": "layer", "session_bytes": 10_000_000, "score_copies": 2,
                   "state_copies": 3, "load_transient_tied": False, "packs_per_method": True,
                   "pack_transient": True, "logits_planned": True,
                   "why": "ExecuTorch quantized_kv_cache.py dequantizes the cache to fp32 on every update (anchors.md "
                          "section 2); edgekv's exported attention is matmul-softmax-matmul, which materialises scores"},
    "onnxruntime": {"scores": True, "kv_dequant": "layer", "session_bytes": 17_000_000, "score_copies": 2,
                    "mask_copies": 2, "state_copies": 3, "load_transient_tied": True, "packs_per_method": False,
                    "rolling_attends_first": True, "where_casts_fp16": True,
                    "why": "edgekv's ONNX graphs dequantize a layer's cache, then run matmul-softmax-matmul"},
    "executorch-llama": {"scores": False, "kv_dequant": "fused", "state_copies": 1, "score_copies": 0,
                         "why": "ExecuTorch's Llama export: llama::custom_sdpa / custom_quantized_sdpa read the cache "
                                "in place and tile their scores (edgekv/costs/runtimes.json); its session and "
                                "activations are in the device profile's runtime overhead, derived from its RSS"},
    "llama.cpp": {"scores": False, "kv_dequant": "fused",
                  "why": "flash attention on (stack.md); quantized K/V read by the attention kernel"},
    "vllm": {"scores": False, "kv_dequant": "fused", "why": "paged flash attention kernels read the cache in place"},
}
MEASURED = {  # how each numeric field above was measured; shown by --explain next to the number
    "onnxruntime": "session 17 MB = the middle of what ONNX Runtime holds after loading edgekv's tiny graphs, beyond "
                   "weights and state: 14.6 (window) - 14.7 (kv) - 15.4 (Mamba) - 17.5 (kv-int8) - 18.3 (RWKV) - 19.2 "
                   "(converted MLA) - 19.3 MB (kv-int4), +-3.4 MB by graph (a call's own tensors are the workspace; the "
                   "earlier 19 MB added a first call's 3.9 MB); 2 score copies + 2 [C, T] masks = steady-state prefill peak with the arena and memory "
                   "patterns off, tiny Llama kv fp16 (H=4): 32768 slots C=128 / 512: 575.5 / 1048.8 MB (slope 1.23 "
                   "MB/token = 2 x 16 B x T + 2 x 4 B x T + 12 KB activations), 1024 slots C=128 / 512: 45.3 / 66.6 MB; "
                   "3 state copies = the feed + ORT's outputs + the numpy arrays run() copies them into (decode at "
                   "32768 slots: 382 MB steady state, 256 MB on a first call whose zeroed feed is not yet resident); "
                   "not modelled: ORT's default arena and memory patterns keep blocks of earlier calls (+211 MB at "
                   "32768 slots C=128 over a 64-call prefill, +12.6 MB at 1024); load transient = SmolLM2 fp32 after creating the "
                   "session (weights mapped from model.onnx.data, the head a FusedMatMul over the table) 637 MiB = "
                   "520 packed weights and session + 116 MiB of the table's mapped pages, which the packing read; "
                   "given back (sparse), a 1900-token prompt of 431 distinct tokens + 64 steps ends at 590 MiB "
                   "(state 90 MiB; 664 MiB when fault-around mapped the rows' neighbours back; 774 MiB resident "
                   "and an 882 MiB load peak with the table's transpose folded, in a single-file model.onnx)",
    "executorch": "session 10 MB (tiny Llama .pte, kv fp16, loaded Method: peak above the baseline minus weights, "
                  "state and the call's planned buffers = 10.8 / 10.2 / 10.1 MB at 1k / 8k / 32k slots; 8 MB with "
                  "Module.run_method, before the LLM custom ops were imported after the baseline), 2 score copies, 1 + 2 state copies per method (the caller's + each method's "
                  "planned input and output buffers: tiny Llama kv 32k, state 100.7 MB: decode method 375 MB, + prefill "
                  "method 643 MB); packs per method: SmolLM2 decode method 698 MB, + prefill method "
                  "570 MB (XNNPACK packs the 425 MB linear + 113 MB lm_head again); tied head: SmolLM2 fp32 .pte "
                  "after loading the program 115 MiB (the mlocked embedding table), 113.5 MB of it released, "
                  "525 MiB after packing (538 MB weights), the table's rows read page by page after loading "
                  "(fault-around mapped back +98 MiB of it over 8k tokens of real text before); pack transient: SmolLM2 .pte (one method, kv fp16, 1k "
                  "slots): steady RSS after the first call 684 MiB above the baseline, peak 787 MiB (+108.5 MB, the "
                  "113 MB lm_head being packed)",
}


# fp32 [chunk, d_inner, d_state] tensors in a prefill call of edgekv's Mamba export (exp(dt A), dt B x and the scan's
# own copies). Measured here, tiny Mamba fixture (d_inner 512, d_state 16: 32.8 KB per token and copy) in ONNX Runtime
# with its arena and memory patterns off and the profile's malloc settings (edgekv/profile/run.py MALLOC_ENV), calls
# of C = 32 / 128 / 320 tokens: a call's own peak above the resident set 4.1 / 17.8 / 45.2 MB (142.7 KB per token,
# less 25.9 KB of activations and logits: 3.6 copies alive at once), and the first call leaves 47.7 KB per token more
# resident (1.4 copies), which every later peak sits on: 5 in all, the slope of the profile's peak (188.5 KB per
# token). (The earlier 6 was measured with glibc's sliding mmap threshold, which kept freed per-call blocks.)
SCAN_COPIES = 5.0

# fp32 [T, Hkv*D] tensors (one layer's keys for every slot) alive at once while a converted-MLA layer rebuilds its
# keys (edgekv.models.mla.ConvertedAttention): RoPE needs each slot's own position, so every call multiplies the
# whole latent out again and rotates it. ONNX Runtime's optimized graph runs MatMul -> Split -> Neg -> Concat ->
# Mul(sin), Mul(cos) -> Add -> Transpose per layer, with the fp32 latent (T x r) alive until the softmax-weighted
# sum. Measured here (tiny Llama converted at r = Hkv*D = 192, fp16 latent, 8192 slots, arena and memory patterns
# off): a decode call peaks 81.8 MB above the resident state = 2 state copies (25.2 MB) + 56.6 MB = 9.0 x 6.29 MB,
# i.e. the fp32 latent + 8 key-sized tensors; a 128-token call 128 MB = that + 2 score copies + the masks.
MLA_REBUILD_COPIES = 8

# fp32 [Hkv, T, D] tensors a sub-byte (int4/int2) cache adds to the layer's fp32 K and V while it is unpacked:
# quant.unpack's per-nibble planes (each [.., D/per] fp32, masked then scaled), their stack, then the scale multiply
# and the zero add each make one more. Measured here: tiny Llama kv-int4 g16 at 8192 slots, first 128-token call
# 91.6 MB above weights + state + session where 2 fp32 K,V (12.6 MB) + the rest predicted 75.0 MB: +16.6 MB =
# 2.6 x 6.29 MB. int8 (codes.float() * scale, no planes) stays at 2: its rows are within 9 % without it.
UNPACK_EXTRA_COPIES = 2.6

# Model types whose export writes a float cache with torch.where (edgekv.models.hybrid.NoPEAttention): ONNX Runtime's
# CPU Where has no fp16 kernel, so for a fp16 cache it inserts casts (InsertedPrecisionFreeCast_past.* /
# _present.* in its optimized graph): the past K and V and the written present K and V of one layer exist in fp32,
# 4 layer-sized fp32 tensors where Llama's arithmetic blend (computed in the cache dtype) reads back 2.
WHERE_WRITTEN_TYPES = ("jamba",)


def _rt(runtime: str) -> dict:
    return RUNTIMES.get(runtime, RUNTIMES["executorch"])


# What `edgekv plan --runtime R` assumes R does, each fact with its source: edgekv/costs/runtimes.json. Keyed by the
# name users pass; `cost_model` is the RUNTIMES entry above that models it ("executorch" and "onnxruntime" there are
# edgekv's own artifacts, which export and profile plan with).
PLAN_RUNTIMES = {k: v for k, v in json.loads((Path(__file__).resolve().parent / "costs" / "runtimes.json")
                                               .read_text()).items() if not k.startswith("_")}
KV_READ = {v["cost_model"]: v["kv_read"]["value"] for v in PLAN_RUNTIMES.values()}


def kv_read(runtime: str, strategy: Strategy) -> str:
    """How the runtime's attention reads this strategy's cache: 'in place', 'cast' or 'dequantized copy'
    (edgekv/costs/runtimes.json kv_read; a runtime not listed there dequantizes whole layers)."""
    key = {8: "int8", 4: "int4", 2: "int2"}.get(strategy.kv_bits or 0) or strategy.params.get("dtype", "fp32")
    return KV_READ.get(runtime, {}).get(key, "dequantized copy" if strategy.kv_bits else "cast")


# edgekv's ONNX export runs a Llama-family float cache through ONNX Runtime's GroupQueryAttention (com.microsoft;
# edgekv/models/llama.py Attention.fused) with present.* bound to past.*'s buffers (OrtStepper, manifest
# state_in_place): the state exists once, there is no mask or one-hot write, and the op's own scratch is one fp32
# [H, C, T] probability buffer (T = the present buffer's slots; onnxruntime contrib_ops/cpu/bert/gqa_attention_base.h
# ApplyAttention) plus, for a fp16 cache, one head's K or V converted to fp32 per thread. Measured: benchmarks/
# plan_accuracy.py ("kv fp16" ORT rows).
# Its session, beyond weights and state after loading, is the smallest of edgekv's graphs: 14.6-14.7 MB (tiny Llama
# kv fp16, and a window that covers the context, which is the same graph), where the 17 MB of RUNTIMES is the middle
# of every graph's (MEASURED["onnxruntime"]).
GQA = {"score_copies": 1, "mask_copies": 0, "state_copies": 1, "kv_dequant": "head", "session_bytes": 14_700_000,
       "why": "edgekv's ONNX kv graph: GroupQueryAttention over the written slots, state updated in place"}


# edgekv's .pte runs the same plain float cache through ExecuTorch's LLM kernels (edgekv/models/llama.py
# Attention.custom: index_put_ on the past.* tensor, llama::custom_sdpa over the written rows) in one method with a
# dynamic token axis: the state is not memory-planned and exists once, the op tiles its scores (none materialised),
# and there is no mask. A fp16 cache is read back as fp32 rows 0..pos+C-1 for the op (a slice of the fp16 rows, then
# a cast): 2.5 K-sized fp32 tensors in the method's memory plan (its planned buffer: 15.9 / 16.0 MB at 8k for the
# tiny Llama / SmolLM2, read from the .pte). Measured, peak above the runtime baseline (tiny Llama, 4 layers, and
# SmolLM2, 30 layers, kv fp16, chunk 32, 1k / 8k / 32k slots): see benchmarks/plan_accuracy.py. (Until 2026-12-01
# the runner called the pybindings' Module.run_method, which allocated a fresh buffer for every in-place output on
# each call: one more state, once modelled here as "one K-sized read-back per layer". A loaded Method keeps those
# buffers, and the state lives in them.)
# A quantized cache is read back the same way, its rows dequantized (edgekv.quant.dequantize on the slice): int8
# with one scale per token and head in one op (dequantize_per_token), int8 with finer groups a cast and a scale
# multiply, packed int4/int2 each nibble plane masked, cast, scaled and offset, then the planes concatenated
# (planar channel order). The copies are the slope of the method's planned buffer (non_const_buffer_sizes, read
# from the .pte) over the context, in K-sized fp32 tensors: tiny Llama 8k -> 32k fp16 2.50, int8 2.31, int8
# group 16 3.13, int4 group 16 3.25; SmolLM2 at 8k (buffer / K-size) 2.55, 2.34, -, 3.18.
# The logits come after the last layer's attention, so the plan lays them over the read-back (SmolLM2 at 1k: the
# buffer, 6.07 MB, is the 6.0 MB of a 32-token chunk's logits; the read-back, 1.9 MB, hides under them).
# A quantized cache's read-back also runs ExecuTorch kernels a float cache's graph does not (13 more operators for
# packed int4): their code is paged in from the kernel library, file-backed memory the process holds from its first
# call on. Measured with /proc/self/smaps (the .so mappings' Rss after loading and a 200-token call, minus the fp16
# cache's; the same on the tiny Llama and on SmolLM2-135M, 1k slots): int8 +1088 KiB, int8 groups +1160 KiB, packed
# +2000 KiB, nearly all libexecutorch_kernels_optimized.so. The fp16 graph's own code pages (6.3 MiB) are part of
# the measured session cost (MEASURED["executorch"]).
ET_SDPA = {"scores": False, "mask_copies": 0, "state_copies": 1, "kv_dequant": "layer", "in_place": True,
           "readback_copies": {"fp16": 2.5, "int8": 2.3, "int8 groups": 3.1, "packed": 3.25},
           "kernel_code": {"fp16": 0, "fp32": 0, "int8": 1088 * 1024, "int8 groups": 1160 * 1024,
                           "packed": 2000 * 1024},
           "logits_over_scratch": True,
           "why": "edgekv's .pte kv graph: custom_sdpa over the written rows, state written in place"}


def fused_gqa(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str) -> bool:
    """Whether edgekv's export of this (model, strategy) for this runtime attends through a fused op in place
    (ONNX Runtime's GroupQueryAttention, ExecuTorch's custom_sdpa): a float cache with one slot per position in
    every layer (`kv`, or a window that covers the context) of a Llama-family model with no rolling (native sliding)
    layer; for ExecuTorch also a quantized cache
    (kv-int8/int4/int2), whose written rows it dequantizes for custom_sdpa (edgekv.models.llama
    Llama.pte_in_place, the same rule). A window whose W + S covers the context keeps a slot per position: a plain
    cache (tiny Llama window w=4096 at 1k: measured 27.7 MiB above the baseline, as kv fp16, not the explicit
    graph's 40)."""
    if runtime not in ("onnxruntime", "executorch") or arch.model_type not in LLAMA_EXPORT_TYPES:
        return False
    if strategy.name not in ("kv", "window") and not (runtime == "executorch" and strategy.kv_bits):
        return False
    return all(t.shape[2] == layout.ctx for t in layout.tensors if t.role == "key")


def _traits(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str) -> dict:
    """The runtime's RUNTIMES entry, with the fused graph's own traits over it (GQA for ONNX Runtime, ET_SDPA for
    ExecuTorch) where edgekv's export of this model and strategy attends through the fused op (fused_gqa)."""
    rt = _rt(runtime)
    if fused_gqa(arch, layout, strategy, runtime):
        rt = {**rt, **(GQA if runtime == "onnxruntime" else ET_SDPA)}
    if runtime == "executorch-llama" and strategy is not None and kv_read(runtime, strategy) == "dequantized copy":
        rt = {**rt, "kv_dequant": "layer"}  # a cache the recipe has no kernel for: rows dequantized to fp32 first
    return rt


@dataclass
class Item:
    """A number and how it was computed."""
    value: float
    formula: str

    def __int__(self):
        return int(self.value)


# ---- weights ----


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


# ---- compute ----


def _attn_tokens(ctx: int, window: int | None) -> float:
    """Sum over positions t = 1..ctx of the keys position t attends to (causal, capped by a window)."""
    if window is None or window >= ctx:
        return ctx * (ctx + 1) / 2
    return window * (window + 1) / 2 + (ctx - window) * window


def decode_flops(arch: Arch, layout: StateLayout, strategy: Strategy) -> Item:
    """FLOP for one new token at the layout's context: 2 x active matmul params + attention over the kept tokens
    (+ reconstructing K and V from a converted MLA latent, + the SSM/linear recurrences)."""
    lin = 2 * sum(w.numel * w.read_fraction for w in arch.weights if w.cls in ("linear", "lm_head")) \
        + (2 * arch.vocab * arch.hidden if not any(w.cls == "lm_head" for w in arch.weights) else 0)
    kept = {t.layer: t.shape[2] if t.role in ("key",) else t.shape[1] for t in layout.tensors
            if t.role in ("key", "latent")}
    attn = extra = rec = 0.0
    for i, b in enumerate(arch.blocks):
        for m in b.mixers:
            if isinstance(m, Attention):
                t = kept.get(i, 0)
                attn += 4 * m.n_heads * m.head_dim * t
                if strategy.name == "mla":
                    extra += 2 * layout_rank(layout, i) * 2 * m.n_kv_heads * m.head_dim * t
            elif isinstance(m, MLA):
                # absorbed MLA (DeepSeek-V2 inference): scores and values computed in the latent space
                t = kept.get(i, 0)
                attn += 2 * m.n_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * t
            elif isinstance(m, SSM):
                rec += 6 * (m.d_inner * m.d_state) + 2 * m.conv_dim * m.d_conv
            elif isinstance(m, Linear):
                rec += 6 * (m.n_vectors * m.width if m.n_vectors else m.n_heads * m.d_k * m.d_v)
            elif isinstance(m, ShortConv):  # B * x, the K-tap conv, C * y
                rec += 2 * m.width * (m.d_conv + 1)
    total = lin + attn + extra + rec
    f = (f"2 x active matmul params ({lin:.3g}) + attention 4*H*D*T per layer ({attn:.3g})"
         + (f" + K/V reconstruction from the latent 2*r*2*Hkv*D*T per layer ({extra:.3g})" if extra else "")
         + (f" + recurrences ({rec:.3g})" if rec else "") + f" = {total:.3g} FLOP/token")
    return Item(total, f)


def layout_rank(layout: StateLayout, layer: int) -> int:
    for t in layout.tensors:
        if t.layer == layer and t.role == "latent":
            return t.shape[-1]
    return 0


def prefill_flops(arch: Arch, strategy: Strategy, ctx: int, chunk: int) -> Item:
    """FLOP to prefill ctx tokens in chunks: 2 x active params per token, causal attention summed over positions
    (windows cap it), a converted-MLA latent re-expanded for every chunk, SSM scans linear in ctx."""
    lin = 2 * sum(w.numel * w.read_fraction for w in arch.weights if w.cls == "linear") * ctx
    head = 2 * arch.vocab * arch.hidden * math.ceil(ctx / chunk)  # logits for the last token of each chunk
    attn = extra = rec = 0.0
    w_cap = strategy.params["w"] + strategy.params["sinks"] if strategy.name == "window" else None
    for b in arch.blocks:
        for m in b.mixers:
            if isinstance(m, Attention):
                win = m.window if w_cap is None else min(w_cap, m.window or w_cap)
                attn += 4 * m.n_heads * m.head_dim * _attn_tokens(ctx, win)
                if strategy.name == "mla":
                    r = mla_rank(arch, strategy)
                    n_chunks = math.ceil(ctx / chunk)
                    prefix = chunk * n_chunks * (n_chunks + 1) / 2  # tokens re-expanded, summed over chunks
                    extra += 2 * r * 2 * m.n_kv_heads * m.head_dim * min(prefix, ctx * n_chunks)
            elif isinstance(m, MLA):
                attn += 2 * m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * _attn_tokens(ctx, None)
            elif isinstance(m, SSM):
                rec += (6 * m.d_inner * m.d_state + 2 * m.conv_dim * m.d_conv) * ctx
            elif isinstance(m, Linear):
                rec += 6 * (m.n_vectors * m.width if m.n_vectors else m.n_heads * m.d_k * m.d_v) * ctx
            elif isinstance(m, ShortConv):
                rec += 2 * m.width * (m.d_conv + 1) * ctx
    total = lin + head + attn + extra + rec
    return Item(total, f"2*params*ctx ({lin:.3g}) + logits per chunk ({head:.3g}) + causal attention ({attn:.3g})"
                       + (f" + latent re-expansion ({extra:.3g})" if extra else "")
                       + (f" + scans ({rec:.3g})" if rec else "") + f" = {total:.3g} FLOP")


# ---- workspace ----


def workspace_bytes(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str, chunk: int,
                    precision: str = "fp32", methods: int = 1) -> Item:
    """Transient memory at the worst moment of a prefill chunk or a decode step (fp32 activations):
    chunk activations + attention scores (x the copies the runtime keeps alive, if it materialises them) + logits
    + dequant/reconstruction scratch for one layer + the extra state copies alive during a call; or, where larger, the
    runtime's load-time transient (ORT packing a tied lm_head from the table's mapped pages)."""
    rt = _traits(arch, layout, strategy, runtime)
    inter = arch.mlp_width
    qkv = 0
    ssm_w = 0
    scores = 0
    scratch = 0
    scan = 0
    masks = 0
    scratch_how = ""
    kept, width = {}, {}
    for t in layout.tensors:
        if t.role in ("key", "latent"):
            kept[t.layer] = t.shape[2] if t.role == "key" else t.shape[1]
            width[t.layer] = t.shape[-1]
    rolling = False  # a rolling (window) layer's attention reads the old cache + the chunk, not the state it writes
    for i, b in enumerate(arch.blocks):
        for m in b.mixers:
            if isinstance(m, Attention):
                qkv = max(qkv, (m.n_heads + 2 * m.n_kv_heads) * m.head_dim)
                t = kept.get(i, 0)
                rolling |= 0 < t < layout.ctx and rt.get("rolling_attends_first", False)
                if rt["scores"]:
                    seen = t if t == layout.ctx else t + chunk  # a static cache already holds the chunk
                    scores = max(scores, m.n_heads * chunk * seen * 4)
                    masks = max(masks, chunk * seen * 4)
                layer, how = _layer_scratch(arch, m, t, width.get(i, 0), strategy, rt, chunk)
                if layer > scratch:
                    scratch, scratch_how = layer, how
            elif isinstance(m, MLA):
                qkv = max(qkv, m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.kv_lora_rank)
                if rt["scores"]:
                    scores = max(scores, m.n_heads * chunk * (kept.get(i, 0) + chunk) * 4)
            elif isinstance(m, SSM):
                ssm_w = max(ssm_w, 2 * m.d_inner + m.conv_dim)
                scan = max(scan, SCAN_COPIES * chunk * m.d_inner * m.d_state * 4)
    copies = rt.get("score_copies", 1)
    n_state = rt.get("state_copies", 1)
    if rt.get("packs_per_method"):  # every method has its own planned buffers: state in + state out, dequant scratch
        n_state, scratch = (1 if rt.get("in_place") else 1 + 2 * methods), scratch * methods
    extra_state = (n_state - 1) * layout.nbytes
    act = chunk * (4 * arch.hidden + qkv + 3 * inter + ssm_w) * 4
    # the exported step returns the logits of the rows the caller asks for (edgekv.models.head): one in generation
    # and prefill. A memory-planned runtime (ExecuTorch) holds a slot for the most rows a call can ask for, the chunk
    logits_rows = chunk if rt.get("logits_planned") else 1
    logits = logits_rows * arch.vocab * 4
    masks *= rt.get("mask_copies", 0)
    pack = _largest_packed(arch, precision) if rt.get("pack_transient") else 0
    # a memory plan that lays the logits over the attention's scratch: the larger of the two
    attend = act + copies * scores + masks + scan + (max(logits, scratch) if rt.get("logits_over_scratch")
                                                     else logits + scratch)
    # static caches: attention reads the state the call writes, so the written copies are alive with its scratch;
    # rolling layers: the written state is an output no node reads, and ORT's order runs the attention first, so the
    # call peaks at the larger of the two. Measured (tiny Llama window w=4096 + 4 sinks, fp16, 8192-token context,
    # peak above the resident state): 128-token calls 28.8 MB (attention 29.7 predicted, 2 copies 25.2), 256-token
    # calls 50.0 MB (54.5), decode 20-23 MB (25.2); the sum over-predicted by 19 %.
    step = max(attend, extra_state + logits) if rolling else attend + extra_state
    # loading packs a tied head from the table's mapped pages (given back after), before the state is resident
    load = _tied_bytes(arch, precision) - layout.nbytes if rt.get("load_transient_tied") else 0
    # XNNPACK packs while the methods load: their planned buffers exist, the caller's state does not yet (a loaded
    # ExecuTorch method allocates the buffers of its in-place outputs, where the state then lives, on its first
    # call); the embedding's pages were given back before loading
    packing = pack + extra_state - layout.nbytes if pack else 0
    total = max(step, load, packing)
    parts = [f"activations {chunk} tok x (4*hidden + qkv + 3*inter{' + ssm' if ssm_w else ''}) x 4 B = {act:,.0f}",
             (f"scores {copies} x H x chunk x T x 4 B = {copies * scores:,}" if rt["scores"]
              else "scores not materialised"),
             *([f"masks {rt['mask_copies']} x chunk x T x 4 B = {masks:,}"] if masks else []),
             f"logits {'chunk' if logits_rows > 1 else '1 row'} x vocab x 4 B = {logits:,}"]
    if scratch and rt.get("logits_over_scratch"):
        parts[-1] = (f"max({parts[-1]}, {scratch_how} = {scratch:,.0f}) (the plan lays the logits over the "
                     "attention's scratch)")
    elif scratch:
        parts.append(f"{scratch_how} = {scratch:,.0f}")
    if scan:
        parts.append(f"selective-scan inputs {SCAN_COPIES} x chunk x d_inner x d_state x 4 B = {scan:,}")
    if rolling:
        f = (f"max(attention: {' + '.join(parts)} = {attend:,.0f}, end of the call: {n_state - 1} more state copies"
             f" {extra_state:,} + logits) = {step:,.0f} (rolling layers attend before they write)")
    else:
        if extra_state:
            parts.append(f"{n_state - 1} more state copies during a call = {extra_state:,}")
        f = " + ".join(parts) + f" = {step:,.0f}"
    if load:
        f = (f"max(step: {f}, load: the tied table's pages read while packing the head, before the state is "
             f"resident {load:,.0f}) = {total:,.0f}")
    if packing:
        f = (f"max(step: {f}, load: the largest delegated weight matrix unpacked while XNNPACK packs it {pack:,.0f}"
             + (f" + {n_state - 1} planned state copies" if extra_state else "")
             + f" - the state, not yet resident = {packing:,.0f}) = {total:,.0f}")
    return Item(total, f + f" [{runtime}: {rt['why']}" + (f"; measured: {MEASURED[runtime]}" if runtime in MEASURED
                                                           else "") + "]")


def _layer_scratch(arch: Arch, m: Attention, t: int, width: int, strategy: Strategy, rt: dict, chunk: int
                   ) -> tuple[float, str]:
    """fp32 scratch one attention layer of t slots needs beside its scores, and what it is (for --explain)."""
    unit = m.n_kv_heads * t * m.head_dim * 4  # one layer's K (or V) for every slot, fp32
    dtype = strategy.params.get("dtype", "fp32")
    if strategy.name == "mla":  # converted: the fp32 latent + the keys rebuilt and rotated for every slot
        return (t * width * 4 + MLA_REBUILD_COPIES * unit,
                f"one layer's latent in fp32 + {MLA_REBUILD_COPIES} key-sized fp32 tensors while its keys are "
                "rebuilt and rotated for every slot")
    if rt["kv_dequant"] == "head":
        if dtype == "fp32":
            return 0, ""
        return 2 * (t + chunk) * m.head_dim * 4, f"one head's K,V in fp32 (cast from {dtype})"
    if rt["kv_dequant"] != "layer" or not (strategy.kv_bits or dtype != "fp32"):
        return 0, ""
    if "readback_copies" in rt:
        bits = strategy.kv_bits
        src = _readback_source(m, strategy)
        copies = rt["readback_copies"][src]
        how = (f"{'dequantized' if bits else 'cast'} from {src}; {copies} K-sized fp32 tensors in each "
               "method's memory plan, shared by the layers")
    elif strategy.kv_bits:
        sub = strategy.kv_bits < 8
        copies = 2 + (UNPACK_EXTRA_COPIES if sub else 0)
        how = "dequantized" + (f", + {UNPACK_EXTRA_COPIES} K-sized unpacking planes" if sub else "")
    elif arch.model_type in WHERE_WRITTEN_TYPES and rt.get("where_casts_fp16"):
        copies, how = 4, f"cast from {dtype}, past and present: ONNX Runtime's Where has no fp16 kernel"
    else:
        copies, how = 2, f"cast from {dtype}"
    return copies * unit, f"one layer's K,V in fp32 ({how})"


def _readback_source(m: Attention, strategy: Strategy) -> str:
    """What a fused .pte reads its cache rows back from (ET_SDPA's keys): the float dtype, int8 with one scale per
    token and head, int8 with finer groups, or packed sub-byte codes."""
    bits = strategy.kv_bits
    if not bits:
        return strategy.params.get("dtype", "fp32")
    if bits < 8:
        return "packed"
    return "int8" if per_token_int8(bits, strategy.params.get("group"), m.head_dim) else "int8 groups"


def _kernel_code(arch: Arch, strategy: Strategy, rt: dict) -> float:
    """Code pages of the extra kernels a fused .pte's quantized read-back runs (ET_SDPA kernel_code), else 0."""
    att = next((m for b in arch.blocks for m in b.mixers if isinstance(m, Attention)), None)
    return rt["kernel_code"].get(_readback_source(att, strategy), 0) if "kernel_code" in rt and att else 0


def _largest_packed(arch: Arch, precision: str) -> float:
    """Bytes of the largest matrix XNNPACK packs: a linear, the lm_head, or the embedding a tied lm_head reads."""
    sizes = [weight_bytes_one(w, precision) for w in arch.weights if w.cls in ("linear", "lm_head")]
    return max(sizes + [_tied_bytes(arch, precision)])


def _tied_bytes(arch: Arch, precision: str) -> float:
    """The embedding table's bytes when the lm_head is tied to it (no lm_head tensor), else 0."""
    if any(w.cls == "lm_head" for w in arch.weights):
        return 0
    return sum(weight_bytes_one(w, precision) for w in arch.weights if w.cls == "embedding")


# What a runtime's arm64 kernels pack beyond its x86 kernels, as a fraction of the stored weights, by cost model and
# weight precision: `edgekv profile --arch arm64` measurements (edgekv/costs/arm64_packing.json, {value, source}).
ARM64_PACKING = {k: v for k, v in json.loads((Path(__file__).resolve().parent / "costs" / "arm64_packing.json")
                                             .read_text()).items() if not k.startswith("_")}


def arm64_load(load: Item, weights_stored: float, runtime: str, precision: str) -> Item:
    """The runtime's load bytes on an arm64 device (a phone): plus the packing measured on arm64 where it differs."""
    f = ARM64_PACKING.get(runtime, {}).get(precision)
    if not f:
        return load
    extra = f["value"] * weights_stored
    return Item(load.value + extra, f"{load.formula} + arm64 packing {f['value']:+.4f} x stored weights "
                                    f"{weights_stored:,.0f} = {extra:+,.0f} B ({f['source']})")


def runtime_load_bytes(arch: Arch, precision: str, runtime: str, methods: int = 1,
                       layout: StateLayout | None = None, strategy: Strategy | None = None) -> Item:
    """Resident bytes the runtime adds to the stored weights once the model is loaded and has run: its per-session
    cost and (XNNPACK) one more packed copy of the delegated weights for every
    method beyond the first (a .pte of a recurrent or blended state has two, prefill and decode; a plain kv cache's
    .pte has one, forward). With the layout and strategy given, a fused graph's traits apply (_traits): its own
    session (ONNX Runtime's GroupQueryAttention graph) and the code pages of the kernels a fused .pte's quantized
    read-back adds."""
    given = layout is not None and strategy is not None
    rt = _traits(arch, layout, strategy, runtime) if given else _rt(runtime)
    sess = rt.get("session_bytes", 0)
    own = sess != _rt(runtime).get("session_bytes", 0)  # the fused graph's own session (GQA)
    packs = 0.0
    if rt.get("packs_per_method") and methods > 1:
        delegated = sum(weight_bytes_one(w, precision) for w in arch.weights if w.cls in ("linear", "lm_head"))
        packs = (methods - 1) * (delegated + _tied_bytes(arch, precision))  # a tied lm_head is packed too
    code = _kernel_code(arch, strategy, rt) if given else 0
    total = sess + packs + code
    f = f"session {sess:,}" + (" (the fused graph's)" if own else "") \
        + (f" + {methods - 1} more XNNPACK-packed copy of linear + lm_head {packs:,.0f}" if packs else "") \
        + (f" + code of the quantized read-back's kernels {code:,.0f}" if code else "") \
        + f" = {total:,.0f} B [{runtime}" + (f"; measured: {MEASURED[runtime]}" if runtime in MEASURED else "") + "]"
    return Item(total, f)


# ---- speed ----


def decode_read_bytes(weights_read: float, layout: StateLayout, strategy: Strategy, runtime: str) -> Item:
    """Bytes one decode step moves: active weights + the whole state (+ writing and reading a dequantized fp32
    copy of the cache when the runtime dequantizes whole layers)."""
    state = layout.nbytes
    extra = 0
    if strategy.kv_bits and kv_read(runtime, strategy) == "dequantized copy":
        extra = 2 * sum(math.prod(t.shape[:3]) * (t.shape[3] * (8 // t.packed_bits if t.packed_bits else 1)) * 4
                        for t in layout.tensors if t.role in ("key", "value"))
    total = weights_read + state + extra
    return Item(total, f"weights read {weights_read:,.0f} + state {state:,}"
                       + (f" + fp32 dequant copy written and read {extra:,}" if extra else "") + f" = {total:,.0f} B")


def decode_tokens_per_s(read: float, flops: float, bandwidth: float, bw_eff: float, peak_flops: float,
                        flop_eff: float) -> Item:
    t_bw = read / (bandwidth * bw_eff)
    t_fl = flops / (peak_flops * flop_eff)
    t = max(t_bw, t_fl)
    bound = "bandwidth" if t_bw >= t_fl else "compute"
    return Item(1 / t, f"1 / max(bytes {read:.3g} / ({bandwidth:.3g} B/s x {bw_eff}), FLOP {flops:.3g} / "
                       f"({peak_flops:.3g} FLOP/s x {flop_eff})) = {1 / t:.3g} tok/s ({bound}-bound)")


def prefill_seconds(flops: float, weights_stored: float, ctx: int, chunk: int, bandwidth: float, bw_eff: float,
                    peak_flops: float, flop_eff: float) -> Item:
    t_fl = flops / (peak_flops * flop_eff)
    t_bw = math.ceil(ctx / chunk) * weights_stored / (bandwidth * bw_eff)
    t = max(t_fl, t_bw)
    return Item(t, f"max(FLOP {flops:.3g} / ({peak_flops:.3g} x {flop_eff}), {math.ceil(ctx / chunk)} chunks x weights "
                   f"{weights_stored:.3g} B / ({bandwidth:.3g} x {bw_eff})) = {t:.3g} s")


# ---- datacenter: concurrency and cost ----


def users_per_gpu(pool_bytes: float, per_user_bytes: float) -> Item:
    u = int(pool_bytes // per_user_bytes) if per_user_bytes > 0 else 0
    return Item(u, f"floor(KV pool {pool_bytes:,.0f} B / per-user state {per_user_bytes:,.0f} B) = {u}")


def usd_per_m_tokens(usd_per_hour: float, n_gpus: int, users: int, tok_s_per_user: float) -> Item:
    if users <= 0 or tok_s_per_user <= 0:
        return Item(math.inf, "no user fits: cost is unbounded")
    agg = users * tok_s_per_user
    v = n_gpus * usd_per_hour / (agg * 3600 / 1e6)
    return Item(v, f"{n_gpus} GPU x ${usd_per_hour}/h / ({users} users x {tok_s_per_user:.4g} tok/s x 3600 / 1e6) "
                   f"= ${v:.4g} per M tokens")


@dataclass
class Deployment:
    """Everything the planner knows about one (model, strategy, ctx, weights, runtime): the one object export writes
    into the manifest and profile compares against."""
    model: str
    strategy: Strategy
    ctx: int
    weight_precision: str
    runtime: str
    layout: StateLayout
    weights: dict[str, float]
    workspace: Item
    runtime_overhead: float
    load: Item = field(default_factory=lambda: Item(0, "not modelled"))
    explain: dict[str, str] = field(default_factory=dict)

    @property
    def bytes(self) -> dict[str, int]:
        w = int(self.weights["total"])
        s = self.layout.nbytes
        ws = int(self.workspace.value)
        rt = int(self.runtime_overhead)
        ld = int(self.load.value)
        return {"weights": w, "state": s, "workspace": ws, "load": ld, "runtime": rt, "total": w + s + ws + ld + rt}

    def to_json(self) -> dict:
        return {"model": self.model, "strategy": self.strategy.name, "params": self.strategy.params,
                "ctx": self.ctx, "weights": self.weight_precision, "runtime": self.runtime, "bytes": self.bytes,
                "weight_bytes_by_class": {k: int(v) for k, v in self.weights.items()},
                "state": self.layout.to_json()}
