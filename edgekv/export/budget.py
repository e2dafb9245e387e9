"""What an `edgekv export` will need, said before it starts: peak resident memory and CPU time from the model's
shapes (the Arch read from config.json or the GGUF header, no weights loaded), the formats and the weight recipe;
and a refusal, one line, when the machine does not have that memory (instead of an OOM kill an hour in).

The peak is modelled as

    peak = BASE + k(format, recipe) x 4 x params + STATE_COPIES x state bytes at max_ctx

4 x params is the fp32 eager module an export builds (edgekv.models loads every weight as fp32, but where an ONNX
int8 / int4 export keeps a bf16 / fp16 checkpoint narrow: K_NARROW); k counts the copies of it alive at the worst
stage. An ONNX int8 / int4 export streams: the module is loaded once (no second
copy for its state dict), lowered without a folded copy of its weights, written and quantized one tensor at a time,
and its weights are freed before quantizing; its worst stages (trace, lower) hold the module and what the trace adds
(the fused q/k/v copies the runtime's attention swap makes, the traced state). The other recipes still hold more:
the ONNX proto of fp32 / fp16 weights beside the module (and ONNX Runtime's fp16 converter's copy), the .pte path's
quantized deep copy and XNNPACK's packed weights. The state term is the eager cache plus the runtime's inputs and
outputs while verifying. The constants are fitted to measured exports (benchmarks/export_cost.py; the figures are in
benchmarks/results/export_cost_*.json and benchmarks/README.md, "What an export costs"), rounded up: an estimate on
the high side of what was measured.

The memory available is --max-memory / EDGEKV_MAX_MEMORY where given (a limit the user states, e.g. a share of a
shared host: it replaces what the machine reports), else the smaller of the kernel's MemAvailable (/proc/meminfo) and
a cgroup v2 limit's headroom (memory.max - memory.current); where none is known, nothing is refused.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import EdgekvError
from ..units import fmt_mem, parse_bytes

ENV = "EDGEKV_MAX_MEMORY"
# the process with torch, ONNX Runtime and the exporters imported, before any weight, and the floor a small model
# never gets under (SmolLM2-135M's streamed int4 export: benchmarks/results/export_cost_*.json)
BASE = 0.75e9
# copies of the fp32 weights alive at the worst stage, per format and weight recipe, rounded up from the exports
# measured by benchmarks/export_cost.py (benchmarks/results/export_cost_*.json; which stage holds what: benchmarks/
# README.md, "What an export costs"). ONNX int8 / int4 stream: from tracing on the module holds its weights as their
# exact bf16 / fp16 copies (edgekv.export.lazy_weights), so the peak is verify-quant's fp32 pass and the fused q/k/v
# made for the trace, at the trace stage (the factor is rounded up over the random Llama-3.2-1B's lazy-weights runs,
# SmolLM2-135M's, whose peak is the imports and ONNX Runtime's session, and the earlier 1B runs, which lowered over
# the fp32 module: export_cost_*.json, tests/test_export_budget.py); fp32 and fp16 hold the whole ONNX proto beside the module at lower/serialize-onnx
# (fp16: and the fp16 converter's copy at quantize-onnx). The .pte fp32 figure is Gemma-3-270M's at 32k; the
# quantized .pte recipes (a quantized deep copy of the module besides) are not measured: one copy more is assumed.
# gguf streams too. Its peak is at load / calibrate, while the module the GGUF is dequantized into is alive: that fp32
# module (one copy: K_ONNX), one matrix more, the largest (GGUF_MATRIX: carry's fp32 table beside its codes, Gemma-3-
# 270M's 262144 x 640; kv-int8c's calibration logits over the tied head, the random Llama-3.2-1B's 128256 x 2048; the
# mapped file's pages), and the eager state once; verify's copies of the state come after the module is freed, so
# they count only where they are larger (verify-quant: a quarter of the module and the state copies). Fitted to both models
# (export_cost_gemma3_270m_onnx_gguf_16k_after.json, export_cost_llama_3.2_1b_random_onnx_gguf_q4_0_*_8k.json;
# tests/test_export_budget.py holds each measured peak under its estimate and within 1.2x of it).
K_ONNX = {"fp32": 3.75, "fp16": 4.75, "int8": 1.05, "int4": 1.05, "int4-mix": 1.05, "gguf": 1.0}  # int4-mix streams as int4
GGUF_MATRIX = 1.1
K_PTE = {"fp32": 5.0, "int8": 6.0, "int4": 6.0}
# The same streamed recipes where the export keeps a bf16 / fp16 checkpoint's weights narrow from the load on
# (edgekv.export.narrow_route.narrow_load: an ONNX-only export of a safetensors folder, no GenAI runner): the fp32 module
# is never built, so the peak (trace to serialize-onnx) is the narrow weights (half the fp32 bytes), the embedding
# table widened for verify-quant's fp32 pass and torch.onnx's graph. Rounded up from the random Llama-3.2-1B's and
# 3B's narrow-load runs (export_cost_*_narrow_load.json, tests/test_export_budget.py).
K_NARROW = {"int8": 0.65, "int4": 0.65, "int4-mix": 0.65}
# A .pte-only int8 / int4 export of such a checkpoint loads narrow too and quantizes the .pte's module one linear at a
# time from the narrow weights (narrow_route.quantize_narrow), so neither the fp32 module nor its quantized deep copy
# exists. Its peak is the quantize stage: the narrow weights (half the fp32 bytes: K_PTE_NARROW) and the largest
# matrix, the embedding table, widened for verify-quant's fp32 pass, then the untied head's fp32 while torchao
# quantizes it in blocks of rows (PTE_NARROW_MATRIX of that matrix's fp32). lower-pte, serialize-pte and verify-pte
# hold the codes (one byte per weight) and what XNNPACK serializes, below it. Fitted to the random Llama-3.2-1B at 8k
# and a 2-layer model of its width (the same table, a quarter of the weights), so the matrix term is separated from
# the weights' (export_cost_llama_3.2_1b{,_2layers}_random_pte_int4_8k_lean.json, tests/test_export_budget.py).
K_PTE_NARROW = {"int8": 0.5, "int4": 0.5}
PTE_NARROW_MATRIX = 1.2
STATE_COPIES = 3  # the eager state, the runtime's past and present state while verifying
# CPU seconds per billion parameters (one core of the 2-core reference VM, x86-64 AMD EPYC): load, trace, lower,
# serialize and verify per format; the quantize and verify-quant stages on top for int8 / int4 / fp16. A busy host
# takes longer in wall time.
SEC_PER_GPARAM = {"onnx": 150.0, "quantize-onnx": 150.0, "pte": 1000.0, "quantize-pte": 300.0}
SEC_BASE = 45.0  # imports, tokenizer, the verify prompt's steps
# a .pte-only int8 / int4 export of a bf16 / fp16 folder (narrow from the load on, verify-pte's eager linears through
# edgekv.export.eager_linear): the random Llama-3.2-1B's int4 .pte at 8k took 328.8 s of CPU, (328.8 - 45) / 1.236
# = 230 s per billion parameters (benchmarks/results/export_cost_llama_3.2_1b_random_pte_int4_8k_fastverify.json)
SEC_PTE_NARROW = 240.0


def estimate(arch, strategy, max_ctx: int, formats, weights: str, chunk: int, narrow: bool = False) -> dict:
    """{"peak_bytes", "seconds", "params", "weights_fp32", "state_bytes"}: what the export is expected to need.
    narrow: the export keeps the checkpoint's weights narrow from the load on (narrow_export)."""
    params = arch.n_params
    w32 = 4 * params
    state = _state_bytes(arch, strategy, max_ctx, formats, weights, chunk)
    matrix = 0
    if narrow and weights in K_NARROW and tuple(formats) == ("onnx",):
        k = K_NARROW[weights]
    elif narrow and weights in K_PTE_NARROW and tuple(formats) == ("pte",):
        k = K_PTE_NARROW[weights]
        matrix = PTE_NARROW_MATRIX * 4 * max((w.numel for w in arch.weights), default=0)
    else:
        k = max(K_ONNX.get(weights, 4.75) if f == "onnx" else K_PTE.get(weights, 6.0) for f in formats)
    peak = BASE + k * w32 + matrix + STATE_COPIES * state
    if weights == "gguf":  # ONNX only
        largest = 4 * max((w.numel for w in arch.weights), default=0)
        peak = BASE + max(k * w32 + GGUF_MATRIX * largest + state, w32 / 4 + STATE_COPIES * state)
    g = params / 1e9
    secs = SEC_BASE
    for f in formats:
        if matrix:  # the narrow .pte route (K_PTE_NARROW above)
            secs += SEC_PTE_NARROW * g
            continue
        secs += SEC_PER_GPARAM[f] * g
        if weights != "fp32":
            secs += SEC_PER_GPARAM[f"quantize-{f}"] * g
    return {"peak_bytes": int(peak), "seconds": round(secs), "params": params, "weights_fp32": w32,
            "state_bytes": state, "copies": k, "matrix_bytes": int(matrix)}


def _state_bytes(arch, strategy, max_ctx, formats, weights, chunk) -> int:
    """The plan's state bytes at max_ctx for this strategy (edgekv.export.options.planned), the largest over the
    formats; 0 where the planner has no row for it (the weights term then carries the estimate)."""
    from ..strategies import NotApplicable
    from .options import planned
    try:
        p = planned(arch, strategy, max_ctx, formats, chunk, weights)
    except (EdgekvError, NotApplicable, KeyError, ValueError, TypeError):
        return 0
    return max(int(f["bytes"].get("state", 0)) for f in p["formats"].values())


def available(max_memory: str | None = None) -> tuple[int | None, str]:
    """(bytes the export may use, where that figure comes from); (None, ...) where nothing is known."""
    given = max_memory or os.environ.get(ENV)
    if given:  # a limit the user states replaces what the machine reports (swap, a share of a shared host)
        source = "--max-memory" if max_memory else ENV
        try:
            return parse_bytes(given), source
        except EdgekvError as e:
            raise EdgekvError(f"{source}: {e}") from None
    found = []
    mem = _meminfo_available()
    if mem is not None:
        found.append((mem, "MemAvailable"))
    cg = _cgroup_headroom()
    if cg is not None:
        found.append((cg, "the cgroup's memory.max"))
    if not found:
        return None, "unknown"
    return min(found)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:  # no psutil, or a platform it does not read
        return None


def _cgroup_headroom() -> int | None:
    try:
        cg = Path("/proc/self/cgroup").read_text().strip().splitlines()
        rel = next(ln.split("::", 1)[1] for ln in cg if ln.startswith("0::"))
        d = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (d / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((d / "memory.current").read_text().strip())
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def check(arch, strategy, max_ctx, formats, weights, chunk, max_memory=None, narrow: bool = False) -> dict:
    """Refuse with one line when the memory available is below the estimated peak; else return the estimate, its
    one-line summary under "line" (printed by the caller where its output starts)."""
    e = estimate(arch, strategy, max_ctx, formats, weights, chunk, narrow)
    limit, source = available(max_memory)
    p = e["params"]
    what = (f"{p / 1e9:.2f}B" if p >= 1e9 else f"{p / 1e6:.3g}M") + f" parameters: fp32 weights " \
        f"{fmt_mem(e['weights_fp32'])} x {e['copies']:g}, " + \
        (f"largest matrix fp32 {fmt_mem(e['matrix_bytes'] / PTE_NARROW_MATRIX)} x {PTE_NARROW_MATRIX:g}, "
         if e.get("matrix_bytes") else "") + f"state {fmt_mem(e['state_bytes'])} x {STATE_COPIES}"
    if limit is not None and e["peak_bytes"] > limit:
        raise EdgekvError(f"this export needs about {fmt_mem(e['peak_bytes'])} of memory at its peak ({what}) and "
                          f"{fmt_mem(limit)} is available ({source}): free memory, export a smaller --max-ctx or "
                          f"one --format at a time, or state the memory to plan for with --max-memory / {ENV}")
    mins = max(1, round(e["seconds"] / 60))
    line = (f"estimate: peak memory about {fmt_mem(e['peak_bytes'])} ({what}), about {mins} min of CPU time (one "
            "x86-64 core; longer on a busy host)" + (f"; {fmt_mem(limit)} available ({source})" if limit else ""))
    return {**e, "available": limit, "available_source": source, "line": line}


def check_export(opts, strategy) -> dict:
    """check() for an `edgekv export`'s options: the model's Arch from its config.json or GGUF header (no weights)."""
    from ..arch import read_config_json, read_gguf
    from ..models.weights import resolve_model

    src = resolve_model(opts.model)
    arch = read_gguf(src) if src.suffix.lower() == ".gguf" else read_config_json(src)
    return check(arch, strategy, opts.max_ctx, opts.formats, opts.weights, max(1, min(opts.prefill_chunk, opts.max_ctx)),
                 opts.max_memory, narrow_export(src, opts))


def narrow_export(src: Path, opts) -> bool:
    """Whether the export keeps the checkpoint's weights narrow from the load on (narrow_route.narrow_load): an
    ONNX-only int8 / int4 / int4-mix export without the GenAI runner, or a .pte-only int8 / int4 one
    (narrow_route.pte_narrow), of a safetensors folder whose config.json stores bf16 or fp16 weights."""
    onnx = tuple(opts.formats) == ("onnx",) and opts.weights in K_NARROW and "genai" not in (opts.runners or ())
    pte = tuple(opts.formats) == ("pte",) and opts.weights in K_PTE_NARROW
    if not (onnx or pte):
        return False
    if not (src.is_dir() and (src / "config.json").is_file()):
        return False
    from ..jsonfile import read_config
    try:
        cfg = read_config(src / "config.json")
    except EdgekvError:
        return False
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "") in ("bfloat16", "float16")
