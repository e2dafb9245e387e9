"""The planner's decode and prefill at a filled context against this host's measured rows, on rows it was not fitted
to.

Every row of every benchmarks/results/filled_context_*.json (benchmarks/filled_context.py: a real prompt of ctx - n
tokens, then n decode steps, 1 thread) is predicted and compared with its tokens per CPU second of the row's own
process (decode_tok_per_cpu_s, prefill_tok_per_cpu_s: on a shared 2-core host the wall time also counts the time
the one thread waits for a core). SmolLM2-135M's rows are the fit set, Gemma-3-270M's (other heads, head size 256,
sliding windows on 15 of 18 layers, a 4x larger vocabulary) the held-out check.

Decode time per token = weights term + attention term, per runtime (a memory.RUNTIMES cost model):
  onnxruntime (edgekv's ONNX), executorch (edgekv's .pte), llama.cpp: the attention term at the kernel rate measured
    by benchmarks/attention_rates.py (one GroupQueryAttention / custom_sdpa call; llama.cpp: a decode step of a
    1-layer random model at the head shape, flash attention, per cache type f16 / q8_0 / q4_0; no model rows:
    edgekv/costs/attention_rates.json, each kind's fit at the model's own head size where one is stored); the
    weights term's one parameter, the rate the runtime's int4 weight kernels read the weights at (and, for llama.cpp,
    the step's fixed costs), is fitted here on SmolLM2's rows (least squares in relative error of the measured
    seconds per token less the attention term, over the weights bytes); ONNX Runtime's is its matrices at the
    MatMulNBits rows measured per matrix size (attention_rates.py --matmul) plus the step's other ops per layer,
    that one parameter fitted here instead. llama.cpp on a GGUF no 512-token run measured: each GGML type at the
    rates measured on random files of that type (attention_rates.py --gguf-types), as the plan charges it.
Prefill time = matmul FLOP / a matmul rate + attention FLOP / an attention rate per cache kind, per runtime: the
attention rate is the kernel's at the model's head size where benchmarks/attention_rates.py measures one (ONNX
Runtime: a GroupQueryAttention call of 128 queries, --prefill; the .pte: a custom_sdpa call of 32, --runtime executorch
--prefill; llama.cpp: the prefill that fills its cache), else it
is fitted here with the matmul rate on SmolLM2's rows (memory.prefill_parts: the FLOP of each part; Gemma's windows
cap its attention FLOP). A .pte cache read back to fp32 rows every prefill call (PTE_READBACK: kv-int4) is charged
custom_sdpa's fp32 rate plus the values it reads back (memory.prefill.readback_values), their cost per value fitted
here. A kernel's prompt is charged each call at its own keys' rate where the kernel run stored them
(memory.prefill.prefill_keys_factor); an ONNX prompt's matmul at the fitted rate times the model's matrix shapes'
MatMulNBits rate over SmolLM2's (memory.prefill.matmul_shape_scale); a .pte's sliding layers as the eager rings they
are (memory.prefill.ring_layers), at the eager window graph's fitted rate.

The fitted numbers are what edgekv/costs/attention_rates.json stores for the host (weights, prefill;
tests/test_attention_rates.py checks that they agree); `edgekv plan --device host --runtime R --weights int4` prints the plan's own number beside each row. Rows the planner has no rate for (a superseded export, a GGUF
not on this machine, a weight type no form was timed for) are listed with the reason they are not modelled.
`edgekv export --weights gguf` rows (the GGUF's blocks, each type in its MatMulNBits form) are planned as `edgekv plan
-m FILE.gguf --weights gguf` plans them, each matrix at its form's kernel rows (attention_rates.py --matmul-forms), and
ONNX Runtime GenAI's rows at the kernel rows of the ops its graph runs (GENAI) plus its cache's 4 KiB pages
(GENAI_PAGES, measured by benchmarks/genai_step.py); both held out: nothing is fitted on them. A .pte whose export calls edgekv's own int8 kernel (export --pte-kernel edgekv:
its manifest's custom_ops, recorded by filled_context) is priced as `edgekv plan --pte-kernel edgekv` prices it,
at that kernel's measured rows, and held out whatever its model: nothing is fitted on it.

    python benchmarks/plan_vs_filled.py [--ggufs] [--gguf-dir DIR] [--out benchmarks/results/plan_vs_filled.json]
    python benchmarks/plan_vs_filled.py --table host-xeon [--into benchmarks/README.md]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# SmolLM2-135M's rows are the fit set; every other model's rows are held out (Gemma-3-270M's; a 1B-class model's
# filled_context JSON, benchmarks/filled_context.py run on a GGUF or HF folder outside the catalog, joins them as it
# lands in results/: its settings.model, a catalog name or the path of its weights, is planned as `edgekv plan -m`
# plans it)
FIT_MODEL = "smollm2-135m"
# `edgekv export --weights gguf` rows (edgekv-ort:S/gguf): the GGUF's own blocks, each type in its MatMulNBits form
# (edgekv.export.gguf_codec), planned as `edgekv plan -m FILE.gguf --runtime onnxruntime --weights gguf` plans them:
# each matrix at its form's rows (benchmarks/attention_rates.py --matmul-forms, results/matmul_nbits_forms.json;
# edgekv/costs/attention_rates.json onnxruntime weights.gguf), the step's other ops per layer the int4 graph's fitted
# ones. Nothing is fitted on them: held out, whatever the model.
# ONNX Runtime GenAI's own builder graphs (genai:int4, benchmarks/speed_child.py genai_model: `builder -p int4 -e cpu`,
# onnxruntime-genai 0.18.0): GroupQueryAttention on a fp32 cache (io dtype fp32 on cpu) of max_length slots, and on
# Gemma 3 its sliding layers' window cache (local_window_size 512), as edgekv's fused fp32-cache graph; its weights
# MatMulNBits 4 bits, blocks of 32, symmetric (no zero points), accuracy_level 4 (the builder's cpu defaults:
# onnxruntime_genai/models/quantization/quant_config.py), the output layer too, and a tied table GatherBlockQuantized
# on the head's codes (shared_embeddings: the table's one row a step, not charged). So its step is charged as
# edgekv's kv:dtype=fp32 graph's attention, every matrix at the "4-bit/32" form's rows (the form Q4_0 is carried in),
# plus the int4 graph's other ops per layer, plus GENAI_PAGES; nothing is fitted on its rows (held out).
GENAI = ("kv:dtype=fp32", "4-bit/32")
# What GenAI's generator adds to that graph's step (benchmarks/genai_step.py): not its loop (0.34 ms outside the
# session at a filled 8k, the logits copy 0.2 ms) but its cache's pages: GenAI allocates the cache through ONNX
# Runtime's allocator (glibc malloc, 4 KiB pages) where the kernel rates were timed on numpy arrays, in 2 MiB pages
# from 4 MiB up; GroupQueryAttention then takes longer per page of K and V it reads (memory.speed.small_pages_seconds
# at edgekv/costs/attention_rates.json onnxruntime cache_pages, measured on the Intel Xeon VM)
GENAI_PAGES = "cache_pages"
GENAI_PREFILL = ("GenAI's prompt goes in calls of 512 tokens (filled_context GENAI_CHUNK) through its own loop; no "
                 "kernel benchmark times GroupQueryAttention over 512 queries (attention_rates.py --prefill: 128): "
                 "prefill not modelled")
TOLERANCE = 0.25
# row family in the filled-context benchmark -> the planner's runtime (plan --runtime) and cost model
RUNTIMES = {"edgekv-ort": ("onnxruntime", "onnxruntime"), "edgekv-pte": ("edgekv-pte", "executorch"),
            "llamacpp": ("llama.cpp", "llama.cpp"), "et-llama": ("executorch", "executorch-llama")}
# ExecuTorch's own Llama export's rows (benchmarks/et_llama.py: export_llama 8da4w, its fp32 cache or
# --quantize_kv_cache): cache -> the edgekv strategy the plan prices it as; 8da4w -> the plan's int4 (runtimes.json
# executorch weights: its output layer and embedding int8). Their attention is charged at the kernel rows
# benchmarks/attention_rates.py times as its SDPACustom / QuantizedSDPA call the ops, their weights at the .pte's
# weights rate (the same XNNPACK kernels): nothing is fitted on them, so they are held out
ETLLAMA_CACHE = {"kv-fp32": "kv:dtype=fp32", "kv-fp16": "kv", "kv-int8": "kv-int8"}
# each run is set against the host profile whose `cpu` (device_profiles/*.toml: /proc/cpuinfo's model name of the VM its
# rates were measured on) is its JSON's machine.cpu: host (the 2-vCPU AMD EPYC VM) or host-xeon (the 2-vCPU Intel Xeon
# VM); each profile's weights and prefill rates are fitted on its own CPU's SmolLM2-135M rows. A run that records no
# CPU is the EPYC's (DEFAULT_DEVICE: every run before machine.cpu was recorded ran there); a CPU no profile names is
# listed, not priced
DEFAULT_DEVICE = "host"


@functools.lru_cache(maxsize=1)
def host_profiles() -> dict[str, str]:
    """{cpu: profile id} of the built-in host profiles that name their CPU (devices.DeviceProfile.cpu)."""
    from edgekv.devices import all_devices

    return {d.cpu: d.id for d in all_devices() if d.device_class == "host" and d.cpu}


def row_device(cpu: str | None) -> str | None:
    """The host profile a run measured on this CPU (its JSON's machine.cpu) is set against; None: no profile's."""
    if not cpu:
        return DEFAULT_DEVICE
    return host_profiles().get(" ".join(cpu.split()))
# llama.cpp's weight-type runs per host profile (benchmarks/attention_rates.py --runtime llamacpp on that CPU):
# --gguf-prefill (the real GGUFs' 512-token prefills: gguf_matmul_rates) and --gguf-types (random files per GGML type:
# gguf_type_rates); each profile's llama.cpp rows are priced at its own CPU's
LLAMACPP_GGUF_RUNS = {"host": ("llamacpp_gguf_prefill.json", "llamacpp_gguf_types.json"),
                      "host-xeon": ("llamacpp_gguf_prefill_xeon.json", "llamacpp_gguf_types_xeon.json")}
# a cost model whose weights and prefill rates are another's (edgekv/costs/attention_rates.json rates_from)
RATES_FROM = {"executorch-llama": "executorch"}
# llama.cpp's K and V type -> the edgekv strategy whose cache it is (kv-int4's group of 32: q4_0's block)
LLAMACPP_CACHE = {"f16": "kv", "q8_0": "kv-int8", "q4_0": "kv-int4"}
NOT_MODELLED: dict[str, str] = {}
# the cache kinds benchmarks/attention_rates.py times per runtime (the rest are fitted here on model rows)
KERNEL_KINDS = {"onnxruntime": ("fp32", "fp16", "int8c"),
                "executorch": ("fp32", "fp16", "int8", "int8c", "edgekv int8", "edgekv int8c", "edgekv fp16",
                               "edgekv int4"),
                "llama.cpp": ("f16", "q8_0", "q4_0"), "executorch-llama": ("fp32", "fp16", "int8")}
# the eager graphs a benchmark times too (benchmarks/attention_rates.py --window: the window strategy's layer; the
# explicit kv-int8 graph per kept key, benchmarks/eager_per_key.py on profile_ort.py's rounds of the model): charged
# at their stored rows, not fitted on model rows
KERNEL_EAGER = {"onnxruntime": ("eager fp16", "eager int8"), "executorch": ("eager fp16",)}
# of those, the kinds measured on the model itself (benchmarks/eager_per_key.py: the kv-int8 export's step less the
# fp32-cache export's, its GroupQueryAttention added back): their rows do not fit the weights term again
KERNEL_ON_MODEL = ("eager int8",)
# filled-context runs saved under another name (their run was named so that this check would not read them): read
# too, so every row the filled-context benchmark ran at a filled 32k on Gemma-3-270M is set against the plan
OTHER_RUNS = ("pte32k_filled_gemma3_32768_fp32.json", "pte32k_filled_gemma3_32768_kv_fp16.json")
# runs listed in the table but not fitted to, and why
NOT_FITTED = {
    "filled_context_8192_int8c.json": "its attention-heavy rows (fp32 and fp16 cache, llama.cpp f16) ran 1.6-2.5x "
    "slower than every other measurement of the same rows (filled_context_8192, _etllama_kvq, _etllama_side, "
    "_etpeer_edgekv, profile_ort_kv_fp32_8192, and filled_context_8192_rerun41, which reran its five rows in one run) "
    "while its kv-int8c row agrees with them: a run on a slower memory path, not the host's typical rate",
    "filled_context_2048_pte_int8_inplace.json": "one row (the .pte's kv-int8 read in place by custom_quantized_sdpa) "
    "run alone at a load average of 6-12, without the fp32 row beside it: a check of the plan's int8 kernel rate, "
    "not a weights-rate measurement",
    "filled_context_8192_epyc_recheck.json": "SmolLM2-135M's edgekv ONNX rows, llama.cpp f16 and GenAI at a filled 8k "
    "rerun on the AMD EPYC VM (issue 41's done-when, `edgekv plan --device host -m smollm2-135m -c 8k`) after the "
    "host's rates were fitted and stored: a check of the stored rates, listed and predicted, not fitted",
    "filled_context_8192_epyc_recheck_pte.json": "SmolLM2-135M's .pte rows (fp32, fp16, kv-int4 caches, window) and "
    "llama.cpp q8_0 at a filled 8k, rerun on the AMD EPYC VM after the host's rates were stored: a check, not fitted",
    "filled_context_1024_epyc_recheck.json": "SmolLM2-135M's fp32-cache ONNX rows (int4 and the GGUF's own blocks) at a "
    "filled 1k, rerun on the AMD EPYC VM beside Gemma's after the host's rates were stored: a check, not fitted",
    "filled_context_2048_pte_window.json": "the window .pte and ONNX window rows at a filled 2k (the window covers the "
    "whole context), run at a load average of 3.8-4.5 after the host's rates were fitted and stored "
    "(edgekv/costs/attention_rates.json): listed and predicted at the stored rates, not fitted, so one run's load does "
    "not move the stored weights rates",
}
# Gemma-3-270M's edgekv ONNX rows measured before edgekv's export put its sliding layers on GroupQueryAttention's
# window-sized cache (commit 48159e8, 2026-12-05 00:51 UTC; the window_gqa runs measured that export before it was
# committed): another graph than the one the planner plans (memory.fused_gqa takes native windows), not compared
SUPERSEDED_BEFORE = ("gemma-3-270m", "edgekv-ort:", "2026-12-05T00:23")
# Gemma-3-270M's .pte rows of a full cache measured before its sliding rings were written in place
# (swaps.RingSdpaAttention: until then every call copied the whole state in and out, a graph the planner no longer
# plans), or before its int4 .pte kept only six decoder layers int8 (edgekv.arch.variants.pte_int8_kept; every layer
# int8 until the merge of commit 48d2b27, PTE_PER_HEAD; the branch's own runs, PTE_ROWS_FILES, measured it first):
# weights the planner no longer plans, listed, not compared
SUPERSEDED_PTE_BEFORE = ("gemma-3-270m", "edgekv-pte:kv", "2026-12-05T22:53")
# the .pte's int8 caches before custom_quantized_sdpa read their codes in place: a row measured then ran another
# graph, modelled with the rate of the graph it ran (attention_rates.json keeps both): kv-int8 dequantized its rows
# for custom_sdpa ("readback int8", a kernel rate), kv-int8c attended through the eager graph ("eager int8c", fitted on
# such rows below)
PTE_INT8_BEFORE = "2026-12-05T14:50"
PTE_INT8_OLD_KIND = {"edgekv-pte:kv-int8/": "readback int8", "edgekv-pte:kv-int8c/": "eager int8c"}
# the .pte's fp32 cache before a one-token call handed custom_sdpa a KV head's G query heads as G rows (commit 48d2b27,
# merged at 2026-12-05 22:53 UTC; the branch's own runs, PTE_ROWS_FILES, measured it first): a row measured before ran
# one attention per query head, modelled at that graph's kernel rate ("per-head fp32", attention_rates.json keeps both)
# the .pte's eager rings on a model's own sliding layers (swaps.RingSdpaAttention, commit 6ce6995): a row measured
# before ran those layers on another graph, its decode not charged the rings' (speed.ring_decode_layers)
PTE_RINGS_SINCE = "2026-12-05T17:47"
PTE_PER_HEAD = ("edgekv-pte:kv:dtype=fp32/", "2026-12-05T22:53", "per-head fp32")
PTE_ROWS_FILES = {"filled_context_gemma3_16384_pte_fast.json", "filled_context_gemma3_16384_pte_fast_r2.json"}
# edgekv's own operators a .pte may call (its manifest's custom_ops, recorded by filled_context as export.custom_ops)
# -> the --pte-kernel that builds it: the plan prices edgekv::int8_sdpa and edgekv::fp16_sdpa at their kernel rows
# (benchmarks/attention_rates.py --runtime executorch --int8-kernel edgekv; edgekv/costs/attention_rates.json kinds
# "edgekv int8" / "edgekv int8c" / "edgekv fp16"). Such rows are held out: nothing is fitted on them (their attention and prefill
# attention are the kernel's measured rates, their weights term and prefill matmul rate the other .pte rows')
PTE_INT8_KERNEL_OPS = {"edgekv::int8_sdpa": "edgekv", "edgekv::fp16_sdpa": "edgekv", "edgekv::packed_sdpa": "edgekv"}
# runs whose .pte called edgekv::int8_sdpa before its register tiles (commit 34f6f6f: 1.6-2.1x as long per call,
# results/attention_rates_executorch_int8_edgekv_blocks.json / _r2.json against _tiles.json): another kernel than the
# one whose rates are stored, listed, not compared. Named by file, not date: filled_context_gemma3_32768_pte_cells ran
# after that commit on a tree without it.
PTE_KERNEL_BEFORE_TILES = {"filled_context_8192_pte_int8c_edgekv.json", "filled_context_8192_pte_int8_edgekv.json",
                           "filled_context_8192_pte_edgekv_kernel_fp32w.json",
                           "filled_context_gemma3_16384_pte_int8c_edgekv.json",
                           "filled_context_gemma3_32768_pte_cells.json"}
# Gemma-3-270M's kernel runs before its sliding rings' one-token call went through edgekv::int8_sdpa too
# (swaps.RingSdpaAttention._kernel_forward; before, each ring's int8 codes were cast to fp32 by a portable copy and
# attended by eager arithmetic every step: results/profile_pte_gemma3_16384_int8c_edgekv_tiles.json): another graph
# than the one the plan prices (every layer on the kernel), listed, not compared
PTE_RINGS_EAGER = {"filled_context_gemma3_16384_pte_int8c_edgekv_tiles.json",
                   "filled_context_gemma3_16384_pte_int8c_edgekv_tiles_r2.json"}
# the .pte's step outside attention split into its weight kernels and the other ops (norms, elementwise, the
# delegate and operator dispatch, the cache writes, the binding): benchmarks/profile_pte.py on SmolLM2-135M's .pte of
# the graph the plan charges; the fitted weights term is split by these shares into a weights rate and a per-layer
# cost (SmolLM2's rows alone cannot separate the two: every one reads the same bytes through the same 30 layers)
PTE_PROFILE = "profile_pte_smollm2_rows_graph_2k.json"
# the .pte's caches read back to fp32 rows every prefill call (SdpaAttention's "fp32 rows": a packed int4 cache
# through dequantize_planar, rows 0..pos+C-1, then custom_sdpa per head): their prompt is charged custom_sdpa's fp32
# kernel rate at the model's head size plus the values read back (memory.prefill.readback_values), whose cost per value
# is fitted here on SmolLM2's prompts (a rate per attention FLOP fitted on them charged the read-back as a share of
# the FLOP, which at Gemma 3's 4 query heads per KV head and head size 256 is another share: +30 % at 32k);
# PTE_PREFILL_CHUNK: the tokens of one call of the .pte's prefill (edgekv export --prefill-chunk's default, the
# calls of every filled-context .pte row)
PTE_READBACK = {"int4": "fp32"}
PTE_PREFILL_CHUNK = 32
# ONNX Runtime's explicit kv-int8 / kv-int4 graphs (the eager graph over a quantized cache): each prefill call reads
# every slot back to fp32 and attends over all of them as the window strategy's eager graph does over its fp16 slots
# (memory.prefill.eager_attention_flop, eager_readback_values); their prompt is charged that graph's rate at the
# model's head size (attention_rates.py --window --prefill, "eager fp16"; fitted on the window rows where no kernel
# run measured it) plus the values read back at a cost per value fitted on SmolLM2's prompts (a rate per FLOP
# fitted on them alone charged Gemma 3's head size 256 at head size 64's rate: benchmarks/README.md). The prefill
# call size is the ONNX export's (edgekv.plan.DEFAULT_CHUNK)
ORT_READBACK = {"eager int8": "eager fp16", "eager int4": "eager fp16"}
READBACK = {"executorch": PTE_READBACK, "onnxruntime": ORT_READBACK}
PTE_STEP_OTHER = ("xnnpack other", "xnnpack dispatch", "cache write", "portable other", "operator dispatch",
                  "method rest", "outside execute")
# another measurement of the same export at the same fill, where one exists: benchmarks/profile_ort.py's step time
# (1 thread), printed beside a row the filled-context run may have measured on a busier or slower VM
PROFILED = {("smollm2-135m", "edgekv-ort:kv:dtype=fp32/int4", 8192): "profile_ort_kv_fp32_8192.json",
            ("smollm2-135m", "edgekv-ort:kv-int8c/int4", 8192): "profile_ort_kv_int8c_8192_epyc.json",
            ("gemma-3-270m", "edgekv-ort:kv-int8c/int4", 16384): "profile_ort_gemma3_kv_int8c_16384_window_gqa.json"}


# the models outside the catalog whose filled-context runs name them by a scratch path (settings.model): the file's
# name -> the name plan_vs_filled.json gives it and what rebuilds it byte for byte (make_random_model.py seeds each
# tensor from --seed and its name; the one seed checked against the file's own tensors), so a reader can reproduce
# the row; the file is looked for under --gguf-dir, else at the recorded path, and where it is in neither the rows
# are listed, not planned
REBUILT = {
    "llama-3.2-1b-q4_0.gguf": {
        "name": "llama-3.2-1b random (seed 0), Q4_0",
        "rebuild": "python scripts/make_random_model.py llama-3.2-1b --out DIR --seed 0 (writes DIR/llama-3.2-1b-f16"
                   ".gguf); then llama-cpp-python 0.3.36: llama_cpp.llama_model_quantize(b'DIR/llama-3.2-1b-f16.gguf',"
                   " b'llama-3.2-1b-q4_0.gguf', params) with llama_model_quantize_default_params(), ftype "
                   "LLAMA_FTYPE_MOSTLY_Q4_0, nthread 1 (llama.cpp's Q4_0 recipe: the tied token table Q6_K)",
        "sha256": "8bd565322729a60f35d6457fbbab23ed0e58ec5647a49687e1ac863b06e99038",
    },
}


def local_model(recorded: str | None, gguf_dir: Path | None = None) -> str | None:
    """The file a run recorded as settings.model / model_path, where this machine has it: under gguf_dir by its
    name if REBUILT names it and it is there, else the recorded path (which may be missing: the caller lists such
    rows, not planned). A catalog name comes back as it is."""
    if recorded and gguf_dir and Path(recorded).name in REBUILT and (Path(gguf_dir) / Path(recorded).name).is_file():
        return str(Path(gguf_dir) / Path(recorded).name)
    return recorded


def model_label(recorded: str) -> tuple[str, dict]:
    """settings.model -> (the name plan_vs_filled.json gives the rows, {"rebuild", "sha256"} or {}): a REBUILT
    file by its name and recipe, never its scratch path; anything else as recorded."""
    r = REBUILT.get(Path(recorded).name)
    return (r["name"], {"rebuild": r["rebuild"], "sha256": r["sha256"]}) if r else (recorded, {})


def measured_rows(extra=(), gguf_dir: Path | None = None) -> list[dict]:
    """Every row of results/filled_context_*.json, and of the extra files named (--also); a REBUILT model's rows
    read its file from gguf_dir where it is there (local_model)."""
    out = []
    for f in sorted((HERE / "results").glob("filled_context_*.json")) + [HERE / "results" / x for x in OTHER_RUNS] \
            + [Path(x) for x in extra]:
        d = json.loads(f.read_text())
        if int(d["settings"].get("threads") or 1) != 1:
            # every stored rate (the kernels', the fitted weights and prefill rates) is one thread's: a run at more
            # threads (results/filled_context_8192_llama32_1b_target3_xeon_2threads.json) is read beside its
            # 1-thread run in benchmarks/README.md, not set against the plan
            continue
        model = local_model(d["settings"]["model"], gguf_dir)
        path = local_model(d["settings"].get("model_path"), gguf_dir)
        for r in d["rows"]:
            if r.get("decode_tok_s"):
                out.append({"model": model, "file": f.name, "vm": d["machine"].get("platform", ""),
                            "cpu": d["machine"].get("cpu"),
                             "started_utc": d["started_utc"],
                             "gguf": Path(path or "").name,
                             "gguf_path": path,
                            "bandwidth_gb_s": round(max(float(b["best_bytes_s"]) for b in d.get("bandwidth", {})
                                                        .values()) / 1e9, 1) if d.get("bandwidth") else None, **r})
    return out


def parse(name: str, gguf: str | None = None) -> tuple[str, str, str] | str:
    """A row name -> (plan runtime, strategy spec, weights), or the reason it is not modelled. gguf: the row's GGUF
    (settings.model_path), whose weight types say whether its carried blocks are int4's (GGUF_AS_INT4)."""
    family, _, rest = name.partition(":")
    if family in NOT_MODELLED:
        return NOT_MODELLED[family]
    if family == "genai":
        if rest != "int4":
            return f"ONNX Runtime GenAI {rest}: no rate stored for its weights"
        return "onnxruntime", GENAI[0], "genai-int4"
    if family == "llamacpp":
        return "llama.cpp", LLAMACPP_CACHE[rest], "int4"
    if family == "et-llama":
        cache, _, weights = rest.partition("/")
        if weights != "8da4w" or cache not in ETLLAMA_CACHE:
            return f"ExecuTorch's Llama export with {rest}: no rate stored"
        return RUNTIMES[family][0], ETLLAMA_CACHE[cache], "int4"
    spec, _, weights = rest.rpartition("/")
    if weights == "gguf" and family == "edgekv-ort":
        if not (gguf and Path(gguf).is_file()):
            return "its GGUF is not on this machine (settings.model_path; --gguf-dir for a REBUILT one)"
        from edgekv import memory as M

        ga = _read_gguf(gguf)
        types = {w.name: w.gguf_type for w in ga.weights}
        fp32 = sorted({types[m[0]] for m in M.carried_matrices(ga) if m[1] is None})
        if fp32:
            return (f"gguf weights of types {', '.join(fp32)}, not carried (the graph's fp32 MatMul): no rate stored "
                    "for them")
        return RUNTIMES[family][0], spec, "gguf"
    if weights != "int4":
        return f"{weights} weights carried from the GGUF: no weights rate stored"
    return RUNTIMES[family][0], spec, "int4"


def terms(model: str, runtime: str, spec: str, ctx: int, prompt: int, kind_then: str | None = None,
          int8_kernel: str = "executorch", weights: str = "int4", gguf: str | None = None,
          device: str = DEFAULT_DEVICE, rings_then: bool = True) -> dict:
    """The planner's pieces for this row: weights bytes per token, the attention seconds at the stored kernel rate
    (None: no rate for this row), the prefill FLOP by part and the prefill kind, and plan's own decode / prefill.
    kind_then: the stored kind of the graph an older row ran (PTE_INT8_OLD_KIND), in place of the planner's;
    int8_kernel: what read the .pte's int8 codes (its export's custom_ops: PTE_INT8_KERNEL_OPS), as
    `edgekv plan --pte-kernel` prices it. weights: "int4", "gguf" (the row's GGUF, `gguf`, read as `edgekv plan
    -m FILE.gguf --weights gguf` reads it) or "genai-int4" (GENAI: the plan's int4 row, its matrices at GenAI's form).
    device: the host profile whose rates price it (row_device: the one measured on the row's CPU). rings_then: the
    row ran the .pte's eager rings (PTE_RINGS_SINCE)."""
    from edgekv import memory as M
    from edgekv.arch import Attention
    from edgekv.devices import load_device
    from edgekv.plan import DEFAULT_CHUNK, plan_one
    from edgekv.strategies import parse_strategy

    arch = _read_gguf(gguf) if weights == "gguf" else model_arch(model)
    dev, strategy = load_device(device), parse_strategy(spec)
    row = plan_one(arch, strategy, dev, ctx, "gguf" if weights == "gguf" else "int4", runtime=runtime,
                   int8_kernel=int8_kernel)
    cost = next(c for rt, c in RUNTIMES.values() if rt == runtime)
    layout = row.deployment.layout
    rates = M.attention_rates(cost, device, dev.device_class)
    kind = M.attention_kind(arch, layout, strategy, cost, rates, int8_kernel)
    if kind_then:
        kind = kind_then if kind_then in rates["kinds"] and not kind_then.startswith("eager") else None
    fused = cost in ("llama.cpp", "executorch-llama") or M.fused_gqa(arch, layout, strategy, cost)
    # the prompt as the row's graph computes it (prefill.prefill_graph: on the eager graph every slot of each call)
    pre_kind, pre_parts = M.prefill.prefill_graph(arch, strategy, layout, cost, prompt, min(DEFAULT_CHUNK, prompt),
                                                int8_kernel)
    out = {"cost": cost, "weights_bytes": row.deployment.weights["read_per_token"], "plan_tok_s": row.decode.value,
           "plan_prefill_s": row.prefill.value, "kind": kind, "cache": M.cache_kind(strategy, layout, cost, int8_kernel),
           "prefill_kind": pre_kind, "prefill_parts": pre_parts, "fused": fused,
           "n_layers": arch.n_layers,
           # a kind device_rates.py stored from this script's own fit (fitted_per_key_s), not from a measurement: fitted
           # again here, never charged as a kernel's rows (KERNEL_EAGER), or each run would undo the last one's
           "kind_fitted": bool(kind and rates["kinds"].get(kind, {}).get("fitted_on_model_rows"))}
    if kind_then in PTE_INT8_OLD_KIND.values():
        # its prompt ran that older graph too (custom_sdpa over fp32 rows read back, or the eager graph), not
        # custom_quantized_sdpa's scalar int8 path the planner's kind now charges: no prefill rate for it
        out["prefill_kind"] = None
    by = ((rates or {}).get("weights") or {}).get("int4", {}).get("by_matrix")
    by_form = ((rates or {}).get("weights") or {}).get("gguf", {}).get("by_form")
    if weights in ("gguf", "genai-int4") and not by_form:
        out["why_not"] = (f"no MatMulNBits forms measured on {device}'s CPU (benchmarks/attention_rates.py "
                          "--matmul-forms; benchmarks/device_rates.py MATMUL_FORMS_SOURCES)")
    elif weights == "gguf":  # each GGUF type's MatMulNBits form at its rows (attention_rates.py --matmul-forms)
        got = M.speed.weights_seconds_by_form(M.carried_matrices(arch), by_form, arch.n_layers, 0.0)
        out.update(weights_kernel_s=got[1], weights_formula=got[2])
    elif weights == "genai-int4":  # GenAI's int4: every matrix (the head too) 4 bits, blocks of 32, fp32 scales
        mats = genai_matrices(arch)
        got = M.speed.weights_seconds_by_form(mats, by_form, arch.n_layers, 0.0)
        out.update(weights_kernel_s=got[1], weights_formula=got[2], weights_bytes=sum(m[2] for m in mats),
                   plan_tok_s=None, plan_prefill_s=None)
        if rates.get(GENAI_PAGES):  # its cache in 4 KiB pages: the pages of K and V a step reads (GENAI_PAGES)
            out["pages_s"], out["pages_formula"] = M.speed.small_pages_seconds(layout, rates[GENAI_PAGES])
    elif by:  # the weights kernel timed per matrix (attention_rates.py --matmul): the matrices' seconds, as plan sums them
        from edgekv.plan import runtime_cost

        out["weights_kernel_s"] = M.speed.weights_seconds_by_matrix(arch, "int4", by, runtime_cost(runtime, arch,
                                                                                                   "int4")[1])[1]
        out["n_layers"] = arch.n_layers
    # the .pte's eager rings at their own decode kind, as plan prices them (not for a run before them): their
    # seconds apart (ring_s), and out of the per-key work a kind fitted on model rows charges (key_work)
    ring_kinds = M.speed.ring_decode_layers(arch, layout, strategy, cost, rates and rates["kinds"], int8_kernel) \
        if rings_then else {}
    out["ring_s"] = 0.0
    if ring_kinds:
        import dataclasses

        only = dataclasses.replace(layout, tensors=[t for t in layout.tensors if t.layer in ring_kinds])
        out["ring_s"] = M.attention_seconds(arch, only, next(iter(ring_kinds.values())), rates["kinds"],
                                            layer_kinds=ring_kinds)[0]
    if kind:
        out["attention_s"], out["attention_formula"] = M.attention_seconds(
            arch, layout, kind, rates["kinds"], rates["kinds"][kind].get("kernel", rates["kernel"]), ring_kinds)
        if "pages_s" in out:
            out["attention_s"] += out["pages_s"]
            out["attention_formula"] += f" + {out['pages_formula']}"
    # the prefill attention rate benchmarks/attention_rates.py measured for this kind at this head size (None: the
    # kind's rate is fitted below on the prefills themselves)
    pre = (rates or {}).get("prefill") or {}
    by = pre.get("attention_flop_per_s_by_head_dim", {})
    # the kernel's rates alone (with their factor by KV heads, llama.cpp's), not the rates fitted on model rows
    kernel = {"attention_flop_per_s_by_head_dim": by, "attention_flop_per_s": {},
              "attention_flop_per_s_kv_heads_scale": pre.get("attention_flop_per_s_kv_heads_scale", {})}
    # the kind whose rate prices the attention FLOP: the row's own, or for a cache read back every call (READBACK)
    # the kind its graph attends at once the values are fp32, its read-back charged per value beside it
    base = out["prefill_rate_kind"] = READBACK.get(cost, {}).get(out["prefill_kind"], out["prefill_kind"])
    out["prefill_kernel_rate"] = M.prefill._prefill_rate(kernel, base, arch)[0] if base in by else None
    ring_list = M.prefill.ring_layers(arch, layout, strategy, cost)
    rings = tuple(m for m, _ in ring_list)
    if out["prefill_kernel_rate"] and not base.startswith("eager"):  # each call at its own keys' rate, as plan does
        out["prefill_kernel_rate"] *= M.prefill.prefill_keys_factor(pre, base, arch, strategy, prompt,
                                                                  min(DEFAULT_CHUNK, prompt), rings)[0]
    # the .pte's eager rings (prefill.ring_layers): at the eager layer's rate fitted on SmolLM2's .pte window prompts,
    # times the kernel run's ratio at the model's head size
    rk = out["prefill_ring_kind"] = M.prefill.ring_kind(pre, layout, ring_list)
    out["prefill_ring_scale"] = M.prefill.head_dim_scale(pre, rk, arch)[0]
    out["prefill_ring_fitted"] = M.prefill.fitted_kind(pre, rk)
    # a fitted kind's rate at this model's head size: the fit rows' rate x the kernel's ratio by head size
    out["prefill_rate_scale"] = M.prefill.head_dim_scale(pre, base, arch)[0]
    # the fitted matmul rate at this model's matrix shapes (the weights kernel timed per shape at a prefill call)
    out["prefill_matmul_scale"] = M.prefill.matmul_shape_scale(pre, arch)[0]
    if base != out["prefill_kind"]:
        chunk = out["prefill_readback_chunk"] = PTE_PREFILL_CHUNK if cost == "executorch" else DEFAULT_CHUNK
        out["prefill_readback"] = (M.prefill.readback_values(arch, strategy, prompt, chunk) if cost == "executorch" else
                                   M.prefill.eager_readback_values(arch, layout, prompt, min(chunk, prompt)))
    # the per-key work of each layer (sum over layers of kept keys x query heads x head size): llama.cpp's fit
    kept = {t.layer: t.shape[2] for t in layout.tensors if t.role == "key"}
    out["key_work"] = float(sum(kept[i] * m.n_heads * m.head_dim for i, b in enumerate(arch.blocks)
                                for m in b.mixers if isinstance(m, Attention) and i in kept and i not in ring_kinds))
    return out


def genai_matrices(arch) -> list[tuple]:
    """The matrices a decode step of GenAI's int4 graph multiplies (GENAI): every linear row and the output layer
    (the tied table's shape where tied), as MatMulNBits 4 bits, blocks of 32, one fp32 scale a block, no zero points
    (its builder's symmetric default): (name, form, bytes, read fraction, (K, N)), as memory.carried_matrices lists
    them."""
    import math

    tied = not any(w.cls == "lm_head" for w in arch.weights)
    return [(w.name, GENAI[1], w.numel / 2 + 4 * w.numel / 32, w.read_fraction, (math.prod(w.shape[1:]), w.shape[0]))
            for w in arch.weights if w.cls in ("linear", "lm_head") or (w.cls == "embedding" and tied)
            if len(w.shape) == 2 and math.prod(w.shape[1:]) % 32 == 0]


def fit_prefill(rows: list[dict]) -> dict:
    """Least squares in relative error of t = (matmul + logits FLOP) / (matmul rate x the row's
    prefill_matmul_scale, its matrix shapes against the fit model's) + attention FLOP / rate[kind] over one runtime's
    fit rows, a kind's rate fixed at the kernel's (prefill_kernel_rate: benchmarks/
    attention_rates.py at the model's head size) where one is measured, else fitted here: {"matmul_flop_per_s",
    "attention_flop_per_s": {fitted kind: rate}}."""
    from edgekv.memory.prefill import RING_KIND

    kinds = sorted({r["prefill_rate_kind"] for r in rows if not r["prefill_kernel_rate"]})
    # a cache read back every call (READBACK): its attention at the rate of the kind it attends as (the kernel's, or
    # fitted with that kind's rows), its values read back fitted
    rbk = sorted({r["prefill_kind"] for r in rows if r.get("prefill_readback")})
    x = np.array([[(r["prefill_parts"]["matmul"] + r["prefill_parts"]["logits"]) / r.get("prefill_matmul_scale", 1.0)]
                  + [r["prefill_parts"]["attention"] / r["prefill_rate_scale"] * (r["prefill_rate_kind"] == k)
                     + r["prefill_parts"].get("ring", 0.0) / r.get("prefill_ring_scale", 1.0)
                     * (k == r.get("prefill_ring_fitted", RING_KIND))
                     for k in kinds]
                  + [r.get("prefill_readback", 0.0) * (r["prefill_kind"] == k) for k in rbk] for r in rows])
    y = np.array([r["prefill_s"] for r in rows])
    fixed = np.array([r["prefill_parts"]["attention"] / r["prefill_kernel_rate"] if r["prefill_kernel_rate"] else 0.0
                      for r in rows])
    coef, *_ = np.linalg.lstsq(x / y[:, None], (y - fixed) / y, rcond=None)
    out = {"matmul_flop_per_s": 1 / coef[0],
           "attention_flop_per_s": {k: (1 / c if c > 0 else None) for k, c in zip(kinds, coef[1:])}}
    if rbk:  # per kind: the kind its attention is priced at, the prefill call size its values are counted in
        first = {k: next(r for r in rows if r["prefill_kind"] == k and r.get("prefill_readback")) for k in rbk}
        out["readback"] = {k: {"kernel_kind": first[k]["prefill_rate_kind"], "chunk": first[k]["prefill_readback_chunk"],
                               "s_per_value": float(c)} for k, c in zip(rbk, coef[1 + len(kinds):])}
    return out


@functools.lru_cache(maxsize=None)
def model_arch(model: str):
    """A filled-context JSON's settings.model as `edgekv plan -m` reads it: a catalog name, a .gguf file or an HF
    folder (edgekv.arch.load_arch), once per process."""
    from edgekv.arch import load_arch

    return load_arch(model)


@functools.lru_cache(maxsize=None)
def _read_gguf(path: str):
    """edgekv.arch.read_gguf, once per file (reading a real GGUF's tensor table takes seconds)."""
    from edgekv.arch import read_gguf

    return read_gguf(path)


def gguf_matmul_rates(read_files: bool = False, device: str = DEFAULT_DEVICE) -> dict:
    """llama.cpp's matmul rate per GGUF file: results/llamacpp_gguf_prefill.json's 512-token prefill (benchmarks/
    attention_rates.py --runtime llamacpp --gguf-prefill) less its attention at the kernel's f16 prefill rate, over
    the matmul and logits FLOP of 512 tokens (memory.prefill_parts, one chunk: llama.cpp computes the last token's
    logits); and the decode step's time outside attention (step_rest_s: its step after that prefill less the
    attention at the kernel's f16 decode rate), which replaces bytes / fitted rate for that file's rows. The weight types differ per file (SmolLM2's Q4_1, Gemma 3's Q4_K_M: Q5_0 / Q4_K / Q6_K / Q8_0 rows), and
    so does the rate their matmul kernels run at; the plan's int4 weights do not say which. device: the host profile
    whose CPU ran them (LLAMACPP_GGUF_RUNS), its kernel rates taking the attention out."""
    from edgekv import memory as M
    from edgekv.strategies import parse_strategy

    f = HERE / "results" / LLAMACPP_GGUF_RUNS[device][0]
    if not f.exists():
        return {}
    files = json.loads(f.read_text())["files"]
    models, paths = {}, {}
    for path in (HERE / "results").glob("filled_context_*.json"):
        s = json.loads(path.read_text())["settings"]
        if s.get("model_path"):
            models[Path(s["model_path"]).name] = s["model"]
            paths[Path(s["model_path"]).name] = Path(s["model_path"])
    rates = M.attention_rates("llama.cpp", device, "desktop")["prefill"]
    out = {}
    for name, g in files.items():
        if name not in models:
            continue
        arch = model_arch(models[name])
        parts = M.prefill_parts(arch, parse_strategy("kv"), g["tokens"], g["tokens"])
        attn_rate = M.prefill._prefill_rate(rates, "f16", arch)[0]
        t_mm = g["cpu_s"] - parts["attention"] / attn_rate
        out[name] = {"matmul_flop_per_s": (parts["matmul"] + parts["logits"]) / t_mm, "model": models[name]}
        if "step_cpu_s" in g:  # the decode step less its attention (f16 cache, kernel rate) at step_ctx keys
            t = terms(models[name], "llama.cpp", "kv", g["step_ctx"], g["step_ctx"], device=device)
            out[name].update(step_ctx=g["step_ctx"], step_rest_s=g["step_cpu_s"] - t["attention_s"])
            if read_files and paths[name].is_file():  # the file itself: its weight types, the bytes a step reads
                from edgekv.devices import load_device
                from edgekv.plan import plan_one

                ga = _read_gguf(str(paths[name]))
                read = plan_one(ga, parse_strategy("kv"), load_device(device), g["step_ctx"], "gguf",
                                runtime="llama.cpp").deployment.weights["read_per_token"]
                out[name].update(type_mix=M.gguf_type_mix(ga), weights_read_per_token=read,
                                 read_bytes_per_s=read / out[name]["step_rest_s"])
    return out


def gguf_type_rates(device: str = DEFAULT_DEVICE) -> dict:
    """llama.cpp's rates per GGML type (benchmarks/attention_rates.py --runtime llamacpp --gguf-types): each type's
    random file whose linear rows are all that type (a Q4_K_S file holds Q5_K rows too: not one type, left out),
    what edgekv/costs/attention_rates.json stores as gguf_type_rates."""
    f = HERE / "results" / LLAMACPP_GGUF_RUNS[device][1]
    if not f.exists():
        return {}
    return {t: {"matmul_flop_per_s": g["matmul_flop_per_s"], "read_bytes_per_s": g["read_bytes_per_s"]}
            for t, g in json.loads(f.read_text())["types"].items() if g["type_mix"] == t}


def llamacpp_rates(device: str) -> bool:
    """Whether edgekv/costs/attention_rates.json holds llama.cpp rates measured on this profile's CPU."""
    from edgekv import memory as M

    r = M.attention_rates("llama.cpp", device, "desktop")
    return bool(r and r["basis"] == "measured" and r.get("prefill"))


def by_type_terms(r: dict) -> dict | None:
    """A llama.cpp row of a GGUF whose file no 512-token run measured (not in llamacpp_gguf_prefill.json: the 1B
    of issue 40): its weights term and matmul rate as `edgekv plan -m <the GGUF> --runtime llama.cpp` charges them,
    each GGML type at the rates measured on a random file of that type alone (gguf_type_rates,
    results/llamacpp_gguf_types.json): {"weights_s", "matmul_flop_per_s", "note"}; None where a type has no rate."""
    from edgekv import memory as M
    from edgekv.devices import load_device
    from edgekv.plan import plan_one
    from edgekv.strategies import parse_strategy

    if not (r.get("gguf_path") and Path(r["gguf_path"]).is_file()):
        return None
    ga = _read_gguf(r["gguf_path"])
    by = M.speed.gguf_rates_by_type(ga, (M.attention_rates("llama.cpp", r["device"], "desktop") or {}).get(
        "gguf_type_rates") or {})
    if not by:
        return None
    row = plan_one(ga, parse_strategy(r["spec"]), load_device(r["device"]), r["ctx"], "gguf", runtime="llama.cpp")
    w = row.deployment.weights["read_per_token"]
    return {"weights_s": w / by["read_bytes_per_s"], "matmul_flop_per_s": by["matmul_flop_per_s"],
            "note": f"{r['gguf']}: {w / 1e6:.1f} MB a step at {by['read_bytes_per_s'] / 1e9:.2f} GB/s, matmuls "
                    f"{by['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s (its types at the rates measured per type, "
                    f"llamacpp_gguf_types)"}


def plan_on_gguf(r: dict) -> float:
    """`edgekv plan -m <the row's GGUF> --runtime llama.cpp` at the row's context: the plan reading the file itself
    (its weights in their own types, charged at the rates measured on that type mix where stored)."""
    from edgekv.devices import load_device
    from edgekv.plan import plan_one
    from edgekv.strategies import parse_strategy

    return plan_one(_read_gguf(r["gguf_path"]), parse_strategy(r["spec"]), load_device(r["device"]), r["ctx"], "gguf",
                    runtime="llama.cpp").decode.value


def _round(v: float | None) -> float | None:
    """v to 2 decimals; None (GenAI's rows: no plan runtime) stays None."""
    return None if v is None else round(v, 2)


def prefill_pred(r: dict, p: dict) -> float | None:
    """A row's prompt seconds at one runtime's fit p (fit_prefill): its matmuls at the fitted rate times its matrix
    shapes' factor, its attention at the kernel's rate (each call at its keys') or the fitted kind's, a cache read back
    every call at the fitted cost per value, the .pte's eager rings at the eager layer's fitted rate. None where a
    rate it needs is not fitted."""
    from edgekv.memory.prefill import RING_KIND

    rate = r["prefill_kernel_rate"] or p["attention_flop_per_s"].get(r["prefill_rate_kind"])
    if not rate:
        return None
    if not r["prefill_kernel_rate"]:
        rate *= r["prefill_rate_scale"]
    extra = 0.0
    if r.get("prefill_readback"):  # the values read back at the cost per value fitted on SmolLM2's prompts
        c = p.get("readback", {}).get(r["prefill_kind"], {}).get("s_per_value")
        if c is None:
            return None
        extra = r["prefill_readback"] * c
    ring = r["prefill_parts"].get("ring", 0.0)
    if ring:  # the .pte's eager rings at the eager layer's fitted rate (prefill.RING_KIND)
        ring_rate = p["attention_flop_per_s"].get(r.get("prefill_ring_fitted", RING_KIND))
        if not ring_rate:
            return None
        extra += ring / (ring_rate * r["prefill_ring_scale"])
    mm_rate = p["matmul_flop_per_s"] * r.get("prefill_matmul_scale", 1.0)
    return ((r["prefill_parts"]["matmul"] + r["prefill_parts"]["logits"]) / mm_rate
            + r["prefill_parts"]["attention"] / rate + extra)


TABLE_HEAD = ("| set | model | row | ctx | run (`results/filled_context_*.json`) | decode measured | predicted | error "
              "| prefill measured s | predicted s | error |")


def _pct(err: float, ok: bool) -> str:
    return f"{err * 100:+.0f} %" + ("" if ok else " (miss)")


def markdown_table(rows: list[dict], device: str) -> str:
    """One profile's rows of plan_vs_filled.json as the markdown table benchmarks/README.md shows (--table): the fit
    rows, then the held-out ones; each model's rows by context, run and row; a catalog model by its name, a GGUF by
    its file's name."""
    rows = [r for r in rows if r.get("device") == device]
    models = list(dict.fromkeys([FIT_MODEL] + sorted(Path(r["model"]).name for r in rows)))
    rows.sort(key=lambda r: (r["set"] != "fit", models.index(Path(r["model"]).name), r["ctx"], r["file"], r["row"]))
    out = [TABLE_HEAD, "|---" * TABLE_HEAD.count(" | ") + "|---|"]
    for r in rows:
        run = r["file"].removeprefix("filled_context_").removesuffix(".json")
        dec = (f"{r['predicted_tok_s']:.2f} | {_pct(r['error'], r['within_25'])}" if r["modelled"]
               else "- | not modelled")
        pre = (f"{r['predicted_prefill_s']:.1f} | {_pct(r['prefill_error'], r['prefill_within_25'])}"
               if r.get("prefill_error") is not None else "- | -")
        measured_pre = f"{r['measured_prefill_s']:.1f}" if r.get("measured_prefill_s") else "-"
        out.append(f"| {r['set']} | {Path(r['model']).name} | `{r['row']}` | {r['ctx']} | {run} | "
                   f"{r['measured_tok_per_cpu_s']:.2f} | {dec} | {measured_pre} | {pre} |")
    return "\n".join(out) + "\n"


def replace_table(text: str, table: str) -> str:
    """text with its table that starts at TABLE_HEAD (up to the first blank line) replaced by table; ValueError where
    text holds no such table or more than one."""
    if text.count(TABLE_HEAD) != 1:
        raise ValueError(f"{text.count(TABLE_HEAD)} tables start with plan_vs_filled's header (need exactly one)")
    a = text.index(TABLE_HEAD)
    b = text.find("\n\n", a)
    return text[:a] + table + (text[b + 1:] if b >= 0 else "")


def write_whole(path: Path, text: str) -> None:
    """text to path through a temporary file of its own beside it (mkstemp: no file of the user's, such as
    NAME.tmp, is overwritten), moved over it whole; an existing file keeps its mode (not mkstemp's 0600)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "plan_vs_filled.json")
    ap.add_argument("--ggufs", action="store_true",
                    help="read the rows' GGUF files where present: each file's weight type mix and its weights read "
                         "rate (llamacpp_gguf_types, what edgekv/costs/attention_rates.json stores per mix), and "
                         "`edgekv plan -m <the row's GGUF>` beside each llama.cpp row (plan_gguf_tok_s)")
    ap.add_argument("--also", nargs="+", default=(), metavar="JSON",
                    help="further filled_context JSONs to predict (a run not yet in results/, e.g. another branch's "
                         "1B rows); their rows are held out")
    ap.add_argument("--gguf-dir", type=Path,
                    help="the folder holding the rebuilt GGUFs of models outside the catalog (REBUILT: the random 1B's "
                         "llama-3.2-1b-q4_0.gguf), looked for by name before the path the run recorded")
    ap.add_argument("--table", metavar="DEVICE",
                    help="print DEVICE's rows of --out (an earlier run's JSON; nothing is predicted) as a markdown "
                         "table, e.g. host-xeon for benchmarks/README.md's \"On the Intel Xeon VM\"")
    ap.add_argument("--into", type=Path, metavar="MARKDOWN",
                    help="with --table: replace the table of that header in this markdown file instead of printing")
    a = ap.parse_args(argv)
    if a.into and not a.table:
        ap.error("--into needs --table DEVICE")
    if a.table:
        try:
            table = markdown_table(json.loads(a.out.read_text())["rows"], a.table)
            if a.into:
                text = replace_table(a.into.read_text(encoding="utf-8"), table)
        except (OSError, ValueError, KeyError) as e:
            print(f"plan_vs_filled --table: {e}", file=sys.stderr)
            return 1
        if table.count("\n") < 3:
            print(f"plan_vs_filled --table: {a.out} holds no row of device {a.table!r}", file=sys.stderr)
            return 1
        if not a.into:
            print(table, end="")
            return 0
        write_whole(a.into, text)
        print(f"wrote {a.into} ({table.count(chr(10)) - 2} rows of {a.table})")
        return 0
    from edgekv.errors import EdgekvError

    rows = []
    for r in measured_rows(a.also, a.gguf_dir):
        r["set"] = "fit" if r["model"] == FIT_MODEL else "held-out"
        r["tok_s"] = r.get("decode_tok_per_cpu_s") or r["decode_tok_s"]
        prompt = r.get("prompt_tokens") or r["ctx"]
        pf = r.get("prefill_tok_per_cpu_s") or r.get("prefill_tok_s")
        r["prefill_s"] = prompt / pf if pf else None
        how = parse(r["name"], r.get("gguf_path"))
        if r["name"].startswith("et-llama:"):  # kernel rows and the .pte's weights rate: nothing fitted on it
            r["set"] = "held-out"
        if r["name"].startswith("genai:") or r["name"].endswith("/gguf"):  # kernel rows per form: nothing fitted
            r["set"] = "held-out"
        r["device"] = row_device(r["cpu"])
        if r["device"] is None:
            how = f"measured on another machine ({r['cpu']}): no host profile holds that CPU's rates"
        m, fam, before = SUPERSEDED_BEFORE
        if r["model"] == m and r["name"].startswith(fam) and r["started_utc"] < before:
            how = "superseded export: measured before edgekv's ONNX put Gemma 3's sliding layers on GroupQueryAttention"
        m, fam, before = SUPERSEDED_PTE_BEFORE
        if r["model"] == m and r["name"].startswith(fam) and r["started_utc"] < before and \
                r["file"] not in PTE_ROWS_FILES:
            how = ("superseded export: measured before edgekv's .pte wrote Gemma 3's sliding rings in place"
                   if r["started_utc"] < "2026-12-05T19:00" else "superseded export: measured before edgekv's int4 "
                   ".pte kept only Gemma-3-270M's six measured layers int8")
        # filled_context: the operators of edgekv's own that a .pte calls (its manifest's custom_ops)
        ops = {op.split(".")[0] for op in (r.get("export") or {}).get("custom_ops") or ()}
        int8_kernel = "executorch"
        if ops and ops <= set(PTE_INT8_KERNEL_OPS) and r["file"] in PTE_KERNEL_BEFORE_TILES | PTE_RINGS_EAGER \
                and not isinstance(how, str):
            how = ("another kernel: edgekv::int8_sdpa before its register tiles (PTE_KERNEL_BEFORE_TILES)"
                   if r["file"] in PTE_KERNEL_BEFORE_TILES else
                   "another graph: the sliding rings attended by eager arithmetic (PTE_RINGS_EAGER)")
            r["set"] = "held-out"
        elif ops and ops <= set(PTE_INT8_KERNEL_OPS) and not isinstance(how, str):
            int8_kernel = PTE_INT8_KERNEL_OPS[sorted(ops)[0]]
            # its attention at the kernel's own measured rows (nothing fitted on model rows): a check, not a fit row
            r["set"] = "held-out"
        elif ops:
            how = f"edgekv's own operators {', '.join(sorted(ops))}: no rate stored for them"
        w_export = (r.get("export") or {}).get("weights")
        if w_export and w_export != "int4" and not isinstance(how, str) and r["name"].endswith("/int4"):
            how = (f"its export's weights are {w_export} (manifest), not the int4 of its row's name: no "
                   f"{r['name'].split(':')[0]} {w_export}-weights rate stored")
        old_kind = next((k for pre, k in PTE_INT8_OLD_KIND.items() if r["name"].startswith(pre)
                         and r["started_utc"] < PTE_INT8_BEFORE), None)
        pre, before, kind = PTE_PER_HEAD
        if r["name"].startswith(pre) and r["started_utc"] < before and r["file"] not in PTE_ROWS_FILES:
            old_kind = kind
        if not isinstance(how, str):
            try:
                model_arch(r["model"])
            except (EdgekvError, OSError) as e:  # a model outside the catalog whose weights are not on this machine
                how = ("its GGUF is not on this machine: rebuild it (rebuild) and pass --gguf-dir"
                       if Path(r["model"]).name in REBUILT else f"its model is not readable here ({e})")
        if isinstance(how, str):
            r["why_not"] = how
        else:
            r["runtime"], r["spec"], weights = how
            r.update(terms(r["model"], r["runtime"], r["spec"], r["ctx"], prompt, old_kind, int8_kernel, weights,
                           r.get("gguf_path"), r["device"], r["started_utc"] >= PTE_RINGS_SINCE))
            if int8_kernel != "executorch":
                r["int8_kernel"] = int8_kernel
            if old_kind and old_kind.startswith("eager"):
                r["eager"] = old_kind
            elif r["cost"] != "llama.cpp" and not r["fused"] and r["prefill_kind"] and r["kind"] in KERNEL_EAGER.get(
                    r["cost"], ()) and not r["kind_fitted"]:
                pass  # an eager graph with kernel rows: attention_s at the stored rate, as the plan charges it
            elif r["cost"] != "llama.cpp" and not r["fused"] and r["prefill_kind"]:
                pk = r["prefill_kind"]  # the eager graph: a rate fitted on model rows below
                r["eager"] = pk if pk.startswith("eager ") else f"eager {pk}"
            elif r["cost"] != "llama.cpp" and r["fused"] and r["prefill_kind"] and r["kind"] in (
                    None, r["prefill_kind"]) and r["prefill_kind"] not in KERNEL_KINDS[r["cost"]]:
                r["eager"] = r["prefill_kind"]  # the fused op on a cache the kernel benchmark does not time
            elif not r["kind"]:
                r["why_not"] = f"no {r['cost']} kernel rate stored for this cache ({r['cache']})"
        rows.append(r)
    fit = [r for r in rows if r["set"] == "fit" and "why_not" not in r and r["file"] not in NOT_FITTED]
    for r in rows:
        if "why_not" not in r and "cost" in r and "eager" not in r:
            r["model_attention_s"] = r["attention_s"]
    w_all: dict[str, dict] = {}  # per host profile (row_device), per runtime: the weights rate fitted on its rows
    fitted_all: dict[str, dict] = {}  # per host profile, per runtime: the per-key costs fitted on model rows
    pre_all: dict[str, dict] = {}  # per host profile, per runtime: the prefill rates fitted on its rows

    def weights_s(r: dict) -> float:
        """The row's weights term: its matrices at the kernel's per-size rows plus the fitted per-layer ops where
        the runtime's kernel was timed per matrix, else its bytes over the fitted rate (its own CPU's: row_device)."""
        w = w_all[r["device"]][RATES_FROM.get(r["cost"], r["cost"])]
        if "layer_overhead_s" in w and "weights_kernel_s" in r:
            return r["weights_kernel_s"] + r["n_layers"] * w["layer_overhead_s"]
        if "layer_overhead_s" in w:  # the .pte: its weight kernels' rate + the other ops per layer
            return r["weights_bytes"] / w["rate"] + r["n_layers"] * w["layer_overhead_s"]
        return r["weights_bytes"] / w["rate"]

    # each host profile's rates on its own CPU's rows (the EPYC's first: DEFAULT_DEVICE)
    for dev in sorted({r["device"] for r in rows if r.get("device")}, key=lambda d: (d != DEFAULT_DEVICE, d)):
        w_rates = w_all.setdefault(dev, {})
        for cost in ("onnxruntime", "executorch", "llama.cpp"):
            # (not the rows of a graph whose per-key cost was measured on the model as its step less the fp32 step:
            # KERNEL_ON_MODEL; their step is that measurement's, not another weights measurement)
            sub = [r for r in fit if r["device"] == dev and r["cost"] == cost and "eager" not in r
                   and r["kind"] not in KERNEL_ON_MODEL]
            if cost == "executorch":
                # the rows of the graph the plan charges (not the per-head fp32 graph's: its kernel rows charged those
                # steps' attention high, leaving their weights a residual of 2-3 ms against the 6.8 ms its profile
                # gave the weight kernels), and only where the rest is a quarter of the step or more (the fp16, int8
                # and int8c caches' rows spend 90-100 % of it in attention: what is left says nothing about the rest)
                sub = [r for r in sub if r["kind"] != PTE_PER_HEAD[2] and r["model_attention_s"] * r["tok_s"] < 0.75]
            if sub:  # least squares in relative error of t = weights / rate + the attention at the kernel rate
                num = sum(r["weights_bytes"] * r["tok_s"] * (1 - r["model_attention_s"] * r["tok_s"]) for r in sub)
                den = sum((r["weights_bytes"] * r["tok_s"]) ** 2 for r in sub)
                # each row's own rate (its seconds less the attention, over the weights), where the rest is positive
                per = [r["weights_bytes"] / (1 / r["tok_s"] - r["model_attention_s"]) for r in sub
                       if 1 / r["tok_s"] > r["model_attention_s"]]
                w_rates[cost] = {"rate": den / num, "per_row": per}
                prof = HERE / "results" / PTE_PROFILE
                if cost == "executorch" and prof.exists():  # split by the profile's shares: weights rate + per layer
                    d = json.loads(prof.read_text())["runs"][0]["decode_ms"]
                    frac = d["xnnpack gemm"] / (d["xnnpack gemm"] + sum(d[k] for k in PTE_STEP_OTHER))
                    step = sub[0]["weights_bytes"] * num / den  # the fitted seconds outside attention
                    w_rates[cost].update(rate=den / num / frac, gemm_share=frac,
                                         layer_overhead_s=(1 - frac) * step / sub[0]["n_layers"])
                elif all("weights_kernel_s" in r for r in sub):  # the matrices at their kernel rows + per layer c: fit c
                    y = [(1 / r["tok_s"] - r["model_attention_s"] - r["weights_kernel_s"]) * r["tok_s"] for r in sub]
                    x = [r["n_layers"] * r["tok_s"] for r in sub]
                    w_rates[cost]["layer_overhead_s"] = sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x)

        # the graphs no kernel benchmark times (ONNX Runtime's and the .pte's eager graphs: a quantized cache dequantized
        # whole, a window with sinks; the .pte's custom_sdpa on an int4 cache read back by dequantize_planar): the
        # weights term above plus a per key x query head x head size cost (repeat_kv expands K and V to every query
        # head before the two matmuls), least squares in relative error over the fit rows of each runtime and cache kind
        fitted, acc = fitted_all.setdefault(dev, {}), {}
        for r in fit:
            if "eager" in r and r["device"] == dev and RATES_FROM.get(r["cost"], r["cost"]) in w_rates:
                w_t, k = weights_s(r) * r["tok_s"], r["key_work"] * r["tok_s"]
                num, den = acc.get((r["cost"], r["eager"]), (0.0, 0.0))
                acc[r["cost"], r["eager"]] = (num + k * (1 - w_t - r["ring_s"] * r["tok_s"]), den + k * k)
        for (cost, kind), (num, den) in acc.items():
            fitted.setdefault(cost, {})[kind] = num / den
        for r in rows:
            if "eager" in r and r.get("device") == dev:
                c = fitted.get(r["cost"], {}).get(r["eager"])
                if c:
                    r["model_attention_s"] = r["key_work"] * c + r["ring_s"]
                    r["attention_formula"] = (f"{r['key_work']:.4g} key x head x dim per step x {c * 1e12:.3g} ps "
                                              f"({r['eager']}, fitted on model rows)"
                                              + (f" + the eager rings {r['ring_s'] * 1e3:.3g} ms" if r["ring_s"] else ""))
                else:
                    r["why_not"] = (f"no SmolLM2-135M row of {r['cost']}'s {r['eager']} graph to fit its rate on"
                                    + ("" if dev == DEFAULT_DEVICE else f" measured on {dev}'s CPU"))
        for cost, kinds in fitted.items():
            print(f"{dev}: {cost} graphs without a kernel rate, per key x query head x head size: "
                  + ", ".join(f"{k} {c * 1e12:.1f} ps" for k, c in kinds.items()))
        for cost, w in w_rates.items():
            extra = f" (rows alone: {', '.join(f'{x / 1e9:.2f}' for x in sorted(w['per_row']))})" if w["per_row"] else ""
            print(f"{dev}: {cost}: weights rate fitted on SmolLM2-135M rows: {w['rate'] / 1e9:.2f} GB/s{extra}"
                  + (f"; split by {PTE_PROFILE}'s shares ({w['gemm_share']:.0%} weight kernels): the other ops per layer "
                     f"{w['layer_overhead_s'] * 1e6:.1f} us" if "gemm_share" in w else
                     f"; with the matrices at the kernel's per-size rows, the other ops per layer: "
                     f"{w['layer_overhead_s'] * 1e6:.1f} us" if "layer_overhead_s" in w else ""))
        # prefill: per runtime, on the fit rows with a measured prefill (the explicit graphs included: their prefill
        # kind is their cache's, and the attention FLOP are the same)
        pre_rows = [r for r in rows if "cost" in r and r.get("prefill_s") and not r.get("why_not", "").startswith("super")]
        pre_fits = pre_all.setdefault(dev, {})
        # the .pte's prefill: no kernel benchmark times custom_sdpa over a chunk of queries, so its matmul rate and each
        # cache kind's attention rate are fitted on SmolLM2's .pte rows (fp32 at 2k and 8k separate the two)
        for cost in ("onnxruntime", "executorch", "llama.cpp"):
            sub = [r for r in pre_rows if r["device"] == dev and r["set"] == "fit" and r["cost"] == cost and r["prefill_kind"]
                   and r["file"] not in NOT_FITTED]
            if len({r["ctx"] for r in sub}) < 2 and not all(r["prefill_kernel_rate"] for r in sub):
                # one context: matmul (linear) and attention (quadratic) inseparable, unless every row's attention
                # is at a measured kernel rate (llama.cpp on host-xeon: its SmolLM2 rows at 2k) and only the matmul
                # rate is fitted
                print(f"{dev}: {cost} prefill: not fitted (its rows are at one context)")
                continue
            if sub:
                pre_fits[cost] = fit_prefill(sub)
                p = pre_fits[cost]
                print(f"{dev}: {cost} prefill: matmul {p['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s, attention "
                      + ", ".join(f"{k} {v / 1e9:.1f}" if v else f"{k} -" for k, v in p["attention_flop_per_s"].items())
                      + " GFLOP/s" + "".join(f"; {k} read back: at the {b['kernel_kind']} rate + "
                                             f"{b['s_per_value'] * 1e9:.2f} ns per value"
                                             for k, b in p.get("readback", {}).items()))
    gguf_mm_all = {dev: gguf_matmul_rates(a.ggufs, dev) for dev in LLAMACPP_GGUF_RUNS
                   if llamacpp_rates(dev)}
    gguf_mm = gguf_mm_all.get(DEFAULT_DEVICE, {})
    for name, g in ((f"{n} ({dev})" if dev != DEFAULT_DEVICE else n, g) for dev, m in gguf_mm_all.items()
                    for n, g in m.items()):
        print(f"llama.cpp on {name} (a 512-token prefill and the steps after it, less their attention at the kernel "
              f"rates): matmul {g['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s, step outside attention "
              f"{g.get('step_rest_s', 0) * 1e3:.2f} ms"
              + (f"; weight types {g['type_mix']}: {g['weights_read_per_token'] / 1e6:.1f} MB read per step, "
                 f"{g['read_bytes_per_s'] / 1e9:.2f} GB/s" if "type_mix" in g else ""))
    out_rows = []
    print(f"{'set':9} {'model':13} {'row':31} {'ctx':>6} {'file':30} {'dec meas':>8} {'model':>7} {'plan':>7} "
          f"{'error':>6}  {'pre s':>6} {'model':>6} {'error':>6}")
    for r in sorted(rows, key=lambda r: (r["set"] != "fit", r["model"], r["ctx"], r["name"], r["file"])):
        label, rebuild = model_label(r["model"])
        o = {"set": r["set"], "model": label, **rebuild, "row": r["name"], "ctx": r["ctx"], "file": r["file"],
             "vm": r["vm"], "bandwidth_gb_s": r["bandwidth_gb_s"], "measured_tok_per_cpu_s": r["tok_s"],
             "measured_tok_s_wall": r["decode_tok_s"], "measured_prefill_s": r["prefill_s"],
             "modelled": "why_not" not in r}
        if r.get("device") not in (None, DEFAULT_DEVICE):  # priced at another host profile's rates (row_device)
            o["device"] = r["device"]
        pre = None
        if r["name"].startswith("genai:"):
            o["prefill_not_modelled"] = GENAI_PREFILL
        elif "cost" in r and r.get("prefill_s") and RATES_FROM.get(r["cost"], r["cost"]) in pre_all.get(r["device"], {}) \
                and r["prefill_kind"]:
            p = pre_all[r["device"]][RATES_FROM.get(r["cost"], r["cost"])]
            # (llama.cpp's per-GGUF and per-type rates: those measured on the row's own CPU)
            g = gguf_mm_all.get(r["device"], {}).get(r["gguf"]) if r["cost"] == "llama.cpp" else None
            bt = by_type_terms(r) if r["cost"] == "llama.cpp" and not g else None
            if g:  # llama.cpp's matmuls at the rate of the row's own GGUF's weight types (measured, not fitted)
                p = {**p, "matmul_flop_per_s": g["matmul_flop_per_s"]}
                o["prefill_matmul"] = f"{r['gguf']}: {g['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s (llamacpp_gguf_prefill)"
            elif bt:  # a file measured nowhere: its types at the rates measured per type
                p = {**p, "matmul_flop_per_s": bt["matmul_flop_per_s"]}
                o["prefill_matmul"] = bt["note"]
            pre = prefill_pred(r, p)
            if pre:
                pre = float(pre)
                o.update(predicted_prefill_s=round(pre, 2), plan_prefill_s=_round(r["plan_prefill_s"]),
                         prefill_error=round(pre / r["prefill_s"] - 1, 3),
                         prefill_within_25=bool(abs(pre / r["prefill_s"] - 1) <= TOLERANCE))
        pcol = (f"{r['prefill_s']:6.1f} {pre:6.1f} {pre / r['prefill_s'] - 1:+6.0%}" if pre else "")
        if o["modelled"] and RATES_FROM.get(r["cost"], r["cost"]) not in w_all.get(r["device"], {}):
            r["why_not"], o["modelled"] = (f"no {r['cost']} row to fit its weights rate on"
                                           + ("" if r["device"] == DEFAULT_DEVICE else f" measured on {r['device']}'s "
                                              "CPU"), False)
        if o["modelled"]:
            w_s = weights_s(r)
            g = gguf_mm_all.get(r["device"], {}).get(r["gguf"]) if r["cost"] == "llama.cpp" else None
            bt = by_type_terms(r) if r["cost"] == "llama.cpp" and not g else None
            if g:  # the step outside attention measured on the row's own GGUF at a short context (not fitted)
                w_s = g["step_rest_s"]
                o["weights_term"] = (f"{r['gguf']}: {w_s * 1e3:.2f} ms (its step at {g['step_ctx']} keys less the "
                                     f"attention at the kernel rate, llamacpp_gguf_prefill)")
            elif bt:  # the plan's own weights term on the file, each type at its measured rate (nothing fitted)
                w_s = bt["weights_s"]
                o["weights_term"] = f"{w_s * 1e3:.2f} ms: {bt['note']}"
            elif "weights_formula" in r:  # --weights gguf / GenAI: each matrix at its form's rows + the int4 graph's ops
                o["weights_term"] = (f"{w_s * 1e3:.2f} ms: {r['weights_formula'].rsplit(' + ', 1)[0]} + "
                                     f"{r['n_layers']} layers x {w_all[r['device']][r['cost']]['layer_overhead_s'] * 1e6:.3g} us "
                                     "(the int4 graph's other ops, fitted on SmolLM2's rows)")
            pred = float(1 / (w_s + r["model_attention_s"]))
            err = pred / r["tok_s"] - 1
            prof = PROFILED.get((r["model"], r["name"], r["ctx"]))
            if prof:
                ms = json.loads((HERE / "results" / prof).read_text())["rows"][0]["ms_per_step"]
                o["profiled"] = {"file": prof, "tok_s": round(1e3 / ms, 2), "error": round(pred * ms / 1e3 - 1, 3)}
            if a.ggufs and r["cost"] == "llama.cpp" and r.get("gguf_path") and Path(r["gguf_path"]).is_file():
                o["plan_gguf_tok_s"] = round(plan_on_gguf(r), 2)  # `edgekv plan -m <the row's GGUF>`
            o.update(runtime=r["runtime"], cache=r["cache"], predicted_tok_s=round(pred, 2),
                     plan_tok_s=_round(r["plan_tok_s"]), error=round(err, 3), within_25=abs(err) <= TOLERANCE,
                     weights_bytes=r["weights_bytes"], attention_ms=round(r["model_attention_s"] * 1e3, 3),
                     attention_formula=r["attention_formula"])
            if "int8_kernel" in r:  # the .pte's int8 cache read by edgekv's own kernel (its export's custom_ops)
                o["int8_kernel"] = r["int8_kernel"]
            print(f"{r['set']:9} {Path(r['model']).name[:13]:13} {r['name']:31} {r['ctx']:6} {r['file'][15:-5]:30} {r['tok_s']:8.2f} "
                  f"{pred:7.2f} {_round(r['plan_tok_s']) or '-':>7} {err:+6.0%}{' ' if o['within_25'] else '!'} {pcol}")
        else:
            o["why_not"] = r["why_not"]
            plan = ""
            if r.get("plan_tok_s") and not r["why_not"].startswith("super"):  # the roofline's number, for comparison
                o.update(plan_tok_s=round(r["plan_tok_s"], 2), plan_error=round(r["plan_tok_s"] / r["tok_s"] - 1, 3))
                plan = f"{r['plan_tok_s']:7.2f} {o['plan_error']:+6.0%} "
            print(f"{r['set']:9} {Path(r['model']).name[:13]:13} {r['name']:31} {r['ctx']:6} {r['file'][15:-5]:30} {r['tok_s']:8.2f} "
                  f"{'-':>7} {plan or f'{chr(45):>7} {chr(32) * 7}'} {pcol}  (not modelled"
                  f"{': roofline' if plan else ''})")
        out_rows.append(o)
    for dev, s in [(d, s) for d in [None, *sorted({o["device"] for o in out_rows if "device" in o})]
                   for s in ("fit", "held-out")]:  # the host profile's rows, then each other profile's
        rows_d = [o for o in out_rows if o.get("device") == dev]
        m = [o for o in rows_d if o["set"] == s and o["modelled"]]
        p = [o for o in rows_d if o["set"] == s and "prefill_error" in o]
        print(f"{dev + ' ' if dev else ''}{s} rows: decode within {TOLERANCE:.0%}: {sum(o['within_25'] for o in m)} of {len(m)} modelled "
              f"({sum(not o['modelled'] for o in rows_d if o['set'] == s)} not modelled); prefill within "
              f"{TOLERANCE:.0%}: {sum(o['prefill_within_25'] for o in p)} of {len(p)}")
    # llama.cpp's decode timed alone at several filled contexts on one GGUF (experiments/llamacpp_decode_by_ctx.py:
    # a process per point, 8 steps, results/llamacpp_decode_by_ctx_*.json), against `edgekv plan -m <that GGUF>
    # --runtime llama.cpp` at that context on its CPU's profile (--ggufs, where the file is here): how a miss at a
    # filled context grows from the short ones
    by_ctx = []
    for f in sorted((HERE / "results").glob("llamacpp_decode_by_ctx_*.json")) if a.ggufs else ():
        d = json.loads(f.read_text())
        dev, path = row_device(d.get("machine", {}).get("cpu")), local_model(d["gguf"], a.gguf_dir)
        if not (dev and path and Path(path).is_file() and llamacpp_rates(dev)):
            continue
        for r in d["rows"]:
            plan = plan_on_gguf({"gguf_path": path, "spec": LLAMACPP_CACHE[r["cache"]], "device": dev, "ctx": r["ctx"]})
            by_ctx.append({"file": f.name, "model": model_label(d["gguf"])[0], "device": dev, "cache": r["cache"],
                           "ctx": r["ctx"], "measured_tok_per_cpu_s": r["decode_tok_per_cpu_s"],
                           "plan_gguf_tok_s": round(plan, 2), "error": round(plan / r["decode_tok_per_cpu_s"] - 1, 3)})
            print(f"{f.name}: llama.cpp {r['cache']} at {r['ctx']}: measured {r['decode_tok_per_cpu_s']:.2f}, plan "
                  f"-m {Path(path).name} --device {dev} {plan:.2f} ({by_ctx[-1]['error']:+.0%})")
    w_rates, fitted, pre_fits = (w_all.get(DEFAULT_DEVICE, {}), fitted_all.get(DEFAULT_DEVICE, {}),
                                 pre_all.get(DEFAULT_DEVICE, {}))
    res = {"benchmark": "plan_vs_filled", "speed": "tokens per CPU second of the row's process (1 thread)",
           "weights_rates_bytes_per_s": {k: v["rate"] for k, v in w_rates.items()},
           "weights_rates_per_fit_row": {k: v["per_row"] for k, v in w_rates.items() if v["per_row"]},
           "layer_overhead_s": {k: v["layer_overhead_s"] for k, v in w_rates.items() if "layer_overhead_s" in v},
           "pte_gemm_share": {"profile": PTE_PROFILE, "share": w_rates.get("executorch", {}).get("gemm_share")},
           "fitted_per_key_s": fitted, "prefill": pre_fits,
           "llamacpp_gguf_types": {g["type_mix"]: {"file": n, "matmul_flop_per_s": g["matmul_flop_per_s"],
                                                   "read_bytes_per_s": g["read_bytes_per_s"]}
                                   for n, g in gguf_mm.items() if "type_mix" in g}, "llamacpp_gguf_type_rates": gguf_type_rates(),
           "not_fitted": NOT_FITTED, "tolerance": TOLERANCE,
           # the other host profiles' rates, each fitted on its own CPU's rows (row_device), as above for host
           "devices": {dev: {"cpu": next((c for c, i in host_profiles().items() if i == dev), None),
                             "weights_rates_bytes_per_s": {k: v["rate"] for k, v in w_all[dev].items()},
                             "weights_rates_per_fit_row": {k: v["per_row"] for k, v in w_all[dev].items()
                                                           if v["per_row"]},
                             "layer_overhead_s": {k: v["layer_overhead_s"] for k, v in w_all[dev].items()
                                                  if "layer_overhead_s" in v},
                             "pte_gemm_share": {"profile": PTE_PROFILE,
                                                "share": w_all[dev].get("executorch", {}).get("gemm_share")},
                             "fitted_per_key_s": fitted_all.get(dev, {}), "prefill": pre_all.get(dev, {}),
                             **({"llamacpp_gguf_types": {
                                 g["type_mix"]: {"file": n, "matmul_flop_per_s": g["matmul_flop_per_s"],
                                                 "read_bytes_per_s": g["read_bytes_per_s"]}
                                 for n, g in gguf_mm_all.get(dev, {}).items() if "type_mix" in g},
                                 "llamacpp_gguf_type_rates": gguf_type_rates(dev)} if dev in gguf_mm_all else {})}
                       for dev in w_all if dev != DEFAULT_DEVICE},
           **({"llamacpp_decode_by_ctx": by_ctx} if by_ctx else {}), "rows": out_rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_whole(a.out, json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
