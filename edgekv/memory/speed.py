"""FLOP and bytes per decode step and the tokens per second they take on a device; the attention kernels' stored rates
(edgekv/costs/attention_rates.json) and the cache kind that prices a row (a prompt's cost: memory.prefill)."""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from ..arch import MLA, SSM, Arch, Attention, Linear, ShortConv
from ..strategies import StateLayout, Strategy
from ..units import fmt_sig
from .costs import fused_gqa, kv_read
from .item import Item


def _attn_tokens(ctx: int, window: int | None) -> float:
    """Sum over positions t = 1..ctx of the keys position t attends to (causal, capped by a window)."""
    if window is None or window >= ctx:
        return ctx * (ctx + 1) / 2
    return window * (window + 1) / 2 + (ctx - window) * window


@functools.lru_cache(maxsize=512)  # per (Arch, classes): the same for every row of a model
def _active_params(arch: Arch, classes: tuple[str, ...]) -> float:
    """Parameters of those weight classes one token reads (routed experts weighted by top_k / n_experts)."""
    return sum(w.numel * w.read_fraction for w in arch.weights if w.cls in classes)


def decode_flops(arch: Arch, layout: StateLayout, strategy: Strategy) -> Item:
    """FLOP for one new token at the layout's context: 2 x active matmul params + attention over the kept tokens
    (+ reconstructing K and V from a converted MLA latent, + the SSM/linear recurrences)."""
    lin = 2 * _active_params(arch, ("linear", "lm_head")) \
        + (2 * arch.vocab * arch.hidden if not any(w.cls == "lm_head" for w in arch.weights) else 0)
    kept = {t.layer: t.shape[2] if t.role in ("key",) else t.shape[1] for t in layout.tensors
            if t.role in ("key", "latent")}
    attn = extra = rec = 0.0
    for i, b in enumerate(arch.blocks):
        for m in b.mixers:
            if isinstance(m, Attention):
                t = kept.get(i, 0)
                attn += 4 * m.n_heads * m.head_dim * t
                if strategy.converts_to_latent:
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


def decode_read_bytes(weights_read: float, layout: StateLayout, strategy: Strategy, runtime: str) -> Item:
    """Bytes one decode step moves: active weights + the whole state (+ writing and reading a dequantized fp32
    copy of the cache when the runtime dequantizes whole layers)."""
    state = layout.nbytes
    extra = 0
    st = strategy.kv_storage
    if st is not None and st.quantized and kv_read(runtime, strategy) == "dequantized copy":
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


# One decode step's attention as each runtime's kernel runs it: per layer overhead + T * (2 * Hkv * D * bytes / read
# rate + H * D * compute), T the keys the layer keeps. The rates per runtime, device and cache kind, with their
# sources: edgekv/costs/attention_rates.json (ONNX Runtime's GroupQueryAttention and edgekv's .pte custom_sdpa
# measured on the host by benchmarks/attention_rates.py, llama.cpp's flash attention fitted on its filled-context
# decode rows by benchmarks/plan_vs_filled.py; phones: the host's scaled by an assumed range, hence a speed range).
ATTENTION_RATES = json.loads((Path(__file__).resolve().parent.parent / "costs" / "attention_rates.json").read_text())
# bytes per cached value of each stored kind (llama.cpp's q8_0 / q4_0: 32 values in a 34 / 18-byte block)
_KIND_BYTES = {"fp32": 4, "fp16": 2, "int8c": 1, "int8": 1, "int4": 0.5, "int2": 0.25, "f16": 2, "q8_0": 34 / 32,
               "q4_0": 18 / 32}
_FLOAT_KIND = {"float32": "fp32", "float16": "fp16"}  # a layout tensor's dtype -> its stored kernel rate
_GGML_KIND = {"float16": "f16", 8: "q8_0", 4: "q4_0"}  # llama.cpp's cache type for a float16 / 8-bit / 4-bit cache


def attention_rates(runtime: str, device_id: str, device_class: str) -> dict | None:
    """The stored attention rates of this runtime (a memory.RUNTIMES cost model) on this device: {"kinds", "scale":
    (low, high), "weights", "prefill", "kernel", "source", "basis"}; None where none apply (a runtime or device class
    with no entry)."""
    rt = ATTENTION_RATES.get(runtime)
    if rt is None:
        return None
    dev = rt["devices"].get(device_id)
    if dev is not None:
        # rates_from: another cost model whose weight kernels and prefill this runtime runs as well (ExecuTorch's
        # Llama export: the same XNNPACK 8da4w kernels as edgekv's .pte, its prompt through the same custom_sdpa /
        # custom_quantized_sdpa): the weights and prefill rates stored there
        src = ATTENTION_RATES[dev["rates_from"]]["devices"].get(device_id, {}) if "rates_from" in dev else dev
        return {"kinds": dev["kinds"], "scale": (1.0, 1.0), "weights": src.get("weights", {}),
                "cache_pages": dev.get("cache_pages"),
                "gguf_types": dev.get("gguf_types", {}), "gguf_type_rates": dev.get("gguf_type_rates", {}),
                "prefill": src.get("prefill"), "source": dev["source"], "basis": dev["basis"], "kernel": rt["label"]}
    cls = rt["classes"].get(device_class)
    if cls is None:
        return None
    base = rt["devices"][cls["scaled_from"]]
    return {"kinds": base["kinds"], "scale": tuple(cls["scale"]), "weights": {}, "gguf_types": {}, "gguf_type_rates": {},
            "prefill": None,
            "source": cls["source"], "basis": cls["basis"], "kernel": rt["label"]}


def gguf_type_mix(arch: Arch) -> str | None:
    """The weight types of a GGUF's matmul rows (its linear tensors), sorted and joined with '+' (SmolLM2's Q4_1 file:
    'Q4_1'; Gemma 3's Q4_K_M: 'Q4_K+Q5_0+Q6_K+Q8_0'): llama.cpp runs each type's own kernels, so the rate its
    matmuls and weight reads run at is a property of this mix, not of a bit width. None: not read from a GGUF."""
    types = sorted({w.gguf_type for w in arch.weights if w.gguf_type and w.cls == "linear"})
    return "+".join(types) or None


def gguf_rates_by_type(arch: Arch, type_rates: dict) -> dict | None:
    """A GGUF's weights and matmul rates from the rates measured per GGML type (llama.cpp: gguf_type_rates, one random
    file per type at a 1B layer shape): each type's kernels read its own bytes at their own rate, so the step's weight
    time is the sum over types of bytes / rate, i.e. the bytes over their harmonic mean weighted by bytes (the
    matrices a step reads: the linear rows, the output layer, or the embedding table where it is tied); the prefill's
    matmuls likewise weighted by the linear rows' parameters. None where a type the step reads has no measured rate.
    Returns {"read_bytes_per_s", "matmul_flop_per_s", "types": {type: bytes read}}."""
    if not type_rates:
        return None
    head = any(w.cls == "lm_head" for w in arch.weights)
    read: dict[str, float] = {}
    params: dict[str, float] = {}
    for w in arch.weights:
        if w.gguf_type is None or w.gguf_bytes is None:
            return None
        if w.cls in ("linear", "lm_head") or (w.cls == "embedding" and not head):
            read[w.gguf_type] = read.get(w.gguf_type, 0.0) + w.gguf_bytes * w.read_fraction
        if w.cls == "linear":
            params[w.gguf_type] = params.get(w.gguf_type, 0.0) + w.numel * w.read_fraction
    if not read or not params or any(t not in type_rates for t in {*read, *params}):
        return None
    t_read = sum(b / type_rates[t]["read_bytes_per_s"] for t, b in read.items())
    t_mm = sum(n / type_rates[t]["matmul_flop_per_s"] for t, n in params.items())
    return {"read_bytes_per_s": sum(read.values()) / t_read, "matmul_flop_per_s": sum(params.values()) / t_mm,
            "types": read}


# what reads a .pte's int8 codes or fp16 cache (export --pte-kernel): ExecuTorch's llama::custom_quantized_sdpa (the
# kinds int8 / int8c) and its fp16 rows cast for custom_sdpa (fp16), or edgekv's own edgekv::int8_sdpa and
# edgekv::fp16_sdpa in place (edgekv/native; the kinds "edgekv int8" / "edgekv int8c" / "edgekv fp16",
# benchmarks/attention_rates.py --runtime executorch --int8-kernel edgekv)
PTE_INT8_KERNELS = ("executorch", "edgekv")


def cache_kind(strategy: Strategy, layout: StateLayout, runtime: str = "onnxruntime",
               int8_kernel: str = "executorch") -> str | None:
    """The stored rate a layer's cache reads at on this runtime: ONNX Runtime: kv-int8c's codes or the float cache's
    dtype; edgekv's .pte: the float cache's dtype, int8 codes custom_quantized_sdpa reads in place (a scale per token
    and head: int8; static scales: int8c; int8_kernel "edgekv": edgekv::int8_sdpa reads them, "edgekv int8" /
    "edgekv int8c", and edgekv::fp16_sdpa an fp16 cache, "edgekv fp16") or packed int4 / int2 codes; llama.cpp: its
    cache type (f16, q8_0, q4_0)."""
    kind = _cache_kind(strategy, layout, runtime)
    if runtime == "executorch" and int8_kernel == "edgekv" and kind in ("int8", "int8c", "fp16", "int4"):
        return f"edgekv {kind}"
    return kind


def _cache_kind(strategy: Strategy, layout: StateLayout, runtime: str) -> str | None:
    dtypes = {t.dtype for t in layout.tensors if t.role == "key"}
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    st = strategy.kv_storage
    bits = st.bits if st is not None else None
    if runtime == "llama.cpp":
        if bits and st.static_scales:
            return None
        return _GGML_KIND.get(bits or dtype)
    if runtime == "executorch-llama":  # its KVCache in the model dtype, or --quantize_kv_cache's QuantizedKVCache
        # (int8, a scale per token and head, custom_quantized_sdpa in place): the .pte's kinds, less static scales,
        # which its recipe has none of; a packed cache, not in its recipe, read back as edgekv's .pte reads it
        if bits and st.static_scales:
            return None
        runtime = "executorch"
    if bits and st.static_scales:  # int8 codes at static scales, read in place
        return "int8c" if runtime in ("onnxruntime", "executorch") else None
    if bits:  # the .pte: int8 codes in place (custom_quantized_sdpa), packed codes read back; ONNX Runtime: no fused kind
        if runtime != "executorch":
            return None
        if bits < 8:  # packed codes, dequantize_planar
            return f"int{bits}"
        heads = {t.shape[-1] for t in layout.tensors if t.role == "key"}
        # one scale per token and head: the cache ExecuTorch's dequantize_per_token reads back (an fp8 or grouped
        # int8 cache has no stored rate)
        return "int8" if all(st.readback_source(d) == "int8" for d in heads) else None
    return _FLOAT_KIND.get(dtype)


def prefill_kind(strategy: Strategy, layout: StateLayout, runtime: str, int8_kernel: str = "executorch") -> str | None:
    """The cache kind a prefill's attention rate is stored under: the decode kernel's kind (cache_kind), else the
    quantized cache's bits (int8c for static scales, int8 / int4 / int2 codes) on a graph that dequantizes it."""
    kind = cache_kind(strategy, layout, runtime, int8_kernel)
    st = strategy.kv_storage
    if kind or st is None or not st.quantized:
        return kind
    return "int8c" if st.static_scales else f"int{st.bits}"


def attention_kind(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str, rates: dict | None,
                   int8_kernel: str = "executorch") -> str | None:
    """The cache kind whose stored rate charges this row's attention, or None (the roofline charges it): ONNX
    Runtime and edgekv's .pte where edgekv's export attends through the fused op (fused_gqa), llama.cpp always (its
    attention is its own flash attention over the cache it keeps), ExecuTorch's Llama export always (custom_sdpa or
    custom_quantized_sdpa over the cache it keeps, every model type it defines attending so); ONNX Runtime's eager graph (no
    GroupQueryAttention) at its "eager <kind>" rate; and only a kind with a stored rate."""
    if not rates:
        return None
    if not eager_decode(arch, layout, strategy, runtime):
        kind = cache_kind(strategy, layout, runtime, int8_kernel)
    else:
        kind = prefill_kind(strategy, layout, runtime, int8_kernel)
        kind = kind and f"eager {kind}"
    return kind if kind in rates["kinds"] else None


def eager_decode(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str) -> bool:
    """Whether this row's decode attends through edgekv's eager graph (no fused op: its "eager <kind>" rates) rather
    than a runtime's own kernel (llama.cpp's and ExecuTorch's Llama export's always; edgekv's where fused_gqa)."""
    return not (runtime in ("llama.cpp", "executorch-llama") or fused_gqa(arch, layout, strategy, runtime))


def _compute_at(r: dict, keys: int) -> float:
    """A kind's per key x head x head size cost at this many kept keys: where the kernel's rows at that head size do
    not follow a linear law (compute_by_kept_keys: each measured row's time over its keys x H x D), the measured
    curve, linear between two measured key counts and held at the nearest end outside them; else the constant."""
    by = r.get("compute_by_kept_keys")
    if not by:
        return r["compute_s_per_head_dim_position"]
    return _curve_at(by, keys)


def _curve_at(by: dict, keys: int) -> float:
    """A measured curve {kept keys: value} at this many kept keys: linear between two measured key counts, held at
    the nearest end outside them."""
    pts = sorted((int(k), v) for k, v in by.items())
    if keys <= pts[0][0]:
        return pts[0][1]
    for (k0, c0), (k1, c1) in zip(pts, pts[1:]):
        if keys <= k1:
            return c0 + (keys - k0) / (k1 - k0) * (c1 - c0)
    return pts[-1][1]


def kv_heads_factor(by: dict | None, kv_heads: int) -> float:
    """The per-key cost at this many KV heads against the head size's measured shape ({KV heads: factor}, llama.cpp:
    kv_heads_scale, benchmarks/attention_rates.py kv_heads_scales; its cache row holds every KV head of a position, so
    a head's keys are read at a stride that grows with them): linear between two measured counts, held at the nearest
    end outside them; 1 where none is stored."""
    return _curve_at(by, kv_heads) if by else 1.0


def attention_seconds(arch: Arch, layout: StateLayout, kind: str, rates: dict, kernel: str = "GroupQueryAttention",
                      layer_kinds: dict[int, str] | None = None) -> tuple[float, str]:
    """Seconds of one decode step's attention at the device's measured kernel rate (scale 1), summed over the
    layers: overhead + T * (2 * Hkv * D * bytes / read_rate + H * D * c_compute), T the layer's kept keys; a kind's
    fit for the layer's own head size where one is stored (by_head_dim; its measured curve where the kernel slows
    faster than linearly: _compute_at; times the factor at the layer's KV heads where one is stored:
    kv_heads_factor), else its fit over the measured shapes. layer_kinds: layers priced at another kind (the .pte's
    eager rings: ring_decode_kind)."""
    kept = {t.layer: t.shape[2] for t in layout.tensors if t.role == "key"}
    total, groups = 0.0, {}
    for i, b in enumerate(arch.blocks):
        for m in b.mixers:
            if isinstance(m, Attention) and i in kept:
                k = (layer_kinds or {}).get(i, kind)
                r = rates[k].get("by_head_dim", {}).get(str(m.head_dim), rates[k])
                rate, over = r["read_bytes_per_s"], r["overhead_s"]
                kvf = kv_heads_factor(r.get("kv_heads_scale"), m.n_kv_heads)
                comp = _compute_at(r, kept[i]) * kvf
                # a cache the graph casts to fp32 rows every step before the kernel (the .pte's fp16 cache): the
                # cast's measured cost per value, K and V (cast_s_per_value_by_kept_keys, benchmarks/
                # pte_cast_per_key.py), a term of its own beside the kernel's
                by = r.get("cast_s_per_value_by_kept_keys")
                cast = 2 * m.n_kv_heads * m.head_dim * _curve_at(by, kept[i]) if by else 0.0
                per_pos = (2 * m.n_kv_heads * m.head_dim * _KIND_BYTES[k.split()[-1]] / rate if rate else 0.0) \
                    + m.n_heads * m.head_dim * comp + cast
                total += over + kept[i] * per_pos
                key = (kept[i], over, per_pos, cast, kvf, m.n_kv_heads, k if k != kind else "")
                groups[key] = groups.get(key, 0) + 1
    parts = " + ".join(f"{n} x ({over * 1e6:.3g} us + {T} x {per_pos * 1e6:.4g} us)"
                       + (f" [of each key's, the cast to fp32 {cast * 1e6:.4g} us]" if cast else "")
                       + (f" [the kernel's cost x {kvf:.3g} at {kv} KV heads]" if kvf != 1.0 else "")
                       + (f" [{other}: the .pte's eager ring]" if other else "")
                       for (T, over, per_pos, cast, kvf, kv, other), n in groups.items())
    return total, f"attention ({kind} {kernel}: layers x (overhead + kept keys x per-key cost)) = " \
                  f"{parts} = {total * 1e3:.3g} ms"


def attention_bracket(arch: Arch, layout: StateLayout, rates: dict, int8_kernel: str = "executorch",
                      layer_kinds: dict[int, str] | None = None, eager: bool = False
                      ) -> tuple[float, float, str, str] | None:
    """A decode step's attention where this device stores kernel rates for the runtime but none for this row's cache
    (llama.cpp's f32 cache, a bf16 / fp8 cache, int8 codes in groups: attention_kind None): between the runtime's
    measured kinds of the same graph (eager: the graph without the fused op, its "eager <kind>" kinds; else the
    fused op's), each charged as attention_seconds charges it (the .pte's eager rings and edgekv's own kernel's
    kinds only where they apply; a superseded graph's kind, kept for the rows measured on it, never), so the plan
    shows a range instead of the roofline, which leaves a long context's attention out. Returns (slowest seconds,
    fastest seconds, formula, the slowest kind) or None where no kind prices a layer (no attention cache in the
    layout: an SSM, a latent)."""
    got = {}
    for k in rates:
        if k.startswith("eager ring") or k.startswith("eager ") != eager \
                or (k.startswith("edgekv ") and int8_kernel != "edgekv") or rates[k].get("superseded"):
            continue
        s, _ = attention_seconds(arch, layout, k, rates, layer_kinds=layer_kinds)
        if s > 0:
            got[k] = s
    if not got:
        return None
    fast, slow = min(got, key=got.get), max(got, key=got.get)
    return got[slow], got[fast], (f"attention (no kernel rate stored for this cache on this runtime: between its "
                                  f"measured kinds of this graph, {len(got)} of them) = {fast} "
                                  f"{fmt_sig(got[fast] * 1e3)} ms .. {slow} {fmt_sig(got[slow] * 1e3)} ms = "
                                  f"{fmt_sig(got[slow] * 1e3)} ms"), slow


def ring_decode_layers(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str, rates: dict | None,
                       int8_kernel: str = "executorch") -> dict[int, str]:
    """{layer index: the stored kind its decode step is priced at} for the .pte's eager rings (memory.prefill
    .ring_layers: a model's own sliding layers), whose one-token call is the eager layer's, not the fused kernel's:
    "eager ring fp32" on an fp32 ring, else the window graph's "eager fp16" (the ring read back to fp32 every step);
    none where edgekv's own kernel reads the ring in place (--pte-kernel edgekv on an int8 / int8c / fp16 ring:
    swaps._ring_make) or no such kind is stored."""
    from .prefill import ring_dtypes, ring_layers

    rings = ring_layers(arch, layout, strategy, runtime)
    if not rings or not rates:
        return {}
    dtypes = ring_dtypes(layout, rings)
    if int8_kernel == "edgekv" and dtypes <= {"int8", "float16"}:  # its one-token call is edgekv's kernel's
        return {}
    kind = "eager ring fp32" if dtypes == {"float32"} else "eager fp16"
    if kind not in rates:
        return {}
    slots = {t for _, t in rings}
    return {t.layer: kind for t in layout.tensors if t.role == "key" and t.shape[2] in slots}


def small_pages_seconds(layout: StateLayout, pages: dict) -> tuple[float, str]:
    """What a decode step's attention adds when the runtime holds its cache in 4 KiB pages (ONNX Runtime GenAI's
    generator: its allocator's glibc malloc) where the kernel rates were measured on a cache in 2 MiB pages (numpy's
    huge-page advice on an array of huge_page_min_bytes or more, as benchmarks/attention_rates.py and edgekv's runtime
    bind theirs): s_per_page for each page_bytes page of K and V, on the layers whose K (and V) tensor is that large
    (a smaller one was in 4 KiB pages when its rate was measured too). pages: attention_rates.json's cache_pages
    (benchmarks/genai_step.py --fit). -> (seconds, formula)."""
    big = [t for t in layout.tensors if t.role in ("key", "value") and t.nbytes >= pages["huge_page_min_bytes"]]
    n = sum(t.nbytes for t in big) / pages["page_bytes"]
    per = pages["s_per_page"]
    return n * per, (f"cache in {pages['page_bytes'] // 1024} KiB pages: {n:.0f} pages of K and V read ("
                     f"{len(big) // 2} layers' tensors of {pages['huge_page_min_bytes'] >> 20} MiB or more) x "
                     f"{per * 1e9:.0f} ns = {n * per * 1e3:.3g} ms")


def attention_flops(arch: Arch, layout: StateLayout) -> float:
    """The attention part of decode_flops for a plain cache: 4 * H * D * T per layer."""
    kept = {t.layer: t.shape[2] for t in layout.tensors if t.role == "key"}
    return sum(4 * m.n_heads * m.head_dim * kept[i] for i, b in enumerate(arch.blocks) for m in b.mixers
               if isinstance(m, Attention) and i in kept)


def _rate_at(rows: list[tuple[float, float]], nbytes: float) -> float:
    """The read rate (bytes / second) of a matrix of nbytes from measured (bytes, seconds) rows: linear in
    log(bytes) between the two measured sizes around it, held at the nearest end outside them."""
    pts = sorted((b, b / t) for b, t in rows)
    if nbytes <= pts[0][0]:
        return pts[0][1]
    for (b0, r0), (b1, r1) in zip(pts, pts[1:]):
        if nbytes <= b1:
            f = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0)) if b1 > b0 else 1.0
            return r0 + f * (r1 - r0)
    return pts[-1][1]


def weights_seconds_by_matrix(arch: Arch, precision: str, by: dict, scheme: dict | None = None
                              ) -> tuple[float, float, str]:
    """One decode step's weights term from the runtime's weights kernel timed per matrix (by_matrix: rows of [K, N,
    bytes, seconds], benchmarks/attention_rates.py --matmul): each matrix a token reads (the linear rows, the output
    layer or the tied table; routed experts by their read fraction), at its bytes as the plan stores it (the
    runtime's scheme, as memory.weight_bytes counts them), read at the measured rate of its size (_rate_at: a small
    matrix is read far slower than a large one), plus per layer the step's other ops (layer_overhead_s, fitted on
    SmolLM2's rows by benchmarks/plan_vs_filled.py). Returns (seconds, the matrices' kernel seconds, formula)."""
    from ..arch import Weight
    from .weights import _scheme_bytes, scheme_part, weight_bytes_one

    def nbytes(w: Weight) -> float:
        return _scheme_bytes(w, scheme_part(w, scheme)) if scheme else weight_bytes_one(w, precision, arch.n_layers)

    rows = [(r[2], r[3]) for r in by["rows"]]
    mats = [(nbytes(w), w.read_fraction) for w in arch.weights if w.cls in ("linear", "lm_head")]
    if not any(w.cls == "lm_head" for w in arch.weights):  # tied: the output layer reads the table's shape
        mats += [(nbytes(Weight("output", w.shape, "lm_head")) if scheme else weight_bytes_one(
            w, precision, arch.n_layers), 1.0) for w in arch.weights if w.cls == "embedding"]
    kern = sum(b / _rate_at(rows, b) * f for b, f in mats)
    per_layer = by.get("layer_overhead_s", 0.0)
    return kern + per_layer * arch.n_layers, kern, (
        f"{len(mats)} matrices at {by['kernel']}'s rate measured per matrix size = {kern * 1e3:.3g} ms + "
        f"{arch.n_layers} layers x {per_layer * 1e6:.3g} us of other ops")


def weights_seconds_by_form(mats: list[tuple], by_form: dict, n_layers: int, per_layer: float
                            ) -> tuple[float, float, str, str] | None:
    """One decode step's weights term where each matrix runs in its own kernel form (--weights gguf in edgekv's ONNX:
    each GGUF type's MatMulNBits form, memory.weights.carried_matrices): each matrix at the seconds its form was
    measured at for its shape (by_form["forms"][form]["rows"]: [K, N, bytes, seconds], benchmarks/attention_rates.py
    --matmul-forms), or where no row has its shape at its bytes over the rate of a matrix of that size (_rate_at), plus
    per layer the step's other ops (per_layer: the int4 graph's layer_overhead_s, fitted on SmolLM2's rows). mats:
    (name, form, bytes, read fraction, (K, N)). Returns (seconds, the matrices' kernel seconds, formula), or None
    where a matrix's form has no measured rows (a fp32 MatMul)."""
    forms = by_form["forms"]
    if any(m[1] not in forms for m in mats):
        return None
    by: dict[str, list[float]] = {}
    for _, f, b, frac, shape in mats:
        rows = forms[f]["rows"]
        exact = next((r[3] for r in rows if (r[0], r[1]) == tuple(shape)), None)
        t = by.setdefault(f, [0.0, 0.0])
        t[0] += b * frac
        t[1] += (exact if exact is not None else b / _rate_at([(r[2], r[3]) for r in rows], b)) * frac
    kern = sum(t for _, t in by.values())
    parts = ", ".join(f"{f} {b / 1e6:.4g} MB {t * 1e3:.3g} ms" for f, (b, t) in sorted(by.items()))
    return kern + per_layer * n_layers, kern, (
        f"{len(mats)} matrices at {by_form['kernel']}'s rate measured per form and matrix shape ({parts}) = "
        f"{kern * 1e3:.3g} ms + {n_layers} layers x {per_layer * 1e6:.3g} us of other ops")


def decode_with_attention(weights_read: float, lin_flops: float, attn_s: float, scale: tuple[float, float],
                          bandwidth: float, bw_eff: float, peak_flops: float, flop_eff: float,
                          weights_rate: float | None = None,
                          weights_s: tuple[float, str] | None = None,
                          fast_attn_s: float | None = None) -> tuple[Item, dict]:
    """tok/s = 1 / (weights term + attention term): the weights term is the roofline over the weights alone (or
    the weights over a measured rate of the runtime's weight kernels where stored, or weights_s: (seconds, formula)
    where the kernel was timed per matrix), the attention term the fitted
    kernel time divided by the device's scale (low, high); fast_attn_s: the attention's fast end where the kernel
    is not known, only bracketed (attention_bracket: attn_s the slowest measured kind, this the fastest). Returns the
    low end's Item and the terms ({weights_s, weights, attention_s, [attention_fast_s], scale, tok_s: (low, high)})
    for the explain line."""
    detail = ""
    if weights_s:  # the weights kernel timed per matrix (weights_seconds_by_matrix): its effective rate shown
        t_w, detail = weights_s
        how = f"~{weights_read / 1e9:.3g} GB weights / {weights_read / t_w / 1e9:.3g} GB/s (measured)"
    elif weights_rate:
        t_w = weights_read / weights_rate
        how = f"~{weights_read / 1e9:.3g} GB weights / {weights_rate / 1e9:.3g} GB/s (measured)"
    else:
        t_bw, t_fl = weights_read / (bandwidth * bw_eff), lin_flops / (peak_flops * flop_eff)
        t_w = max(t_bw, t_fl)
        how = (f"~{weights_read / 1e9:.3g} GB weights / ({bandwidth / 1e9:.3g} GB/s x {bw_eff:g})" if t_bw >= t_fl
               else f"~{lin_flops / 1e9:.3g} GFLOP matmuls / ({peak_flops / 1e9:.3g} GFLOP/s x {flop_eff:g})")
    lo, hi = scale
    fast_s = attn_s if fast_attn_s is None else fast_attn_s
    slow, fast = 1 / (t_w + attn_s / lo), 1 / (t_w + fast_s / hi)
    between = f"{fast_s * 1e3:.3g}-" if fast_s != attn_s else ""
    f = (f"1 / ({how} = {t_w * 1e3:.3g} ms + attention {between}{attn_s * 1e3:.3g} ms"
         + (f" / device scale {lo:g}-{hi:g}" if scale != (1.0, 1.0) else "") + ") = "
         + (f"{slow:.3g}-{fast:.3g} tok/s" if slow != fast else f"{slow:.3g} tok/s")
         + (f"; the weights term: {detail}" if detail else ""))
    return Item(slow, f), {"weights_s": t_w, "weights": how, "attention_s": attn_s, "scale": scale,
                           "tok_s": (slow, fast), **({"attention_fast_s": fast_s} if between else {})}
