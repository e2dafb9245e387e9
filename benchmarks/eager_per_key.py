"""The per-key cost of edgekv's explicit kv-int8 ONNX graph (no GroupQueryAttention: every step dequantizes the whole
int8 cache to fp32, expands it to the query heads and runs two MatMuls) at the kept keys of two exports, measured on
the model rather than fitted: benchmarks/profile_ort.py times the kv-int8 export and the fp32-cache export of the
same context and int4 weights in the same rounds (--compare), so

    attention_int8(T) = CPU per step(kv-int8, T) - CPU per step(fp32, T) + the fp32 cache's GroupQueryAttention at T

(the last at its stored kernel rate, edgekv/costs/attention_rates.json, as the plan charges it), and the cost per key
x query head x head size is that over layers x T x heads x head_dim (SmolLM2-135M: 30 x T x 9 x 64; the graph
reads all T slots of its export whatever the position). Writes a JSON whose figures edgekv/costs/attention_rates.json
stores as the "eager int8" kind's measured curve (compute_by_kept_keys).

    python benchmarks/eager_per_key.py PROFILE_2K.json PROFILE_8K.json [--device host-xeon] --out benchmarks/results/FILE.json

--device: the host profile whose GroupQueryAttention rate is added back (the profile of the CPU the rounds ran on:
host, the AMD EPYC VM; host-xeon, the Intel Xeon VM). The host's stored curve is such a run; the Xeon's explicit
graphs are fitted on its filled rows instead (benchmarks/plan_vs_filled.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="+", type=Path, help="profile_ort.py JSONs: the kv-int8 export as 'edgekv graph', "
                                                          "the fp32-cache export of its context as 'edgekv graph 2'")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="host",
                    help="the host profile of the CPU the profiles ran on, whose GroupQueryAttention rate is added "
                         "back (default host)")
    a = ap.parse_args(argv)
    import plan_vs_filled as P
    from edgekv.arch import Attention

    arch = P.model_arch("smollm2-135m")
    att = [m for b in arch.blocks for m in b.mixers if isinstance(m, Attention)]
    rows = []
    for f in a.profiles:
        d = json.loads(f.read_text())
        by = {r["name"]: r for r in d["rows"]}
        i8, f32 = by["edgekv graph"], by["edgekv graph 2"]
        keys = d["slots"]
        gqa = P.terms("smollm2-135m", "onnxruntime", "kv:dtype=fp32", keys, keys, device=a.device)["attention_s"]
        attn = (i8["cpu_ms_per_step"] - f32["cpu_ms_per_step"]) / 1e3 + gqa
        work = sum(keys * m.n_heads * m.head_dim for m in att)
        rows.append({"profile": f.name, "kept_keys": keys, "kv_int8_cpu_ms_per_step": i8["cpu_ms_per_step"],
                     "kv_int8_runs_cpu_ms": i8.get("runs_cpu_ms"), "fp32_cpu_ms_per_step": f32["cpu_ms_per_step"],
                     "fp32_runs_cpu_ms": f32.get("runs_cpu_ms"), "fp32_gqa_ms_at_kernel_rate": round(gqa * 1e3, 3),
                     "kv_int8_attention_ms": round(attn * 1e3, 3), "key_work": work,
                     "s_per_key_head_dim": attn / work})
        print(f"{keys} kept keys: kv-int8 {i8['cpu_ms_per_step']:.1f} CPU ms a step, fp32 {f32['cpu_ms_per_step']:.1f} "
              f"(its GroupQueryAttention {gqa * 1e3:.1f} at the kernel rate): the int8 graph's attention "
              f"{attn * 1e3:.1f} ms, {attn / work * 1e12:.0f} ps per key x head x head size")
    out = {"benchmark": "eager_per_key", "graph": "edgekv's explicit kv-int8 ONNX graph (the eager attention)",
           "model": "smollm2-135m", "device": a.device, "how": __doc__.split("\n\n")[1], "rows": rows,
           "compute_by_kept_keys": {str(r["kept_keys"]): float(f"{r['s_per_key_head_dim']:.4g}") for r in rows}}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
