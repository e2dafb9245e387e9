"""What ONNX Runtime's CPU GroupQueryAttention can read: one decode step of one attention layer over a filled cache,
fp32 vs an int8 or int4 cache (the op's k_quant_type / v_quant_type = PER_CHANNEL, kv_cache_bit_width 8 / 4), in the
pinned onnxruntime.

Each configuration is a one-node graph (com.microsoft GroupQueryAttention, SmolLM2-135M's layer shape by default:
9 query heads, 3 KV heads, head 64) called for the token at position T - 1 with T - 1 cached rows. past and present
share one buffer (IO binding, as ONNX Runtime GenAI runs it), so a call reads the cache and writes one row, no copy.
Before timing, each quantized call's output is checked against numpy attention over the dequantized cache (the new
row quantized with the same scales). The op's quantized cache takes static scales only: one per (KV head, channel),
k_scale / v_scale of shape [1, Hkv, 1, D] (a per-token scale of shape [1, Hkv, T, 1] is refused:
"k_scale shape mismatch"), so it cannot read edgekv's kv-int8 cache (one scale per token and head, set at write time)
as it is; see benchmarks/log/filled_context.md.

Usage: python experiments/ort_quant_cache.py [--ctx 2048,8192,16384] [--threads 1] [--runs 20]
Output: a table and benchmarks/results/ort_quant_cache.json (--out), with the load average. Per configuration the
median wall time and the median CPU time of the calling process (time.process_time: with one thread, the time the
kernel ran, which a machine shared with other jobs inflates far less than the wall time).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def graph(h: int, hk: int, d: int, bits: int | None) -> bytes:
    """A GroupQueryAttention node over a cache of `bits` (None: fp32) with dynamic cache length."""
    from onnx import TensorProto as TP
    from onnx import helper

    cache_t = {None: TP.FLOAT, 8: TP.INT8, 4: TP.UINT8}[bits]
    dc = d if bits != 4 else d // 2
    ins = ["q", "k", "v", "pk", "pv", "seqlens", "total"]
    attrs = {"num_heads": h, "kv_num_heads": hk}
    vi = [helper.make_tensor_value_info("q", TP.FLOAT, [1, 1, h * d]),
          helper.make_tensor_value_info("k", TP.FLOAT, [1, 1, hk * d]),
          helper.make_tensor_value_info("v", TP.FLOAT, [1, 1, hk * d]),
          helper.make_tensor_value_info("pk", cache_t, [1, hk, "T", dc]),
          helper.make_tensor_value_info("pv", cache_t, [1, hk, "T", dc]),
          helper.make_tensor_value_info("seqlens", TP.INT32, [1]),
          helper.make_tensor_value_info("total", TP.INT32, [])]
    if bits:
        ins += ["", "", "", "", "", "ks", "vs"]
        attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=bits)
        vi += [helper.make_tensor_value_info(n, TP.FLOAT, [1, hk, 1, d]) for n in ("ks", "vs")]
    node = helper.make_node("GroupQueryAttention", ins, ["o", "prk", "prv"], domain="com.microsoft", **attrs)
    outs = [helper.make_tensor_value_info("o", TP.FLOAT, None), helper.make_tensor_value_info("prk", cache_t, None),
            helper.make_tensor_value_info("prv", cache_t, None)]
    m = helper.make_model(helper.make_graph([node], "gqa", vi, outs),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString()


def dequant(codes: np.ndarray, scale: np.ndarray, bits: int | None) -> np.ndarray:
    """[1, Hkv, T, Dc] codes -> fp32 [1, Hkv, T, D]; int4: two codes per byte, low nibble first, each stored as
    value + 8 (0..15 for -8..7): the layout the CPU kernel reads, found by checking its output against each."""
    if bits is None:
        return codes
    if bits == 8:
        return codes.astype(np.float32) * scale
    lo = (codes & 0x0F).astype(np.int16) - 8
    hi = (codes >> 4).astype(np.int16) - 8
    vals = np.stack([lo, hi], axis=-1)
    return vals.reshape(*codes.shape[:-1], -1).astype(np.float32) * scale


def attention(q, kc, vc, h: int, hk: int, d: int) -> np.ndarray:
    out = []
    for i in range(h):
        g = i // (h // hk)
        s = q[i] @ kc[g].T / np.sqrt(d)
        p = np.exp(s - s.max())
        out.append((p / p.sum()) @ vc[g])
    return np.concatenate(out)


def measure(t: int, bits: int | None, a) -> dict:
    import onnxruntime as ort

    h, hk, d = a.heads, a.kv_heads, a.head_dim
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    sess = ort.InferenceSession(graph(h, hk, d, bits), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    dc = d if bits != 4 else d // 2
    if bits is None:
        pk = rng.standard_normal((1, hk, t, d)).astype(np.float32)
        pv = rng.standard_normal((1, hk, t, d)).astype(np.float32)
    elif bits == 8:
        pk, pv = (rng.integers(-127, 128, (1, hk, t, dc)).astype(np.int8) for _ in range(2))
    else:
        pk, pv = (rng.integers(0, 256, (1, hk, t, dc)).astype(np.uint8) for _ in range(2))
    scale = np.full((1, hk, 1, d), 0.02 if bits == 8 else 0.3, np.float32)
    feed = {"q": rng.standard_normal((1, 1, h * d)).astype(np.float32),
            "k": (rng.standard_normal((1, 1, hk * d)) * 0.5).astype(np.float32),
            "v": (rng.standard_normal((1, 1, hk * d)) * 0.5).astype(np.float32),
            "seqlens": np.array([t - 1], np.int32), "total": np.array(t, np.int32)}
    if bits:
        feed.update(ks=scale, vs=scale)
    kref, vref = dequant(pk, scale, bits)[0], dequant(pv, scale, bits)[0]
    pk_v, pv_v = ort.OrtValue.ortvalue_from_numpy(pk), ort.OrtValue.ortvalue_from_numpy(pv)
    bind = sess.io_binding()
    for n, v in feed.items():
        bind.bind_cpu_input(n, v)
    bind.bind_ortvalue_input("pk", pk_v)
    bind.bind_ortvalue_input("pv", pv_v)
    bind.bind_output("o")
    bind.bind_ortvalue_output("prk", pk_v)  # past and present share the buffer
    bind.bind_ortvalue_output("prv", pv_v)
    sess.run_with_iobinding(bind)
    got = bind.copy_outputs_to_cpu()[0].reshape(-1)
    # the new row at slot t - 1, as the op wrote it, then attention over all t rows
    kc = dequant(pk_v.numpy(), scale, bits)[0]
    vc = dequant(pv_v.numpy(), scale, bits)[0]
    kc[:, :t - 1], vc[:, :t - 1] = kref[:, :t - 1], vref[:, :t - 1]
    ref = attention(feed["q"].reshape(h, d), kc, vc, h, hk, d)
    err = float(np.abs(ref - got).max())
    times, cpu = [], []
    for _ in range(a.runs):
        t0, c0 = time.perf_counter(), time.process_time()
        sess.run_with_iobinding(bind)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    cache_bytes = 2 * pk.nbytes
    med, cmed = statistics.median(times), statistics.median(cpu)
    return {"ctx": t, "cache": "fp32" if bits is None else f"int{bits} per-channel", "max_abs_err": err,
            "median_us": round(med * 1e6, 1), "best_us": round(min(times) * 1e6, 1),
            "cpu_median_us": round(cmed * 1e6, 1), "cache_bytes": cache_bytes,
            "cache_read_gb_s_cpu": round(cache_bytes / cmed / 1e9, 2) if cmed else None,
            "loadavg": list(os.getloadavg())}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", default="2048,8192,16384")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ort_quant_cache.json"))
    a = ap.parse_args(argv)
    try:
        ctxs = [int(c) for c in a.ctx.split(",")]
    except ValueError:
        ap.error(f"--ctx {a.ctx!r}: comma-separated integers")
    if min(ctxs) < 2 or a.runs < 1 or a.threads < 1 or a.heads % a.kv_heads or a.head_dim % 2:
        ap.error("--ctx at least 2, --runs and --threads at least 1, heads a multiple of kv-heads, head-dim even")
    from importlib.metadata import version
    res = {"benchmark": "ort_quant_cache", "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
           "onnxruntime": version("onnxruntime"), "loadavg_start": list(os.getloadavg()),
           "settings": {"threads": a.threads, "runs": a.runs, "heads": a.heads, "kv_heads": a.kv_heads,
                        "head_dim": a.head_dim, "what": "one GroupQueryAttention decode call, past/present shared"},
           "rows": []}
    for t in ctxs:
        for bits in (None, 8, 4):
            r = measure(t, bits, a)
            res["rows"].append(r)
            print(f"ctx {t:>6} {r['cache']:<18} wall {r['median_us']:>10.1f} us  cpu {r['cpu_median_us']:>10.1f} us  "
                  f"max err {r['max_abs_err']:.2e}", flush=True)
    res["loadavg_end"] = list(os.getloadavg())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"load average {res['loadavg_start']} -> {res['loadavg_end']}; wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
