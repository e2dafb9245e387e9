"""Rank and explain options: Arch + Strategy + ctx -> Deployment; Deployment + DeviceProfile -> PlanRow / BaselineRow."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from . import measured
from . import memory as M
from .arch import Arch, catalog_arch, catalog_names
from .arch.variants import pte_int8_kept, variant
from .catalog_index import summary as catalog_summary
from .models import family_for_type  # the export registry (edgekv.models imports no torch)
from .devices import Budget, DeviceProfile, artifact_budget, cpu_note
from .errors import EdgekvError
from .quality import RISK_ORDER, past_trained, quality, with_weights
from .serving import BaselineRow, serve
from .strategies import NotApplicable, ParamsDoNotFit, Strategy, defaults_for
from .clibase import plan_flag

DEFAULT_CHUNK = 128
# the artifact format whose measured weight cost (quality.weights_cost) a plan runtime's row cites
WEIGHT_FORMAT = {"executorch": "pte", "edgekv-pte": "pte", "onnxruntime": "onnx"}
# a fit: "yes" with more headroom than the budget's own uncertainty, "tight" within it, "no" over the budget
FIT_ORDER = {"yes": 0, "tight": 1, "no": 2}


def deployment(arch: Arch, strategy: Strategy, ctx: int, weights: str, runtime: str, overhead: float,
               chunk: int = DEFAULT_CHUNK, methods: int = 1, scheme: dict | None = None,
               filled: int | None = None, int8_kernel: str = "executorch") -> M.Deployment:
    """methods: entry points the runtime initialises (a .pte of a recurrent or blended state has prefill + decode:
    XNNPACK packs the weights twice; a plain kv cache's .pte has one `forward`). scheme: the runtime's own weight
    layout for this precision (memory.weight_bytes), None = edgekv's. filled: the positions a run fills when fewer
    than ctx (the state's slots), for the terms that follow them (memory.workspace_bytes); None = ctx. int8_kernel:
    what reads a .pte's int8 cache (export --pte-kernel; memory.workspace_bytes). The weights' resident bytes
    are the stored bytes less what the runtime leaves in the file (memory.paged_table)."""
    if weights == "gguf" and not arch.gguf_path:
        raise EdgekvError(f"--weights gguf needs a GGUF model; {arch.name} was read from {arch.source}")
    layout = strategy.layout(arch, ctx)
    carried = weights == "gguf" and runtime == "onnxruntime" and scheme is None
    if carried:  # edgekv's ONNX carries the file's blocks in MatMulNBits' form, larger than the file (memory.weights)
        scheme = M.GGUF_CARRIED
    wb = M.weight_bytes(arch, weights, scheme)
    ws = M.workspace_bytes(arch, layout, strategy, runtime, min(chunk, ctx), weights, methods, filled, int8_kernel)
    load = M.runtime_load_bytes(arch, weights, runtime, methods, layout, strategy)
    paged = M.paged_table(arch, wb, runtime)
    d = M.Deployment(arch.name, strategy, ctx, weights, runtime, layout, wb, ws, overhead, load, paged=paged)
    d.explain = {
        "weights": f"{weights}: " + ", ".join(f"{k} {v:,.0f} B" for k, v in wb.items() if k not in ("total",
                   "read_per_token")) + f" = {wb['total']:,.0f} B (from {len(arch.weights)} tensor shapes; "
                   + ("the GGUF's blocks as edgekv's ONNX carries them: MatMulNBits codes (Q5_0, Q6_K, Q8_0 at 8 "
                      "bits), fp32 scales, Q4_1/Q4_K zero points + fp32 remainders, a tied 8-bit table's own scales"
                      if carried else "exact GGUF bytes" if weights == "gguf" else
                      f"the runtime's layout: {scheme}" if scheme else
                      "int4 = 4-bit g32 + fp16 scales for linear layers, int8 rows for embeddings; "
                      "int8 = 1 B + fp16 scale per row; norms/conv/A/D fp32") + ")"
                   + (f"; resident {wb['total'] - paged.value:,.0f} B: {paged.formula}" if paged.value else ""),
        "state": f"{len(layout.tensors)} state tensors, e.g. " + "; ".join(
            f"{t.name} {list(t.shape)} {t.dtype} = {t.nbytes:,} B" for t in layout.tensors[:3])
            + f"; total {layout.nbytes:,} B",
        "workspace": ws.formula,
        "load": load.formula,
    }
    return d


@dataclass
class PlanRow:
    model: str
    strategy: Strategy
    native: bool
    deployment: M.Deployment
    budget: int
    decode: M.Item
    prefill: M.Item
    quality: dict
    notes: list[str] = field(default_factory=list)
    trained_ctx: tuple[int, str] | None = None
    exportable: tuple[bool, str] = (False, "")
    runtime: str = ""
    recall: dict | None = None  # measured.curves: the stored recall-vs-distance curve of this strategy
    budget_basis: Budget | None = None  # devices.artifact_budget: the basis fits is judged on
    read: M.Item | None = None  # bytes one decode step moves (the decode formula's numerator when bandwidth-bound)
    decode_flops: M.Item | None = None  # FLOP of one decode step (its numerator when compute-bound)
    prefill_flops: M.Item | None = None
    chunk: int = DEFAULT_CHUNK  # prefill tokens per call (the prefill formula's chunks)

    @property
    def above_baseline(self) -> int:
        """What this row holds above the runtime's own baseline: the total less the runtime's overhead."""
        b = self.deployment.bytes
        return b["total"] - b["runtime"]

    @property
    def fits(self) -> bool:
        if self.budget_basis is None:
            return self.deployment.bytes["total"] <= self.budget
        return self.above_baseline <= self.budget_basis.above_baseline

    @property
    def headroom(self) -> int:
        return self.budget - self.deployment.bytes["total"]

    @property
    def uncertainty(self) -> int:
        return self.budget_basis.uncertainty if self.budget_basis else 0

    @property
    def fit(self) -> str:
        """"yes" (headroom beyond the budget's uncertainty), "tight" (inside the budget, within its uncertainty) or
        "no"."""
        return "no" if not self.fits else "yes" if self.headroom > self.uncertainty else "tight"

    def to_json(self, explain: bool = False) -> dict:
        d = {"model": self.model, "strategy": self.strategy.name,
             "params": {**self.strategy.params, "weights": self.deployment.weight_precision,
                        "runtime": self.deployment.runtime},
             "native": self.native, "bytes": self.deployment.bytes, "budget_bytes": self.budget, "fits": self.fits,
             "fit": self.fit, "headroom_bytes": self.budget - self.deployment.bytes["total"],
             "decode_tokens_per_s": round(self.decode.value, 3), "prefill_seconds": round(self.prefill.value, 3),
             **({"decode_tokens_per_s_range": [round(v, 3) for v in self.decode_range]} if self.decode_range else {}),
             **({"prefill_seconds_range": [round(v, 3) for v in self.prefill_range]} if self.prefill_range else {}),
             "quality": self.quality, "notes": self.notes,
             "trained_ctx": ({"value": self.trained_ctx[0], "source": self.trained_ctx[1]} if self.trained_ctx
                             else {"value": None, "source": "unknown: the config names no trained length"}),
             "exportable": self.exportable[0], "exportable_reason": self.exportable[1]}
        if self.serving is not None:
            d["users_per_gpu"] = int(self.serving.users.value)
            d["usd_per_m_tokens"] = None if math.isinf(self.serving.usd.value) else round(self.serving.usd.value, 4)
        if explain:
            d["explain"] = {**self.deployment.explain, "runtime": self._runtime_cite,
                            "decode_tokens_per_s": self.decode.formula, "prefill_seconds": self.prefill.formula,
                            "recall": self.recall}
        return d

    _runtime_cite: str = ""
    decode_range: tuple[float, float] | None = None  # (low, high) tok/s where the attention rate is a guessed range
    attention_terms: dict | None = None  # the weights and attention terms where attention is charged at its kernel rate
    prefill_measured: str | None = None  # the prefill formula where charged at the device's fitted prefill rates
    prefill_range: tuple[float, float] | None = None  # (fast, slow) s where no prefill rate is stored for the cache
    serving: "BaselineRow | None" = None


# The plan's default runtime on a device: what `edgekv export --from-plan DEVICE` builds for the device profile's
# runtime (edgekv's .pte on ExecuTorch, its ONNX on ONNX Runtime), so that the footer's export command builds the row
# the table shows. ExecuTorch's own Llama export (the planner's "executorch") is smaller, but edgekv does not build it:
# a plan for it is asked for by name (--runtime executorch-llama).
BUILT_ON = {"executorch": "edgekv-pte"}
# the plan runtimes whose artifact `edgekv export` builds (its .pte, its ONNX); ExecuTorch's own Llama export is an
# artifact another tool builds (its examples/models/llama); llama.cpp and vLLM run the model's own GGUF / HF weights
EDGEKV_BUILDS = ("edgekv-pte", "onnxruntime")
OTHERS_BUILD = ("executorch",)


def default_runtime(device: DeviceProfile) -> str:
    return BUILT_ON.get(device.runtime, device.runtime)


def plan_one(arch: Arch, strategy: Strategy, device: DeviceProfile, ctx: int, weights: str, runtime: str | None = None,
             budget: int | None = None, chunk: int = DEFAULT_CHUNK, entitled: bool = False,
             int8_kernel: str = "executorch") -> PlanRow:
    """budget: an app budget in place of the device's (its uncertainty stays the device's); entitled: the iOS
    increased-memory-limit budget; int8_kernel: what reads a .pte's int8 cache in place (export --pte-kernel:
    ExecuTorch's custom_quantized_sdpa, or edgekv's own edgekv::int8_sdpa, each charged at its measured rate)."""
    if int8_kernel not in M.PTE_INT8_KERNELS:
        raise EdgekvError(f"--pte-kernel: {int8_kernel!r} is not one of {', '.join(M.PTE_INT8_KERNELS)}")
    name = runtime or default_runtime(device)
    cost, scheme, how = runtime_cost(name, arch, weights)
    ov = device.overhead(M.PLAN_RUNTIMES[name]["overhead"])
    basis = artifact_budget(device, M.PLAN_RUNTIMES[name]["overhead"], entitled)
    if budget is not None and budget != basis.app:
        basis = Budget(basis.device, budget, basis.runtime, basis.overhead, basis.uncertainty, basis.entitled)
    strategy.check_device(device.is_datacenter)
    dep = device_deployment(arch, strategy, device, ctx, weights, name, chunk, int8_kernel)
    rt = cost
    read = M.decode_read_bytes(dep.weights["read_per_token"], dep.layout, strategy, rt)
    fl = M.decode_flops(arch, dep.layout, strategy)
    dec = M.decode_tokens_per_s(read.value, fl.value, device.bandwidth, device.decode_efficiency, device.flops,
                                device.prefill_efficiency)
    dec.formula = read.formula + "; " + fl.formula + "; " + dec.formula
    dec_range = attn_terms = None
    rates = M.attention_rates(rt, device.id, device.device_class)
    kind = M.attention_kind(arch, dep.layout, strategy, rt, rates, int8_kernel)
    gguf_rate, gguf_how = _gguf_rates(arch, weights, rates)
    rings = M.speed.ring_decode_layers(arch, dep.layout, strategy, rt, rates and rates["kinds"], int8_kernel)
    bracket = None if kind or not rates or strategy.converts_to_latent else \
        M.speed.attention_bracket(arch, dep.layout, rates["kinds"], int8_kernel, rings,
                                  M.speed.eager_decode(arch, dep.layout, strategy, rt))
    if kind or bracket:
        # the runtime's attention kernel (GroupQueryAttention, custom_sdpa, llama.cpp's flash attention) reads the
        # cache at its own rate, far below the memory bandwidth: the roofline keeps the weights, the attention is
        # charged at the fitted kernel cost (edgekv/costs/attention_rates.json); a cache with no stored rate here
        # (bracket), between the runtime's measured kinds: a range, the slow end the row's value
        fast_s = None
        if kind:
            kernel = rates["kinds"][kind].get("kernel", rates["kernel"])
            attn_s, attn_f = M.attention_seconds(arch, dep.layout, kind, rates["kinds"], kernel, rings)
        else:
            attn_s, fast_s, attn_f, slowest = bracket
            kernel = rates["kinds"][slowest].get("kernel", rates["kernel"])
        lin = fl.value - M.attention_flops(arch, dep.layout)
        w_rate = (gguf_rate or rates["weights"].get(dep.weight_precision, {})).get("read_bytes_per_s")
        by = None if gguf_rate else rates["weights"].get(dep.weight_precision, {}).get("by_matrix")
        w_s = None
        if by:  # the weights kernel timed per matrix shape on this device
            t, _, f = M.speed.weights_seconds_by_matrix(arch, dep.weight_precision, by, scheme)
            w_s = (t, f"{f} ({by['source']})")
        by_form = (rates["weights"].get("gguf") or {}).get("by_form") \
            if dep.weight_precision == "gguf" and rt == "onnxruntime" else None
        if by_form:  # --weights gguf in edgekv's ONNX: each GGUF type's MatMulNBits form at its own measured rows
            over = (rates["weights"].get(by_form["layer_overhead_from"]) or {}).get("by_matrix") or {}
            got = M.speed.weights_seconds_by_form(M.carried_matrices(arch), by_form, arch.n_layers,
                                                  over.get("layer_overhead_s", 0.0))
            if got:
                w_s = (got[0], f"{got[2]} ({by_form['source']})")
        per_layer = None if gguf_rate else rates["weights"].get(dep.weight_precision, {}).get("layer_overhead_s")
        if w_rate and per_layer and not by:  # the weight kernels at their rate + the step's other ops per layer
            read = dep.weights["read_per_token"]
            w_s = (read / w_rate + arch.n_layers * per_layer,
                   f"{read / 1e9:.3g} GB / {w_rate / 1e9:.3g} GB/s + {arch.n_layers} layers x {per_layer * 1e6:.3g} us "
                   "(the step's other ops per layer)")
        dec, attn_terms = M.decode_with_attention(dep.weights["read_per_token"], lin, attn_s, rates["scale"],
                                                  device.bandwidth, device.decode_efficiency, device.flops,
                                                  device.prefill_efficiency, w_rate, w_s, fast_s)
        dec.formula = f"{attn_f}; {dec.formula} ({rates['basis']}: {rates['source']})" + gguf_how
        attn_terms["formula"] = attn_f.split(" = ", 1)[1].rsplit(" = ", 1)[0]
        attn_terms["kernel"] = kernel
        dec_range = attn_terms["tok_s"] if attn_terms["tok_s"][0] != attn_terms["tok_s"][1] else None
    pf = M.prefill_flops(arch, strategy, ctx, chunk, dep.layout, rt)
    pre = M.prefill_seconds(pf.value, dep.weights["total"], ctx, min(chunk, ctx), device.bandwidth,
                            device.decode_efficiency, device.flops, device.prefill_efficiency)
    pre.formula = pf.formula + "; " + pre.formula
    pre_rates = rates and rates.get("prefill")
    if pre_rates and gguf_rate:  # llama.cpp's matmuls at the rate measured on this GGUF's weight types
        pre_rates = {**pre_rates, "matmul_flop_per_s": gguf_rate["matmul_flop_per_s"]}
    fitted = M.prefill_at_rates(arch, strategy, dep.layout, rt, ctx, min(chunk, ctx), pre_rates, int8_kernel) \
        if pre_rates else None
    pre_range = None
    if pre_rates and not fitted and not strategy.converts_to_latent:  # no rate for this cache: its measured kinds'
        fitted, pre_range = M.prefill.prefill_bracket(arch, strategy, dep.layout, rt, ctx, min(chunk, ctx), pre_rates,
                                                      int8_kernel) or (None, None)
    pre_fitted = fitted.formula if fitted else None
    if fitted:  # the runtime's prefill rates measured on this device (benchmarks/plan_vs_filled.py)
        fitted.formula = f"{pf.formula}; {fitted.formula} ({rates['prefill']['source']})" + gguf_how
        pre = fitted
    converted = strategy.converts_to_latent and "mla" not in arch.kinds
    q = past_trained(quality(arch.name, strategy, ctx, strategy.is_native(arch), converted, arch.family),
                     arch.name, strategy, ctx, arch.trained_ctx, arch.family)
    stored = next((n for n in measured.names_for(arch.name, arch.source) if measured.recall_path(n).is_file()),
                  arch.name)
    q = measured.cite(q, stored, strategy, ctx)  # recall at distance, where edgekv analyze stored it
    q = with_weights(q, arch.name, weights, WEIGHT_FORMAT.get(name))  # what quantizing the weights costs, measured
    try:
        recall = measured.curves(stored, strategy)  # the whole curve, for --explain
    except measured.Unreadable:
        recall = None  # the evidence already says why
    notes = []
    if arch.max_position and ctx > arch.max_position:
        notes.append(f"ctx {ctx} exceeds the model's max_position_embeddings {arch.max_position}")
    if converted:
        notes.append(f"converted from GQA at rank {dep.layout.tensors[0].shape[-1]}: K and V are re-expanded "
                     f"from the latent every step (compute)")
    row = PlanRow(arch.name, strategy, strategy.is_native(arch), dep, basis.app, dec, pre, q,
                  notes, arch.trained_ctx, export_support(arch, strategy, ctx, name, weights), name, recall, basis, read, fl, pf,
                  min(chunk, ctx))
    row.decode_range, row.attention_terms = dec_range, attn_terms
    row.prefill_measured = pre_fitted
    row.prefill_range = pre_range
    row._runtime_cite = f"{name} overhead {int(ov.value):,} B ({ov.cite})"
    if device.is_datacenter:
        row.serving = serve(device, arch, dep)
    return row


def _gguf_rates(arch: Arch, weights: str, rates: dict | None) -> tuple[dict | None, str]:
    """A model read from a GGUF and planned with its own weights, on a runtime whose rates are stored per GGUF weight
    type mix (llama.cpp: edgekv/costs/attention_rates.json gguf_types): the rates measured on that mix ({
    "read_bytes_per_s", "matmul_flop_per_s"}) and the sentence --explain adds; where no rate was measured for this
    mix, None and the assumption the default rates make. A catalog model (a shape, no GGUF) planned at weights the
    runtime stores a catalog recipe for (weights[w].catalog_mix: llama.cpp int4 -> the Q4_K_M mix, the recipe a user
    downloads or quantizes to): that mix's measured rates, on the plan's own weight bytes, and --explain says so."""
    if not rates or not rates.get("gguf_types"):
        return None, ""
    if weights != "gguf":
        w = rates["weights"].get(weights) or {}
        r = rates["gguf_types"].get(w.get("catalog_mix"))
        if not r:
            return None, ""
        return r, (f"; no GGUF weight types planned (a catalog model, or --weights {weights} rather than gguf): its "
                   f"{weights} weights and matmuls charged at the rates measured "
                   f"on {w['catalog_recipe']}'s weight types {w['catalog_mix']} ({r['source']}), the recipe a "
                   f"{weights} GGUF is usually made with, on the plan's {weights} weight bytes; -m FILE.gguf charges "
                   f"the file's own types")
    mix = M.gguf_type_mix(arch)
    r = rates["gguf_types"].get(mix)
    if r:
        return r, f"; this GGUF's weight types {mix}: weights and matmuls at the rates measured on them ({r['source']})"
    by = M.speed.gguf_rates_by_type(arch, rates.get("gguf_type_rates") or {})
    if by:  # a mix measured nowhere as a whole: each of its types at the rate measured on a file of that type alone
        types = ", ".join(f"{t} {b / 1e6:.4g} MB at {rates['gguf_type_rates'][t]['read_bytes_per_s'] / 1e9:.3g} GB/s"
                          for t, b in sorted(by["types"].items()))
        src = {rates["gguf_type_rates"][t]["source"] for t in by["types"]}
        return by, (f"; this GGUF's weight types ({mix}), no file of this mix measured: each type at the rates "
                    f"measured on a file of that type alone (read per step: {types}; matmuls "
                    f"{by['matmul_flop_per_s'] / 1e9:.3g} GFLOP/s over the linear rows' types; {'; '.join(sorted(src))})")
    return None, (f"; no rate measured on this GGUF's weight types ({mix or 'none named'}; measured: "
                  f"{', '.join(rates['gguf_types'])}"
                  + (f"; per type: {', '.join(rates['gguf_type_rates'])}" if rates.get("gguf_type_rates") else "")
                  + "): its weights and matmuls charged at the default rates, an "
                  "assumption (llama.cpp's kernels run each type at its own rate)")


def device_deployment(arch: Arch, strategy: Strategy, device: DeviceProfile, ctx: int, weights: str, name: str,
                      chunk: int = DEFAULT_CHUNK, int8_kernel: str = "executorch") -> M.Deployment:
    """The memory side of a plan row: deployment() under plan runtime `name` on this device (its overhead, and on a
    phone the runtime's arm64 packing at load)."""
    cost, scheme, how = runtime_cost(name, arch, weights)
    ov = device.overhead(M.PLAN_RUNTIMES[name]["overhead"])
    dep = deployment(arch, strategy, ctx, weights, cost, ov.value, chunk, scheme=scheme, int8_kernel=int8_kernel)
    dep.explain["runtime model"] = how
    if device.device_class == "phone":  # a phone runs the runtime's arm64 kernels: their packing, as measured
        dep.load = M.arm64_load(dep.load, dep.weights["total"], cost, weights)
        dep.explain["load"] = dep.load.formula
    return dep


def runtime_cost(name: str, arch: Arch, weights: str) -> tuple[str, dict | None, str]:
    """The memory.RUNTIMES cost model, the runtime's own weight layout (None = edgekv's) and a sentence saying
    which, for `--runtime name` and this model (edgekv/costs/runtimes.json). A model type the runtime's own export
    does not define (fused_types) runs as its fallback does (ExecuTorch: edgekv's own .pte)."""
    spec = M.PLAN_RUNTIMES.get(name)
    if spec is None:
        raise EdgekvError(f"unknown runtime {name!r}; runtimes: {', '.join(M.PLAN_RUNTIMES)}")
    fused = spec.get("fused_types")
    if fused and arch.model_type not in fused["value"]:
        fb = M.PLAN_RUNTIMES[spec["fallback"]["value"]]
        return fb["cost_model"], None, (f"{spec['label']}: {arch.model_type} is not one of its model types, so "
                                        f"planned as {fb['label']} ({spec['fallback']['source']})")
    scheme = (spec.get("weights") or {}).get("value", {}).get(weights)
    declared = variant(arch.model_type)
    wide = (spec.get("weights") or {}).get("variant_layers")
    if weights == "int4" and scheme and wide and declared is not None and getattr(declared, wide) != "int4":
        # the variant keeps its decoder layers wider in this runtime's int4 (edgekv.arch.variants pte_int4_layers):
        # every one, or only the layers measured for this model's shape (pte_int8_kept), the rest at the scheme's own
        wider = spec["weights"]["value"][getattr(declared, wide)]["linear"]
        kept = pte_int8_kept(arch.n_layers, arch.hidden, arch.vocab)
        scheme = {**scheme, "linear": wider} if kept is None else {**scheme, "linear_kept": wider,
                                                                   "kept_layers": list(kept)}
    if scheme and "output_large_head" in scheme:
        scheme = large_head(scheme, arch)
    return spec["cost_model"], scheme, (f"{spec['label']}; attention over {', '.join(fused['value'])}: fused "
                                        f"({fused['source']})" if fused else spec["label"]) \
        + (f"; weights: {spec['weights']['source']}" if scheme else "")


def large_head(scheme: dict, arch: Arch) -> dict:
    """A runtime scheme with *_large_head entries (edgekv's int4 .pte) for this model: the output layer and the
    table gathered from its codes take them where the output matrix holds more weights than the decoder layers'
    linears together and its width is a multiple of their group (wquant.pte_head_group, the export's rule), the
    scheme's own output and embedding entries otherwise; the *_large_head keys are dropped either way."""
    from .arch.variants import head_outweighs_layers

    out = {k: v for k, v in scheme.items() if not k.endswith("_large_head")}
    if head_outweighs_layers(arch.vocab * arch.hidden, [w.numel for w in arch.weights if w.cls == "linear"],
                             arch.hidden, scheme["output_large_head"]["group"]):
        out["output"], out["embedding"] = scheme["output_large_head"], scheme["embedding_large_head"]
    return out


def cannot_build(arch: Arch, strategy: Strategy, ctx: int, runtime: str, weights: str | None) -> str:
    """Why edgekv export fails to build this (model type, weights, cache kind, ctx) for the runtime although its
    family takes the strategy (runtimes.json cannot_build: each entry a failed run; an entry naming strategies matches
    only those, e.g. mla, whose latent cache has kv's cache kind; one naming models only those, where the run failed
    on one model of its type), or ""."""
    for e in M.PLAN_RUNTIMES.get(runtime, {}).get("cannot_build", {}).get("value", []):
        if arch.model_type in e["model_types"] and weights in e["weights"] and M.cache_key(strategy) in e["caches"] \
                and strategy.full_cache == e["full_cache"] and ctx >= e.get("min_ctx", 0) \
                and strategy.name in e.get("strategies", [strategy.name]) and arch.name in e.get("models", [arch.name]):
            return f"edgekv export cannot build this row yet: {e['reason']} ({e['evidence']})"
    return ""


def export_support(arch: Arch, strategy: Strategy, ctx: int, runtime: str = "edgekv-pte",
                   weights: str | None = None) -> tuple[bool, str]:
    """(whether `edgekv export --model M --strategy S --max-ctx ctx [--weights W]` builds this row for plan runtime
    `runtime` today, why not)."""
    from .export.options import EXPORTABLE  # torch-free and numpy-free at import

    if runtime in OTHERS_BUILD:
        return False, (f"edgekv export does not build {M.PLAN_RUNTIMES[runtime]['label']}; it builds "
                       + " and ".join(M.PLAN_RUNTIMES[k]["label"] for k in EDGEKV_BUILDS))
    if not strategy.exportable:
        return False, f"edgekv export does not build {strategy.name} (exportable: {', '.join(EXPORTABLE)})"
    found = family_for_type(arch.model_type)  # the export registry (edgekv.models: FAMILIES, torch-free)
    if found is None:
        return False, f"edgekv export has no module for model_type {arch.model_type}"
    family, names = found
    dtypes, capped = family.state_dtypes, family.ctx_capped
    if strategy.name not in names:
        return False, f"edgekv's {arch.model_type} module takes {', '.join(names)}, not {strategy.name}"
    for k in ("dtype", "state_dtype"):
        d = strategy.params.get(k)
        kv = strategy.attention_kv
        if k == "dtype" and kv is not None and kv.kv_bits and family.kv_quantized:
            continue  # the attention layers' quantized cache (strategies.hybrid_kv)
        if d and d not in dtypes:
            return False, f"edgekv's {arch.model_type} module stores {', '.join(dtypes)}, not {d}"
    if capped and arch.max_position and ctx > arch.max_position:
        return False, f"export refuses max_ctx {ctx} > max_position_embeddings {arch.max_position}"
    why = cannot_build(arch, strategy, ctx, runtime, weights)
    return (False, why) if why else (True, "")


def strategies_for(arch: Arch, device: DeviceProfile, only: list[Strategy] | None) -> list[Strategy]:
    if only:
        return only
    return defaults_for(arch, device.is_datacenter)


@functools.lru_cache(maxsize=None)
def _family_members(family: str) -> tuple[tuple[int, str], ...]:
    return tuple((s["n_params"], n) for n in catalog_names() for s in [catalog_summary(n)] if s["family"] == family)


def alternatives(family: str, near_params: float, device: DeviceProfile | None = None, k: int = 3) -> list[str]:
    """Catalog models of that family that could run on the device, closest in parameter count to near_params."""
    cands = [(abs(math.log(n / near_params)), name) for n, name in _family_members(family)
             if device is None or _plausible_bytes(catalog_summary(name)["int4_bytes"], device)]
    return [name for _, name in sorted(cands)[:k]]


def plausible(arch: Arch, device: DeviceProfile) -> bool:
    """Could this model run on the device at all? Its int4 weights must fit the app budget."""
    return _plausible_bytes(_int4_bytes(arch), device)


def _plausible_bytes(int4_bytes: float, device: DeviceProfile) -> bool:
    return device.is_datacenter or int4_bytes <= device.budget_bytes


@functools.lru_cache(maxsize=None)
def _int4_bytes(arch: Arch) -> float:
    return M.weight_bytes(arch, "int4")["total"]


@dataclass
class Plan:
    device: DeviceProfile
    ctx: int
    rows: list[PlanRow]
    not_applicable: list[dict]
    budget: int

    def ranked(self) -> list[PlanRow]:
        return sorted(self.rows, key=lambda r: (FIT_ORDER[r.fit], RISK_ORDER[r.quality["risk"]], not r.exportable[0],
                                                -r.decode.value))

    @property
    def runtime(self) -> str:
        return self.rows[0].runtime if self.rows else (self._runtime or default_runtime(self.device))

    _runtime: str | None = None

    suggestions: list[dict] | None = None  # what_would_fit, where the caller asked and nothing fits well
    int8_kernel: str = "executorch"  # what reads a .pte's int8 cache (plan --pte-kernel, as export takes it)
    # devices.cpu_note: the profile's speeds are another CPU's than this machine's (None: they match, or unknown)
    cpu_note: str | None = None

    def to_json(self, explain: bool = False) -> dict:
        d = {"device": self.device.to_json(), "ctx": self.ctx, "budget_bytes": self.budget,
             "budget_uncertainty_bytes": self.device.budget_uncertainty_bytes, "cpu_note": self.cpu_note,
             "runtime": {"name": self.runtime, "flag": plan_flag(self.runtime),
                         "label": M.PLAN_RUNTIMES[self.runtime]["label"]},
             "options": [r.to_json(explain) for r in self.ranked()], "not_applicable": self.not_applicable}
        if self.suggestions is not None:
            d["what_would_fit"] = self.suggestions
        return d


def make_plan(device: DeviceProfile, ctx: int, archs: list[Arch], strategies: list[Strategy] | None = None,
              weights: str | None = None, runtime: str | None = None, entitled: bool = False,
              chunk: int = DEFAULT_CHUNK, int8_kernel: str = "executorch") -> Plan:
    if entitled and device.entitled_budget_bytes is None:
        raise EdgekvError(f"device {device.id} has no increased-memory-limit budget (iOS only)")
    budget = device.entitled_budget_bytes if entitled else device.budget_bytes
    name = runtime or default_runtime(device)
    if name not in M.PLAN_RUNTIMES:
        raise EdgekvError(f"unknown runtime {name!r}; runtimes: {', '.join(M.PLAN_RUNTIMES)}")
    if M.PLAN_RUNTIMES[name]["overhead"] not in device.runtime_overhead:
        device.overhead(M.PLAN_RUNTIMES[name]["overhead"])  # one line naming the runtimes the profile has
    rows, na = [], []
    alt_cache: dict = {}
    for arch in archs:
        w = weights or ("gguf" if arch.gguf_path else ("fp16" if device.is_datacenter else "int4"))
        for s in strategies_for(arch, device, strategies):
            try:
                rows.append(plan_one(arch, s, device, ctx, w, runtime, None, chunk, entitled, int8_kernel))
            except NotApplicable as e:
                fam = s.needs_family  # mla converts from any GQA model
                entry = {"model": arch.name, "strategy": s.name, "reason": str(e)}
                if fam and fam != arch.family:
                    key = (fam, arch.name)
                    if key not in alt_cache:
                        alt_cache[key] = alternatives(fam, arch.n_params, device)
                    entry["needs_family"] = fam
                    entry["alternatives"] = alt_cache[key]
                na.append(entry)
            except ParamsDoNotFit as e:  # a default strategy whose parameters do not fit this model (kv-int4's group
                if strategies:  # 32 and a head_dim of 48): listed with its reason; one the user asked for is an error
                    raise
                na.append({"model": arch.name, "strategy": s.label, "reason": str(e)})
    rows, same = _drop_windows_equal_to_kv(rows)
    na += same
    p = Plan(device, ctx, rows, na, budget)
    p._runtime = name
    p.int8_kernel = int8_kernel
    p.cpu_note = cpu_note(device)
    return p


def _drop_windows_equal_to_kv(rows: list[PlanRow]) -> tuple[list[PlanRow], list[dict]]:
    """A window whose W + sinks cover the context keeps every token: the same state as plain kv in that dtype, so it
    is not a separate option (it is listed in not_applicable with that reason)."""
    kv = {(r.model, r.strategy.params.get("dtype"), r.deployment.layout.nbytes) for r in rows if r.strategy.plain_kv}
    keep, dropped = [], []
    for r in rows:
        p, w = r.strategy.params, r.strategy.window_tokens
        if (w is not None and r.deployment.ctx <= w
                and (r.model, p["dtype"], r.deployment.layout.nbytes) in kv):
            dropped.append({"model": r.model, "strategy": r.strategy.name, "reason": f"{r.strategy.short} covers the whole "
                            f"context ({r.deployment.ctx:,} tokens): the same state as kv {p['dtype']}"})
        else:
            keep.append(r)
    return keep, dropped


def default_models(device: DeviceProfile) -> list[Arch]:
    """The catalog models that could plausibly run on the device; only those are built (edgekv.catalog_index)."""
    return [catalog_arch(n) for n in catalog_names() if _plausible_bytes(catalog_summary(n)["int4_bytes"], device)]


# ---- datacenter baseline ----


def baseline(device: DeviceProfile, arch: Arch, ctxs: list[int], strategies: list[Strategy] | None = None,
             weights: str = "int4", runtime: str | None = None) -> list[BaselineRow]:
    """Per strategy and ctx: per-user state, users per GPU (KV pool = HBM - weights - runtime - workspace),
    per-user decode speed at that batch (bandwidth roofline) and $ per million tokens."""
    if device.usd_per_hour is None:
        raise EdgekvError(f"device {device.id} is not a datacenter GPU (no usd_per_hour); try h100, h200 or a100")
    rt = runtime or device.runtime
    ov = device.overhead(rt).value
    rows = []
    for ctx in ctxs:
        for s in strategies_for(arch, device, strategies):
            try:
                dep = deployment(arch, s, ctx, weights, rt, ov)
            except NotApplicable:
                continue
            rows.append(serve(device, arch, dep))
    return rows


# ---- the longest context per option (plan --ctx max) ----
