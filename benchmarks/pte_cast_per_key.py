"""The per-key cost of the fp16-cache .pte's read-back: edgekv's .pte attends a fp16 cache by casting its rows
0..pos to fp32 every step (edgekv.models.swaps.SdpaAttention, "fp32 rows") and handing them to llama::custom_sdpa
one query head at a time (rows_ok=False: the causal per-head call). Three small ExecuTorch programs per head shape
and filled context, each lowered as edgekv export lowers a model (edgekv.export.to_pte: XNNPACK, state written in
place) and run by ExecuTorch's runtime on 1 thread, the rows going round in the same rounds:

  fp16      the layer's read as the .pte runs it: the call's row written, the rows cast, per-head custom_sdpa
            (benchmarks/attention_rates.py et_program, kind fp16)
  fp32      the same per-head custom_sdpa on a fp32 cache in place (no cast)
  cast      the row written and the rows cast, no attention (a check of the difference below)

so, as benchmarks/eager_per_key.py takes the kv-int8 graph's attention as its step less the fp32 step's,

    cast(T) = call(fp16, T) - call(fp32, T)

per kept key x KV head x head size x 2 (K and V: the values one step casts), and the per-head custom_sdpa per key x
query head x head size from the fp32 rows. The two are what edgekv/costs/attention_rates.json stores for the .pte's
fp16 kind at each head size (compute_by_kept_keys: the fp32 per-head rows; cast_s_per_value_by_kept_keys: the cast),
so the plan charges the fp16 .pte's attention as those two named terms. Each call reads a cold cache (the caches
cycled as benchmarks/attention_rates.py cycles them).

    python benchmarks/pte_cast_per_key.py [--ctx 512,...,32768] [--runs 7] --out benchmarks/results/FILE.json
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

KINDS = ("fp16", "fp32", "cast")


def program(h: int, hkv: int, d: int, kind: str, ctx: int) -> bytes:
    """One decode call at slot ctx - 1 (ctx keys): forward(q [Hkv, 1, G, D], pos [1], k, v [1, Hkv, ctx, D]) writes the
    call's row at slot pos in place and returns custom_sdpa per query head over slots 0..pos (fp16: rows cast to fp32
    first, as SdpaAttention reads a fp16 cache; cast: the cast rows' last row, no attention)."""
    import torch
    from torch import nn

    import attention_rates as A
    from edgekv.export.to_pte import lower_pte, to_buffer

    if kind == "fp16":
        return A.et_program(h, hkv, d, "fp16", ctx)

    class Step(nn.Module):
        def forward(self, q, pos, k, v):
            start = pos[0].item()
            torch._check(start >= 0)
            torch._check(start + 1 <= ctx)
            n = start + 1
            row = q[:, :, :1, :].permute(2, 0, 1, 3)  # [1, Hkv, 1, D]: a stand-in for the call's new rows
            dt = torch.float16 if kind == "cast" else torch.float32
            k, v = (torch.ops.aten.index_put(s, [None, None, pos], row.to(dt)) for s in (k, v))
            if kind == "cast":
                kc, vc = (s[:, :, :n].float().view(hkv, n, 1, d) for s in (k, v))
                return kc[:, -1:] + vc[:, -1:]
            kc, vc = (s[:, :, :n].view(hkv, n, 1, d) for s in (k, v))
            return torch.ops.llama.custom_sdpa(q, kc, vc, start, None, 0.0, True, d ** -0.5)

    args = inputs(h, hkv, d, kind, ctx, np.random.default_rng(0))
    ep = torch.export.export(Step(), args, strict=False)
    return to_buffer(lower_pte({"forward": ep}, in_place=True), in_place=True)


def inputs(h: int, hkv: int, d: int, kind: str, ctx: int, rng) -> tuple:
    import torch

    q = torch.from_numpy(rng.standard_normal((hkv, 1, h // hkv, d)).astype(np.float32))
    dt = np.float32 if kind == "fp32" else np.float16
    k, v = (torch.from_numpy(rng.standard_normal((1, hkv, ctx, d)).astype(dt)) for _ in range(2))
    return q, torch.tensor([ctx - 1]), k, v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--shapes", help="of " + ",".join(("smollm2-135m", "gemma-3-270m")))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    import torch
    from executorch.extension.pybindings import portable_lib

    import attention_rates as A
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (llama::custom_sdpa)
    from edgekv.export.pte_stepper import quiet_native_stderr

    torch.set_num_threads(1)
    t0 = time.time()
    rows = []
    for name, (h, hkv, d) in A.SHAPES.items():
        if a.shapes and name not in a.shapes.split(","):
            continue
        for ctx in (int(c) for c in a.ctx.split(",")):
            mods, sets, bufs = {}, {}, []
            for kind in KINDS:
                buf = program(h, hkv, d, kind, ctx)
                bufs.append(buf)  # the module reads its program from this buffer: it must outlive it
                with quiet_native_stderr():
                    portable_lib._unsafe_reset_threadpool(1)
                    mods[kind] = portable_lib._load_for_executorch_from_buffer(buf)
                cache_bytes = 2 * hkv * ctx * d * (4 if kind == "fp32" else 2)
                n = min(max(2, -(-A.COLD_BYTES // cache_bytes)), 30)  # each call reads a cold cache
                rng = np.random.default_rng(0)
                sets[kind] = [inputs(h, hkv, d, kind, ctx, rng) for _ in range(n)]
            # the kinds in turn within each round, so the three see the same load
            calls = [(kind, lambda m=mods[kind], x=x: m.forward(x)) for kind in KINDS for x in sets[kind]]
            for _, c in calls:
                c()
            cpu = {k: [] for k in KINDS}
            with quiet_native_stderr():
                for _ in range(a.runs):
                    for kind, c in calls:
                        c0 = time.process_time()
                        c()
                        cpu[kind].append(time.process_time() - c0)
            med = {k: statistics.median(v) for k, v in cpu.items()}
            cast = med["fp16"] - med["fp32"]
            values = 2 * hkv * d * ctx  # K and V values one step casts
            r = {"shape": name, "heads": h, "kv_heads": hkv, "head_dim": d, "ctx": ctx,
                 **{f"{k}_median_us": round(med[k] * 1e6, 1) for k in KINDS},
                 **{f"{k}_best_us": round(min(cpu[k]) * 1e6, 1) for k in KINDS},
                 "cast_us": round(cast * 1e6, 1), "cast_s_per_value": cast / values,
                 "cast_alone_s_per_value": med["cast"] / values,
                 "fp32_s_per_key_head_dim": med["fp32"] / (ctx * h * d),
                 "fp16_s_per_key_head_dim": med["fp16"] / (ctx * h * d),
                 "loadavg": round(os.getloadavg()[0], 2)}
            rows.append(r)
            print(f"{name:13} ctx {ctx:6}: fp16 {r['fp16_median_us']:9.1f} us, fp32 per head {r['fp32_median_us']:9.1f}, "
                  f"cast alone {r['cast_median_us']:9.1f}: cast {cast / values * 1e9:.2f} ns per value (alone "
                  f"{med['cast'] / values * 1e9:.2f})  (load {r['loadavg']})", flush=True)
    by = {}
    for r in rows:
        b = by.setdefault(str(r["head_dim"]), {"cast_s_per_value_by_kept_keys": {}, "compute_by_kept_keys": {}})
        b["cast_s_per_value_by_kept_keys"][str(r["ctx"])] = float(f"{r['cast_s_per_value']:.4g}")
        b["compute_by_kept_keys"][str(r["ctx"])] = float(f"{r['fp32_s_per_key_head_dim']:.4g}")
    import executorch

    out = {"benchmark": "pte_cast_per_key", "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
           "executorch": getattr(executorch, "__version__", None) or A._version("executorch"),
           "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "platform": platform.platform(), "threads": 1, "runs": a.runs, "loadavg_end": list(os.getloadavg()),
           "what": __doc__.split("\n\n")[0], "how": __doc__.rsplit("\n\n", 1)[0], "rows": rows, "by_head_dim": by,
           "seconds": round(time.time() - t0, 1)}
    A.write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
