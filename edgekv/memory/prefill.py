"""A prompt's cost: the FLOP a prefill computes as the row's graph computes it (causal on the fused kernels, every slot
of each call on the eager graph, a cache read back to fp32 every call), and the seconds it takes at a device's stored
prefill rates (edgekv/costs/attention_rates.json "prefill": the kernels' rates by head size, kept keys and KV heads,
the matmul rate fitted on measured prompts by benchmarks/plan_vs_filled.py and its factor by matrix shape) or, where
none are stored, on the roofline."""
from __future__ import annotations

import math

from ..arch import MLA, SSM, Arch, Attention, Linear, ShortConv
from ..strategies import StateLayout, Strategy, mla_rank
from .costs import fused_gqa
from .item import Item
from .speed import _active_params, _attn_tokens, _curve_at, _rate_at, kv_heads_factor, prefill_kind


def prefill_flops(arch: Arch, strategy: Strategy, ctx: int, chunk: int, layout: StateLayout | None = None,
                  runtime: str = "") -> Item:
    """FLOP to prefill ctx tokens in chunks: 2 x active params per token, causal attention summed over positions
    (windows cap it), a converted-MLA latent re-expanded for every chunk, SSM scans linear in ctx; with the row's
    layout and runtime, the attention as its graph computes it (prefill_graph: every slot of each call on the eager
    graph)."""
    if layout is not None and runtime:
        p = prefill_graph(arch, strategy, layout, runtime, ctx, chunk)[1]
        eager = eager_prefill(arch, layout, strategy, runtime)
    else:
        p, eager = prefill_parts(arch, strategy, ctx, chunk), False
    lin, head, attn, extra, rec = (p[k] for k in ("matmul", "logits", "attention", "reexpand", "scans"))
    ring = p.get("ring", 0.0)
    total = lin + head + attn + extra + rec + ring
    what = "attention, every slot of each call (the eager graph)" if eager else "causal attention"
    return Item(total, f"2*params*ctx ({lin:.3g}) + logits per chunk ({head:.3g}) + {what} ({attn:.3g})"
                       + (f" + the sliding layers' eager rings, every slot of each call ({ring:.3g})" if ring else "")
                       + (f" + latent re-expansion ({extra:.3g})" if extra else "")
                       + (f" + scans ({rec:.3g})" if rec else "") + f" = {total:.3g} FLOP")


def _window(m: Attention, strategy: Strategy) -> int | None:
    """A layer's window in a prompt: its own sliding window, the strategy's window capping it (None: global)."""
    w_cap = strategy.window_tokens
    return m.window if w_cap is None else min(w_cap, m.window or w_cap)


def _call_keys(ctx: int, chunk: int, cap: int) -> tuple[list[int], int]:
    """The rows a prompt of ctx tokens in calls of `chunk` reaches call by call on a layer that keeps at most `cap`:
    call j reaches (j + 1) x chunk while that fits, the calls after it reach cap. -> (the growing calls' counts, how
    many calls reach cap)."""
    n = math.ceil(ctx / chunk)
    k = min(n, cap // chunk)
    return [(j + 1) * chunk for j in range(k)], n - k


def prefill_parts(arch: Arch, strategy: Strategy, ctx: int, chunk: int) -> dict:
    """prefill_flops by part: matmul (2 x params x ctx), logits (the last token of each chunk), attention (causal,
    windows cap it), reexpand (a converted-MLA latent), scans (recurrences)."""
    lin = 2 * _active_params(arch, ("linear",)) * ctx
    head = 2 * arch.vocab * arch.hidden * math.ceil(ctx / chunk)  # logits for the last token of each chunk
    attn = extra = rec = 0.0
    for b in arch.blocks:
        for m in b.mixers:
            if isinstance(m, Attention):
                attn += 4 * m.n_heads * m.head_dim * _attn_tokens(ctx, _window(m, strategy))
                if strategy.converts_to_latent:
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
    return {"matmul": lin, "logits": head, "attention": attn, "reexpand": extra, "scans": rec}


def prefill_seconds(flops: float, weights_stored: float, ctx: int, chunk: int, bandwidth: float, bw_eff: float,
                    peak_flops: float, flop_eff: float) -> Item:
    t_fl = flops / (peak_flops * flop_eff)
    t_bw = math.ceil(ctx / chunk) * weights_stored / (bandwidth * bw_eff)
    t = max(t_fl, t_bw)
    return Item(t, f"max(FLOP {flops:.3g} / ({peak_flops:.3g} x {flop_eff}), {math.ceil(ctx / chunk)} chunks x weights "
                   f"{weights_stored:.3g} B / ({bandwidth:.3g} x {bw_eff})) = {t:.3g} s")


def readback_values(arch: Arch, strategy: Strategy, ctx: int, chunk: int) -> float:
    """The cache values a prefill of ctx tokens in calls of `chunk` reads back to fp32 where its graph dequantizes the
    rows written so far every call (edgekv's .pte on a packed int4 cache: SdpaAttention's "fp32 rows", rows
    0..pos+C-1 through dequantize_planar, then custom_sdpa): per attention layer, K and V, 2 x Hkv x D values per
    row, summed over the calls (call j reads j x chunk rows, a window capping them)."""
    total = 0.0
    for b in arch.blocks:
        for m in b.mixers:
            if isinstance(m, Attention):
                w = min(_window(m, strategy) or ctx, ctx)
                grow, rest = _call_keys(ctx, chunk, w)  # the calls that read all rows so far; the rest the window's w
                total += 2 * m.n_kv_heads * m.head_dim * (sum(grow) + rest * w)
    return total


def _layer_slots(arch: Arch, layout: StateLayout) -> list[tuple[Attention, int]]:
    """Each attention layer with the slots T its key tensor keeps ([1, Hkv, T, .]), in layer order."""
    attns = [m for b in arch.blocks for m in b.mixers if isinstance(m, Attention)]
    return [(m, t.shape[2]) for m, t in zip(attns, (t for t in layout.tensors if t.role == "key"))]


def eager_attention_flop(arch: Arch, layout: StateLayout, ctx: int, chunk: int) -> float:
    """The attention FLOP of a prefill of ctx tokens in calls of `chunk` on edgekv's eager graph (no fused op:
    edgekv.models.attention.Attention, whose mask is [G x C, T] over every slot of a full cache and [G x C, T + C]
    over a rolling cache's slots and the call's own rows): each call's C queries meet all T slots of the layer, written
    yet or not, so a prompt's attention grows as ctx x T, not causally as ctx^2 / 2. Per attention layer (a key
    tensor, [1, Hkv, T, .]) 4 x H x D x (ctx x T, + the sum of C^2 over the calls where T is a rolling cache's)."""
    return _every_slot_flop(_layer_slots(arch, layout), layout, ctx, chunk)


def _every_slot_flop(layers: list[tuple[Attention, int]], layout: StateLayout, ctx: int, chunk: int) -> float:
    """eager_attention_flop over these (layer, slots): 4 x H x D x (ctx x T, + the sum of C^2 over the calls where T
    is a rolling cache's)."""
    full, rem = divmod(ctx, chunk)
    own = full * chunk * chunk + rem * rem  # sum over the calls of C x C: each call's queries over its own rows
    return sum(4 * m.n_heads * m.head_dim * (ctx * slots + (own if slots < layout.ctx else 0)) for m, slots in layers)


def eager_readback_values(arch: Arch, layout: StateLayout, ctx: int, chunk: int) -> float:
    """The cache values a prefill of ctx tokens in calls of `chunk` dequantizes on edgekv's eager graph over a
    quantized cache (ONNX Runtime's explicit kv-int8 / kv-int4 graphs): every call reads every slot of each layer back
    to fp32 (the mask is over all of them: eager_attention_flop), K and V, 2 x Hkv x D values a slot."""
    return math.ceil(ctx / chunk) * sum(2 * m.n_kv_heads * m.head_dim * slots for m, slots in _layer_slots(arch, layout))


def eager_prefill(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str) -> bool:
    """Whether edgekv's export prefills this row on the eager graph (eager_attention_flop): a KV cache on ONNX
    Runtime or edgekv's .pte where the export does not attend through the fused op (fused_gqa): the explicit
    kv-int8 / kv-int4 graphs on ONNX Runtime, the window strategy's rolling layers on both."""
    return (runtime in ("onnxruntime", "executorch") and strategy.kv_cache and not strategy.converts_to_latent
            and not fused_gqa(arch, layout, strategy, runtime))


# the rate a .pte's eager ring prefills at: the window strategy's eager layer's (fitted on SmolLM2's .pte window
# prompts by benchmarks/plan_vs_filled.py, at the model's head size by the kernel run's ratio: head_dim_scale); an
# fp32 ring's: "eager fp32" (ring_kind)
RING_KIND = "eager fp16"


def ring_layers(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str) -> list[tuple[Attention, int]]:
    """The layers edgekv's .pte prefills on the eager ring (models.swaps.RingSdpaAttention), with their slots: on
    ExecuTorch, where the other layers take the fused kernel (fused_gqa), a model's own sliding layers (a rolling key
    tensor of exactly its window, as Gemma 3's). A call of several tokens attends all W slots of the ring and its own
    C rows on the eager graph, written yet or not, whatever reads the ring at decode (--pte-kernel edgekv's torch.cond
    branch too)."""
    if runtime != "executorch" or not strategy.kv_cache or strategy.converts_to_latent \
            or not fused_gqa(arch, layout, strategy, runtime):
        return []
    return [(m, t) for m, t in _layer_slots(arch, layout) if m.window and t == m.window and t < layout.ctx]


def prefill_graph(arch: Arch, strategy: Strategy, layout: StateLayout, runtime: str, ctx: int, chunk: int,
                  int8_kernel: str = "executorch") -> tuple[str | None, dict]:
    """The prefill's attention kind (its stored rate's name) and its FLOP by part (prefill_parts) as the runtime's
    graph computes them: on the eager graph (eager_prefill) the kind is "eager <kind>" and the attention the graph's
    every-slot FLOP (eager_attention_flop); else the fused op's kind and causal attention, less the .pte's eager rings
    (ring_layers), whose every-slot FLOP are the part "ring" (charged at the .pte's eager rate, RING_KIND)."""
    kind = prefill_kind(strategy, layout, runtime, int8_kernel)
    parts = prefill_parts(arch, strategy, ctx, chunk)
    parts["ring"] = 0.0
    if eager_prefill(arch, layout, strategy, runtime):
        kind = kind and f"eager {kind}"
        parts["attention"] = eager_attention_flop(arch, layout, ctx, chunk)
    else:
        rings = ring_layers(arch, layout, strategy, runtime)
        for m, slots in rings:
            parts["attention"] -= 4 * m.n_heads * m.head_dim * _attn_tokens(ctx, slots)
        parts["ring"] = _every_slot_flop(rings, layout, ctx, chunk)
    return kind, parts


def _at_head_dim(by: dict, d: int) -> tuple[float, str]:
    """A value stored per head size ({"64": v, "256": v}) at head size d: the measured one, else interpolated in
    log2(head size) between the two measured around it (clamped at the ends)."""
    if str(d) in by:
        return by[str(d)], f"at head size {d}"
    pts = sorted((int(k), v) for k, v in by.items())
    lo = max([p for p in pts if p[0] < d], default=pts[0])
    hi = min([p for p in pts if p[0] > d], default=pts[-1])
    if lo == hi:
        return lo[1], f"at head size {lo[0]} (nearest measured to {d})"
    f = (math.log2(d) - math.log2(lo[0])) / (math.log2(hi[0]) - math.log2(lo[0]))
    return lo[1] + f * (hi[1] - lo[1]), f"at head sizes {lo[0]} and {hi[0]} interpolated to {d}"


def _head_dim(arch: Arch) -> int | None:
    """The head size a prefill rate is taken at (a model with several: its smallest)."""
    dims = {m.head_dim for b in arch.blocks for m in b.mixers if isinstance(m, Attention)}
    return min(dims) if dims else None


def head_dim_scale(rates: dict, kind: str, arch: Arch) -> tuple[float, str]:
    """The factor a kind's rate fitted on model rows of one head size takes at this model's head size: a kernel run's
    rate at each head size over its rate at the fitted rows' (attention_flop_per_s_head_dim_scale: the .pte's eager
    window graph, whose kernel run sets how its rate moves with the head size, and the filled rows its level); 1.0
    where none is stored."""
    by = rates.get("attention_flop_per_s_head_dim_scale", {}).get(kind)
    d = _head_dim(arch)
    if not by or d is None:
        return 1.0, ""
    f, where = _at_head_dim(by, d)
    return f, f" x {f:.3g} {where} (the kernel's rate by head size)" if f != 1.0 else ""


def _prefill_rate(rates: dict, kind: str, arch: Arch) -> tuple[float | None, str]:
    """The prefill attention rate of this cache kind for the model's head size: the kernel's rate measured at that
    head size (attention_flop_per_s_by_head_dim, benchmarks/attention_rates.py), between two measured head sizes
    interpolated in log2(head size) (clamped at the ends; a model with several head sizes: its smallest); else the
    kind's rate fitted on model rows (times head_dim_scale)."""
    by = rates.get("attention_flop_per_s_by_head_dim", {}).get(kind)
    d = _head_dim(arch)
    if by and d is not None:
        if str(d) in by:
            kv = next(m.n_kv_heads for b in arch.blocks for m in b.mixers if isinstance(m, Attention) and m.head_dim == d)
            f = kv_heads_factor(rates.get("attention_flop_per_s_kv_heads_scale", {}).get(kind, {}).get(str(d)), kv)
            return by[str(d)] / f, f"{kind}, kernel rate at head size {d}" + (
                f" over {f:.3g} at {kv} KV heads (kv_heads_scale)" if f != 1.0 else "")
        rate, where = _at_head_dim(by, d)
        return rate, f"{kind}, kernel rate {where}"
    base = fitted_kind(rates, kind)
    rate = rates["attention_flop_per_s"].get(base)
    f, how = head_dim_scale(rates, kind, arch)
    return (rate * f if rate else rate), f"{kind}; rates fitted on this device's measured prefills" + (
        f" ({base}'s)" if base != kind else "") + how


def fitted_kind(rates: dict, kind: str) -> str:
    """The kind whose rate fitted on model rows prices this one (attention_flop_per_s_scaled_from: a kind no model
    row fits, whose kernel run sets its rate against that kind's by head_dim_scale), else the kind itself."""
    return rates.get("attention_flop_per_s_scaled_from", {}).get(kind, kind)


def ring_kind(rates: dict, layout: StateLayout, rings: list[tuple[Attention, int]]) -> str:
    """The stored kind a .pte's eager rings prefill at: "eager fp32" where the rings hold fp32 values and that kind
    is stored (its kernel run beside the eager fp16 graph's: no dequantization), else RING_KIND."""
    if ring_dtypes(layout, rings) == {"float32"} and "eager fp32" in rates.get("attention_flop_per_s_head_dim_scale", {}):
        return "eager fp32"
    return RING_KIND


def ring_dtypes(layout: StateLayout, rings: list[tuple[Attention, int]]) -> set[str]:
    """The stored dtypes of the rings' keys (ring_layers), which set the kind their prompt and decode are priced at."""
    slots = {t for _, t in rings}
    return {t.dtype for t in layout.tensors if t.role == "key" and t.shape[2] in slots}


def matmul_kernel_rate(arch: Arch, by: dict) -> float | None:
    """The FLOP rate of this model's linear matrices at the runtime's weights kernel timed per matrix shape at a
    prefill call's tokens (by: {"tokens", "rows": [[K, N, seconds per call]]}, benchmarks/attention_rates.py --matmul
    --tokens N): each matrix's seconds at its own (K, N) where measured, else at the rate of the measured rows of its
    K (the kernel's rate follows K: whole 128-wide steps or not), else of all rows, interpolated in log FLOP
    (_rate_at); their FLOP over their seconds. None where no matrix is linear."""
    t, rows = by["tokens"], by["rows"]
    flop = sec = 0.0
    for w in arch.weights:
        if w.cls != "linear" or len(w.shape) != 2:
            continue
        k, n = w.shape[1], w.shape[0]
        f = 2 * k * n * t * w.read_fraction
        exact = next((s for kk, nn, s in rows if (kk, nn) == (k, n)), None)
        if exact is None:
            pts = [(2 * kk * nn * t, s) for kk, nn, s in rows if kk == k] or [(2 * kk * nn * t, s) for kk, nn, s in rows]
            sec += f / _rate_at(pts, f)
        else:
            sec += exact * w.read_fraction
        flop += f
    return flop / sec if sec else None


def matmul_shape_scale(rates: dict, arch: Arch) -> tuple[float, str]:
    """The factor on the prefill matmul rate fitted on one model's prompts (matmul_flop_per_s) for this model's
    matrix shapes: this model's matrices' kernel rate over the fit model's (matmul_kernel_rate, the device's
    "matmul_by_matrix" entry: benchmarks/device_rates.py). 1 where no shape was timed at prefill on this device."""
    by = rates.get("matmul_by_matrix")
    r = matmul_kernel_rate(arch, by) if by else None
    if not r:
        return 1.0, ""
    f = r / by["fit_flop_per_s"]
    return f, (f" x {f:.3g} (this model's matrices at {by['kernel']}'s rate per shape at {by['tokens']} tokens, "
               f"{r / 1e9:.3g} GFLOP/s, over {by['fit_model']}'s, {by['fit_flop_per_s'] / 1e9:.3g})")


def prefill_keys_factor(rates: dict, kind: str, arch: Arch, strategy: Strategy, ctx: int, chunk: int,
                        skip: tuple[Attention, ...] = ()) -> tuple[float, str]:
    """The factor on a kind's prefill kernel rate at the model's head size (attention_flop_per_s_by_head_dim, one
    least-squares rate over the kernel's calls at 1k-32k kept keys) for this prompt: where the kernel's rate per call
    is stored by kept keys (attention_flop_per_s_by_keys: each measured call's FLOP over its time,
    benchmarks/device_rates.py), each attention layer's calls at the rate of their own keys (call j of `chunk` tokens
    attends (j + 1) x chunk keys, a window capping them; the curve linear between measured key counts and held at the
    ends), weighted by their FLOP; the layers' FLOP over their seconds, over the stored rate. skip: layers the
    kernel does not prefill (the .pte's eager rings). A long prompt's calls
    run at the rate of a long cache, which on the Intel Xeon VM is below the short calls' (benchmarks/README.md).
    1 where no curve is stored or the model has several head sizes."""
    d = _head_dim(arch)
    curve = rates.get("attention_flop_per_s_by_keys", {}).get(kind, {}).get(str(d))
    base = rates.get("attention_flop_per_s_by_head_dim", {}).get(kind, {}).get(str(d))
    if not curve or not base or len({m.head_dim for b in arch.blocks for m in b.mixers if isinstance(m, Attention)}) > 1:
        return 1.0, ""
    per_cap: dict[int, tuple[float, float]] = {}  # keys cap -> (sum of keys, sum of keys / rate) over the calls
    flop = sec = 0.0
    for b in arch.blocks:
        for m in b.mixers:
            if not isinstance(m, Attention) or any(m is x for x in skip):
                continue
            cap = min(_window(m, strategy) or ctx, ctx)
            if cap not in per_cap:
                grow, rest = _call_keys(ctx, chunk, cap)
                keys = sum(grow) + rest * cap
                per_cap[cap] = keys, sum(x / _curve_at(curve, x) for x in grow) + rest * cap / _curve_at(curve, cap)
            keys, t = per_cap[cap]
            flop += m.n_heads * keys
            sec += m.n_heads * t
    if not sec:  # every layer skipped (a model whose every layer is a .pte ring): the kernel prefills nothing
        return 1.0, ""
    f = flop / sec / base
    return f, f" x {f:.3g} (its calls at the kernel's rate by kept keys)"


def prefill_at_rates(arch: Arch, strategy: Strategy, layout: StateLayout, runtime: str, ctx: int, chunk: int,
                     rates: dict, int8_kernel: str = "executorch", as_kind: str | None = None) -> Item | None:
    """Prefill seconds at the device's prefill rates (edgekv/costs/attention_rates.json "prefill"): matmul FLOP (with
    the logits and scans) over the runtime's matmul rate (fitted on measured filled-context prefills by
    benchmarks/plan_vs_filled.py) + attention FLOP over the rate of this cache kind (the kernel's at the model's head
    size where benchmarks/attention_rates.py measured one, else fitted on the same prefills); on the eager graph
    (prefill_graph) the attention the graph computes, every slot of each call, at the "eager <kind>" rate. None where
    no rate is stored. as_kind: the graph's FLOP at another stored kind's rates (prefill_bracket)."""
    kind, p = prefill_graph(arch, strategy, layout, runtime, ctx, chunk, int8_kernel)
    kind = as_kind or kind
    rb = (rates.get("readback") or {}).get(kind) if kind else None
    if rb:  # a cache read back to fp32 rows every call: the kernel's rate + the read-back per value (readback_values)
        rate, how = _prefill_rate(rates, rb["kernel_kind"], arch)
    else:
        rate, how = _prefill_rate(rates, kind, arch) if kind else (None, "")
    if not rate:
        return None
    ring_list = ring_layers(arch, layout, strategy, runtime) if p["ring"] else []
    rings = tuple(m for m, _ in ring_list)
    if not kind.startswith("eager"):  # a kernel over the keys written so far: each call at its own keys' rate
        f, f_how = prefill_keys_factor(rates, rb["kernel_kind"] if rb else kind, arch, strategy, ctx, chunk, rings)
        rate, how = rate * f, how + f_how
    if not rates.get("matmul_flop_per_s"):  # kernel attention rates stored, no matmul rate fitted yet on this device
        return None
    mm, attn = p["matmul"] + p["logits"] + p["scans"], p["attention"] + p["reexpand"]
    scale, mm_how = matmul_shape_scale(rates, arch)
    mm_rate = rates["matmul_flop_per_s"] * scale
    t = mm / mm_rate + attn / rate
    what = "attention, every slot of each call" if kind.startswith("eager") else "attention"
    text = f"matmul {mm:.3g} FLOP / {mm_rate / 1e9:.3g} GFLOP/s" + (
        f" ({rates['matmul_flop_per_s'] / 1e9:.3g}{mm_how})" if mm_how else "")
    text += f" + {what} {attn:.3g} FLOP / {rate / 1e9:.3g} GFLOP/s ({how})"
    if rings:  # the sliding layers' eager rings at the .pte's eager rate
        r_rate, r_how = _prefill_rate(rates, ring_kind(rates, layout, ring_list), arch)
        if not r_rate:
            return None
        t += p["ring"] / r_rate
        text += (f" + {len(rings)} sliding layers' eager rings, every slot of each call, {p['ring']:.3g} FLOP / "
                 f"{r_rate / 1e9:.3g} GFLOP/s ({r_how})")
    if rb:
        vals = (eager_readback_values(arch, layout, ctx, rb["chunk"]) if kind.startswith("eager") else
                readback_values(arch, strategy, ctx, rb["chunk"]))
        t += vals * rb["s_per_value"]
        text += (f" + the {kind} cache read back to fp32 rows each call of {rb['chunk']} tokens, {vals:.3g} values x "
                 f"{rb['s_per_value'] * 1e9:.3g} ns")
    return Item(t, f"{text} = {t:.3g} s")


def prefill_bracket(arch: Arch, strategy: Strategy, layout: StateLayout, runtime: str, ctx: int, chunk: int,
                    rates: dict, int8_kernel: str = "executorch") -> tuple[Item, tuple[float, float]] | None:
    """A prompt's seconds where this device stores prefill rates for the runtime but none for this row's cache (an
    f32 cache on llama.cpp, a bf16 / fp8 cache, int8 codes in groups: prefill_at_rates None): the graph's FLOP at
    each of the runtime's measured kinds of the same graph (eager or the fused op; edgekv's own kernel's kinds only
    with it), the slowest of them the row's value, as the decode's range takes its slow end (speed.attention_bracket),
    where the roofline would leave the attention's measured rate out. Returns (that Item, (fastest, slowest)
    seconds, or None where one kind prices it); None where the layout has no key cache (an SSM) or no kind prices it."""
    if not any(t.role == "key" for t in layout.tensors):
        return None
    eager = eager_prefill(arch, layout, strategy, runtime)
    stored = {*rates.get("attention_flop_per_s_by_head_dim", {}), *(k for k, v in rates.get("attention_flop_per_s",
                                                                                              {}).items() if v)}
    got = {}
    for k in sorted(stored):
        if k.startswith("eager") != eager or (k.startswith("edgekv ") and int8_kernel != "edgekv"):
            continue
        t = prefill_at_rates(arch, strategy, layout, runtime, ctx, chunk, rates, int8_kernel, as_kind=k)
        if t is not None:
            got[k] = t
    if not got:
        return None
    fast, slow = min(got, key=lambda k: got[k].value), max(got, key=lambda k: got[k].value)
    if len(got) == 1:
        return Item(got[slow].value, f"no prefill rate stored for this cache here: at the runtime's one measured kind "
                                     f"of this graph, {slow}: {got[slow].formula}"), None
    return Item(got[slow].value, f"no prefill rate stored for this cache here: between the runtime's measured kinds "
                                 f"of this graph ({len(got)}), {fast} {got[fast].value:.3g} s .. {slow} "
                                 f"{got[slow].value:.3g} s, the slow end: {got[slow].formula}"), \
        (got[fast].value, got[slow].value)
