"""Predicted vs measured memory for every strategy with an export: `edgekv profile` against the planner.

    .venv/bin/python benchmarks/plan_accuracy.py [--quick] [--work /tmp/plan_accuracy] [--json out.json]

For each (strategy, runtime, ctx): export with --max-ctx ctx (the state size is fixed by the export), then
`edgekv profile --ctx ctx` in a fresh process. Target (issue 5): measured peak - runtime baseline within 10% of the
prediction; ssm memory at 32k within 2% of that at 1k. Exports are kept in --work and reused (the slow part: 40-200 s
each on 2 cores; a 32k ORT prefill of the tiny Llama in 512-token calls takes about 5 minutes).

Models: the trained tiny fixtures (fixtures/tiny/: Llama for kv/window/mla, Mamba for ssm, RWKV for linear), whose
7 MB of weights make the state and the runtime's own costs dominate at long contexts -- a check of the state and
workspace arithmetic more than of weight loading; the tiny Llama's config says max_position_embeddings 8192, so a copy
with 32768 (same trained weights; positions past 8k are untrained, which memory does not care about) is used at 32k.
Real-model rows: SmolLM2-135M at 1k and 8k, kv fp16 and kv-int8 in ONNX and ExecuTorch, kv-int4, window, mla in ONNX.
Gemma-3-270M (kv fp32, ONNX; its rows go to their own file: --only 'kv fp32 Gemma-3-270M,kv fp32 Gemma-3-270M (max_ctx
32768 export)' --json benchmarks/results/plan_accuracy_gemma3_270m.json): exports at 1k, 8k and 32k, each profiled
with its context filled (ctx - 8 prompt tokens of real text, then 8 decoded), and the 32k export at 1k and 8k. Its
run peaks while ORT loads (the tied head packed from the 671 MB table's pages, before the state exists), the same at
every context, so each row also reports the calls' own peak (the profile child resets VmHWM after loading), which
grows with the 3 global layers' slots, beside the plan's weights + state + a call's workspace + session.

Llama-3.2-1B at its published shapes (random weights, int4): an 8k export profiled at a filled 1k and 8k, and a 32k
export filled to 32k with its state written directly (FILLED_STATE, filled_state(): a 32k prefill of a 1B on one core
runs for hours); --filled-state measures the 8k export's rows that way too, beside their real prefill. The same model
as an int4 kv-int8c .pte read by edgekv's own int8 kernel (EXTRA_EXPORT_ARGS): an 8k export profiled at a filled 1k and
8k by a real prefill (benchmarks/results/plan_accuracy_llama32_1b_random_pte.json).

How the runtime constants in edgekv/costs/workspace.json were probed, and how each planner term moved these rows
when it was added: benchmarks/log/plan_accuracy_probes.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from edgekv.children import child_setup  # a child dies with this process

ROOT = Path(__file__).resolve().parents[1]
EDGEKV = [str(Path(sys.executable).parent / "edgekv")]
TINY = ROOT / "fixtures" / "tiny"
# (label, model, strategy, runtime, contexts in the full run[, the export's max_ctx when it is not each context]);
# "llama32k" = the tiny Llama with a 32k position limit
CASES = [
    ("kv fp16", "llama", "kv", "ort", (1024, 8192, 32768)),
    ("kv fp16", "llama", "kv", "executorch", (1024, 8192, 32768)),
    ("kv-int8", "llama", "kv-int8", "ort", (1024, 8192, 32768)),
    ("kv-int8", "llama", "kv-int8", "executorch", (1024, 8192, 32768)),
    ("kv-int4 g16", "llama", "kv-int4:group=16", "ort", (1024, 8192, 32768)),  # head_dim 48: not a multiple of 32
    ("kv-int4 g16", "llama", "kv-int4:group=16", "executorch", (1024, 8192, 32768)),
    ("kv-int8 g16", "llama", "kv-int8:group=16", "executorch", (1024, 8192, 32768)),  # the .pte's cast + multiply
    ("window", "llama", "window", "ort", (1024, 8192, 32768)),
    ("mla", "llama", "mla", "ort", (1024, 8192, 32768)),
    ("ssm", "mamba", "ssm", "ort", (1024, 8192, 32768)),
    ("linear", "rwkv", "linear", "ort", (1024, 8192, 32768)),
    ("hybrid", "jamba", "hybrid", "ort", (1024, 8192, 32768)),
    ("kv fp16 SmolLM2-135M", "smollm2-135m", "kv", "ort", (1024, 8192)),
    ("kv fp16 SmolLM2-135M", "smollm2-135m", "kv", "executorch", (1024, 8192)),
    # the same strategies on the real model, where the ORT session (~20 MB, 15-31 MB by graph) and glibc's heap
    # slack (up to 8 MiB) are a few % of the total instead of half of it
    ("kv-int8 SmolLM2-135M", "smollm2-135m", "kv-int8", "ort", (1024, 8192)),
    ("kv-int8 SmolLM2-135M", "smollm2-135m", "kv-int8", "executorch", (1024, 8192)),
    ("kv-int4 SmolLM2-135M", "smollm2-135m", "kv-int4", "ort", (1024, 8192)),
    ("kv-int4 SmolLM2-135M", "smollm2-135m", "kv-int4", "executorch", (1024, 8192)),
    ("window SmolLM2-135M", "smollm2-135m", "window:w=512,sinks=4", "ort", (1024, 8192)),
    ("mla SmolLM2-135M", "smollm2-135m", "mla", "ort", (1024, 8192)),
    # Gemma 3's native state: 15 sliding layers of 512 slots (flat) + 3 global layers that grow with the context
    ("kv fp32 Gemma-3-270M", "gemma-3-270m", "kv:dtype=fp32", "ort", (1024, 8192, 32768)),
    # the 32k export (the same folder as the row above at 32768) with shorter prompts: its state is allocated whole
    ("kv fp32 Gemma-3-270M (max_ctx 32768 export)", "gemma-3-270m", "kv:dtype=fp32", "ort", (1024, 8192), 32768),
    # Llama-3.2-1B at its published shapes with seeded random weights (scripts/make_random_model.py, written into
    # --work; memory follows the shapes, not trained values), int4 weights: one 8k export, profiled at a filled 1k
    # and 8k. Its export peaks near 6 GB: on a shared host run it under the host's lock (its rows: --only 'kv fp16
    # Llama-3.2-1B random int4' --json benchmarks/results/plan_accuracy_llama32_1b_random.json)
    ("kv fp16 Llama-3.2-1B random int4", "random:llama-3.2-1b", "kv", "ort", (1024, 8192), 8192),
    # the same at 32768 slots, filled to 32k: a 32k prefill of a 1B on one core runs for hours, so its rows write
    # the state a prompt leaves directly and run the prompt's last call and the decode steps (FILLED_STATE; the
    # 8k export's rows, filled by a real prefill, are measured both ways: --filled-state)
    ("kv fp16 Llama-3.2-1B random int4 (max_ctx 32768 export)", "random:llama-3.2-1b", "kv", "ort", (32768,), 32768),
    # the same model as a .pte: int4 weights, the int8 cache with static per-channel scales read by edgekv's own
    # kernel (EXTRA_EXPORT_ARGS), one 8k export profiled at a filled 1k and 8k by a real prefill (~47 tokens per CPU
    # s: 8k is ~3 CPU min; the export ~6.5 min and 5.2 GB: run it under the host's lock. Its rows: --only
    # 'kv-int8c Llama-3.2-1B random int4' --json benchmarks/results/plan_accuracy_llama32_1b_random_pte.json)
    ("kv-int8c Llama-3.2-1B random int4", "random:llama-3.2-1b", "kv-int8c", "executorch", (1024, 8192), 8192),
    # the same .pte at 32768 slots, filled to 32k positionally (FILLED_CHILD_PTE: a 32k prefill of the 1B on one
    # core runs for most of an hour); --filled-state measures the 8k export's rows that way too, beside their prefill
    ("kv-int8c Llama-3.2-1B random int4 (max_ctx 32768 export)", "random:llama-3.2-1b", "kv-int8c", "executorch",
     (32768,), 32768),
    # Llama-3.2-3B's shapes the same way: one 8k .pte (its cost: results/export_cost_llama_3.2_3b_random_pte_*),
    # filled positionally
    ("kv-int8c Llama-3.2-3B random int4", "random:llama-3.2-3b", "kv-int8c", "executorch", (1024, 8192), 8192),
]
WEIGHTS = {"kv fp16 Llama-3.2-1B random int4": "int4",  # --weights of a row's export where not fp32
           "kv fp16 Llama-3.2-1B random int4 (max_ctx 32768 export)": "int4",
           "kv-int8c Llama-3.2-1B random int4": "int4",
           "kv-int8c Llama-3.2-1B random int4 (max_ctx 32768 export)": "int4",
           "kv-int8c Llama-3.2-3B random int4": "int4"}
EXTRA_EXPORT_ARGS = {"kv-int8c Llama-3.2-1B random int4": ["--pte-kernel", "edgekv"],  # a row's other options
                     "kv-int8c Llama-3.2-1B random int4 (max_ctx 32768 export)": ["--pte-kernel", "edgekv"],
                     "kv-int8c Llama-3.2-3B random int4": ["--pte-kernel", "edgekv"]}
FILLED_STATE = {"kv fp16 Llama-3.2-1B random int4 (max_ctx 32768 export)",  # rows measured by filled_state()
                "kv-int8c Llama-3.2-1B random int4 (max_ctx 32768 export)", "kv-int8c Llama-3.2-3B random int4"}
QUICK_CTX = (1024, 8192)


def tiny_jamba(work: Path) -> Path:
    """No trained hybrid fixture exists: a tiny random Jamba (transformers' JambaConfig, save_pretrained, as
    tests/test_export_strategies.py builds one). Weights do not matter for memory; the layout (2 Mamba + 2 attention
    layers, MoE on every other layer) does. Reported as such in the output."""
    dst = work / "jamba"
    if not (dst / "config.json").is_file():
        import torch
        from transformers import JambaConfig, JambaForCausalLM
        torch.manual_seed(0)
        cfg = JambaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                          attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
                          mamba_d_state=16, mamba_dt_rank=8, max_position_embeddings=32768)
        JambaForCausalLM(cfg).save_pretrained(dst)
    return dst


def model_path(name: str | None, ctx: int, work: Path) -> str | None:
    if name is None:
        return None
    if name == "jamba":
        return str(tiny_jamba(work))
    if name.startswith("random:"):  # a catalog config's shapes, seeded random weights, made once into --work
        dst = work / name.split(":", 1)[1]
        if not (dst / "config.json").is_file():
            sys.path.insert(0, str(ROOT / "scripts"))
            from make_random_model import make
            make(dst.name, dst, gguf_file=False)
        return str(dst)
    if name == "llama" and ctx > 8192:
        dst = work / "llama32k"
        if not (dst / "config.json").is_file():
            dst.mkdir(parents=True, exist_ok=True)
            for f in ("model.safetensors", "generation_config.json"):
                shutil.copy(TINY / "llama" / f, dst / f)
            cfg = json.loads((TINY / "llama" / "config.json").read_text())
            cfg["max_position_embeddings"] = 32768
            (dst / "config.json").write_text(json.dumps(cfg, indent=2))
        return str(dst)
    return str(TINY / name) if (TINY / name).is_dir() else name


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"


def folder_name(label: str, fmt: str, max_ctx: int) -> str:
    """The export folder of a row under --work: one per (model and strategy, format, max_ctx); a label's
    " (max_ctx N export)" suffix names the same export as the plain label's row at N."""
    return f"{label.split(' (max_ctx')[0].replace(' ', '_')}-{fmt}-{max_ctx}"


def export(model: str, strategy: str, fmt: str, ctx: int, out: Path, weights: str = "fp32",
           extra: list[str] = ()) -> str | None:
    """None when out holds a finished export, else the error line. extra: further `edgekv export` options."""
    if (out / "manifest.json").is_file():
        return None
    p = subprocess.run(EDGEKV + ["export", "--model", model, "--strategy", strategy, "--format", fmt, "--max-ctx",
                                 str(ctx), "--out", str(out), "--verify-steps", "0", "--threads", "1", "--force",
                                 "--weights", weights, *extra],
                       capture_output=True, text=True, cwd=ROOT, preexec_fn=child_setup())
    return None if p.returncode == 0 else last_line(p.stderr or p.stdout)


def profile(out: Path, runtime: str, ctx: int, steps: int, repeats: int = 1) -> dict:
    p = subprocess.run(EDGEKV + ["profile", str(out), "--ctx", str(ctx), "--steps", str(steps), "--threads", "1",
                                 "--runtime", runtime, "--repeats", str(repeats), "--json"],
                       capture_output=True, text=True, cwd=ROOT, preexec_fn=child_setup())
    if p.returncode != 0:
        return {"error": last_line(p.stderr)}
    rep = json.loads(p.stdout)
    r = rep["runs"][0]
    if r.get("measured_bytes") is None:
        return {"error": r.get("status", "no measurement")}
    return {"predicted_bytes": r["predicted_bytes"], "measured_bytes": r["measured_bytes"],
            "predicted_components": r["predicted_components"], "measured_components": r.get("measured_components"),
            "runtime_baseline_bytes": r["runtime_baseline_bytes"], "prefill_chunk": rep.get("prefill_chunk"),
            "prefill_seconds": r.get("prefill_seconds"), "tokens_per_s": r.get("tokens_per_s"),
            "error_pct": r["error_pct"], "within_target": abs(r["error_pct"]) <= 10.0,
            "prompt_tokens": r["prompt_tokens"], "load_average": [round(x, 2) for x in os.getloadavg()],
            **{k: r[k] for k in ("predicted_calls_bytes", "calls_error_pct") if k in r},
            **({"measured_bytes_runs": r["measured_bytes_runs"]} if "measured_bytes_runs" in r else {})}


STEADY_CHILD = """
import json, os, sys
os.environ["OMP_NUM_THREADS"] = "1"
import onnxruntime as ort
from pathlib import Path
from edgekv.export.manifest import load_export
from edgekv.export.runtime import OrtStepper
from edgekv.profile.procmem import hwm, reset_hwm, rss
folder, c = Path(sys.argv[1]), int(sys.argv[2])
plain = ort.InferenceSession
def session(path, opts, **kw):  # ORT keeps no blocks between calls: the peak is the call's own tensors
    opts.enable_cpu_mem_arena = False
    opts.enable_mem_pattern = False
    return plain(path, opts, **kw)
ort.InferenceSession = session
base = rss(); reset_hwm()
m = load_export(folder, check_hashes=False)
st = OrtStepper(m, folder, 1)
v = m["model"]["vocab"]
for k in range(3):  # from the 2nd call on, the feed is a resident state (a first call's zeros are not yet)
    st.step([(7919 * (k * c + i)) % v for i in range(c)], k * c, last=True)  # the last row's logits, as prefill
st.step([1], 3 * c)
print(json.dumps({"steady_bytes": hwm() - base}))
"""


def steady(folder: Path, chunk: int) -> int | None:
    """Peak of 3 prefill calls + 1 decode call with ORT's arena and memory patterns off, above the ORT baseline, at
    the start of the state (positions 0 to 3 x chunk) and under glibc's default malloc settings. edgekv's stepper,
    which the profile rows run, turns the arena and memory patterns off as well (OrtStepper lean)."""
    p = subprocess.run([sys.executable, "-c", STEADY_CHILD, str(folder), str(chunk)], capture_output=True,
                       text=True, cwd=ROOT, preexec_fn=child_setup())
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    return json.loads(line)["steady_bytes"] if line else None


FILLED_CHILD = """
import ctypes, json, sys
import numpy as np
import onnxruntime  # noqa: F401  (the baseline is taken after importing the runtime, as edgekv.profile.child does)
from pathlib import Path
from edgekv.export.manifest import load_export
from edgekv.export.runtime import OrtStepper
from edgekv.profile.procmem import hwm, reset_hwm, rss
folder, ctx, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
m = load_export(folder, check_hashes=False)
base = rss(); reset_hwm()
st = OrtStepper(m, folder, 1)  # edgekv's stepper: ORT's arena and memory patterns off, as the profile and the app run
out = {"runtime_baseline_bytes": base, "after_load_bytes": rss(), "load_peak_bytes": hwm()}
v, c, n = m["model"]["vocab"], st.max_chunk, ctx - steps
# the rows a prompt of n tokens leaves in each [1, Hkv, T, D] buffer, random values (one layer's rows at a time)
rng = np.random.default_rng(0)
for a in st.state_arrays():
    a[:, :, :n] = rng.standard_normal((a.shape[0], a.shape[1], n, a.shape[3]), dtype=np.float32).astype(a.dtype)
ctypes.CDLL(None).malloc_trim(0)  # the fill's own temporaries are not the model's
out["after_fill_bytes"] = rss()
reset_hwm()
st.step([(7919 * i) % v for i in range(c)], n - c, last=True)  # the prompt's last call, as the profile's prefill ends
out["after_prefill_bytes"] = rss()
for i in range(steps):
    st.step([1], n + i)
out["calls_peak_bytes"] = hwm()
print(json.dumps(out))
"""


# The .pte's state is the program's own mutable buffers, which no API writes from outside; ExecuTorch allocates
# them whole when the method loads (the 8k export's rows held the same bytes at a filled 1k and 8k:
# results/plan_accuracy_llama32_1b_random_pte.json). So its "fill" is positional: the prompt's last call at position
# ctx - steps - C and the decode steps after it, each reading every key up to its position (the kernels' scratch
# at its full size), over the zeros the load left in the rows before. Same memory, not the same values.
FILLED_CHILD_PTE = """
import ctypes, json, sys
from executorch.runtime import Runtime  # noqa: F401  (the baseline after the runtime's import, as edgekv.profile.child)
from pathlib import Path
from edgekv.export.manifest import load_export
from edgekv.export.runtime import open_stepper
from edgekv.profile.procmem import hwm, reset_hwm, rss
folder, ctx, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
m = load_export(folder, check_hashes=False)
base = rss(); reset_hwm()
st = open_stepper(folder, m, "executorch", 1)
out = {"runtime_baseline_bytes": base, "after_load_bytes": rss(), "load_peak_bytes": hwm()}
v, c, n = m["model"]["vocab"], st.chunk or st.max_chunk, ctx - steps
out["after_fill_bytes"] = rss()
reset_hwm()
st.step([(7919 * i) % v for i in range(c)], n - c, last=True)  # the prompt's last call, as the profile's prefill ends
ctypes.CDLL(None).malloc_trim(0)  # as the profile's heap_trimmer after each call
out["after_prefill_bytes"] = rss()
for i in range(steps):
    st.step([1], n + i)
out["calls_peak_bytes"] = hwm()
print(json.dumps(out))
"""


def filled_state(out: Path, ctx: int, steps: int, runtime: str = "ort") -> dict:
    """A row measured with its state filled directly: a fresh process loads the export through edgekv's stepper
    (the profile's malloc settings), writes random rows into the positions a prompt of ctx - steps tokens leaves
    (ONNX Runtime; a .pte's is positional: FILLED_CHILD_PTE), then runs that prompt's last call and `steps` decode
    steps. Peak above the runtime's baseline = the larger of the load's and the calls' peaks, as `edgekv profile`
    measures; the predicted side is the profile's (predicted)."""
    from edgekv.children import child_setup
    from edgekv.export.manifest import load_export
    from edgekv.profile.run import child_env, predicted, prefill_chunk
    child = FILLED_CHILD_PTE if runtime == "executorch" else FILLED_CHILD
    p = subprocess.run([sys.executable, "-c", child, str(out), str(ctx), str(steps)], capture_output=True,
                       text=True, cwd=ROOT, env={**child_env(), "OMP_NUM_THREADS": "1"}, preexec_fn=child_setup())
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    if line is None:
        return {"error": last_line(p.stderr)}
    r = json.loads(line)
    base = r["runtime_baseline_bytes"]
    m = load_export(out, check_hashes=False)
    pred = predicted(m, runtime, ctx)
    calls = pred.pop("explain")["calls_bytes"]
    measured = max(r["load_peak_bytes"], r["calls_peak_bytes"]) - base
    total = sum(pred.values())
    return {"predicted_bytes": total, "measured_bytes": measured, "predicted_components": pred,
            "measured_components": {"weights+state": r["after_load_bytes"] - base,
                                    "load_peak": r["load_peak_bytes"] - base,
                                    "after_fill": r["after_fill_bytes"] - base,
                                    "calls_peak": r["calls_peak_bytes"] - base,
                                    "after_prefill": r["after_prefill_bytes"] - base},
            "runtime_baseline_bytes": base, "prefill_chunk": prefill_chunk(m, runtime),
            "error_pct": 100.0 * (measured - total) / total, "within_target": abs(measured - total) <= 0.10 * total,
            "prompt_tokens": ctx - steps, "predicted_calls_bytes": calls,
            "calls_error_pct": 100.0 * (r["calls_peak_bytes"] - base - calls) / calls,
            "fill": ("state written directly (plan_accuracy.py filled_state), the prompt's last call + decode"
                     if runtime == "ort" else "positional: the .pte's state allocated whole at load, the prompt's "
                     "last call at its position + decode (plan_accuracy.py FILLED_CHILD_PTE)"),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def repredict(rows: list[dict], work: Path) -> None:
    """Recompute each stored row's prediction with the planner as it is now (the measurement stays): the
    prediction is a pure function of the export (model, strategy, max_ctx) and the runtime's call size."""
    from edgekv.export.manifest import load_export
    from edgekv.profile.run import predicted
    for r in rows:
        fmt = "onnx" if r["runtime"] == "ort" else "pte"
        folder = work / folder_name(r["strategy"], fmt, r.get("max_ctx", r["ctx"]))
        if not (folder / "manifest.json").is_file():
            print(f"  {r['strategy']} {r['runtime']} {r['ctx']}: no export in {folder}, prediction kept",
                  file=sys.stderr)
            continue
        pred = predicted(load_export(folder, check_hashes=False), r["runtime"], r["ctx"])
        calls = (pred.pop("explain", None) or {}).get("calls_bytes")
        if calls is not None and "calls_peak" in (r.get("measured_components") or {}):
            r["predicted_calls_bytes"] = calls
            r["calls_error_pct"] = 100.0 * (r["measured_components"]["calls_peak"] - calls) / calls
        r["predicted_components"], r["predicted_bytes"] = pred, sum(pred.values())
        r["error_pct"] = 100.0 * (r["measured_bytes"] - r["predicted_bytes"]) / r["predicted_bytes"]
        r["within_target"] = abs(r["error_pct"]) <= 10.0
        for k in ("steady", "filled_state"):  # the other measurements of the row, against the same prediction
            if r.get(f"{k}_bytes"):
                r[f"{k}_error_pct"] = 100.0 * (r[f"{k}_bytes"] - r["predicted_bytes"]) / r["predicted_bytes"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"contexts {QUICK_CTX} only")
    ap.add_argument("--work", default="/tmp/plan_accuracy", help="where exports are kept and reused")
    ap.add_argument("--json", dest="json_out", default=str(ROOT / "benchmarks" / "results" / "plan_accuracy.json"),
                    help="write the rows here (merged with the rows already there, keyed by strategy/runtime/ctx)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per profile run")
    ap.add_argument("--ctx", default=None, help="comma-separated contexts to run, e.g. 1024 (default: all)")
    ap.add_argument("--only", default=None, help="comma-separated strategy labels to run (e.g. 'kv fp16,ssm')")
    ap.add_argument("--runtime", choices=("ort", "executorch"), default=None, help="only the rows of this runtime")
    ap.add_argument("--repeats", type=int, default=1,
                    help="fresh processes per row; each row is the run with the median memory (edgekv profile --repeats)")
    ap.add_argument("--export-only", action="store_true", help="make the exports, profile nothing (rows kept)")
    ap.add_argument("--steady", action="store_true", help="measure nothing else: add each stored ORT row's "
                    "steady-state call peak with the arena and memory patterns off (steady_bytes)")
    ap.add_argument("--filled-state", action="store_true", help="measure nothing else: add each stored row's "
                    "peak with its state written directly (a .pte's: positionally) (filled_state: filled_state_bytes), beside its prefill's")
    ap.add_argument("--repredict", action="store_true",
                    help="measure nothing: recompute the stored rows' predictions with the current planner")
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    only = set(a.only.split(",")) if a.only else None
    rows, failed = [], []
    t0 = time.perf_counter()
    for label, model, strategy, runtime, ctxs, *fixed in ([] if a.repredict or a.steady or a.filled_state
                                                          else CASES):
        if (only and label not in only) or (a.runtime and runtime != a.runtime):
            continue
        want = {int(c) for c in a.ctx.split(",")} if a.ctx else None
        for ctx in (c for c in ctxs if (not a.quick or c in QUICK_CTX) and (want is None or c in want)):
            max_ctx = fixed[0] if fixed else ctx
            src = model_path(model, max_ctx, work)
            if src is None:
                failed.append({"strategy": label, "runtime": runtime, "ctx": ctx,
                               "error": "no hybrid model here: no trained tiny Jamba/Zamba fixture in fixtures/tiny/"})
                continue
            fmt = "onnx" if runtime == "ort" else "pte"
            out = work / folder_name(label, fmt, max_ctx)
            err = export(src, strategy, fmt, max_ctx, out, WEIGHTS.get(label, "fp32"), EXTRA_EXPORT_ARGS.get(label, ()))
            row = {"strategy": label, "runtime": runtime, "ctx": ctx, **({"max_ctx": max_ctx} if fixed else {})}
            if a.export_only:
                print(f"  {label} {runtime} {ctx}: export " + (err or "ok"), file=sys.stderr, flush=True)
                continue
            if err is None:
                res = (filled_state(out, ctx, a.steps, runtime) if label in FILLED_STATE
                       else profile(out, runtime, ctx, a.steps, a.repeats))
                err = res.pop("error", None)
                row.update(res)
            if err is not None:
                failed.append({**row, "error": err})
            else:
                rows.append(row)
            print(f"  {label} {runtime} {ctx}: " + (f"error: {err}" if err else f"{row['error_pct']:+.1f}%"),
                  file=sys.stderr, flush=True)
    if a.export_only:
        return 0
    key = lambda r: (r["strategy"], r["runtime"], r["ctx"])  # noqa: E731
    old = None
    if a.json_out and Path(a.json_out).is_file():  # keep the rows of earlier (partial) runs this one did not redo
        old = json.loads(Path(a.json_out).read_text())
        done = {key(r) for r in rows + failed}
        rows += [r for r in old.get("rows", []) if key(r) not in done]
        failed += [r for r in old.get("failed", []) if key(r) not in done]
    if a.repredict:
        repredict(rows, work)
    if a.steady:
        for r in rows:
            if r["runtime"] == "ort" and (only is None or r["strategy"] in only):
                folder = work / folder_name(r["strategy"], "onnx", r.get("max_ctx", r["ctx"]))
                r["steady_bytes"] = steady(folder, r["prefill_chunk"])
                if r["steady_bytes"]:
                    r["steady_error_pct"] = 100.0 * (r["steady_bytes"] - r["predicted_bytes"]) / r["predicted_bytes"]
                print(f"  {r['strategy']} {r['ctx']}: steady {r.get('steady_error_pct', float('nan')):+.1f}%",
                      file=sys.stderr, flush=True)
    if a.filled_state:
        for r in rows:
            if (only is None or r["strategy"] in only) and "fill" not in r:
                fmt = "onnx" if r["runtime"] == "ort" else "pte"
                folder = work / folder_name(r["strategy"], fmt, r.get("max_ctx", r["ctx"]))
                res = filled_state(folder, r["ctx"], a.steps, r["runtime"])
                if "measured_bytes" in res:
                    r["filled_state_bytes"] = res["measured_bytes"]
                    r["filled_state_components"] = res["measured_components"]
                    r["filled_state_load_average"] = res["load_average"]
                    r["filled_state_error_pct"] = 100.0 * (res["measured_bytes"] - r["predicted_bytes"]) / \
                        r["predicted_bytes"]
                print(f"  {r['strategy']} {r['ctx']}: filled state {r.get('filled_state_error_pct', float('nan')):+.1f}%"
                      f" (its prefill's {r['error_pct']:+.1f}%)", file=sys.stderr, flush=True)
    order = {(c[0], c[3]): i for i, c in enumerate(CASES)}
    rows.sort(key=lambda r: (order.get((r["strategy"], r["runtime"]), 99), r["ctx"]))
    ssm = {r["ctx"]: r["measured_bytes"] for r in rows if r["strategy"] == "ssm"}
    flat = None
    if 1024 in ssm and max(ssm) > 1024:
        flat = 100.0 * (ssm[max(ssm)] - ssm[1024]) / ssm[1024]
    print(f"{'strategy':<22} {'runtime':<10} {'ctx':>6} {'chunk':>5} {'predicted MB':>12} {'measured MB':>12} "
          f"{'error':>8}  within 10%  {'steady MB':>9} {'error':>7}")
    for r in rows:
        st = (f"{r['steady_bytes'] / 1e6:>9.1f} {r['steady_error_pct']:>+6.1f}%" if r.get("steady_bytes")
              else f"{'-':>9} {'-':>7}")
        print(f"{r['strategy']:<22} {r['runtime']:<10} {r['ctx']:>6} {r.get('prefill_chunk') or '-':>5} "
              f"{r['predicted_bytes'] / 1e6:>12.1f} {r['measured_bytes'] / 1e6:>12.1f} {r['error_pct']:>+7.1f}%  "
              f"{'yes' if r['within_target'] else 'NO ':<10}  {st}")
    print("MB = 1e6 bytes; measured = peak RSS (VmHWM) - RSS after importing the runtime, each run a fresh process "
          "(`edgekv profile`: edgekv's stepper, ONNX Runtime's arena and memory patterns off as the manifest's "
          "deployment and the Android app set them).")
    print("steady = peak of 3 prefill calls + 1 decode call at the start of the state (positions 0 to 3 x chunk), "
          "arena and memory patterns off, glibc's default malloc settings; filled state (--filled-state, and the "
          "rows of FILLED_STATE) = the state a prompt of ctx - steps tokens leaves written directly, then that "
          "prompt's last call and the decode steps, in the profile's malloc settings.")
    print("hybrid: a tiny random Jamba (no trained hybrid fixture; weights do not change memory).")
    calls = [r for r in rows
             if r.get("predicted_calls_bytes") and (r.get("measured_components") or {}).get("calls_peak")]
    if calls:  # where the load is the run's peak (a tied head packed from the table), the calls' own peak grows
        print("the calls' own peak (VmHWM reset after loading) against the plan's weights + state + a call's workspace "
              "+ session; after prefill = resident once the prompt is in:")
    for r in calls:
        c = r["measured_components"]
        print(f"  {r['strategy']:<44} {r['ctx']:>6}: load peak {c['load_peak'] / 1e6:8.1f}  calls planned "
              f"{r['predicted_calls_bytes'] / 1e6:8.1f} measured {c['calls_peak'] / 1e6:8.1f} "
              f"{r['calls_error_pct']:+6.1f}%  after prefill {c.get('after_prefill', 0) / 1e6:8.1f}  "
              f"(state {r['predicted_components']['state'] / 1e6:.1f} MB planned)")
    if flat is not None:
        print(f"ssm: measured at {max(ssm)} vs 1024: {flat:+.1f}% ({'within' if abs(flat) <= 2 else 'OUTSIDE'} 2%)")
    for f in failed:
        print(f"not measured: {f['strategy']} {f['runtime']} {f['ctx']}: {f['error']}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        # what else the file says (how it was run, derived figures) stays; a rerun's rows may make it stale, so the
        # keys kept are named on stderr
        kept = {k: v for k, v in old.items() if k not in ("rows", "failed", "ssm_flat_pct")} if old else {}
        if kept:
            print(f"kept from {a.json_out}: {', '.join(kept)} (update them if this run changed what they say)",
                  file=sys.stderr)
        Path(a.json_out).write_text(json.dumps({**kept, "rows": rows, "failed": failed, "ssm_flat_pct": flat},
                                               indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
