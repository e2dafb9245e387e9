"""What `edgekv plan --device host` predicts for each row of a filled-context run, written beside its JSON.

    python benchmarks/plan_for_filled.py benchmarks/results/filled_context_8192_llama32_1b_random.json [...]

For every row of each benchmarks/filled_context.py JSON: the plan of the row's model (settings.model_path), runtime,
cache strategy and weights at the row's context, 1 thread as the rows run, next to what the row measured. Writes
plan_for_FILE (load average recorded). The plan's memory above baseline is its total less its `runtime` bytes: the
row's baseline is the RSS after importing the runtime, before loading the model. Rows the planner does not cover
(GenAI, ExecuTorch's own Llama export) are listed with the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from edgekv.children import child_setup  # a child dies with this process

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the row's family -> `edgekv plan --runtime`; llama.cpp's K/V type -> the planner's cache strategy
RUNTIME = {"edgekv-ort": "onnxruntime", "edgekv-pte": "executorch", "llamacpp": "llama.cpp"}
LLAMACPP_KV = {"f16": "kv", "q8_0": "kv-int8:group=32", "q4_0": "kv-int4:group=32"}


def plan_args(name: str) -> tuple[str, str, str] | str:
    """(runtime, strategy, weights) for a row name, or why the planner has no such row."""
    family, variant = name.split(":", 1)
    if family not in RUNTIME:
        return f"{family}: not a runtime the planner plans"
    if family == "llamacpp":
        return RUNTIME[family], LLAMACPP_KV[variant], "gguf"
    strategy, weights = variant.rsplit("/", 1)
    return RUNTIME[family], strategy, weights


def plan_row(model: str, ctx: int, runtime: str, strategy: str, weights: str, device: str = "host",
             kernel: str | None = None) -> dict:
    """kernel: export --pte-kernel's value where the row's export calls edgekv's own kernels (its custom_ops)."""
    cmd = [sys.executable, "-m", "edgekv.cli", "plan", "--device", device, "--ctx", str(ctx), "--model", model,
           "--runtime", runtime, "--strategy", strategy, "--weights", weights, "--json",
           *(["--pte-kernel", kernel] if kernel else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), preexec_fn=child_setup())
    if p.returncode not in (0, 3):
        return {"error": (p.stderr.strip().splitlines() or [str(p.returncode)])[-1]}
    opts = json.loads(p.stdout)["options"]
    if not opts:
        return {"error": "the plan has no such option"}
    o = opts[0]
    b = o["bytes"]
    return {"command": " ".join(cmd[3:]), "decode_tok_s": o["decode_tokens_per_s"],
            "prefill_s": o["prefill_seconds"], "bytes": b, "above_baseline_bytes": b["total"] - b["runtime"]}


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="benchmarks/filled_context.py JSON files")
    ap.add_argument("--device", default="host", help="the device profile to plan with: the host profile of the CPU "
                                                   "the run measured on (host: the AMD EPYC VM, host-xeon: the Intel "
                                                   "Xeon VM)")
    ap.add_argument("--also", default="", help="comma-separated row names to plan too, at each file's contexts, "
                                               "though the run did not measure them (e.g. rows it could not build)")
    a = ap.parse_args(argv)
    written = []
    for f in map(Path, a.results):
        run = json.loads(f.read_text())
        model = run["settings"]["model_path"]
        rows = []
        extra = [{"name": n, "ctx": c} for n in a.also.split(",") if n
                 for c in sorted({r["ctx"] for r in run["rows"]})]
        for r in run["rows"] + extra:
            how = plan_args(r["name"])
            row = {"name": r["name"], "ctx": r["ctx"],
                   "measured": {k: r.get(k) for k in ("decode_tok_s", "decode_tok_per_cpu_s", "prefill_tok_s",
                                                      "prefill_tok_per_cpu_s", "above_baseline_bytes", "error")
                                if r.get(k) is not None} if r in run["rows"] else "not measured"}
            if isinstance(how, str):
                row["plan"] = {"error": how}
            else:
                kernel = "edgekv" if (r.get("export") or {}).get("custom_ops") else None
                row["plan"] = {"runtime": how[0], "strategy": how[1], "weights": how[2],
                               **({"pte_kernel": kernel} if kernel else {}),
                               **plan_row(model, r["ctx"], *how, device=a.device, kernel=kernel)}
            rows.append(row)
        out = f.with_name("plan_for_" + f.name)  # not filled_context_*: plan_vs_filled.py reads those as runs
        doc = {"benchmark": "plan_for_filled", "of": f.name, "model_path": model, "device": a.device, "threads": 1,
               "written_utc": datetime.now(UTC).isoformat(timespec="seconds"), "loadavg": list(os.getloadavg()),
               "rows": rows}
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)
        written.append(out)
        print(f"wrote {out}")
    return written


if __name__ == "__main__":
    main()
