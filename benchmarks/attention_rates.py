"""One decode step's attention as ONNX Runtime runs it in edgekv's ONNX graphs: one com.microsoft
GroupQueryAttention node (packed q/k/v, the op rotating q and k itself, present bound to past's buffer), timed per
call at several filled contexts, cache kinds and head shapes, on 1 thread. Fits, per cache kind,

    time per call = overhead + ctx * (2 * kv_heads * head_dim * bytes / read_rate + heads * head_dim * c_compute)

(2: keys and values) and writes the measured rows and the fitted terms as JSON. The fitted terms are what
edgekv/costs/attention_rates.json stores for the host (`edgekv plan` reads that file, never this script).

    python benchmarks/attention_rates.py [--ctx 1024,2048,4096,8192,16384,32768] [--runs 7] [--out FILE]

The graph is built as edgekv.models.swaps.GQAAttention emits it: inputs 0-6 (packed qkv, no separate k/v, past
key/value, seqlens_k, total_sequence_length, cos, sin; do_rotary 1), and for kv-int8c the static per-channel
scales as inputs 12-13 with k_quant_type / v_quant_type PER_CHANNEL and kv_cache_bit_width 8; q/k/v go in as the
cache dtype for a float cache, fp32 for int8 codes.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--kinds", default="fp32,fp16,int8c")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_rates.json")
    a = ap.parse_args(argv)
    import onnxruntime as ort

    t0 = time.time()
    rows = []
    for kind in a.kinds.split(","):
        for name, (h, hkv, d) in SHAPES.items():
            for ctx in (int(c) for c in a.ctx.split(",")):
                r = {"shape": name, **time_call(ort, h, hkv, d, kind, ctx, a.runs)}
                rows.append(r)
                print(f"{kind:6} {name:14} ctx {ctx:6}: {r['median_us']:9.1f} us  {r['cache_read_gb_s']:5.2f} GB/s  "
                      f"{r['us_per_position']:.4f} us/position", flush=True)
    fits = {k: fit([r for r in rows if r["kind"] == k]) for k in a.kinds.split(",")}
    for k, f in fits.items():
        rate = f"{f['read_bytes_per_s'] / 1e9:.2f} GB/s" if f["read_bytes_per_s"] else "no read term"
        print(f"fit {k}: overhead {f['overhead_s'] * 1e6:.1f} us, read {rate}, compute "
              f"{f['compute_s_per_head_dim_position'] * 1e12:.2f} ps per head x dim x position; worst row "
              f"{f['max_abs_rel_error']:.0%}")
    out = {"benchmark": "attention_rates", "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
           "onnxruntime": ort.__version__, "machine": platform.processor() or platform.machine(),
           "loadavg": list(os.getloadavg()), "threads": 1, "runs": a.runs,
           "what": "one GroupQueryAttention decode call as edgekv's ONNX graphs emit it, present bound to past",
           "rows": rows, "fits": fits, "seconds": round(time.time() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
