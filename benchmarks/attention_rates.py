"""One decode step's attention as ONNX Runtime runs it in edgekv's ONNX graphs: one com.microsoft
GroupQueryAttention node (packed q/k/v, the op rotating q and k itself, present bound to past's buffer), timed per
call at several filled contexts, cache kinds and head shapes, on 1 thread. Fits, per cache kind,

    time per call = overhead + ctx * (2 * kv_heads * head_dim * bytes / read_rate + heads * head_dim * c_compute)

(2: keys and values) and writes the measured rows and the fitted terms as JSON. The fitted terms are what
edgekv/costs/attention_rates.json stores for the host (`edgekv plan` reads that file, never this script).

    python benchmarks/attention_rates.py [--runtime onnxruntime|executorch|llamacpp] [--ctx 1024,...,32768]
                                         [--runs 7] [--prefill] [--out FILE]

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

--runtime executorch --kinds 'etllama fp32,etllama fp16,etllama int8': the same ops as ExecuTorch's own Llama export
calls them (export_llama --use_sdpa_with_kv_cache; edgekv plan --runtime executorch-llama): etl_program
(attention_rates_executorch_llama.json).

--runtime llamacpp: llama.cpp (llama-cpp-python, `make bench-deps`) has no single attention op to call from Python,
so it times a decode step of a random-weight f16 GGUF of one layer at each head shape (lc_gguf: a 512-token
vocabulary and a 64-wide MLP, so the step outside attention is a small constant), flash attention on, K and V of
each cache type (f16, q8_0, q4_0), 1 thread, the cache filled by a real prefill; each kind is fitted per head size
(by_head_dim) and over both (time = step overhead + layers x ctx x H x D x c). The fill of each context is timed too:
its attention FLOP over its time is llama.cpp's prefill attention rate per kind and head size (prefill_fits).

--window (onnxruntime): the window strategy's layer, which edgekv's ONNX export keeps on the eager graph (sinks plus
a rolling fp16 window, no GroupQueryAttention): one decode call of edgekv.models.attention.Attention over a
RollingCache, lowered as the export lowers a model, at kept keys WIN_SLOTS and both head shapes
(attention_rates_window.json; each head size's measured curve is what the plan charges that graph).

--window --prefill: one prefill call of that layer instead (128 queries on onnxruntime, ET_PREFILL_CHUNK on
executorch) at each kept-key count and head shape; its mask spans every slot and the call's own rows, so its FLOP are
4 x H x D x C x (slots + C) (memory.prefill.eager_attention_flop), whose rate per head size (prefill_fits,
attention_rates_[executorch_]window_prefill.json) prices every eager graph's prompt.

--matmul --tokens 128: MatMulNBits per matrix shape at a prefill call's 128 tokens (gflop_s per row,
matmul_nbits_rates_128.json).

--prefill (onnxruntime): one GroupQueryAttention call of 128 queries (edgekv's ONNX prefills in calls of 128 tokens)
at positions ctx - 128 .. ctx - 1, per kind and shape: the prefill's attention FLOP rate per kind and head size
(prefill_fits, attention_rates_prefill.json). --prefill --runtime executorch: one call of 32 queries (the .pte's
prefill chunk) per kind, the float caches through custom_sdpa (attention_rates_executorch_prefill.json) and the int8
codes through custom_quantized_sdpa (attention_rates_executorch_prefill_int8.json: on x86 its int8 x int8 products
run a scalar loop, about a tenth of custom_sdpa's fp32 rate, so its prompt cannot be fitted on 2k rows whose matmuls
dominate).
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
# head shapes timed only when --shapes names them, never by default: how a kind's per-key cost carries to other
# models' heads at the same head size (edgekv/catalog's configs of head size 64, KV heads 2 to 32). llama.cpp's cache
# row holds every KV head of a position, so one head's keys are read at a stride of KV heads x D x the type's bytes:
# its per key x H x D cost grows with the KV heads (kv_heads_scales)
EXTRA_SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "smollm2-360m": (15, 5, 64), "llama-3.2-1b": (32, 8, 64),
                "smollm2-1.7b": (32, 32, 64)}
COLD_BYTES = 256 << 20
KINDS = {"fp32": (np.float32, 4), "fp16": (np.float16, 2), "int8c": (np.int8, 1)}  # cache dtype, bytes per value
# ExecuTorch: the cache kinds edgekv's .pte attends through custom_sdpa or custom_quantized_sdpa (bytes per value,
# for the fit's read term)
ET_KINDS = {"fp32": 4, "fp16": 2, "int8": 1, "int8c": 1, "int4": 0.5}
ET_INT4_GROUP = 32  # kv-int4's default group (edgekv.strategies): an fp16 scale and zero per 32 channels
# ExecuTorch's own Llama export (examples/models/llama, export_llama --use_sdpa_with_kv_cache; the planner's
# "executorch-llama" cost model): the same ops called as its SDPACustom / QuantizedSDPA call them (etl_program)
ETL_KINDS = {"etllama fp32": 4, "etllama fp16": 2, "etllama int8": 1}
# the tokens of one call of an edgekv .pte's prefill method (edgekv.export.options.ExportOptions.prefill_chunk)
ET_PREFILL_CHUNK = 32
# the window strategy's pinned first positions (edgekv.strategies: window's default sinks)
WIN_SINKS = 4
# the window graph's kept keys timed by --window: Gemma 3's native 512 (+ sinks) up to twice the default W
WIN_SLOTS = (516, 1028, 2052, 4100, 8196)
# the layer's model width in win_program: 1, so its q/k/v/o projections are four matmuls of H x D (or Hkv x D) values
# against one, next to nothing. In a model those projections are the layer's MatMulNBits weights, which the plan's
# weights term already charges; at the model's width (Gemma 3's 4 x 256 heads: 2.6 M fp32 parameters, 10.5 MB a call)
# they were most of the time of a call at 516 kept keys and were charged a second time per key
WIN_HIDDEN = 1


def graph(h: int, hkv: int, d: int, kind: str) -> bytes:
    from onnx import TensorProto as TP
    from onnx import helper

    cache_t = {"fp32": TP.FLOAT, "fp16": TP.FLOAT16, "int8c": TP.INT8}[kind]
    io_t = TP.FLOAT16 if kind == "fp16" else TP.FLOAT
    vi = [helper.make_tensor_value_info("qkv", io_t, [1, "S", (h + 2 * hkv) * d]),
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


def write_json(dest: Path, res: dict) -> None:
    """The results JSON, written whole or not at all (a temporary beside it, then renamed)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, dest)
    print(f"wrote {dest}")


def timed(calls, runs: int, before=None, warm: bool = True) -> tuple[list[float], list[float]]:
    """Each of `calls` once to warm up (warm), then `runs` rounds of them in turn, each call timed alone: (process CPU
    seconds, wall seconds) per call. before: run untimed before each timed call (llama.cpp's cache sweep). The fits
    use the CPU time: on a shared host the wall time also counts the time the one thread waits for a core (the
    filled-context rows they are compared with record both, decode_tok_per_cpu_s)."""
    if warm:
        for c in calls:
            c()
    cpu, wall = [], []
    for _ in range(runs):
        for c in calls:
            if before:
                before()
            t0, c0 = time.perf_counter(), time.process_time()
            c()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
    return cpu, wall


def call_row(ctx: int, kind: str, h: int, hkv: int, d: int, cpu: list[float], wall: list[float], cache_bytes: int,
             per: float, **extra) -> dict:
    """One timed row as every runtime's decode rows store it: the median, wall median and best call, the cache bytes
    one call reads and the rate that is, and the median per attended key (per: keys x layers)."""
    med = statistics.median(cpu)
    return {"ctx": ctx, "kind": kind, "heads": h, "kv_heads": hkv, "head_dim": d, **extra,
            "median_us": round(med * 1e6, 1), "wall_median_us": round(statistics.median(wall) * 1e6, 1),
            "best_us": round(min(cpu) * 1e6, 1), "cache_bytes": cache_bytes,
            "cache_read_gb_s": round(cache_bytes / med / 1e9, 2), "us_per_position": round(med * 1e6 / per, 4)}


def time_call(ort, h: int, hkv: int, d: int, kind: str, ctx: int, runs: int, chunk: int = 1) -> dict:
    """Median and best CPU time (and median wall time) of one decode call at position ctx - 1 (ctx keys attended), cache of ctx slots;
    chunk > 1: one prefill call of `chunk` queries at positions ctx - chunk .. ctx - 1 (edgekv's ONNX prefills in calls
    of 128 tokens: edgekv.export.stepper.Stepper.max_chunk)."""
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
    n = min(max(2, -(-COLD_BYTES // cache_bytes)), 30) if chunk == 1 else 2  # a prefill call: compute-bound
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    ang = np.arange(ctx)[:, None] * inv[None]
    vals = {"qkv": rng.standard_normal((1, chunk, (h + 2 * hkv) * d)).astype(io),
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
    cpu, ts = timed([lambda b=b: sess.run_with_iobinding(b) for b, *_ in binds], runs)
    med = statistics.median(cpu)
    if chunk > 1:  # the call's attention FLOP: 4 x H x D per query and key it attends (causal within the chunk)
        flop = 4 * h * d * sum(ctx - chunk + i + 1 for i in range(chunk))
        return {"ctx": ctx, "chunk": chunk, "kind": kind, "heads": h, "kv_heads": hkv, "head_dim": d,
                "median_us": round(med * 1e6, 1), "wall_median_us": round(statistics.median(ts) * 1e6, 1),
                "best_us": round(min(cpu) * 1e6, 1), "attention_flop": flop,
                "attention_gflop_s": round(flop / med / 1e9, 2)}
    return call_row(ctx, kind, h, hkv, d, cpu, ts, cache_bytes, ctx, caches=n)


# --matmul (onnxruntime): the weights kernel of edgekv's int4 ONNX, one com.microsoft MatMulNBits node per matrix (4
# bits, blocks of 32, fp32 scales and uint8 zero points, accuracy_level 4: edgekv.export.wquant's int4) at one token,
# per matrix shape (K inputs, N outputs) of the models the plan is checked on, as edgekv's graphs run them (q, k and v
# in one matrix: swaps.GQAAttention's qkv_proj; the output layer at the vocabulary): config.json of each model
MATMUL_SHAPES = {"smollm2-135m": ((576, 960), (576, 576), (576, 1536), (1536, 576), (576, 49152)),
                 "gemma-3-270m": ((640, 1536), (1024, 640), (640, 2048), (2048, 640), (640, 262144)),
                 "llama-3.2-1b": ((2048, 3072), (2048, 2048), (2048, 8192), (8192, 2048), (2048, 128256))}
MATMUL_BLOCK = 32
MAX_TOKENS = 4096  # --matmul --tokens: a call's input is tokens x K fp32 (and its outputs tokens x N per copy)
MATMUL_COLD = 48 << 20  # each call's matrices at least this many bytes, so a small matrix is read from memory


def nbits_bytes(k: int, n: int) -> int:
    """A MatMulNBits int4 matrix's bytes: the codes, an fp32 scale and a 4-bit zero point per block of 32."""
    blocks = -(-k // MATMUL_BLOCK)
    return n * blocks * (MATMUL_BLOCK // 2 + 4) + n * -(-blocks // 2)


def matmul_graph(k: int, n: int, copies: int, tokens: int = 1) -> bytes:
    """`copies` MatMulNBits nodes of shape (k, n), each its own random int4 matrix, all on `tokens` fp32 tokens."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    blocks = -(-k // MATMUL_BLOCK)
    nodes, inits, outs = [], [], []
    for i in range(copies):
        b = rng.integers(0, 256, (n, blocks, MATMUL_BLOCK // 2), dtype=np.uint8)
        sc = np.full(n * blocks, 0.01, np.float32)
        zp = np.full(n * -(-blocks // 2), 0x88, np.uint8)
        inits += [numpy_helper.from_array(b, f"b{i}"), numpy_helper.from_array(sc, f"s{i}"),
                  numpy_helper.from_array(zp, f"z{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"b{i}", f"s{i}", f"z{i}"], [f"y{i}"], domain="com.microsoft",
                                      K=k, N=n, bits=4, block_size=MATMUL_BLOCK, accuracy_level=4))
        outs.append(helper.make_tensor_value_info(f"y{i}", TP.FLOAT, None))
    g = helper.make_graph(nodes, "nbits", [helper.make_tensor_value_info("x", TP.FLOAT, [1, tokens, k])], outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString()


def _matmul_header(name: str, ort, t0: float, runs: int) -> dict:
    """The head of a --matmul / --matmul-forms results JSON: what ran, where and when, at what load."""
    return {"benchmark": name, "onnxruntime": ort.__version__,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "machine": {"platform": platform.platform(), "processor": platform.processor()},
            "loadavg_end": list(os.getloadavg()), "threads": 1, "runs": runs}


def matmul_time(ort, k: int, n: int, runs: int, tokens: int = 1) -> dict:
    """CPU seconds of one MatMulNBits call of shape (k, n) at one token, 1 thread: a graph of as many copies as make
    MATMUL_COLD bytes (at most 256), its time per run over the copies (median of `runs`). tokens > 1: a prefill call
    of that many tokens (edgekv's ONNX prefills in calls of 128), its FLOP rate (gflop_s) beside."""
    nbytes = nbits_bytes(k, n)
    copies = max(1, min(256, -(-MATMUL_COLD // nbytes)))
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(matmul_graph(k, n, copies, tokens), so, providers=["CPUExecutionProvider"])
    x = {"x": np.random.default_rng(1).standard_normal((1, tokens, k)).astype(np.float32)}
    cpu, wall = timed([lambda: sess.run(None, x)], runs)
    med = statistics.median(cpu) / copies
    return {"k": k, "n": n, "bytes": nbytes, "copies": copies, "median_us": round(med * 1e6, 2),
            **({"tokens": tokens, "gflop_s": round(2 * tokens * k * n / med / 1e9, 1)} if tokens > 1 else {}),
            "wall_median_us": round(statistics.median(wall) / copies * 1e6, 2),
            "best_us": round(min(cpu) / copies * 1e6, 2), "read_gb_s": round(nbytes / med / 1e9, 3)}


def matmul_main(a) -> int:
    """--matmul: MatMulNBits per shape (MATMUL_SHAPES) into results/matmul_nbits_rates.json."""
    import onnxruntime as ort

    t0 = time.time()
    rows = []
    for model, shapes in MATMUL_SHAPES.items():
        for k, n in shapes:
            r = {"model": model, **matmul_time(ort, k, n, a.runs, a.tokens), "loadavg": round(os.getloadavg()[0], 2)}
            rows.append(r)
            print(r, flush=True)
    out = {**_matmul_header("matmul_nbits_rates", ort, t0, a.runs),
           "what": "one com.microsoft MatMulNBits call (int4, blocks of 32, fp32 scales, uint8 zero points, "
                   f"accuracy_level 4) at {a.tokens} fp32 token(s), per matrix shape (K, N) as edgekv's int4 ONNX runs it; each "
                   f"timed graph holds copies of the matrix totalling at least {MATMUL_COLD >> 20} MiB (at most 256), "
                   "so that each is read from memory as in a model; 1 thread, process CPU time per call",
           "rows": rows, "seconds": round(time.time() - t0, 1)}
    write_json(a.out or Path(__file__).parent / "results" / ("matmul_nbits_rates.json" if a.tokens == 1 else
                                                            f"matmul_nbits_rates_{a.tokens}.json"), out)
    return 0


# --matmul-forms (onnxruntime): the weights kernel in each form `edgekv export --weights gguf` carries a GGUF type in
# (edgekv.memory.weights.CARRIED_FORM, built as edgekv.export.gguf_blocks.carry builds it: MatMulNBits of the form's
# bits and block, fp32 scales, packed uint zero points where the type has a minimum, and its fp32 block-sum remainder:
# Shape, Slice, Concat, Reshape, ReduceSum of the input, MatMul by the [K / block, N] remainder, Add), per matrix
# shape of MATMUL_SHAPES, at one token, accuracy_level 4 (edgekv.export.onnx_quant.ORT_ACCURACY_LEVEL). "4-bit/32" is
# also ONNX Runtime GenAI's int4 (its builder's default: symmetric, blocks of 32, no zero points, accuracy_level 4 on
# cpu). "int4 asym" is edgekv's --weights int4 form (uint8 zero points, the --matmul rows), timed again in the same run
# as the reference the forms are compared with. Each copy of the matrix has its own input (bound once), so no two
# copies share the remainder's block sums (in a model the projections of one input share them: gate and up).
MATMUL_FORMS = ("4-bit/32", "4-bit/32 zp+rem", "8-bit/32", "8-bit/16", "8-bit/32 zp+rem", "int4 asym")


def form_spec(form: str) -> tuple[int, int, bool, bool]:
    """A form's (bits, block, zero points, remainder), as edgekv.memory.weights.carried_form_name names them."""
    if form == "int4 asym":
        return 4, MATMUL_BLOCK, True, False
    bits, rest = form.split("-bit/")
    block, _, extra = rest.partition(" ")
    return int(bits), int(block), extra == "zp+rem", extra == "zp+rem"


def form_bytes(form: str, k: int, n: int) -> int:
    """Bytes of one (k, n) matrix in the form, as edgekv.memory.weights.carried_matrix_bytes counts them (the codes,
    fp32 scales, packed zero points, fp32 remainders)."""
    if form == "int4 asym":
        return nbits_bytes(k, n)
    bits, block, zp, rem = form_spec(form)
    nb = k // block
    out = n * k * bits // 8 + 4 * n * nb
    if zp:
        out += n * (nb if bits == 8 else -(-nb // 2))
    return out + (4 * n * nb if rem else 0)


def form_graph(form: str, k: int, n: int, copies: int) -> bytes:
    """`copies` matrices of shape (k, n) in the form, each its own random codes on its own fp32 token x{i}."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    bits, block, zp, rem = form_spec(form)
    rng = np.random.default_rng(0)
    nb = k // block
    nodes, inits, ins, outs = [], [], [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    for i in range(copies):
        x = f"x{i}"
        ins.append(helper.make_tensor_value_info(x, TP.FLOAT, [1, 1, k]))
        b = const(f"b{i}", rng.integers(0, 256, (n, nb, block * bits // 8), dtype=np.uint8))
        args = [x, b, const(f"s{i}", np.full(n * nb, 0.01, np.float32))]
        if zp:
            args.append(const(f"z{i}", np.full(n * (nb if bits == 8 else -(-nb // 2)), 0x88 if bits == 4 else 128,
                                               np.uint8)))
        y = f"y{i}" if not rem else f"y{i}.nbits"
        nodes.append(helper.make_node("MatMulNBits", args, [y], domain="com.microsoft", K=k, N=n, bits=bits,
                                      block_size=block, accuracy_level=4))
        if rem:  # gguf_blocks.carry's remainder term, node for node
            s = f"{x}.blocksums{block}"
            nodes += [
                helper.make_node("Shape", [x], [s + ".xs"]),
                helper.make_node("Slice", [s + ".xs", const(s + ".0", np.array([0], np.int64)),
                                           const(s + ".-1", np.array([-1], np.int64))], [s + ".lead"]),
                helper.make_node("Concat", [s + ".lead", const(s + ".tail", np.array([nb, block], np.int64))],
                                 [s + ".shape"], axis=0),
                helper.make_node("Reshape", [x, s + ".shape"], [s + ".blocks"]),
                helper.make_node("ReduceSum", [s + ".blocks", const(s + ".axes", np.array([-1], np.int64))], [s],
                                 keepdims=0),
                helper.make_node("MatMul", [s, const(f"r{i}", np.full((nb, n), 1e-3, np.float32))], [f"y{i}.rem"]),
                helper.make_node("Add", [y, f"y{i}.rem"], [f"y{i}"])]
        outs.append(helper.make_tensor_value_info(f"y{i}", TP.FLOAT, None))
    g = helper.make_graph(nodes, "forms", ins, outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString()


def form_time(ort, form: str, k: int, n: int, runs: int) -> dict:
    """CPU seconds of one matrix (k, n) in the form at one token, 1 thread: a graph of as many copies as make
    MATMUL_COLD bytes (at most 256), the inputs bound once (io binding), its time per run over the copies."""
    nbytes = form_bytes(form, k, n)
    copies = max(1, min(256, -(-MATMUL_COLD // nbytes)))
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(form_graph(form, k, n, copies), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    bind = sess.io_binding()
    for i in range(copies):
        bind.bind_cpu_input(f"x{i}", rng.standard_normal((1, 1, k)).astype(np.float32))
        bind.bind_output(f"y{i}")
    cpu, wall = timed([lambda: sess.run_with_iobinding(bind)], runs)
    med = statistics.median(cpu) / copies
    return {"form": form, "k": k, "n": n, "bytes": nbytes, "copies": copies, "median_us": round(med * 1e6, 2),
            "wall_median_us": round(statistics.median(wall) / copies * 1e6, 2),
            "best_us": round(min(cpu) / copies * 1e6, 2), "read_gb_s": round(nbytes / med / 1e9, 3)}


def matmul_forms_main(a) -> int:
    """--matmul-forms: each form (MATMUL_FORMS, or --forms) per shape (MATMUL_SHAPES), the forms going round each
    shape, into results/matmul_nbits_forms.json."""
    import onnxruntime as ort

    forms = a.forms.split(",") if a.forms else list(MATMUL_FORMS)
    t0 = time.time()
    rows = []
    for model, shapes in MATMUL_SHAPES.items():
        for k, n in shapes:
            for form in forms:
                if k % form_spec(form)[1]:
                    continue
                r = {"model": model, **form_time(ort, form, k, n, a.runs), "loadavg": round(os.getloadavg()[0], 2)}
                rows.append(r)
                print(r, flush=True)
    out = {**_matmul_header("matmul_nbits_forms", ort, t0, a.runs),
           "what": "one matrix (K, N) at one fp32 token in each form edgekv export --weights gguf carries a GGUF type "
                   "in (MatMulNBits bits / block, fp32 scales; 'zp+rem': packed uint zero points and the fp32 "
                   "block-sum remainder subgraph of edgekv.export.gguf_blocks.carry), accuracy_level 4; '4-bit/32' is "
                   "also ONNX Runtime GenAI's symmetric int4; 'int4 asym' edgekv's --weights int4 (the --matmul rows' "
                   f"form) in the same run; each timed graph holds copies totalling at least {MATMUL_COLD >> 20} MiB "
                   "(at most 256), each on its own input bound once; 1 thread, process CPU time per matrix",
           "rows": rows, "seconds": round(time.time() - t0, 1)}
    write_json(a.out or Path(__file__).parent / "results" / "matmul_nbits_forms.json", out)
    return 0


def forms_entry(forms: dict, int4_rows: list[list[float]], source: str) -> dict:
    """edgekv/costs/attention_rates.json's onnxruntime weights.gguf.by_form from a --matmul-forms run (forms: its JSON)
    and the stored int4 rows (weights.int4.by_matrix.rows: [K, N, bytes, seconds], the --matmul run the int4 graph's
    per-layer ops were fitted with): each form's seconds at a shape = its median over the same run's "int4 asym" median
    at that shape (the forms compared in one run, on one machine and load) times the stored int4 seconds at that
    shape, so every form sits on the int4 rows the filled rows are predicted with. Rows [K, N, the form's bytes,
    seconds], and ratio_to_int4 per shape."""
    ref = {(r["k"], r["n"]): r["median_us"] for r in forms["rows"] if r["form"] == "int4 asym"}
    stored = {(int(k), int(n)): t for k, n, _, t in int4_rows}
    types: dict[str, list[str]] = {}
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from edgekv.memory.weights import CARRIED_FORM, carried_form_name

    for t in CARRIED_FORM:
        types.setdefault(carried_form_name(t), []).append(t)
    out = {}
    for r in forms["rows"]:
        key = (r["k"], r["n"])
        if r["form"] == "int4 asym" or key not in ref or key not in stored:
            continue
        f = out.setdefault(r["form"], {"types": types.get(r["form"], []), "rows": [], "ratio_to_int4": []})
        ratio = r["median_us"] / ref[key]
        f["rows"].append([r["k"], r["n"], r["bytes"], float(f"{ratio * stored[key]:.4g}")])
        f["ratio_to_int4"].append([r["k"], r["n"], round(ratio, 3)])
    return {"kernel": "MatMulNBits", "forms": out, "layer_overhead_from": "int4", "source": source}


RATES_FILE = Path(__file__).resolve().parent.parent / "edgekv" / "costs" / "attention_rates.json"


def forms_source(name: str, forms: dict, int4_rows: list[list[float]], vm: str = "another VM") -> str:
    """The source line of a forms_entry: the --matmul-forms run (results/NAME), its load, and how its int4 form's
    time compared with the stored int4 rows it is scaled onto."""
    ref = [r for r in forms["rows"] if r["form"] == "int4 asym"]
    load = sorted(r["loadavg"] for r in forms["rows"])
    return (f"rows [K, N, bytes, seconds] per form: one matrix in the form edgekv export --weights gguf carries each "
            f"GGUF type in (types), at one token, 1 thread, accuracy_level 4, timed beside edgekv's int4 form in one "
            f"run (benchmarks/attention_rates.py --matmul-forms, benchmarks/results/{name}, onnxruntime "
            f"{forms['onnxruntime']}, {forms['machine']['platform']}, load average {load[0]:.1f}-{load[-1]:.1f}): "
            f"seconds = that run's ratio to the int4 form at the same shape (ratio_to_int4) x the int4 rows above "
            f"(weights.int4.by_matrix, the rows the filled rows are predicted with; the int4 form ran "
            f"{statistics.median(r['median_us'] / t * 1e-6 for r in ref for k, n, _, t in int4_rows if (k, n) == (r['k'], r['n'])):.2f}x "
            f"their time in this run, {vm}); the step's other ops per layer: the int4 graph's "
            "(layer_overhead_from). '4-bit/32' is also ONNX Runtime GenAI's int4 (symmetric, blocks of 32), which "
            "benchmarks/plan_vs_filled.py checks its rows at")


def store_forms(path: Path) -> int:
    """--store-forms: forms_entry of a --matmul-forms run into RATES_FILE (onnxruntime, host, weights.gguf; another
    profile's: benchmarks/device_rates.py MATMUL_FORMS_SOURCES)."""
    forms = json.loads(path.read_text())
    rates = json.loads(RATES_FILE.read_text())
    w = rates["onnxruntime"]["devices"]["host"]["weights"]
    src = forms_source(path.name, forms, w["int4"]["by_matrix"]["rows"])
    w["gguf"] = {"by_form": forms_entry(forms, w["int4"]["by_matrix"]["rows"], src)}
    tmp = RATES_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(rates, indent=2) + "\n")
    os.replace(tmp, RATES_FILE)
    print(f"wrote {RATES_FILE}: onnxruntime host weights.gguf, forms {', '.join(w['gguf']['by_form']['forms'])}")
    return 0


def win_module(h: int, hkv: int, d: int, slots: int, hidden: int = WIN_HIDDEN, dtype: str = "fp16",
               sinks: int = WIN_SINKS, c: int = 1):
    """One decode call of the window strategy's layer as edgekv's exports build it (no fused op: the eager
    edgekv.models.attention.Attention over a RollingCache of `slots` = sinks + W fp16 slots: the q/k/v projections,
    RoPE, the plan's write / keep / mask, the call's row blended into the cache, the cache read back in fp32 with the
    call's own row appended, two bmm and the softmax, o_proj), torch.export'ed: (ExportedProgram, example args).
    dtype "fp32", sinks 0: a sliding layer's own ring of a plain fp32 cache instead (edgekv.models.cache.layer_caches:
    RollingCache(0, Wn, ...), a Gemma 3 sliding layer when the other layers keep every position). c > 1: one prefill
    call of c tokens instead (the layer's mask [G x c, slots + c]: every slot, written or not, and the call's rows)."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from edgekv.models.attention import Attention, Call
    from edgekv.models.cache import KVFormat, RollingCache
    from edgekv.strategies import FloatStorage

    cfg = SimpleNamespace(n_heads=h, n_kv_heads=hkv, head_dim=d, hidden=hidden, qkv_bias=False, o_bias=False,
                          attn_scale=None, qk_norm=None, rms_eps=1e-6, norm_offset=0.0)

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention(cfg)
            self.attn.cache = (RollingCache(sinks, slots - sinks, slots - sinks, sinks, None) if sinks else
                               RollingCache(0, slots, None, 0, slots))
            self.attn.fmt = KVFormat(FloatStorage(dtype))

        def forward(self, x, cos, sin, pos, k, v):
            out, ks, vs = self.attn(x, cos, sin, (k,), (v,), Call(pos, c, h // hkv))
            return out, ks[0], vs[0]

    torch.manual_seed(0)
    cast = torch.float16 if dtype == "fp16" else torch.float32
    args = (torch.randn(1, c, hidden), torch.randn(c, 1, d), torch.randn(c, 1, d), torch.tensor([4 * slots]),
            torch.randn(1, hkv, slots, d).to(cast), torch.randn(1, hkv, slots, d).to(cast))
    with torch.no_grad():
        return torch.export.export(Step().eval(), args, strict=False), args


def win_program(h: int, hkv: int, d: int, slots: int, hidden: int = WIN_HIDDEN, c: int = 1) -> bytes:
    """The ONNX graph of win_module, lowered by torch.onnx.export(dynamo=True) as edgekv.export.to_onnx lowers a
    model."""
    import contextlib
    import io

    import torch

    ep, _ = win_module(h, hkv, d, slots, hidden, c=c)
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        prog = torch.onnx.export(ep, (), input_names=["x", "cos", "sin", "pos", "k", "v"],
                                 output_names=["o", "nk", "nv"], dynamo=True, external_data=False, optimize=True,
                                 verbose=False)
    return prog.model_proto.SerializeToString()


def et_win_time_call(h: int, hkv: int, d: int, slots: int, runs: int, hidden: int = WIN_HIDDEN, dtype: str = "fp16",
                     sinks: int = WIN_SINKS, c: int = 1) -> dict:
    """win_time_call's figures for the .pte: win_module lowered as edgekv export lowers a model (edgekv.export.to_pte,
    XNNPACK; the eager layer's new cache is an output, not written in place) and run by ExecuTorch's runtime on 1
    thread, inputs cycled so each call reads a cold cache."""
    import torch
    from executorch.extension.pybindings import portable_lib

    from edgekv.export.pte_stepper import quiet_native_stderr
    from edgekv.export.to_pte import lower_pte, to_buffer

    torch.set_num_threads(1)
    ep, _ = win_module(h, hkv, d, slots, hidden, dtype, sinks, c)
    buf = to_buffer(lower_pte({"forward": ep}, in_place=False), in_place=False)
    with quiet_native_stderr():
        portable_lib._unsafe_reset_threadpool(1)
        mod = portable_lib._load_for_executorch_from_buffer(buf)
    cast, size = (torch.float16, 2) if dtype == "fp16" else (torch.float32, 4)
    cache_bytes = 2 * hkv * slots * d * size
    n = min(max(2, -(-COLD_BYTES // cache_bytes)), 30)
    g = torch.Generator().manual_seed(0)
    sets = [(torch.randn(1, c, hidden, generator=g), torch.ones(c, 1, d), torch.zeros(c, 1, d),
             torch.tensor([4 * slots]), torch.randn(1, hkv, slots, d, generator=g).to(cast),
             torch.randn(1, hkv, slots, d, generator=g).to(cast)) for _ in range(n)]
    with quiet_native_stderr():
        cpu, ts = timed([lambda a=a: mod.forward(a) for a in sets], runs)
    kind = "eager window fp16" if sinks else f"eager ring {dtype}"
    return call_row(slots, kind, h, hkv, d, cpu, ts, cache_bytes, slots, caches=n, **win_prefill(h, d, slots, c, cpu))


def win_time_call(h: int, hkv: int, d: int, slots: int, runs: int, hidden: int = WIN_HIDDEN, c: int = 1) -> dict:
    """time_call's figures for the window strategy's eager graph (win_program) at `slots` kept keys, ONNX Runtime
    on 1 thread; each call's new cache goes to its own output buffers (an eager layer's outputs are computed from
    its inputs and are not bound to them: edgekv.models.swaps), inputs cycled so each call reads a cold cache."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(win_program(h, hkv, d, slots, hidden, c), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    cache_bytes = 2 * hkv * slots * d * 2
    n = min(max(2, -(-COLD_BYTES // cache_bytes)), 30)
    sets = [{"x": rng.standard_normal((1, c, hidden)).astype(np.float32),
             "cos": np.ones((c, 1, d), np.float32), "sin": np.zeros((c, 1, d), np.float32),
             "pos": np.array([4 * slots], np.int64),
             "k": rng.standard_normal((1, hkv, slots, d)).astype(np.float16),
             "v": rng.standard_normal((1, hkv, slots, d)).astype(np.float16)} for _ in range(n)]
    cpu, ts = timed([lambda f=f: sess.run(None, f) for f in sets], runs)
    return call_row(slots, "eager window fp16", h, hkv, d, cpu, ts, cache_bytes, slots, caches=n,
                    **win_prefill(h, d, slots, c, cpu))


def win_prefill(h: int, d: int, slots: int, c: int, cpu: list[float]) -> dict:
    """A window prefill call's fields (c > 1): its queries (chunk), the attention FLOP the eager graph computes (every
    slot and the call's own rows: memory.prefill.eager_attention_flop's 4 x H x D x c x (slots + c)) and their rate."""
    if c == 1:
        return {}
    flop = 4 * h * d * c * (slots + c)
    return {"chunk": c, "attention_flop": flop,
            "attention_gflop_s": round(flop / statistics.median(cpu) / 1e9, 2)}


INT8_KERNEL = "executorch"  # --int8-kernel: what reads int8 codes in et_program (edgekv: edgekv/native's kernel)


def etl_program(h: int, hkv: int, d: int, kind: str, ctx: int) -> bytes:
    """The .pte of one decode call's attention as ExecuTorch's own Llama export builds it (executorch 1.5.1
    examples/models/llama/source_transformation: custom_kv_cache.py's CustomKVCache / QuantizedKVCache, sdpa.py's
    SDPACustom / QuantizedSDPA): the cache stored [1, T, Hkv, D] (sequence-major), the call's row written at slot pos
    (its update_cache op; index_put here, one row either way), then all H query heads [1, 1, H, D] handed with the
    whole cache to the op, which maps each query head onto its KV head itself:
      etllama fp32: llama::custom_sdpa(q, k_cache, v_cache, pos, None, 0, True) on the cache as it is;
      etllama fp16: SDPACustom's fp32 fallback for a half model, q, k and v (the whole cache, every slot) cast to
                    fp32 (.to(torch.float)) before custom_sdpa;
      etllama int8: QuantizedKVCache (--quantize_kv_cache: int8 codes, a fp32 scale and an int8 zero point per token
                    and head, choose_qparams_per_token_asymmetric) read by llama::custom_quantized_sdpa, the query
                    quantized per token as QuantizedSDPA quantizes it."""
    import torch
    from torch import nn

    from edgekv.export.to_pte import lower_pte, to_buffer

    class Step(nn.Module):
        def forward(self, q, pos, k, v, *qparams):
            start = pos[0].item()
            torch._check(start >= 0)
            torch._check(start < ctx)
            row = q[:, :, :hkv, :]  # [1, 1, Hkv, D]: a stand-in for the call's new key / value row

            def put(state, r):
                return torch.ops.aten.index_put(state, [None, pos], r)

            if kind == "etllama fp32":
                k, v = put(k, row), put(v, row)
                return torch.ops.llama.custom_sdpa(q, k, v, start, None, 0.0, True)
            if kind == "etllama fp16":
                k, v = put(k, row.half()), put(v, row.half())
                return torch.ops.llama.custom_sdpa(q.half().float(), k.float(), v.float(), start, None, 0.0, True)
            ks, kz, vs, vz = qparams
            rs, rz = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric.default(row, torch.int8)
            codes = torch.ops.quantized_decomposed.quantize_per_token(row, rs, rz, -128, 127, torch.int8)
            k, v = put(k, codes), put(v, codes)
            ks, vs = put(ks, rs.float()), put(vs, rs.float())
            kz, vz = put(kz, rz.to(torch.int8)), put(vz, rz.to(torch.int8))
            qs, qz = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric.default(q, torch.int8)
            qq = torch.ops.quantized_decomposed.quantize_per_token(q, qs, qz, -128, 127, torch.int8)
            return torch.ops.llama.custom_quantized_sdpa(qq, k, v, start, None, 0.0, True, None, qz.to(torch.int8),
                                                         qs.to(torch.float32), kz, ks, vz, vs)
    args = etl_inputs(h, hkv, d, kind, ctx, np.random.default_rng(0))
    ep = torch.export.export(Step(), args, strict=False)
    return to_buffer(lower_pte({"forward": ep}, in_place=True), in_place=True)


def etl_inputs(h: int, hkv: int, d: int, kind: str, ctx: int, rng) -> tuple:
    """etl_program's inputs: q [1, 1, H, D], pos, the caches [1, T, Hkv, D] (int8: codes, and per token and head a
    fp32 scale and an int8 zero point [1, T, Hkv, 1], as QuantizedKVCache keeps them)."""
    import torch

    q = torch.from_numpy(rng.standard_normal((1, 1, h, d)).astype(np.float32))
    pos = torch.tensor([ctx - 1])
    if kind == "etllama int8":
        k, v = (torch.from_numpy(rng.integers(-127, 128, (1, ctx, hkv, d), dtype=np.int8)) for _ in range(2))
        scale, zero = torch.full((1, ctx, hkv, 1), 0.02), torch.zeros((1, ctx, hkv, 1), dtype=torch.int8)
        return q, pos, k, v, scale, zero, scale.clone(), zero.clone()
    dt = np.float32 if kind == "etllama fp32" else np.float16
    k, v = (torch.from_numpy(rng.standard_normal((1, ctx, hkv, d)).astype(dt)) for _ in range(2))
    return q, pos, k, v


def et_program(h: int, hkv: int, d: int, kind: str, ctx: int, chunk: int = 1) -> bytes:
    """The .pte of one decode call's attention on a cache of ctx slots: forward(q, pos, k, v[, k scale, v scale])
    writes the call's row at slot pos in place and returns custom_sdpa over slots 0..pos (SdpaAttention's read).
    chunk > 1: one prefill call of `chunk` queries at slots pos .. pos + chunk - 1, their rows written, custom_sdpa
    (int8 / int8c: custom_quantized_sdpa) causal from pos (edgekv's .pte prefills in calls of
    ExportOptions.prefill_chunk tokens)."""
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
            torch._check(start + chunk <= ctx)
            n = start + chunk
            # [1, Hkv, chunk, D]: a stand-in for the call's new key/value rows
            row = q[:, :, :1, :].permute(2, 0, 1, 3) if chunk == 1 else q[:, :, 0, :].unsqueeze(0)
            at = pos if chunk == 1 else pos + torch.arange(chunk)

            def put(state, r):
                return torch.ops.aten.index_put(state, [None, None, at], r)

            if kind == "int4":  # packed codes, an fp16 scale and zero per group: edgekv::packed_sdpa only
                if INT8_KERNEL != "edgekv":
                    raise SystemExit("--kinds int4: only with --int8-kernel edgekv (edgekv::packed_sdpa)")
                codes = torch.zeros(1, hkv, row.shape[2], d // 2, dtype=torch.uint8)
                k, v = put(k, codes), put(v, codes)
                sz = tuple(put(x, torch.full((1, hkv, row.shape[2], d // ET_INT4_GROUP), 0.02, dtype=torch.float16))
                           for x in scales)  # the call's rows' scales and zeros, written in place as the cache's
                return torch.ops.edgekv.packed_sdpa(q.contiguous(), k, v, *sz, start, d ** -0.5, 4, ET_INT4_GROUP)
            if kind == "fp32":
                k, v = put(k, row), put(v, row)
                kc, vc = k.view(hkv, ctx, 1, d), v.view(hkv, ctx, 1, d)
            elif kind == "fp16":
                k, v = put(k, row.half()), put(v, row.half())
                if INT8_KERNEL == "edgekv":  # edgekv::fp16_sdpa (--int8-kernel edgekv): the fp16 cache in place
                    return torch.ops.edgekv.fp16_sdpa(q.contiguous(), k, v, start, d ** -0.5)
                kc, vc = (s[:, :, :n].float().view(hkv, n, 1, d) for s in (k, v))
            else:  # int8 codes read in place by custom_quantized_sdpa, the query quantized per token
                codes = (row * 20).round().clamp(-127, 127).to(torch.int8)
                k, v = put(k, codes), put(v, codes)
                if INT8_KERNEL == "edgekv":  # edgekv::int8_sdpa (--int8-kernel edgekv): fp32 q, scales as stored
                    if kind == "int8":
                        ks, vs = (put(s, torch.ones(1, hkv, chunk, dtype=torch.float16)) for s in scales)
                    else:
                        ks, vs = scales
                    return torch.ops.edgekv.int8_sdpa(q.contiguous(), k, v, ks, vs, start, d ** -0.5, kind == "int8c")
                zero = torch.zeros(hkv, ctx, 1, 1, dtype=torch.int8)
                if kind == "int8":  # kv-int8: fp16 scale per token and head, cast to fp32 for the op
                    ks, vs = (put(s, torch.ones(1, hkv, chunk, dtype=torch.float16)) for s in scales)
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
            # a float cache: custom_sdpa over the rows read back (a merge of the int8 branch had dropped this return,
            # so a float kind's program computed nothing and failed to lower)
            g = h // hkv
            if chunk == 1 and kind == "fp32" and g > 1:
                # one token on the cache in place: the KV head's G query heads as G rows of one head, not causal, at
                # start - (G - 1), so the cache is read once per KV head (SdpaAttention._custom_sdpa's rows branch)
                out = torch.ops.llama.custom_sdpa(q.reshape(hkv, g, 1, d), kc, vc, start - (g - 1), None, 0.0, False,
                                                  d ** -0.5)
                return out.reshape(hkv, 1, g, d)
            return torch.ops.llama.custom_sdpa(q, kc, vc, start, None, 0.0, True, d ** -0.5)
    args = et_inputs(h, hkv, d, kind, ctx, np.random.default_rng(0), chunk)
    ep = torch.export.export(Step(), args, strict=False)
    return to_buffer(lower_pte({"forward": ep}, in_place=True), in_place=True)


def et_inputs(h: int, hkv: int, d: int, kind: str, ctx: int, rng, chunk: int = 1) -> tuple:
    import torch

    q = torch.from_numpy(rng.standard_normal((hkv, chunk, h // hkv, d)).astype(np.float32))
    pos = torch.tensor([ctx - chunk])
    if kind == "int4":  # packed codes [1, Hkv, T, D/2], fp16 scale and zero [1, Hkv, T, D/group] each for K and V
        k, v = (torch.from_numpy(rng.integers(0, 256, (1, hkv, ctx, d // 2), dtype=np.uint8)) for _ in range(2))
        groups = (1, hkv, ctx, d // ET_INT4_GROUP)
        scales = tuple(torch.full(groups, 0.02 if i % 2 == 0 else -0.1, dtype=torch.float16) for i in range(4))
        return (q, pos, k, v, *scales)
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


def et_time_call(h: int, hkv: int, d: int, kind: str, ctx: int, runs: int, chunk: int = 1) -> dict:
    """time_call's figures for edgekv's .pte attention (et_program), run by ExecuTorch's runtime on 1 thread; chunk >
    1: one prefill call of `chunk` queries, its attention FLOP rate (prefill_fits)."""
    import torch
    from executorch.extension.pybindings import portable_lib

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (llama::custom_sdpa)
    import executorch.kernels.quantized  # noqa: F401 (dequantize_per_token)
    from edgekv.export.pte_stepper import quiet_native_stderr

    torch.set_num_threads(1)
    etl = kind in ETL_KINDS
    # the module reads the program from this buffer: it must outlive it
    buf = etl_program(h, hkv, d, kind, ctx) if etl else et_program(h, hkv, d, kind, ctx, chunk)
    with quiet_native_stderr():
        portable_lib._unsafe_reset_threadpool(1)
        mod = portable_lib._load_for_executorch_from_buffer(buf)
    if etl:  # + QuantizedKVCache's fp32 scale and int8 zero point per token and head
        cache_bytes = 2 * hkv * ctx * d * ETL_KINDS[kind] + (2 * hkv * ctx * 5 if kind == "etllama int8" else 0)
    else:
        cache_bytes = int(2 * hkv * ctx * d * ET_KINDS[kind] + (2 * hkv * ctx * 2 if kind == "int8" else 0)
                          + (2 * hkv * ctx * (d // ET_INT4_GROUP) * 4 if kind == "int4" else 0))
    n = min(max(2, -(-COLD_BYTES // cache_bytes)), 30)  # as time_call: each layer's cache read cold
    rng = np.random.default_rng(0)
    if chunk > 1:  # a prefill call: compute-bound
        n = 2
    sets = [etl_inputs(h, hkv, d, kind, ctx, rng) if etl else et_inputs(h, hkv, d, kind, ctx, rng, chunk)
            for _ in range(n)]
    with quiet_native_stderr():
        cpu, ts = timed([lambda a=a: mod.forward(a) for a in sets], runs)
    if chunk > 1:  # the call's attention FLOP: 4 x H x D per query and key it attends (causal within the chunk)
        med = statistics.median(cpu)
        flop = 4 * h * d * sum(ctx - chunk + i + 1 for i in range(chunk))
        return {"ctx": ctx, "chunk": chunk, "kind": kind, "heads": h, "kv_heads": hkv, "head_dim": d,
                "median_us": round(med * 1e6, 1), "wall_median_us": round(statistics.median(ts) * 1e6, 1),
                "best_us": round(min(cpu) * 1e6, 1), "attention_flop": flop,
                "attention_gflop_s": round(flop / med / 1e9, 2)}
    return call_row(ctx, kind, h, hkv, d, cpu, ts, cache_bytes, ctx, caches=n)


# llama.cpp: its K and V cache types (bytes per value: q8_0 / q4_0 keep 32 values in a 34 / 18-byte block)
LC_KINDS = {"f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}
# the contexts each llama.cpp kind is timed at by default: the fill is a real prefill (its attention quadratic in the
# context), and llama.cpp's flash attention prefills over a quantized cache at a few GFLOP/s
LC_CTX = {"f16": (1024, 2048, 4096, 8192, 16384, 32768), "q8_0": (1024, 2048, 4096, 8192), "q4_0": (1024, 2048, 4096, 8192)}
LC_VOCAB, LC_FF = 512, 64  # a small vocabulary and MLP: the step's time outside attention stays small


def lc_gguf(path: Path, h: int, hkv: int, d: int, layers: int, linear: str = "F16", ff: int = LC_FF,
            embedding: str = "F16") -> None:
    """A random-weight f16 GGUF (llama architecture) of `layers` layers at this head shape (hidden = heads x head
    size, key_length / value_length = head size), its vocabulary the 256 byte symbols and unused fillers (as
    scripts/make_random_model.py writes one): what llama.cpp runs is the shape, the values do not change its time.
    linear: the layers' matrices in this GGML type instead (Q4_0: gguf-py's own quantizer); ff: the MLP's width;
    embedding: the (tied) embedding table's type."""
    import gguf

    hidden = h * d
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(LC_VOCAB)
    w.add_context_length(65536)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(h)
    w.add_head_count_kv(hkv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    fillers = [f"<unused_{i}>" for i in range(256, LC_VOCAB)]
    fillers[-1] = fillers[0] + fillers[1]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([chr(256 + b) for b in range(256)] + fillers)
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.UNUSED] * (LC_VOCAB - 256))
    w.add_token_merges([f"{fillers[0]} {fillers[1]}"])
    w.add_add_bos_token(False)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    def add(name, m, kind=linear):
        if kind == "F16":
            return w.add_tensor(name, m)
        qt = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, gguf.quants.quantize(m.astype(np.float32), qt), raw_dtype=qt)

    add("token_embd.weight", mat(LC_VOCAB, hidden), embedding)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", mat(h * d, hidden))
        add(f"blk.{i}.attn_k.weight", mat(hkv * d, hidden))
        add(f"blk.{i}.attn_v.weight", mat(hkv * d, hidden))
        add(f"blk.{i}.attn_output.weight", mat(hidden, h * d))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.ffn_gate.weight", mat(ff, hidden))
        add(f"blk.{i}.ffn_up.weight", mat(ff, hidden))
        add(f"blk.{i}.ffn_down.weight", mat(hidden, ff))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def lc_time_rows(h: int, hkv: int, d: int, kind: str, ctxs, runs: int, layers: int = 1) -> list[dict]:
    """llama.cpp's decode step on a random model of `layers` layers at this head shape, K and V of this type, flash
    attention, 1 thread (as benchmarks/speed_child.llamacpp_session runs a model), at each filled context: the cache
    filled by a real prefill up to ctx - 1 (one session, filled further between contexts), then `runs` single-token
    steps, each after a 256 MiB buffer is swept so that the layer's cache is read cold, as in a model whose other
    layers' caches evict it. The step's time outside attention (a 512-token vocabulary, a 64-wide MLP) is the fit's
    overhead; a second layer count (--lc-layers) checks that the per-key cost scales with the layers."""
    import tempfile

    import llama_cpp

    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
               "q4_0": llama_cpp.GGML_TYPE_Q4_0}[kind]
    rng = np.random.default_rng(0)
    sweep = np.zeros(COLD_BYTES // 8)
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgekv-attn-") as tmp:
        path = Path(tmp) / "attn.gguf"
        lc_gguf(path, h, hkv, d, layers)
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(ctxs) + runs + 8, n_batch=512, n_ubatch=512,
                              n_threads=1, n_threads_batch=1, flash_attn=True, type_k=kv_type, type_v=kv_type,
                              verbose=False)
        filled = 0
        for ctx in sorted(ctxs):
            n_fill = ctx - 1 - filled
            c0 = time.process_time()
            llm.eval([int(t) for t in rng.integers(0, 256, n_fill)])
            fill_s = time.process_time() - c0
            # the prefill's attention FLOP for positions filled+1 .. ctx-1 (4 x H x D per key and query, causal)
            fill_flop = 4 * h * d * layers * (ctx - 1 + filled + 1) * n_fill / 2
            # a warm-up step, then `runs` steps, each after the sweep (np.add in place: every page written)
            cpu, ts = timed([lambda m=llm: m.eval([int(rng.integers(0, 256))])], runs,
                            before=lambda: np.add(sweep, 1.0, out=sweep))
            filled = ctx + runs
            n = filled - runs // 2  # the keys the median step attended (ctx + 1 .. ctx + runs)
            rows.append(call_row(n, kind, h, hkv, d, cpu, ts, int(2 * layers * hkv * n * d * LC_KINDS[kind]),
                                 n * layers, layers=layers,
                                 prefill={"from": ctx - 1 - n_fill, "tokens": n_fill, "cpu_s": round(fill_s, 3),
                                          "attention_flop": fill_flop}))
        del llm
    return rows


def lc_gguf_prefill(path: Path, tokens: int = 512, runs: int = 3, steps: int = 17) -> dict:
    """The CPU seconds (median of `runs`) of a `tokens`-token prefill of a real GGUF on llama.cpp, 1 thread, f16 cache,
    flash attention (speed_child.llamacpp_session's settings), and the median of `steps` decode steps after it: the
    prefill's matmuls and the step's weight reads dominate, at the rates of that file's weight types
    (benchmarks/plan_vs_filled.py takes the attention at the kernel rates out)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=tokens + steps + 8, n_batch=512, n_ubatch=512, n_threads=1,
                          n_threads_batch=1, flash_attn=True, swa_full=False, verbose=False)
    rng = np.random.default_rng(0)
    top = min(5000, llm.n_vocab())  # ordinary tokens of a real vocabulary; a random file's 512 symbols
    cpu, step = [], []
    for _ in range(runs):
        llm.reset()
        ids = [int(t) for t in rng.integers(300 if top > 300 else 0, top, tokens)]
        c0 = time.process_time()
        llm.eval(ids)
        cpu.append(time.process_time() - c0)
    for _ in range(steps):  # decode steps after the last prefill: the step's time outside long-context attention
        c0 = time.process_time()
        llm.eval([int(rng.integers(300 if top > 300 else 0, top))])
        step.append(time.process_time() - c0)
    del llm
    return {"tokens": tokens, "cpu_s": round(statistics.median(cpu), 4), "runs_cpu_s": [round(c, 4) for c in cpu],
            "steps": steps, "step_ctx": tokens + steps // 2, "step_cpu_s": round(statistics.median(step), 5)}


# --gguf-types: llama.cpp's weight kernels per GGML type, each timed on random GGUFs whose linear rows are all that
# type, at Llama-3.2-1B's layer shape (32 / 8 heads of 64, hidden 2048, MLP 8192: its config.json), written in f16 and
# quantized by llama.cpp's own quantizer (llama_model_quantize, 1 thread), so the blocks are the ones a user's file
# holds. Two depths (LC_TYPE_LAYERS): the rate is the difference between them, the cost of one more layer. A 2-layer
# file alone runs its layers 1.5x faster per FLOP than a deep one (Q4_0 prefill: 0.31 s a layer at 2 layers, 0.475 s
# for each layer added at 6; the 1B's 16 layers take 0.47 s each), and a model's time is its layers'
LC_TYPE_SHAPE = (32, 8, 64, 8192)
LC_TYPE_LAYERS = (2, 6)
LC_FTYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "Q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
             "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def lc_gguf_types(types, runs: int = 3, device: str = "host") -> dict:
    """Per GGML type: random GGUFs of LC_TYPE_SHAPE at each depth of LC_TYPE_LAYERS quantized to it, each run by
    lc_gguf_prefill (a 512-token prefill and 17 decode steps, 1 thread, f16 cache, flash attention). The rates are
    the added layers' work over their added time, the attention at the kernel rates taken out first:
    matmul_flop_per_s = the added matmul FLOP (memory.prefill_parts) over the added prefill CPU seconds;
    read_bytes_per_s = the added bytes a step reads (the plan's weights read per token) over the added step CPU
    seconds. The type mix read back from each file says what its linear rows hold. device: the host profile whose
    stored llama.cpp kernel rates take the attention out (the one measured on the CPU this runs on: --device)."""
    import tempfile

    import llama_cpp

    from edgekv import memory as M
    from edgekv.arch import read_gguf
    from edgekv.devices import load_device
    from edgekv.plan import plan_one
    from edgekv.strategies import parse_strategy

    h, hkv, d, ff = LC_TYPE_SHAPE
    pre_rates = M.attention_rates("llama.cpp", device, "desktop")["prefill"]
    out = {}
    with tempfile.TemporaryDirectory(prefix="edgekv-types-") as tmp:
        f16 = {n: Path(tmp) / f"f16_{n}.gguf" for n in LC_TYPE_LAYERS}
        for n, f in f16.items():
            lc_gguf(f, h, hkv, d, n, ff=ff)
        for t in types:
            depth = {}
            for n in LC_TYPE_LAYERS:
                path = Path(tmp) / f"{t}_{n}.gguf"
                p = llama_cpp.llama_model_quantize_default_params()
                p.ftype, p.nthread = getattr(llama_cpp, LC_FTYPES[t]), 1
                if llama_cpp.llama_model_quantize(str(f16[n]).encode(), str(path).encode(), p) != 0:
                    raise RuntimeError(f"llama_model_quantize failed for {t}")
                arch = read_gguf(str(path))
                m = lc_gguf_prefill(path, runs=runs)
                parts = M.prefill_parts(arch, parse_strategy("kv"), m["tokens"], m["tokens"])
                row = plan_one(arch, parse_strategy("kv"), load_device(device), m["step_ctx"], "gguf",
                               runtime="llama.cpp")
                depth[n] = {**m, "type_mix": M.gguf_type_mix(arch), "file_bytes": path.stat().st_size,
                            "matmul_flop": parts["matmul"] + parts["logits"],
                            "prefill_attention_s": parts["attention"]
                            / M.prefill._prefill_rate(pre_rates, "f16", arch)[0],
                            "weights_read_per_token": row.deployment.weights["read_per_token"],
                            "step_attention_s": row.attention_terms["attention_s"],
                            "loadavg": round(os.getloadavg()[0], 2)}
                path.unlink()
            a, b = (depth[n] for n in LC_TYPE_LAYERS)
            mm = (b["matmul_flop"] - a["matmul_flop"]) / (b["cpu_s"] - b["prefill_attention_s"]
                                                          - a["cpu_s"] + a["prefill_attention_s"])
            rd = (b["weights_read_per_token"] - a["weights_read_per_token"]) / (
                b["step_cpu_s"] - b["step_attention_s"] - a["step_cpu_s"] + a["step_attention_s"])
            out[t] = {"ftype": LC_FTYPES[t], "type_mix": b["type_mix"], "matmul_flop_per_s": mm,
                      "read_bytes_per_s": rd, "by_layers": {str(n): v for n, v in depth.items()}}
            print(t, b["type_mix"], f"matmul {mm / 1e9:.1f} GFLOP/s, weights {rd / 1e9:.2f} GB/s",
                  {n: (v["cpu_s"], v["step_cpu_s"]) for n, v in depth.items()}, flush=True)
    return out


def fit(rows: list[dict]) -> dict:
    """Least squares of time = overhead + ctx * (kv_bytes_per_position / read_rate + heads * head_dim * c_compute)
    over one cache kind's rows (both shapes: the two per-position features differ between them). A term that fits
    negative is dropped (set to 0) and the rest refitted."""
    x = np.array([[1.0, r["cache_bytes"], r.get("layers", 1) * r["ctx"] * r["heads"] * r["head_dim"]] for r in rows])
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
    x = np.array([[1.0, r.get("layers", 1) * r["ctx"] * r["heads"] * r["head_dim"]] for r in rows])
    y = np.array([r["median_us"] * 1e-6 for r in rows])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    over, comp = (float(c) for c in coef)
    if over < 0:  # no overhead: refit the slope alone
        over, comp = 0.0, float(np.sum(x[:, 1] / y) / np.sum((x[:, 1] / y) ** 2))
    err = [(over + comp * xi) / yi - 1 for xi, yi in zip(x[:, 1], y)]
    return {"overhead_s": over, "read_bytes_per_s": None, "compute_s_per_head_dim_position": comp,
            "max_abs_rel_error": round(max(abs(e) for e in err), 3), "rows": len(rows)}


def fit_prefill_rate(rows: list[dict]) -> dict:
    """One cache kind's prefill rows at one head size: least squares (relative error) of time = overhead + attention
    FLOP / rate (onnxruntime: per call of 128 queries; llama.cpp: per fill, whose few-MFLOP-per-token matmuls are the
    overhead, per token). Returns {"attention_flop_per_s", "overhead_s" or "per_token_s", "max_abs_rel_error"}."""
    per_token = "tokens" in rows[0]
    x = np.array([[r["tokens"] if per_token else 1.0, r["attention_flop"]] for r in rows])
    y = np.array([r["cpu_s"] if per_token else r["median_us"] * 1e-6 for r in rows])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    a, b = (float(c) for c in coef)
    if a < 0:  # no overhead: the slope alone
        a, b = 0.0, float(np.sum(x[:, 1] / y) / np.sum((x[:, 1] / y) ** 2))
    err = [(a * xi[0] + b * xi[1]) / yi - 1 for xi, yi in zip(x, y)]
    return {"attention_flop_per_s": 1 / b, ("per_token_s" if per_token else "overhead_s"): a,
            "max_abs_rel_error": round(max(abs(e) for e in err), 3), "rows": len(rows)}


def prefill_fits(rows: list[dict]) -> dict:
    """fit_prefill_rate per cache kind and head size: {kind: {head_dim: fit}}; llama.cpp's rows carry their fill."""
    pre = [{**r["prefill"], "kind": r["kind"], "head_dim": r["head_dim"]} if "prefill" in r else r for r in rows
           if "prefill" in r or "chunk" in r]
    out = {}
    for k in dict.fromkeys(r["kind"] for r in pre):
        for d in sorted({r["head_dim"] for r in pre if r["kind"] == k}):
            sub = [r for r in pre if r["kind"] == k and r["head_dim"] == d and (r.get("tokens") or 1) > 0]
            if len(sub) >= 2:
                out.setdefault(k, {})[str(d)] = fit_prefill_rate(sub)
    return out


def fits_of(rows: list[dict], kinds: list[str]) -> dict:
    """fit per cache kind over both head shapes, and fit_head_dim per head size."""
    fits = {k: fit([r for r in rows if r["kind"] == k]) for k in kinds}
    for k in kinds:
        dims = sorted({r["head_dim"] for r in rows if r["kind"] == k})
        fits[k]["by_head_dim"] = {str(d): fit_head_dim([r for r in rows if r["kind"] == k and r["head_dim"] == d])
                                  for d in dims}
        for d in dims:
            fits[k]["by_head_dim"][str(d)]["compute_by_kept_keys"] = per_key_curve(
                [r for r in rows if r["kind"] == k and r["head_dim"] == d])
    return fits


def per_key_curve(rows: list[dict]) -> dict:
    """One kind's rows at one head size -> {kept keys: seconds per key x H x D}: each context's time over its keys x
    H x D (median over repeats), the measured curve the plan follows where a linear law does not
    (edgekv.memory.speed._compute_at)."""
    return {str(c): statistics.median(r["median_us"] * 1e-6 / (r.get("layers", 1) * r["ctx"] * r["heads"]
                                                               * r["head_dim"]) for r in rows if r["ctx"] == c)
            for c in sorted({r["ctx"] for r in rows})}


def kv_heads_scales(rows: list[dict]) -> dict:
    """llama.cpp: per cache kind and head size, each KV-head count's per-key cost against the base shape's of that head
    size (SHAPES: the shape the stored rates were measured at), measured in the same run: {kind: {head_dim: {"decode":
    {kv heads: the shape's fit_head_dim slope over the base's}, "prefill": {kv heads: the base's fill attention FLOP
    rate over the shape's}, "shapes": {name: [heads, kv heads]}}}}, a factor > 1 meaning slower than the base; several
    shapes of one KV-head count: their median. Only where the base and another KV-head count were both timed."""
    base = {d: name for name, (_h, _hkv, d) in SHAPES.items()}
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        for d, bname in base.items():
            sub = [r for r in rows if r["kind"] == kind and r["head_dim"] == d]
            by = {}
            for r in sub:
                by.setdefault(r["shape"], []).append(r)
            if bname not in by or len({r["kv_heads"] for r in sub}) < 2:
                continue
            slope = {n: fit_head_dim(rs)["compute_s_per_head_dim_position"] for n, rs in by.items()}
            fills = {n: [r["prefill"] for r in rs if r.get("prefill", {}).get("tokens")] for n, rs in by.items()}
            rate = {n: fit_prefill_rate(f)["attention_flop_per_s"] for n, f in fills.items() if len(f) >= 2}
            dec, pre = {}, {}
            for n, rs in by.items():
                dec.setdefault(rs[0]["kv_heads"], []).append(slope[n] / slope[bname])
                if n in rate and bname in rate:
                    pre.setdefault(rs[0]["kv_heads"], []).append(rate[bname] / rate[n])
            out.setdefault(kind, {})[str(d)] = {
                "decode": {str(k): round(float(np.median(v)), 3) for k, v in sorted(dec.items())},
                "prefill": {str(k): round(float(np.median(v)), 3) for k, v in sorted(pre.items())},
                "shapes": {n: [rs[0]["heads"], rs[0]["kv_heads"]] for n, rs in by.items()}}
    return out


def print_fits(fits: dict) -> None:
    for k, f in fits.items():
        rate = f"{f['read_bytes_per_s'] / 1e9:.2f} GB/s" if f["read_bytes_per_s"] else "no read term"
        print(f"fit {k}: overhead {f['overhead_s'] * 1e6:.1f} us, read {rate}, compute "
              f"{f['compute_s_per_head_dim_position'] * 1e12:.2f} ps per head x dim x position; worst row "
              f"{f['max_abs_rel_error']:.0%}; per head size: "
              + ", ".join(f"{d}: {g['overhead_s'] * 1e6:.1f} us + {g['compute_s_per_head_dim_position'] * 1e12:.1f} ps "
                          f"(worst {g['max_abs_rel_error']:.0%})" for d, g in f["by_head_dim"].items()))


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (filled_context's machine.cpu; the device profile's `cpu`
    field): the rates are this CPU's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", choices=("onnxruntime", "executorch", "llamacpp"), default="onnxruntime")
    ap.add_argument("--ctx", help="filled contexts (default 1024,...,32768; llamacpp: per kind, LC_CTX)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--kinds", help="cache kinds (onnxruntime: fp32,fp16,int8c; executorch: fp32,fp16,int8,int8c; "
                                    "llamacpp: f16,q8_0,q4_0)")
    ap.add_argument("--lc-layers", type=int, default=1, help="llamacpp: the random model's layers")
    ap.add_argument("--gguf-prefill", nargs="+", type=Path, metavar="GGUF",
                    help="llamacpp: time a 512-token prefill of each real GGUF (its weight types' matmul rate) into "
                         "results/llamacpp_gguf_prefill.json")
    ap.add_argument("--gguf-types", help="llamacpp: the GGML types to time (comma-separated, of " + ",".join(LC_FTYPES)
                    + "), each on a random GGUF of the 1B's layer shape (lc_gguf_types) into "
                      "results/llamacpp_gguf_types.json")
    ap.add_argument("--matmul", action="store_true", help="onnxruntime: time MatMulNBits (int4) per matrix shape "
                    "(MATMUL_SHAPES) instead (matmul_nbits_rates.json)")
    ap.add_argument("--tokens", type=int, default=1, help="--matmul: tokens per call (128: a prefill call of "
                    "edgekv's ONNX; matmul_nbits_rates_128.json)")
    ap.add_argument("--matmul-forms", action="store_true", help="onnxruntime: time each form --weights gguf carries "
                    "a GGUF type in (MATMUL_FORMS: MatMulNBits bits / block, zero points, remainder) per matrix shape "
                    "instead (matmul_nbits_forms.json)")
    ap.add_argument("--forms", help="--matmul-forms: the forms to time (comma-separated; default all MATMUL_FORMS)")
    ap.add_argument("--store-forms", type=Path, metavar="JSON",
                    help="write a --matmul-forms run's rates into edgekv/costs/attention_rates.json (onnxruntime host "
                         "weights.gguf.by_form: forms_entry) instead of timing")
    ap.add_argument("--prefill", action="store_true", help="onnxruntime: time prefill calls of 128 queries instead "
                    "(attention_rates_prefill.json); executorch: calls of ET_PREFILL_CHUNK queries, fp32 and fp16 "
                    "caches (attention_rates_executorch_prefill.json); llama.cpp's prefill rates come from its fills")
    ap.add_argument("--ring", action="store_true", help="--window --runtime executorch: also time a model's own "
                    "sliding ring of an fp32 cache (no sinks; Gemma 3's sliding layers in a .pte) beside each row")
    ap.add_argument("--window", action="store_true", help="time the window strategy's eager graph (win_module) at "
                    "kept keys WIN_SLOTS instead (attention_rates_window.json; --runtime executorch: the .pte's, "
                    "attention_rates_executorch_window.json)")
    ap.add_argument("--int8-kernel", choices=("executorch", "edgekv"), default="executorch",
                    help="executorch: what reads the int8 / int8c codes, llama::custom_quantized_sdpa or edgekv's own "
                    "edgekv::int8_sdpa (export --pte-kernel edgekv)")
    ap.add_argument("--device", default="host",
                    help="llamacpp --gguf-types: the host profile whose stored kernel rates take the attention out "
                         "(the profile of the CPU it runs on: host-xeon on the Intel Xeon VM)")
    ap.add_argument("--shapes", help="the head shapes to time (default all: " + ",".join(SHAPES) + "; also "
                    + ",".join(EXTRA_SHAPES) + ": llamacpp's per-key cost by KV heads, kv_heads_scales)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--refit", type=Path, help="fit the rows of this results JSON again (no timing)")
    a = ap.parse_args(argv)
    if not 1 <= a.tokens <= MAX_TOKENS:
        ap.error(f"--tokens must be 1 to {MAX_TOKENS} (a prefill call's tokens)")
    if a.ring and not (a.window and a.runtime == "executorch"):
        ap.error("--ring times the .pte's ring beside the window graph: with --window --runtime executorch")
    if a.refit:
        res = json.loads(a.refit.read_text())
        if not any("chunk" in r for r in res["rows"]):
            res["fits"] = fits_of(res["rows"], list(dict.fromkeys(r["kind"] for r in res["rows"])))
            print_fits(res["fits"])
        if any("chunk" in r or "prefill" in r for r in res["rows"]):
            res["prefill_fits"] = prefill_fits(res["rows"])
        dest = a.out or a.refit
        write_json(dest, res)
        return 0
    if a.gguf_types:
        import llama_cpp

        t0 = time.time()
        types = lc_gguf_types(a.gguf_types.split(","), runs=min(a.runs, 3), device=a.device)
        res = {"benchmark": "llamacpp_gguf_types", "llama_cpp_python": llama_cpp.__version__,
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "threads": 1,
               "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu": cpu_name()},
               "device": a.device, "loadavg_end": list(os.getloadavg()),
               "shape": dict(zip(("heads", "kv_heads", "head_dim", "ffn"), LC_TYPE_SHAPE), layers=list(LC_TYPE_LAYERS),
                             hidden=LC_TYPE_SHAPE[0] * LC_TYPE_SHAPE[2], vocab=LC_VOCAB),
               "what": "per GGML type, random GGUFs of Llama-3.2-1B's layer shape at 2 and 6 layers quantized by "
                       "llama_model_quantize: a 512-token prefill (median of 3) and 17 decode steps after it, 1 thread, "
                       "f16 cache, flash attention, process CPU time; the rates: the 4 added layers' FLOP and bytes "
                       "over their added time, the attention at the kernel rates taken out",
               "types": types, "seconds": round(time.time() - t0, 1)}
        write_json(a.out or Path(__file__).parent / "results" / "llamacpp_gguf_types.json", res)
        return 0
    if a.gguf_prefill:
        import llama_cpp

        res = {"benchmark": "llamacpp_gguf_prefill", "llama_cpp_python": llama_cpp.__version__,
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": 1,
               "cpu": cpu_name(), "what": "a 512-token prefill of each GGUF, then 17 decode steps, 1 thread, f16 cache, flash attention, "
                       "process CPU time",
               "files": {}}
        for g in a.gguf_prefill:
            res["files"][g.name] = {**lc_gguf_prefill(g), "loadavg": round(os.getloadavg()[0], 2)}
            print(g.name, res["files"][g.name], flush=True)
        dest = a.out or Path(__file__).parent / "results" / "llamacpp_gguf_prefill.json"
        write_json(dest, res)
        return 0
    if a.window:
        return window_main(a)
    if a.matmul:
        return matmul_main(a)
    if a.matmul_forms:
        return matmul_forms_main(a)
    if a.store_forms:
        return store_forms(a.store_forms)
    et, lc = a.runtime == "executorch", a.runtime == "llamacpp"
    if a.int8_kernel == "edgekv":
        global INT8_KERNEL
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from edgekv import native
        native.load()
        INT8_KERNEL = "edgekv"
    kinds = (a.kinds or ",".join(ET_KINDS if et else LC_KINDS if lc else KINDS)).split(",")
    out_path = a.out or Path(__file__).parent / "results" / ("attention_rates_executorch_prefill.json" if et and a.prefill
                                                             else "attention_rates_executorch.json" if et else
                                                             "attention_rates_llamacpp.json" if lc else
                                                             "attention_rates_prefill.json" if a.prefill else
                                                             "attention_rates.json")
    if lc:
        import llama_cpp

        versions = {"llama_cpp_python": llama_cpp.__version__}
        what = ("one llama.cpp decode step (flash attention, K and V of the kind, 1 thread) on a random f16 model of "
                f"{a.lc_layers} layer(s) at the head shape, the cache filled by a real prefill, each step after a "
                "256 MiB sweep (the cache read cold)")
    elif et:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import executorch
        import torch

        versions = {"executorch": getattr(executorch, "__version__", None) or _version("executorch"),
                    "torch": torch.__version__}
        what = ("one decode call of edgekv's .pte attention (edgekv.models.swaps.SdpaAttention): the row written in "
                "place, the cache read back as custom_sdpa takes it, llama::custom_sdpa (on the fp32 cache in place, a "
                "KV head's G query heads as G rows of one head: SdpaAttention._custom_sdpa); ExecuTorch runtime, "
                "1 thread")
        if set(kinds) <= set(ETL_KINDS):
            what = ("one decode call of ExecuTorch's own Llama export's attention (etl_program: its SDPACustom / "
                    "QuantizedSDPA on a [1, T, Hkv, D] cache, every query head handed to the op with the whole cache; "
                    "a half model's cache cast to fp32 whole; --quantize_kv_cache's int8 codes with a fp32 scale and "
                    "an int8 zero point per token and head); ExecuTorch runtime, 1 thread")
        if a.prefill:
            what = (f"one prefill call of {ET_PREFILL_CHUNK} queries of edgekv's .pte attention (SdpaAttention: the "
                    "rows written in place, the cache read back as custom_sdpa takes it, custom_sdpa causal from the "
                    "call's first slot); ExecuTorch runtime, 1 thread")
    else:
        import onnxruntime as ort

        versions = {"onnxruntime": ort.__version__}
        what = "one GroupQueryAttention decode call as edgekv's ONNX graphs emit it, present bound to past"

    t0 = time.time()
    rows = []
    # the repeats go round the rows (each row's runs in one go, the rows in turn), shapes and contexts interleaved
    for kind in kinds:
        for name, (h, hkv, d) in {**SHAPES, **EXTRA_SHAPES}.items():
            if (a.shapes and name not in a.shapes.split(",")) or (not a.shapes and name in EXTRA_SHAPES):
                continue
            if lc:
                ctxs = [int(c) for c in a.ctx.split(",")] if a.ctx else LC_CTX[kind]
                for r in lc_time_rows(h, hkv, d, kind, ctxs, a.runs, a.lc_layers):
                    r = {"shape": name, **r, "loadavg": round(os.getloadavg()[0], 2)}
                    rows.append(r)
                    print(f"{kind:6} {name:14} ctx {r['ctx']:6}: {r['median_us']:9.1f} us  "
                          f"{r['us_per_position']:.4f} us/position  (load {r['loadavg']})", flush=True)
                continue
            for ctx in (int(c) for c in (a.ctx or "1024,2048,4096,8192,16384,32768").split(",")):
                chunk = (ET_PREFILL_CHUNK if et else 128) if a.prefill else 1
                r = {"shape": name, **(et_time_call(h, hkv, d, kind, ctx, a.runs, chunk) if et
                                       else time_call(ort, h, hkv, d, kind, ctx, a.runs, chunk))}
                if a.prefill:
                    r["loadavg"] = round(os.getloadavg()[0], 2)
                    rows.append(r)
                    print(f"{kind:6} {name:14} ctx {ctx:6} prefill call of {chunk}: {r['median_us']:10.1f} us  "
                          f"{r['attention_gflop_s']:6.2f} GFLOP/s  (load {r['loadavg']})", flush=True)
                    continue
                r["loadavg"] = round(os.getloadavg()[0], 2)
                rows.append(r)
                print(f"{kind:6} {name:14} ctx {ctx:6}: {r['median_us']:9.1f} us  {r['cache_read_gb_s']:5.2f} GB/s  "
                      f"{r['us_per_position']:.4f} us/position  (load {r['loadavg']})", flush=True)
    fits = {} if a.prefill else fits_of(rows, kinds)
    print_fits(fits)
    kvs = kv_heads_scales(rows) if lc else {}
    for k, by in kvs.items():
        for d, g in by.items():
            print(f"{k} head size {d}, per-key cost against {g['shapes']} by KV heads: decode {g['decode']}, "
                  f"prefill {g['prefill']}")
    pre = prefill_fits(rows)
    for k, by in pre.items():
        print(f"prefill {k}: " + ", ".join(f"head size {d}: {f['attention_flop_per_s'] / 1e9:.1f} GFLOP/s (worst row "
                                           f"{f['max_abs_rel_error']:.0%})" for d, f in by.items()))
    out = {"benchmark": "attention_rates", "runtime": a.runtime,
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), **versions,
           "machine": platform.processor() or platform.machine(), "cpu": cpu_name(), "platform": platform.platform(),
           "loadavg": list(os.getloadavg()), "threads": 1, "runs": a.runs, "what": what,
           **({"int8_kernel": "edgekv::int8_sdpa and edgekv::fp16_sdpa (edgekv/native, --pte-kernel edgekv): the "
                             "fp32 query against the int8 codes and their scales as stored, or the fp16 cache, in "
                             "place"} if INT8_KERNEL == "edgekv" else {}),
           "rows": rows, "fits": fits, "prefill_fits": pre,
           **({"kv_heads_scales": kvs} if kvs else {}),
           "seconds": round(time.time() - t0, 1)}
    write_json(out_path, out)
    return 0


def window_main(a) -> int:
    """--window: the window strategy's eager graph at each head shape and kept-key count (sinks + W), fitted per
    head size as fit_head_dim fits a kernel (overhead + kept keys x H x D x c)."""
    et = a.runtime == "executorch"
    if et:
        import executorch
        import torch

        versions = {"executorch": getattr(executorch, "__version__", None) or _version("executorch"),
                    "torch": torch.__version__}
    else:
        import onnxruntime as ort

        versions = {"onnxruntime": ort.__version__}
    t0 = time.time()
    rows = []
    slots = [int(c) for c in a.ctx.split(",")] if a.ctx else WIN_SLOTS
    shapes = {k: v for k, v in SHAPES.items() if not a.shapes or k in a.shapes.split(",")}
    c = (ET_PREFILL_CHUNK if et else 128) if a.prefill else 1
    # --ring (executorch): beside each window row, a model's own sliding ring of a plain fp32 cache (no sinks: a
    # Gemma 3 sliding layer's, swaps.RingSdpaAttention's arithmetic), the rows going round
    rings = ([("fp16", WIN_SINKS), ("fp32", 0)] if et and a.ring else [("fp16", WIN_SINKS)])
    for name, (h, hkv, d) in shapes.items():
        for n, (dt, sinks) in ((n, r) for n in slots for r in rings):
            r = {"shape": name, **(et_win_time_call(h, hkv, d, n, a.runs, dtype=dt, sinks=sinks, c=c) if et else
                                   win_time_call(h, hkv, d, n, a.runs, c=c)),
                 "loadavg": round(os.getloadavg()[0], 2)}
            rows.append(r)
            print(f"{r['kind']:17} {name:14} kept {n:6}" + (f", a prefill call of {c}" if c > 1 else "")
                  + f": {r['median_us']:9.1f} us  "
                  + (f"{r['attention_gflop_s']:6.2f} GFLOP/s" if c > 1 else f"{r['us_per_position']:.4f} us/position")
                  + f"  (load {r['loadavg']})", flush=True)
    if a.prefill:  # the eager graph's prefill rate per head size (every slot's FLOP: win_prefill)
        return write_window(a, et, versions, t0, rows, {}, prefill_fits(rows), c)
    dims = sorted({r["head_dim"] for r in rows})
    fits = {"eager window fp16": {**fit_head_dim(rows), "by_head_dim": {
        str(d): {**fit_head_dim([r for r in rows if r["head_dim"] == d]),
                 "compute_by_kept_keys": per_key_curve([r for r in rows if r["head_dim"] == d])} for d in dims}}}
    for d, g in fits["eager window fp16"]["by_head_dim"].items():
        print(f"fit window, head size {d}: {g['overhead_s'] * 1e6:.1f} us + {g['compute_s_per_head_dim_position'] * 1e12:.1f} "
              f"ps per head x head size x kept key (worst row {g['max_abs_rel_error']:.0%})")
    return write_window(a, et, versions, t0, rows, fits, {}, c)


def write_window(a, et: bool, versions: dict, t0: float, rows: list[dict], fits: dict, pre: dict, c: int) -> int:
    """window_main's results JSON: attention_rates_[executorch_]window[_prefill].json, or --out."""
    for k, by in pre.items():
        for d, f in by.items():
            print(f"fit {k} prefill, head size {d}: {f['attention_flop_per_s'] / 1e9:.1f} GFLOP/s + "
                  f"{f['overhead_s'] * 1e6:.1f} us a call (worst row {f['max_abs_rel_error']:.0%})")
    call = f"one prefill call of {c} tokens" if c > 1 else "one decode call"
    out = {"benchmark": "attention_rates", "runtime": a.runtime,
           "graph": "window strategy, eager (win_module" + (", lowered to a .pte)" if et else ", lowered to ONNX)"),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), **versions,
           "machine": platform.processor() or platform.machine(), "cpu": cpu_name(), "platform": platform.platform(),
           "loadavg": list(os.getloadavg()), "threads": 1, "runs": a.runs,
           "what": f"{call} of the window strategy's eager attention layer (fp16 rolling cache of sinks + W "
                   f"slots, its projections at a model width of {WIN_HIDDEN}) as edgekv's "
                   + ("ExecuTorch export lowers it (XNNPACK), run by ExecuTorch's runtime" if et else
                      "ONNX export lowers it") + ", 1 thread, process CPU time",
           "rows": rows, "fits": fits, **({"prefill_fits": pre} if pre else {}),
           "seconds": round(time.time() - t0, 1)}
    dest = a.out or Path(__file__).parent / "results" / (
        ("attention_rates_executorch_window" if et else "attention_rates_window") + ("_prefill" if c > 1 else "")
        + ".json")
    write_json(dest, out)
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
