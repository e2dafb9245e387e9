"""Store a host profile's speed rates in edgekv/costs/attention_rates.json (`devices.<id>` under each runtime), from
the kernel benchmarks run on that profile's CPU and the weights / prefill rates benchmarks/plan_vs_filled.py fitted on
that CPU's filled-context rows.

    python benchmarks/device_rates.py [--device host-xeon] [--check]

SOURCES names, per profile, the results JSONs each kind's rates come from (benchmarks/attention_rates.py runs on that
CPU: each JSON's rows and fits, a kind per JSON). For each kernel kind it stores the fit over both head shapes (for a
model of another head size) and, per head size, the measured curve (compute_by_kept_keys: each measured call's time
over its kept keys x H x D, overhead 0), so the plan charges a model of a measured head size the measured calls
themselves (memory.speed._compute_at: linear between two measured key counts); llama.cpp's kinds also carry, per
head size, the per-key cost by KV heads measured side by side (KV_HEADS_SOURCES: kv_heads_scale, and the prefill's
attention_flop_per_s_kv_heads_scale; memory.speed.kv_heads_factor). The weights rates, the per-key costs
fitted on model rows (eager graphs, the .pte's int4 read-back) and the prefill matmul rates are plan_vs_filled.json's
`devices.<id>` (fitted on that CPU's SmolLM2-135M rows; Gemma-3-270M's and the 1B's held out). Run this, then
plan_vs_filled.py, then this again (the fits need the kernel rates stored; the stored fits need the fits).
--check: exit 1 where the stored entry differs from what the sources give (tests/test_attention_rates.py).

The host profile's own entries (`devices.host`, the AMD EPYC VM) are not written here: they were assembled by hand
over many runs (their sources in each entry) and stay as they are.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RATES_FILE = HERE.parent / "edgekv" / "costs" / "attention_rates.json"
PVF = RESULTS / "plan_vs_filled.json"

# profile -> runtime -> stored kind -> (results JSON, the kind as its rows name it); the executorch "edgekv K" kinds
# are rows of a run with --int8-kernel edgekv (each JSON's int8_kernel says so)
SOURCES = {
    "host-xeon": {
        "onnxruntime": {
            "fp32": ("attention_rates_xeon.json", "fp32"),
            "fp16": ("attention_rates_xeon.json", "fp16"),
            "int8c": ("attention_rates_xeon.json", "int8c"),
            # the window strategy's eager graph (attention_rates.py --window)
            "eager fp16": ("attention_rates_window_xeon.json", "eager window fp16"),
        },
        "executorch": {
            "fp32": ("attention_rates_executorch_fp16_default_xeon.json", "fp32"),
            "fp16": ("attention_rates_executorch_fp16_default_xeon.json", "fp16"),
            "int8": ("attention_rates_executorch_int8_xeon.json", "int8"),
            "int8c": ("attention_rates_executorch_int8_xeon.json", "int8c"),
            "edgekv int8": ("attention_rates_executorch_int8_edgekv_xeon.json", "int8"),
            "edgekv int8c": ("attention_rates_executorch_int8_edgekv_xeon.json", "int8c"),
            "edgekv fp16": ("attention_rates_executorch_fp16_edgekv.json", "fp16"),
            "edgekv int4": ("attention_rates_executorch_int4_edgekv.json", "int4"),
            "eager fp16": ("attention_rates_executorch_window_xeon.json", "eager window fp16"),
            # a model's own sliding ring of an fp32 cache, eager (Gemma 3's sliding layers: speed.ring_decode_kind;
            # attention_rates.py --runtime executorch --window --ring)
            "eager ring fp32": ("attention_rates_executorch_ring_decode_xeon.json", "eager ring fp32"),
        },
        "executorch-llama": {
            "fp32": ("attention_rates_executorch_llama_xeon_pair.json", "etllama fp32"),
            "fp16": ("attention_rates_executorch_llama_xeon_pair.json", "etllama fp16"),
            "int8": ("attention_rates_executorch_llama_xeon_pair.json", "etllama int8"),
        },
        # llama.cpp's flash attention: a decode step of a 1-layer random model per cache type (attention_rates.py
        # --runtime llamacpp --kinds K, one run per kind)
        "llama.cpp": {
            "f16": ("attention_rates_llamacpp_f16_xeon.json", "f16"),
            "q8_0": ("attention_rates_llamacpp_q8_0_xeon.json", "q8_0"),
            "q4_0": ("attention_rates_llamacpp_q4_0_xeon.json", "q4_0"),
        },
    },
}
# profile -> runtime -> {stored kind: (results JSON, the kind as its rows name it)}: a kernel run's prefill rate by
# head size, stored as its ratio to the rate at head size FIT_HEAD_DIM (attention_flop_per_s_head_dim_scale), where
# the kernel's level is not the model's and the kind's rate is fitted on SmolLM2's rows (head size FIT_HEAD_DIM):
# the .pte's eager window graph (attention_rates.py --runtime executorch --window --prefill: its calls' level is not
# the model's, measured in benchmarks/README.md, "On the Intel Xeon VM"; its ratio by head size is used)
HEAD_DIM_SCALE_SOURCES = {
    "host-xeon": {"executorch": {"eager fp16": ("attention_rates_executorch_window_prefill_xeon.json",
                                                "eager window fp16")}},
}
FIT_HEAD_DIM = 64
# profile -> runtime -> {stored kind: (results JSON, the kind as its rows name it, the fitted kind it is priced from,
# that kind as the rows name it)}: a kind no model row fits (a .pte's fp32 ring: Gemma 3's sliding layers on an fp32
# cache), its rate the fitted kind's times the run's rate of the kind at each head size over the fitted kind's at
# FIT_HEAD_DIM, both in one run (attention_rates.py --runtime executorch --window --prefill --ring)
SCALED_KIND_SOURCES = {
    "host-xeon": {"executorch": {"eager fp32": ("attention_rates_executorch_ring_prefill_xeon.json", "eager ring fp32",
                                                "eager fp16", "eager window fp16")}},
}
# profile -> runtime -> (results JSON, the model the prefill matmul rate is fitted on): the weights kernel timed per
# matrix shape at a prefill call's tokens (attention_rates.py --matmul --tokens 128), stored as "matmul_by_matrix" with
# the fit model's rate at it; a model of other matrix shapes gets the fitted rate times its matrices' kernel rate over
# the fit model's (memory.prefill.matmul_shape_scale). The rate follows K (benchmarks/README.md, "On the Intel Xeon VM")
MATMUL_PREFILL_SOURCES = {
    "host-xeon": {"onnxruntime": ("matmul_nbits_rates_128_xeon.json", "smollm2-135m")},
}
# profile -> runtime -> [(prefill results JSON, {stored kind: the kind as its rows name it})]
PREFILL_SOURCES = {
    "host-xeon": {
        # the window strategy's eager graph: one prefill call of its layer at each kept-key count and head size
        # (attention_rates.py --window --prefill), the rate of every eager graph's prompt ("eager fp16"; the explicit
        # kv-int8 / kv-int4 graphs' too, with their read-back: plan_vs_filled.ORT_READBACK)
        "onnxruntime": [("attention_rates_prefill_xeon.json", {"fp32": "fp32", "fp16": "fp16", "int8c": "int8c"}),
                        ("attention_rates_window_prefill_xeon.json", {"eager fp16": "eager window fp16"})],
        # custom_quantized_sdpa's int8 / int8c prefill (its scalar int8 x int8 loop on x86): the kernel's rate per head
        # size, not fitted on SmolLM2's prompts (Gemma's shape runs it faster per FLOP: benchmarks/README.md)
        "executorch": [("attention_rates_executorch_prefill_xeon.json", {"fp32": "fp32", "fp16": "fp16"}),
                       ("attention_rates_executorch_prefill_int8_xeon.json", {"int8": "int8", "int8c": "int8c"}),
                       ("attention_rates_executorch_prefill_edgekv_xeon.json",
                        {"edgekv int8": "int8", "edgekv int8c": "int8c", "edgekv fp16": "fp16",
                         "edgekv int4": "int4"})],
        # llama.cpp: the fills of its kernel runs (each context's prefill of the 1-layer model)
        "llama.cpp": [("attention_rates_llamacpp_f16_xeon.json", {"f16": "f16"}),
                      ("attention_rates_llamacpp_q8_0_xeon.json", {"q8_0": "q8_0"}),
                      ("attention_rates_llamacpp_q4_0_xeon.json", {"q4_0": "q4_0"})],
    },
}
# profile -> llama.cpp's per-key cost by KV heads (attention_rates.py --runtime llamacpp --shapes with the EXTRA_SHAPES
# of the base shape's head size, in one run: its kv_heads_scales), stored beside each kind's per-head-size rates
KV_HEADS_SOURCES = {"host-xeon": {"llama.cpp": "attention_rates_llamacpp_kv_heads_xeon.json"}}
# profile -> runtime -> {stored kind: (results JSON, the kind as its rows name it)}: a prefill kernel run of the base
# shape (attention_rates.SHAPES) beside a shape of another KV-head count at its head size (attention_rates.py --prefill
# --shapes smollm2-135m,llama-3.2-1b), stored as attention_flop_per_s_kv_heads_scale: the base shape's fitted rate over
# the other's, the factor the rate is divided by at that many KV heads (memory.speed.kv_heads_factor)
PREFILL_KV_HEADS_SOURCES = {"host-xeon": {"executorch": {
    "edgekv int8c": ("attention_rates_executorch_prefill_edgekv_kv_heads_xeon.json", "int8c")}}}
# profile -> llama.cpp's weight-type runs on that CPU: the 512-token prefills of the real GGUFs (--gguf-prefill, taken
# apart by plan_vs_filled.py into gguf_types) and the random files per GGML type (--gguf-types: gguf_type_rates)
GGUF_SOURCES = {"host-xeon": {"prefill": "llamacpp_gguf_prefill_xeon.json", "types": "llamacpp_gguf_types_xeon.json"}}
# profile -> runtime -> the per-matrix weights kernel rows (benchmarks/attention_rates.py --matmul on that CPU)
MATMUL_SOURCES = {"host-xeon": {"onnxruntime": "matmul_nbits_rates_xeon.json"}}
# profile -> runtime -> each GGUF type's MatMulNBits form timed beside the int4 form (attention_rates.py
# --matmul-forms on that CPU): weights.gguf.by_form, scaled onto that CPU's int4 rows (attention_rates.forms_entry);
# GenAI's int4 is its '4-bit/32' form
MATMUL_FORMS_SOURCES = {"host-xeon": {"onnxruntime": "matmul_nbits_forms_xeon.json"}}
LOAD_NOTE = ("the host shared with other benchmarks (the lead's filled-context runs and exports): load average "
             "{load} on 2 cores, process CPU time")


def matmul_by_matrix(name: str, fit_model: str) -> dict:
    """The "matmul_by_matrix" entry from a --matmul --tokens N run (results/NAME): [K, N, seconds per call] per
    shape at its tokens, with the fit model's matrices' rate at it (memory.prefill.matmul_kernel_rate)."""
    from edgekv.arch import load_arch
    from edgekv.memory.prefill import matmul_kernel_rate

    d = _load(name)
    tokens = {r["tokens"] for r in d["rows"]}
    if len(tokens) != 1:
        raise SystemExit(f"{name}: rows at {sorted(tokens)} tokens; one call size per run")
    by = {"kernel": "MatMulNBits int4", "tokens": tokens.pop(),
          "rows": [[r["k"], r["n"], float(f"{r['median_us'] * 1e-6:.4g}")] for r in d["rows"]], "fit_model": fit_model}
    by["fit_flop_per_s"] = float(f"{matmul_kernel_rate(load_arch(fit_model), by):.4g}")
    by["source"] = (f"benchmarks/attention_rates.py --matmul --tokens {by['tokens']} on this CPU (benchmarks/results/"
                    f"{name}, load average {_load_range(d)}): one MatMulNBits call per matrix shape, seconds per call; "
                    f"the prefill matmul rate fitted on {fit_model}'s prompts is charged times a model's matrices' rate "
                    "at these rows over the fit model's")
    return by


def prefill_kv_heads(rows: list[dict], kind: str) -> dict:
    """{head size: {KV heads: the base shape's (attention_rates.SHAPES) fitted prefill rate over the shape's of that
    many KV heads}} from one run's prefill calls (attention_rates.fit_prefill_rate per shape)."""
    import attention_rates as ar

    base = {d: name for name, (_h, _hkv, d) in ar.SHAPES.items()}
    out: dict[str, dict[str, float]] = {}
    for d, bname in base.items():
        by: dict[str, list[dict]] = {}
        for r in rows:
            if r.get("kind") == kind and r["head_dim"] == d and "chunk" in r:
                by.setdefault(r["shape"], []).append(r)
        if bname not in by or len(by) < 2:
            continue
        rate = {n: ar.fit_prefill_rate(rs)["attention_flop_per_s"] for n, rs in by.items()}
        out[str(d)] = {str(rs[0]["kv_heads"]): round(rate[bname] / rate[n], 3)
                       for n, rs in sorted(by.items(), key=lambda x: x[1][0]["kv_heads"])}
    return out


def prefill_curve(rows: list[dict], kind: str) -> dict:
    """A kernel run's prefill calls as a curve per head size: {head size: {kept keys: the call's attention FLOP over
    its CPU seconds (median over rows at that count)}} (memory.prefill.prefill_keys_factor)."""
    import statistics

    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("kind") == kind and "attention_flop" in r and "chunk" in r:
            out.setdefault(str(r["head_dim"]), {}).setdefault(str(r["ctx"]), []).append(
                r["attention_flop"] / (r["median_us"] * 1e-6))
    return {dim: {c: float(f"{statistics.median(v):.4g}") for c, v in sorted(by.items(), key=lambda x: int(x[0]))}
            for dim, by in out.items()}


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _load_range(d: dict) -> str:
    loads = [r["loadavg"] for r in d.get("rows", []) if "loadavg" in r] or list(d.get("loadavg", [])[:1])
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "unrecorded"


def _curve(rows: list[dict]) -> dict:
    """Each context's call over its kept keys x H x D (median over rows of that context): the measured curve."""
    import statistics

    return {str(c): float(f"{statistics.median(r['median_us'] * 1e-6 / (r.get('layers', 1) * c * r['heads'] * r['head_dim']) for r in rows if r['ctx'] == c):.4g}")
            for c in sorted({r["ctx"] for r in rows})}


def kernel_kind(name: str, kind: str, host_entry: dict | None, step: bool = False) -> dict:
    """One stored kind from one results JSON: the fit over both head shapes (attention_rates.fit) and per head size the
    measured curve at overhead 0. step (llama.cpp: each row a whole decode step of a 1-layer model, not one kernel
    call): as the host's llama.cpp entry stores them, the fits' per-key terms alone, their overhead (the step's time
    outside attention, once a step, not once a layer: in the model's weights term) set to 0 and no measured curve
    (each call's time over its keys would charge that overhead to every layer)."""
    sys.path.insert(0, str(HERE))
    import attention_rates as ar

    d = _load(name)
    rows = [r for r in d["rows"] if r["kind"] == kind]
    if not rows:
        raise SystemExit(f"{name}: no rows of kind {kind!r}")
    f = ar.fit(rows)
    out = {}
    if host_entry and "kernel" in host_entry:  # the same kernel as on the reference host (same software)
        out["kernel"] = host_entry["kernel"]
    out.update(overhead_s=0.0 if step else float(f"{f['overhead_s']:.4g}"),
               read_bytes_per_s=float(f"{f['read_bytes_per_s']:.4g}") if f["read_bytes_per_s"] else None,
               compute_s_per_head_dim_position=float(f"{f['compute_s_per_head_dim_position']:.4g}"),
               fit_max_abs_rel_error=f["max_abs_rel_error"], by_head_dim={})
    for dim in sorted({r["head_dim"] for r in rows}):
        sub = [r for r in rows if r["head_dim"] == dim]
        g = ar.fit_head_dim(sub)
        if step:
            out["by_head_dim"][str(dim)] = {
                "overhead_s": 0.0, "read_bytes_per_s": None,
                "compute_s_per_head_dim_position": float(f"{g['compute_s_per_head_dim_position']:.4g}"),
                "fit_max_abs_rel_error": g["max_abs_rel_error"],
                "step_overhead_s": float(f"{g['overhead_s']:.4g}")}
            continue
        out["by_head_dim"][str(dim)] = {
            "overhead_s": 0.0, "read_bytes_per_s": None,
            "compute_s_per_head_dim_position": float(f"{g['compute_s_per_head_dim_position']:.4g}"),
            "compute_by_kept_keys": _curve(sub),
            "fit_max_abs_rel_error": g["max_abs_rel_error"]}
    out["source"] = (f"benchmarks/results/{name}, its {kind} rows ({len(rows)}: "
                     + ", ".join(f"{r['shape']} {r['ctx']}" for r in rows[:2]) + ", ...; "
                     + LOAD_NOTE.format(load=_load_range(d)) + f", CPU {d.get('cpu') or 'Intel(R) Xeon(R) Processor'}): "
                     + ("a decode step of a 1-layer random model per filled context, fitted as time = step overhead + "
                        "ctx x H x D x c, over both head shapes (for a model of another head size) and per head size "
                        "(by_head_dim, which the plan charges a model of that head size); the step overhead "
                        "(step_overhead_s: the tiny model's step outside attention) is stored 0, the model's own step "
                        "outside attention being its weights term" if step else
                        "the fit over both head shapes for a model of another head size; by_head_dim: per head size the "
                        "measured calls over their kept keys x H x D (compute_by_kept_keys), which the plan charges a "
                        "model of that head size"))
    return out


def _kv_heads(device: str, rt: str) -> dict | None:
    """{"scales": the run's kv_heads_scales, "source": where they come from} for this runtime on this profile, or None
    (no run named, or not there)."""
    name = KV_HEADS_SOURCES.get(device, {}).get(rt)
    if not name or not (RESULTS / name).exists():
        return None
    d = _load(name)
    shapes = sorted({f"{r['shape']} {r['heads']}/{r['kv_heads']}x{r['head_dim']}" for r in d["rows"]})
    return {"scales": d["kv_heads_scales"],
            "source": f"benchmarks/results/{name} (one run, {d['runs']} steps a row, {len(d['rows'])} rows, "
                      + LOAD_NOTE.format(load=_load_range(d)) + "): the decode step's per-key cost (the slope over "
                      "its filled contexts) and the fill's attention FLOP rate of each head shape of one head size ("
                      + ", ".join(shapes) + ") over the base shape's, by KV heads"}


def llamacpp_gguf(device: str, pvf: dict) -> dict:
    """llama.cpp's rates per GGUF weight type mix on this CPU ({"gguf_types", "gguf_type_rates"}, as the host's): each
    real GGUF's 512-token prefill and steps taken apart by plan_vs_filled.py (devices.<id>.llamacpp_gguf_types), and
    each GGML type's random files (devices.<id>.llamacpp_gguf_type_rates, from GGUF_SOURCES' --gguf-types run)."""
    src = GGUF_SOURCES.get(device, {})
    out = {}
    if pvf.get("llamacpp_gguf_types"):
        d = _load(src["prefill"])
        load = "-".join(f"{x:.1f}" for x in sorted({min(f["loadavg"] for f in d["files"].values()),
                                                     max(f["loadavg"] for f in d["files"].values())}))
        out["gguf_types"] = {
            mix: {"matmul_flop_per_s": float(f"{g['matmul_flop_per_s']:.4g}"),
                  "read_bytes_per_s": float(f"{g['read_bytes_per_s']:.4g}"),
                  "source": f"measured on {g['file']} on this CPU (benchmarks/attention_rates.py --runtime llamacpp "
                            f"--gguf-prefill: a 512-token prefill and 17 decode steps after it, 1 thread, process CPU "
                            f"time, load average {load}; benchmarks/results/{src['prefill']}), taken apart by "
                            "benchmarks/plan_vs_filled.py (devices." + device + ".llamacpp_gguf_types): "
                            "matmul_flop_per_s = the prefill less its attention at this CPU's f16 kernel rate, over its "
                            "matmul and logits FLOP; read_bytes_per_s = the bytes a step reads from the file over the "
                            "step less its attention at this CPU's f16 kernel rate"}
            for mix, g in sorted(pvf["llamacpp_gguf_types"].items())}
    if pvf.get("llamacpp_gguf_type_rates"):
        d = _load(src["types"])
        out["gguf_type_rates"] = {}
        for t, g in pvf["llamacpp_gguf_type_rates"].items():
            loads = [v["loadavg"] for v in d["types"][t]["by_layers"].values()]
            out["gguf_type_rates"][t] = {
                "matmul_flop_per_s": float(f"{g['matmul_flop_per_s']:.4g}"),
                "read_bytes_per_s": float(f"{g['read_bytes_per_s']:.4g}"),
                "source": f"measured on this CPU on random GGUFs of Llama-3.2-1B's layer shape (hidden 2048, MLP 8192) "
                          f"at {' and '.join(d['types'][t]['by_layers'])} layers quantized to {t} by "
                          f"llama_model_quantize, the added layers' work over their added time (benchmarks/"
                          f"attention_rates.py --runtime llamacpp --gguf-types {t} --device {device}, benchmarks/"
                          f"results/{src['types']}, load average {min(loads):.1f}-{max(loads):.1f}: a 512-token "
                          "prefill and the decode steps after it, 1 thread, CPU time, the attention at this CPU's "
                          "kernel rates taken out)"}
    return out


def build(device: str, current: dict) -> dict:
    """{runtime: devices.<device> entry} from SOURCES, PREFILL_SOURCES, MATMUL_SOURCES and plan_vs_filled.json."""
    pvf = json.loads(PVF.read_text()).get("devices", {}).get(device, {}) if PVF.exists() else {}
    out = {}
    for rt, kinds in SOURCES[device].items():
        host = current[rt]["devices"]["host"]
        e = {"basis": "measured", "threads": 1, "kinds": {}}
        for stored, (name, kind) in kinds.items():
            if (RESULTS / name).exists():
                e["kinds"][stored] = kernel_kind(name, kind, host["kinds"].get(stored), step=rt == "llama.cpp")
        kvh = _kv_heads(device, rt)
        for stored, by_dim in (kvh or {}).get("scales", {}).items():
            for dim, g in by_dim.items():
                if dim in e["kinds"].get(stored, {}).get("by_head_dim", {}):
                    e["kinds"][stored]["by_head_dim"][dim].update(kv_heads_scale=g["decode"],
                                                                  kv_heads_source=kvh["source"])
        cost = rt if rt != "executorch-llama" else "executorch"
        # the per-key costs plan_vs_filled fitted on this CPU's model rows (graphs no kernel benchmark times)
        for kind, c in pvf.get("fitted_per_key_s", {}).get(rt, {}).items():
            e["kinds"][kind] = {**({"kernel": host["kinds"][kind]["kernel"]} if "kernel" in host["kinds"].get(kind, {})
                                   else {}),
                                "overhead_s": 0.0, "read_bytes_per_s": None,
                                "compute_s_per_head_dim_position": float(f"{c:.4g}"), "fitted_on_model_rows": True,
                                "source": "fitted on model rows, not a kernel: benchmarks/plan_vs_filled.py, this CPU's "
                                          "SmolLM2-135M filled decode rows of this graph and cache, the step less the "
                                          "weights term, per key x query head x head size (plan_vs_filled.json "
                                          f"devices.{device}.fitted_per_key_s)"}
        if rt == "executorch-llama":
            e["rates_from"] = "executorch"
        else:
            w = pvf.get("weights_rates_bytes_per_s", {}).get(cost)
            over = pvf.get("layer_overhead_s", {}).get(cost)
            mm = MATMUL_SOURCES.get(device, {}).get(rt)
            mm_ok = bool(mm and (RESULTS / mm).exists())
            if w or mm_ok:
                wi = {"read_bytes_per_s": float(f"{w:.5g}")} if w else {}
                if mm_ok:  # the weights kernel timed per matrix on this CPU; the other ops per layer fitted on its rows
                    d = _load(mm)
                    wi["by_matrix"] = {"kernel": "MatMulNBits",
                                       "rows": [[r["k"], r["n"], r["bytes"], float(f"{r['median_us'] * 1e-6:.4g}")]
                                                for r in d["rows"]],
                                       **({"layer_overhead_s": float(f"{over:.4g}")} if over is not None else {}),
                                       "source": f"rows [K, N, bytes, seconds]: benchmarks/attention_rates.py --matmul "
                                                 f"on this CPU (benchmarks/results/{mm}, "
                                                 + LOAD_NOTE.format(load=_load_range(d)) + "); layer_overhead_s: "
                                                 "fitted by benchmarks/plan_vs_filled.py on this CPU's SmolLM2-135M "
                                                 "rows with the matrices at these rows"}
                elif over is not None:
                    wi["layer_overhead_s"] = float(f"{over:.4g}")
                if rt == "llama.cpp":  # the catalog recipe's mix, where a file of that mix was measured on this CPU
                    hw = host.get("weights", {}).get("int4", {})
                    if hw.get("catalog_mix") in pvf.get("llamacpp_gguf_types", {}):
                        wi.update(catalog_recipe=hw["catalog_recipe"], catalog_mix=hw["catalog_mix"])
                wi["source"] = (f"fitted by benchmarks/plan_vs_filled.py on this CPU's SmolLM2-135M filled {rt} rows "
                                f"(benchmarks/results/plan_vs_filled.json devices.{device}: weights_rates_bytes_per_s"
                                + (", layer_overhead_s split by the EPYC .pte profile's weight-kernel share "
                                   "(pte_gemm_share), not measured on this CPU" if rt == "executorch" else "")
                                + "); Gemma-3-270M's and the 1B's rows on this CPU held out")
                e["weights"] = {"int4": wi}
                fm = MATMUL_FORMS_SOURCES.get(device, {}).get(rt)
                if fm and (RESULTS / fm).exists() and "by_matrix" in wi:
                    sys.path.insert(0, str(HERE))
                    import attention_rates as ar

                    forms = _load(fm)
                    e["weights"]["gguf"] = {"by_form": ar.forms_entry(
                        forms, wi["by_matrix"]["rows"],
                        ar.forms_source(fm, forms, wi["by_matrix"]["rows"], vm="this CPU"))}
            pre = {"attention_flop_per_s": {}, "attention_flop_per_s_by_head_dim": {}}
            p = pvf.get("prefill", {}).get(cost)
            srcs = []
            for name, kinds_map in PREFILL_SOURCES.get(device, {}).get(rt, []):
                if not (RESULTS / name).exists():
                    continue
                d = _load(name)
                srcs.append(f"benchmarks/results/{name} (load average {_load_range(d)})")
                for stored, kind in kinds_map.items():
                    if kind in d.get("prefill_fits", {}):
                        pre["attention_flop_per_s_by_head_dim"][stored] = {
                            dim: float(f"{f['attention_flop_per_s']:.4g}") for dim, f in d["prefill_fits"][kind].items()}
                        curve = prefill_curve(d["rows"], kind)
                        if curve and not stored.startswith("eager"):  # the eager graph's calls attend every slot
                            pre.setdefault("attention_flop_per_s_by_keys", {})[stored] = curve
            pre["source"] = ("attention_flop_per_s_by_head_dim: "
                             + ("the fills of benchmarks/attention_rates.py --runtime llamacpp on this CPU (each "
                                "context's prefill of the 1-layer model, attention FLOP over CPU seconds with a per-token "
                                "term for its small matmuls; prefill_fits) " if rt == "llama.cpp" else
                                "benchmarks/attention_rates.py --prefill on this CPU ")
                             + f"({'; '.join(srcs) or 'none'})")
            if pre.get("attention_flop_per_s_by_keys"):
                pre["source"] += ("; attention_flop_per_s_by_keys: the same runs' calls, each one's attention FLOP over "
                                  "its CPU seconds by kept keys, at which a prompt's calls are charged by their own "
                                  "keys (memory.prefill.prefill_keys_factor)")
            for stored, (name, kind) in HEAD_DIM_SCALE_SOURCES.get(device, {}).get(rt, {}).items():
                if (RESULTS / name).exists():
                    by = _load(name)["prefill_fits"][kind]
                    base = by[str(FIT_HEAD_DIM)]["attention_flop_per_s"]
                    pre.setdefault("attention_flop_per_s_head_dim_scale", {})[stored] = {
                        dim: round(f["attention_flop_per_s"] / base, 3) for dim, f in by.items()}
                    pre["source"] += (f"; attention_flop_per_s_head_dim_scale: {stored}'s rate by head size over its "
                                      f"rate at head size {FIT_HEAD_DIM} (benchmarks/results/{name}, load average "
                                      f"{_load_range(_load(name))}), times which the rate fitted on SmolLM2's rows "
                                      "is charged at another head size")
            for stored, (name, kind, base, base_kind) in SCALED_KIND_SOURCES.get(device, {}).get(rt, {}).items():
                if (RESULTS / name).exists():
                    fits = _load(name)["prefill_fits"]
                    ref = fits[base_kind][str(FIT_HEAD_DIM)]["attention_flop_per_s"]
                    pre.setdefault("attention_flop_per_s_head_dim_scale", {})[stored] = {
                        dim: round(f["attention_flop_per_s"] / ref, 3) for dim, f in fits[kind].items()}
                    pre.setdefault("attention_flop_per_s_scaled_from", {})[stored] = base
                    pre["source"] += (f"; {stored}: {base}'s fitted rate times {kind}'s rate by head size over "
                                      f"{base_kind}'s at head size {FIT_HEAD_DIM}, in one run (benchmarks/results/"
                                      f"{name}, load average {_load_range(_load(name))})")
            mm_src = MATMUL_PREFILL_SOURCES.get(device, {}).get(rt)
            if mm_src and (RESULTS / mm_src[0]).exists():
                pre["matmul_by_matrix"] = matmul_by_matrix(*mm_src)
                pre["source"] += "; matmul_by_matrix: " + pre["matmul_by_matrix"].pop("source")
            for stored, (name, kind) in PREFILL_KV_HEADS_SOURCES.get(device, {}).get(rt, {}).items():
                if (RESULTS / name).exists():
                    d = _load(name)
                    pre.setdefault("attention_flop_per_s_kv_heads_scale", {})[stored] = prefill_kv_heads(d["rows"], kind)
                    pre["source"] += (f"; attention_flop_per_s_kv_heads_scale {stored}: the base shape's prefill rate "
                                      "over each other shape's of its head size, by KV heads (benchmarks/results/"
                                      f"{name}, one run, load average {_load_range(d)})")
            if kvh:
                pre["attention_flop_per_s_kv_heads_scale"] = {k: {dim: g["prefill"] for dim, g in by.items()}
                                                              for k, by in kvh["scales"].items()}
                pre["source"] += ("; attention_flop_per_s_kv_heads_scale: the fills' rate at each KV-head count "
                                  "against the base shape's, a factor the rate is divided by (" + kvh["source"] + ")")
            if p:
                pre["matmul_flop_per_s"] = float(f"{p['matmul_flop_per_s']:.4g}")
                pre["attention_flop_per_s"] = {k: (float(f"{v:.4g}") if v else None)
                                               for k, v in p["attention_flop_per_s"].items()}
                for k, b in p.get("readback", {}).items():
                    pre.setdefault("readback", {})[k] = {
                        "kernel_kind": b["kernel_kind"], "chunk": b["chunk"], "s_per_value": float(f"{b['s_per_value']:.4g}"),
                        "source": "fitted by benchmarks/plan_vs_filled.py (READBACK) on this CPU's SmolLM2-135M "
                                  "prefills with the matmul rate"}
                pre["source"] += ("; matmul_flop_per_s and the kinds no kernel benchmark times: fitted by "
                                  "benchmarks/plan_vs_filled.py on this CPU's SmolLM2-135M filled prefills "
                                  f"(plan_vs_filled.json devices.{device}.prefill)")
            if srcs or p:
                e["prefill"] = pre
            if rt == "llama.cpp":
                e.update(llamacpp_gguf(device, pvf))
        from edgekv.devices import profile_cpu

        pages = host.get("cache_pages")
        if pages and pages.get("machine_cpu") == profile_cpu(device):  # measured on this profile's CPU: carried
            e["cache_pages"] = {**pages, "source": "the host entry's, measured on this CPU (machine_cpu): "
                                                   + pages["source"]}
        e["source"] = (f"measured on {device}'s CPU (device_profiles/{device}.toml cpu) by benchmarks/attention_rates.py "
                       "(1 thread, process CPU time, caches cycled so each call reads a cold cache) and "
                       "benchmarks/plan_vs_filled.py; each kind names its results JSON; written by "
                       "benchmarks/device_rates.py. The host was shared with other benchmarks while they ran (load "
                       "average 2-4 on 2 cores), so these rates are those of a busy host, like the rows they price")
        out[rt] = e
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="host-xeon", choices=sorted(SOURCES))
    ap.add_argument("--check", action="store_true", help="exit 1 where the stored entries differ from the sources")
    a = ap.parse_args(argv)
    cur = json.loads(RATES_FILE.read_text())
    new = build(a.device, cur)
    if a.check:
        bad = [rt for rt, e in new.items() if cur[rt]["devices"].get(a.device) != e]
        print("stored entries match their sources" if not bad else f"differ: {', '.join(bad)}")
        return 1 if bad else 0
    for rt, e in new.items():
        cur[rt]["devices"][a.device] = e
    tmp = RATES_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(cur, indent=2) + "\n")
    os.replace(tmp, RATES_FILE)
    for rt, e in new.items():
        print(f"{a.device} {rt}: kinds {', '.join(e['kinds'])}"
              + (f"; weights {e['weights']['int4']['read_bytes_per_s'] / 1e9:.2f} GB/s" if "read_bytes_per_s" in e.get("weights", {}).get("int4", {}) else "")
              + (f"; prefill matmul {e['prefill']['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s"
                 if "matmul_flop_per_s" in e.get("prefill", {}) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
