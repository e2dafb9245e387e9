"""One decode step's attention as ONNX Runtime runs it in edgekv's ONNX graphs: one com.microsoft
GroupQueryAttention node (packed q/k/v, the op rotating q and k itself, present bound to past's buffer), timed per
call at several filled contexts, cache kinds and head shapes, on 1 thread. Fits, per cache kind,

    time per call = overhead + ctx * (2 * kv_heads * head_dim * bytes / read_rate + heads * head_dim * c_compute)

(2: keys and values) and writes the measured rows and the fitted terms as JSON. The fitted terms are what
edgekv/costs/attention_rates.json stores for the host (`edgekv plan` reads that file, never this script).

    python benchmarks/attention_rates.py [--runtime onnxruntime|executorch] [--ctx 1024,...,32768] [--runs 7]
                                         [--out FILE]

The graph is built as edgekv.models.swaps.GQAAttention emits it: inputs 0-6 (packed qkv, no separate k/v, past
key/value, seqlens_k, total_sequence_length, cos, sin; do_rotary 1), and for kv-int8c the static per-channel
scales as inputs 12-13 with k_quant_type / v_quant_type PER_CHANNEL and kv_cache_bit_width 8; q/k/v go in as the
cache dtype for a float cache, fp32 for int8 codes.

--runtime executorch: the same for edgekv's .pte (edgekv.models.swaps.SdpaAttention), one small program per cache
kind, shape and context, lowered as edgekv export lowers a model (edgekv.export.to_pte: XNNPACK, state inputs
unplanned and written in place) and run by ExecuTorch's runtime (portable_lib) on 1 thread: the call's row written
into the cache with index_put_, then llama::custom_sdpa over slots 0..pos on the cache as it takes it ([Hkv, T, 1, D]:
a fp32 cache as a view, a fp16 cache cast to fp32 rows 0..pos), or llama::custom_quantized_sdpa on int8 codes in place
(kv-int8: the per-token fp16 scales cast to fp32; kv-int8c: the static per-channel scales folded into the query and
the output), the query quantized to int8 per token. The read-back (or the query's quantization) is part of what a
layer costs there, so it is in the time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "gemma-3-270m": (4, 1, 256)}  # heads, kv heads, head_dim (config.json)
COLD_BYTES = 256 << 20
KINDS = {"fp32": (np.float32, 4), "fp16": (np.float16, 2), "int8c": (np.int8, 1)}  # cache dtype, bytes per value
# ExecuTorch: the cache kinds edgekv's .pte attends through custom_sdpa or custom_quantized_sdpa (bytes per value,
# for the fit's read term)
ET_KINDS = {"fp32": 4, "fp16": 2, "int8": 1, "int8c": 1}


def graph(h: int, hkv: int, d: int, kind: str) -> bytes:
    from onnx import TensorProto as TP
    from onnx import helper

    cache_t = {"fp32": TP.FLOAT, "fp16": TP.FLOAT16, "int8c": TP.INT8}[kind]
    io_t = TP.FLOAT16 if kind == "fp16" else TP.FLOAT
    vi = [helper.make_tensor_value_info("qkv", io_t, [1, 1, (h + 2 * hkv) * d]),
          helper.make_tensor_value_info("pk", cache_t, [1, hkv, "T", d]),
          helper.make_tensor_value_info("pv", cache_t, [1, hkv, "T", d]),
          helper.make_tensor_value_info("seqlens", TP.INT32, [1]),
          helper.make_tensor_value_info("total", TP.INT32, []),
          helper.make_tensor_value_info("cos", io_t, ["T", d // 2]),
          helper.make_tensor_value_info("sin", io_t, ["T", d // 2])]
    ins = ["qkv", "", "", "pk", "pv", "seqlens", "total", "cos", "sin"]
    attrs = {"num_heads": h, "kv_num_heads": hkv, "scale": d ** -0.5, "do_rotary": 1}
    if kind == "int8c":
        ins += [""] * (12 - len(ins)) + ["ks", "vs"]
        vi += [helper.make_tensor_value_info(n, TP.FLOAT, [1, hkv, 1, d]) for n in ("ks", "vs")]
        attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    node = helper.make_node("GroupQueryAttention", ins, ["o", "prk", "prv"], domain="com.microsoft", **attrs)
    outs = [helper.make_tensor_value_info("o", io_t, None), helper.make_tensor_value_info("prk", cache_t, None),
            helper.make_tensor_value_info("prv", cache_t, None)]
    m = helper.make_model(helper.make_graph([node], "gqa", vi, outs),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString()


def time_call(ort, h: int, hkv: int, d: int, kind: str, ctx: int, runs: int) -> dict:
    """Median and best CPU time (and median wall time) of one decode call at position ctx - 1 (ctx keys attended), cache of ctx slots."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(graph(h, hkv, d, kind), so, providers=["CPUExecutionProvider"])
    dt, _ = KINDS[kind]
    io = np.float16 if kind == "fp16" else np.float32
    rng = np.random.default_rng(0)
    cache_bytes = 2 * hkv * ctx * d * KINDS[kind][1]
    # as many layers' caches as fill COLD_BYTES, called in turn: in a model each layer's cache is read once per step
    # and evicted by the others' before its next read, so a single cache re-read from the CPU's caches would flatter
    # the rate (at 2k SmolLM2's fp32 layer is 3 MiB, inside the last-level cache)
    n = min(max(2, -(-COLD_BYTES // cache_bytes)), 30)
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    ang = np.arange(ctx)[:, None] * inv[None]
    vals = {"qkv": rng.standard_normal((1, 1, (h + 2 * hkv) * d)).astype(io),
            "seqlens": np.array([ctx - 1], np.int32), "total": np.array(ctx, np.int32),
            "cos": np.cos(ang).astype(io), "sin": np.sin(ang).astype(io)}
    if kind == "int8c":
        vals.update(ks=np.full((1, hkv, 1, d), 0.02, np.float32), vs=np.full((1, hkv, 1, d), 0.02, np.float32))
    binds = []
    for _ in range(n):
        if kind == "int8c":
            pk = rng.integers(-127, 128, (1, hkv, ctx, d), dtype=np.int8)
            pv = rng.integers(-127, 128, (1, hkv, ctx, d), dtype=np.int8)
        else:
            pk = rng.standard_normal((1, hkv, ctx, d)).astype(dt)
            pv = rng.standard_normal((1, hkv, ctx, d)).astype(dt)
        b = sess.io_binding()
        for k, v in vals.items():
            b.bind_cpu_input(k, v)
        ok, ov = ort.OrtValue.ortvalue_from_numpy(pk), ort.OrtValue.ortvalue_from_numpy(pv)
        b.bind_ortvalue_input("pk", ok)
        b.bind_ortvalue_input("pv", ov)
        b.bind_ortvalue_output("prk", ok)  # present shares past's buffer, as edgekv's OrtStepper binds it
        b.bind_ortvalue_output("prv", ov)
        b.bind_output("o")
        binds.append((b, ok, ov))
    for b, *_ in binds:
        sess.run_with_iobinding(b)  # warm-up
    ts, cpu = [], []
    for _ in range(runs):
        for b, *_ in binds:
            t0, c0 = time.perf_counter(), time.process_time()
            sess.run_with_iobinding(b)
            cpu.append(time.process_time() - c0)
            ts.append(time.perf_counter() - t0)
    # the fit uses the process's CPU time: on a shared host the wall time also counts the time the one thread
    # waits for a core (the filled-context rows it is compared with record both, decode_tok_per_cpu_s)
    med = statistics.median(cpu)
    return {"ctx": ctx, "kind": kind, "heads": h, "kv_heads": hkv, "head_dim": d, "median_us": round(med * 1e6, 1),
            "wall_median_us": round(statistics.median(ts) * 1e6, 1), "best_us": round(min(cpu) * 1e6, 1), "caches": n, "cache_bytes": cache_bytes,
            "cache_read_gb_s": round(cache_bytes / med / 1e9, 2), "us_per_position": round(med * 1e6 / ctx, 4)}


def et_program(h: int, hkv: int, d: int, kind: str, ctx: int) -> bytes:
    """The .pte of one decode call's attention on a cache of ctx slots: forward(q, pos, k, v[, k scale, v scale])
    writes the call's row at slot pos in place and returns custom_sdpa over slots 0..pos (SdpaAttention's read)."""
    import torch
    from torch import nn

    from edgekv.export.to_pte import lower_pte, to_buffer

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "int8c":  # the graph's constant per-channel scales [Hkv, D] (keys, values)
                self.register_buffer("static", torch.full((2, hkv, d), 0.02))

        def forward(self, q, pos, k, v, *scales):
            if kind == "int8c":
                scales = (self.static[0], self.static[1])
            start = pos[0].item()
            torch._check(start >= 0)
            torch._check(start + 1 <= ctx)
            n = start + 1
            row = q[:, :, :1, :].permute(2, 0, 1, 3)  # [1, Hkv, 1, D]: a stand-in for the call's new key/value row

            def put(state, r):
                return torch.ops.aten.index_put(state, [None, None, pos], r)

            if kind == "fp32":
                k, v = put(k, row), put(v, row)
                kc, vc = k.view(hkv, ctx, 1, d), v.view(hkv, ctx, 1, d)
            elif kind == "fp16":
                k, v = put(k, row.half()), put(v, row.half())
                kc, vc = (s[:, :, :n].float().view(hkv, n, 1, d) for s in (k, v))
            else:  # int8 codes read in place by custom_quantized_sdpa, the query quantized per token
                codes = (row * 20).round().clamp(-127, 127).to(torch.int8)
                k, v = put(k, codes), put(v, codes)
                zero = torch.zeros(hkv, ctx, 1, 1, dtype=torch.int8)
                if kind == "int8":  # kv-int8: fp16 scale per token and head, cast to fp32 for the op
                    ks, vs = (put(s, torch.ones(1, hkv, 1, dtype=torch.float16)) for s in scales)
                    k_scale, v_scale = (s.float().view(hkv, ctx, 1, 1) for s in (ks, vs))
                    qf = q
                else:  # kv-int8c: static per-channel scales folded into q and the output, unit scales for the op
                    k_scale = v_scale = torch.ones(hkv, ctx, 1, 1)
                    qf = q * scales[0].view(hkv, 1, 1, d)
                qs, qz = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric(qf, torch.int8)
                qq = torch.ops.quantized_decomposed.quantize_per_token(qf, qs, qz, -128, 127, torch.int8)
                out = torch.ops.llama.custom_quantized_sdpa(
                    qq, k.view(hkv, ctx, 1, d), v.view(hkv, ctx, 1, d), start, None, 0.0, True, d ** -0.5,
                    qz.to(torch.int8), qs.to(torch.float32), zero, k_scale, zero, v_scale)
                return out * scales[1].view(hkv, 1, 1, d) if kind == "int8c" else out
    args = et_inputs(h, hkv, d, kind, ctx, np.random.default_rng(0))
    ep = torch.export.export(Step(), args, strict=False)
    return to_buffer(lower_pte({"forward": ep}, in_place=True), in_place=True)


def et_inputs(h: int, hkv: int, d: int, kind: str, ctx: int, rng) -> tuple:
    import torch

    q = torch.from_numpy(rng.standard_normal((hkv, 1, h // hkv, d)).astype(np.float32))
    pos = torch.tensor([ctx - 1])
    if kind in ("int8", "int8c"):
        k, v = (torch.from_numpy(rng.integers(-127, 128, (1, hkv, ctx, d), dtype=np.int8)) for _ in range(2))
    else:
        dt = np.float32 if kind == "fp32" else np.float16
        k, v = (torch.from_numpy(rng.standard_normal((1, hkv, ctx, d)).astype(dt)) for _ in range(2))
    if kind == "int8":  # the state's per-token fp16 scales [1, Hkv, T]
        scales = tuple(torch.full((1, hkv, ctx), 0.02, dtype=torch.float16) for _ in range(2))
    else:  # a float cache; kv-int8c's scales are constants of the program (et_program)
        scales = ()
    return (q, pos, k, v, *scales)


def et_time_call(h: int, hkv: int, d: int, kind: str, ctx: int, runs: int) -> dict:
    """time_call's figures for edgekv's .pte attention (et_program), run by ExecuTorch's runtime on 1 thread."""
    import torch
    from executorch.extension.pybindings import portable_lib

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (llama::custom_sdpa)
    import executorch.kernels.quantized  # noqa: F401 (dequantize_per_token)
    from edgekv.export.pte_stepper import quiet_native_stderr

    torch.set_num_threads(1)
    buf = et_program(h, hkv, d, kind, ctx)  # the module reads the program from this buffer: it must outlive it
    with quiet_native_stderr():
        portable_lib._unsafe_reset_threadpool(1)
        mod = portable_lib._load_for_executorch_from_buffer(buf)
    cache_bytes = 2 * hkv * ctx * d * ET_KINDS[kind] + (2 * hkv * ctx * 2 if kind == "int8" else 0)
    n = min(max(2, -(-COLD_BYTES // cache_bytes)), 30)  # as time_call: each layer's cache read cold
    rng = np.random.default_rng(0)
    sets = [et_inputs(h, hkv, d, kind, ctx, rng) for _ in range(n)]
    with quiet_native_stderr():
        for a in sets:
            mod.forward(a)  # warm-up
        ts, cpu = [], []
        for _ in range(runs):
            for a in sets:
                t0, c0 = time.perf_counter(), time.process_time()
                mod.forward(a)
                cpu.append(time.process_time() - c0)
                ts.append(time.perf_counter() - t0)
    med = statistics.median(cpu)
    return {"ctx": ctx, "kind": kind, "heads": h, "kv_heads": hkv, "head_dim": d, "median_us": round(med * 1e6, 1),
            "wall_median_us": round(statistics.median(ts) * 1e6, 1), "best_us": round(min(cpu) * 1e6, 1), "caches": n,
            "cache_bytes": cache_bytes, "cache_read_gb_s": round(cache_bytes / med / 1e9, 2),
            "us_per_position": round(med * 1e6 / ctx, 4)}


def fit(rows: list[dict]) -> dict:
    """Least squares of time = overhead + ctx * (kv_bytes_per_position / read_rate + heads * head_dim * c_compute)
    over one cache kind's rows (both shapes: the two per-position features differ between them). A term that fits
    negative is dropped (set to 0) and the rest refitted."""
    x = np.array([[1.0, r["cache_bytes"], r["ctx"] * r["heads"] * r["head_dim"]] for r in rows])
    y = np.array([r["median_us"] * 1e-6 for r in rows])
    w = 1 / y  # relative error: the long contexts must not drown the short ones
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        full = dict(zip(keep, coef))
        neg = [k for k in keep if full[k] < 0 and k != 0]
        if not neg:
            break
        keep = [k for k in keep if k not in neg]
    overhead, per_byte, per_flop = (max(full.get(k, 0.0), 0.0) for k in (0, 1, 2))
    pred = x @ np.array([overhead, per_byte, per_flop])
    err = [float(p / t - 1) for p, t in zip(pred, y)]
    return {"overhead_s": float(overhead), "read_bytes_per_s": (1 / per_byte) if per_byte > 0 else None,
            "compute_s_per_head_dim_position": float(per_flop),
            "max_abs_rel_error": round(max(abs(e) for e in err), 3), "rows": len(rows)}


def fit_head_dim(rows: list[dict]) -> dict:
    """One head size's rows: least squares (relative error) of time = overhead + ctx x H x D x c_compute, the per-key
    cost at that head size alone (the plan uses it for models of that head size: the cross-shape law misses how
    a head of 256 costs more per value than one of 64 when each query head re-reads its KV head's cache)."""
    x = np.array([[1.0, r["ctx"] * r["heads"] * r["head_dim"]] for r in rows])
    y = np.array([r["median_us"] * 1e-6 for r in rows])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    over, comp = (float(c) for c in coef)
    if over < 0:  # no overhead: refit the slope alone
        over, comp = 0.0, float(np.sum(x[:, 1] / y) / np.sum((x[:, 1] / y) ** 2))
    err = [(over + comp * xi) / yi - 1 for xi, yi in zip(x[:, 1], y)]
    return {"overhead_s": over, "read_bytes_per_s": None, "compute_s_per_head_dim_position": comp,
            "max_abs_rel_error": round(max(abs(e) for e in err), 3), "rows": len(rows)}


def fits_of(rows: list[dict], kinds: list[str]) -> dict:
    """fit per cache kind over both head shapes, and fit_head_dim per head size."""
    fits = {k: fit([r for r in rows if r["kind"] == k]) for k in kinds}
    for k in kinds:
        dims = sorted({r["head_dim"] for r in rows if r["kind"] == k})
        fits[k]["by_head_dim"] = {str(d): fit_head_dim([r for r in rows if r["kind"] == k and r["head_dim"] == d])
                                  for d in dims}
    return fits


def print_fits(fits: dict) -> None:
    for k, f in fits.items():
        rate = f"{f['read_bytes_per_s'] / 1e9:.2f} GB/s" if f["read_bytes_per_s"] else "no read term"
        print(f"fit {k}: overhead {f['overhead_s'] * 1e6:.1f} us, read {rate}, compute "
              f"{f['compute_s_per_head_dim_position'] * 1e12:.2f} ps per head x dim x position; worst row "
              f"{f['max_abs_rel_error']:.0%}; per head size: "
              + ", ".join(f"{d}: {g['overhead_s'] * 1e6:.1f} us + {g['compute_s_per_head_dim_position'] * 1e12:.1f} ps "
                          f"(worst {g['max_abs_rel_error']:.0%})" for d, g in f["by_head_dim"].items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", choices=("onnxruntime", "executorch"), default="onnxruntime")
    ap.add_argument("--ctx", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--kinds", help="cache kinds (onnxruntime: fp32,fp16,int8c; executorch: fp32,fp16,int8,int8c)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--refit", type=Path, help="fit the rows of this results JSON again (no timing)")
    a = ap.parse_args(argv)
    if a.refit:
        res = json.loads(a.refit.read_text())
        res["fits"] = fits_of(res["rows"], list(dict.fromkeys(r["kind"] for r in res["rows"])))
        print_fits(res["fits"])
        dest = a.out or a.refit
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        os.replace(tmp, dest)
        print(f"wrote {dest}")
        return 0
    et = a.runtime == "executorch"
    kinds = (a.kinds or ",".join(ET_KINDS if et else KINDS)).split(",")
    out_path = a.out or Path(__file__).parent / "results" / ("attention_rates_executorch.json" if et
                                                             else "attention_rates.json")
    if et:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import executorch
        import torch

        versions = {"executorch": getattr(executorch, "__version__", None) or _version("executorch"),
                    "torch": torch.__version__}
        what = ("one decode call of edgekv's .pte attention (edgekv.models.swaps.SdpaAttention): the row written in "
                "place, the cache read back as custom_sdpa takes it, llama::custom_sdpa; ExecuTorch runtime, 1 thread")
    else:
        import onnxruntime as ort

        versions = {"onnxruntime": ort.__version__}
        what = "one GroupQueryAttention decode call as edgekv's ONNX graphs emit it, present bound to past"

    t0 = time.time()
    rows = []
    # the repeats go round the rows (each row's runs in one go, the rows in turn), shapes and contexts interleaved
    for kind in kinds:
        for name, (h, hkv, d) in SHAPES.items():
            for ctx in (int(c) for c in a.ctx.split(",")):
                r = {"shape": name, **(et_time_call(h, hkv, d, kind, ctx, a.runs) if et
                                       else time_call(ort, h, hkv, d, kind, ctx, a.runs))}
                r["loadavg"] = round(os.getloadavg()[0], 2)
                rows.append(r)
                print(f"{kind:6} {name:14} ctx {ctx:6}: {r['median_us']:9.1f} us  {r['cache_read_gb_s']:5.2f} GB/s  "
                      f"{r['us_per_position']:.4f} us/position  (load {r['loadavg']})", flush=True)
    fits = fits_of(rows, kinds)
    print_fits(fits)
    out = {"benchmark": "attention_rates", "runtime": a.runtime,
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), **versions,
           "machine": platform.processor() or platform.machine(), "platform": platform.platform(),
           "loadavg": list(os.getloadavg()), "threads": 1, "runs": a.runs, "what": what,
           "rows": rows, "fits": fits, "seconds": round(time.time() - t0, 1)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, out_path)
    print(f"wrote {out_path}")
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
