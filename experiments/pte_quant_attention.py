"""What ExecuTorch's attention kernels cost over a filled int8 cache: one layer's decode attention (one query token
at position T - 1 over T cached rows), the ways a .pte can read it, timed through the ops' AOT library (the C++
kernels of executorch/extension/llm/custom_ops that the .pte's runtime runs), SmolLM2-135M's layer shape by default.

  fp32 custom_sdpa            llama::custom_sdpa over a fp32 cache (edgekv's kv:dtype=fp32 .pte)
  int8 -> fp32 + custom_sdpa  edgekv's kv-int8 .pte today (models/llama.py Attention.custom): the written rows
                              dequantized to fp32 (one scale per token and head), then custom_sdpa
  custom_quantized_sdpa       llama::custom_quantized_sdpa reading the int8 codes and per-token scales directly, the
                              query quantized to int8 per token (the op takes nothing else), as ExecuTorch's own
                              --quantize_kv_cache export calls it
For each: median wall and CPU time (time.process_time, one thread), the bytes of cache it must read, and its
output's largest error against fp32 attention over the dequantized cache (relative to the output's largest value).
The dequantize step is timed with torch's own kernels (mul of an int8->fp32 cast by the scales): the ExecuTorch
kernel the .pte runs for it (quantized_decomposed::dequantize_per_token) is measured inside a real decode step by
benchmarks/profile_pte.py.

Usage: python experiments/pte_quant_attention.py [--ctx 2048,8192,16384] [--runs 20]
Output: a table and benchmarks/results/pte_quant_attention.json (--out), with the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(fn, runs: int) -> tuple[float, float, object]:
    out = fn()
    wall, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu), out


def measure(t: int, a) -> list[dict]:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers torch.ops.llama.*)
    import torch

    torch.manual_seed(0)
    h, hk, d = a.heads, a.kv_heads, a.head_dim
    g = h // hk
    scale = d ** -0.5
    pos = t - 1
    k = torch.randn(1, t, hk, d)
    v = torch.randn(1, t, hk, d)
    q = torch.randn(1, 1, h, d)

    def per_token(x):  # symmetric int8, one scale per (token, head), zero points 0
        s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8)
        return torch.clamp(torch.round(x / s), -128, 127).to(torch.int8), s

    kq, ks = per_token(k)
    vq, vs = per_token(v)
    kz, vz = torch.zeros_like(ks, dtype=torch.int8), torch.zeros_like(vs, dtype=torch.int8)
    kd, vd = kq.float() * ks, vq.float() * vs
    # the reference: fp32 attention over the dequantized cache
    qh = q[0, 0].view(hk, g, d)
    att = torch.softmax(torch.einsum("kgd,tkd->kgt", qh, kd[0]) * scale, -1)
    ref = torch.einsum("kgt,tkd->kgd", att, vd[0]).reshape(1, 1, h, d)

    def sdpa_fp32():
        return torch.ops.llama.custom_sdpa(q, kd, vd, pos, None, 0.0, True, scale)

    def dequant_then_sdpa():
        return torch.ops.llama.custom_sdpa(q, kq.float() * ks, vq.float() * vs, pos, None, 0.0, True, scale)

    def quantized_sdpa():
        qs = (q.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8)
        qq = torch.clamp(torch.round(q / qs), -128, 127).to(torch.int8)
        return torch.ops.llama.custom_quantized_sdpa(qq, kq, vq, pos, None, 0.0, True, scale,
                                                     torch.zeros_like(qs, dtype=torch.int8), qs, kz, ks, vz, vs)

    rows = []
    for name, fn, nbytes in (("fp32 custom_sdpa", sdpa_fp32, 2 * t * hk * d * 4),
                             ("int8 -> fp32 + custom_sdpa", dequant_then_sdpa, 2 * t * hk * (d + 4)),
                             ("custom_quantized_sdpa", quantized_sdpa, 2 * t * hk * (d + 4 + 1))):
        wall, cpu, out = timed(fn, a.runs)
        err = float((out.reshape(ref.shape) - ref).abs().max() / ref.abs().max())
        rows.append({"ctx": t, "path": name, "median_us": round(wall * 1e6, 1), "cpu_median_us": round(cpu * 1e6, 1),
                     "cache_bytes_read": nbytes, "rel_err_vs_fp32_attention": err, "loadavg": list(os.getloadavg())})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", default="2048,8192,16384")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pte_quant_attention.json"))
    a = ap.parse_args(argv)
    try:
        ctxs = [int(c) for c in a.ctx.split(",")]
    except ValueError:
        ap.error(f"--ctx {a.ctx!r}: comma-separated integers")
    if min(ctxs) < 2 or a.runs < 1 or a.heads % a.kv_heads:
        ap.error("--ctx at least 2, --runs at least 1, heads a multiple of kv-heads")
    from importlib.metadata import version

    import torch

    torch.set_num_threads(1)
    res = {"benchmark": "pte_quant_attention", "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
           "executorch": version("executorch"), "torch": version("torch"), "loadavg_start": list(os.getloadavg()),
           "settings": {"threads": 1, "runs": a.runs, "heads": a.heads, "kv_heads": a.kv_heads,
                        "head_dim": a.head_dim}, "rows": []}
    for t in ctxs:
        for r in measure(t, a):
            res["rows"].append(r)
            print(f"ctx {t:>6} {r['path']:<28} wall {r['median_us']:>9.1f} us  cpu {r['cpu_median_us']:>9.1f} us  "
                  f"rel err {r['rel_err_vs_fp32_attention']:.1e}", flush=True)
    res["loadavg_end"] = list(os.getloadavg())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"load average {res['loadavg_start']} -> {res['loadavg_end']}; wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
