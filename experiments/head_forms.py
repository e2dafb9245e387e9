"""What Gemma-3-270M's tied Q8_0 output head (262144 x 640, 8-bit codes, one fp16 scale per 32) costs a decode step in
each form ONNX Runtime can run it in, one token, one thread, CPU milliseconds per call.

Forms (random codes and scales of the head's shape; the timing does not depend on the values):
  nbits8_acc4       MatMulNBits 8-bit, block 32, accuracy_level 4 (int8 activations per block of 32, as llama.cpp
                    quantizes them for its Q8_0 x Q8_0 dot products): what --weights gguf carries today, exact
  nbits8_acc0       the same, fp32 activations: ONNX Runtime has no packed 8-bit fp32 kernel and dequantizes the
                    whole matrix every call
  nbits8_acc4_4way  the head as 4 MatMulNBits of N / 4 rows each, concatenated (smaller packed buffers)
  nbits8_acc4_lut   the first, with the session's mlas.use_lut_gemm on (ONNX Runtime's table-lookup kernels)
  mmint_blocks      exact weights on the integer GEMM: DynamicQuantizeLinear of the input (one scale per tensor),
                    MatMulInteger over the 20 blocks as a batch [20, 1, 32] x [20, 32, N], then each block's int32
                    sum times its scale, summed over blocks (Cast, Mul, ReduceSum)
  nbits4_acc4       MatMulNBits 4-bit, block 32 (what --weights int4 runs; not the file's values): the reference
Every form is a session of one process; the rounds go round the sessions (--forms A,A,B: A twice, to see how much
two sessions of one form differ). Output: a table and JSON (--out), with the load.

    python experiments/head_forms.py [--rounds 5] [--calls 10] [--out benchmarks/results/head_forms_gemma3.json]
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

N, K, BLOCK = 262144, 640, 32  # Gemma-3-270M: vocabulary x hidden


def _model(nodes, inits, opsets=(("", 21), ("com.microsoft", 1))) -> bytes:
    from onnx import TensorProto, helper

    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, N])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets]).SerializeToString()


def nbits(rng, bits: int, acc: int, parts: int = 1) -> bytes:
    from onnx import helper, numpy_helper

    n = N // parts
    nodes, inits = [], []
    for i in range(parts):
        codes = rng.integers(0, 1 << bits, (n, K // BLOCK, BLOCK), dtype=np.uint8)
        if bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        inits += [numpy_helper.from_array(codes, f"b{i}"),
                  numpy_helper.from_array(rng.random(n * K // BLOCK, dtype=np.float32) * 0.01, f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"b{i}", f"s{i}"], ["y" if parts == 1 else f"y{i}"],
                                      domain="com.microsoft", K=K, N=n, bits=bits, block_size=BLOCK,
                                      accuracy_level=acc))
    if parts > 1:
        nodes.append(helper.make_node("Concat", [f"y{i}" for i in range(parts)], ["y"], axis=-1))
    return _model(nodes, inits)


def mmint_blocks(rng) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    nb = K // BLOCK
    inits = [numpy_helper.from_array(rng.integers(-128, 128, (nb, BLOCK, N), dtype=np.int8), "q"),
             numpy_helper.from_array(rng.random((nb, 1, N), dtype=np.float32) * 0.01, "d"),
             numpy_helper.from_array(np.array([nb, 1, BLOCK], np.int64), "blocks"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.array([1, 1, N], np.int64), "out")]
    nodes = [helper.make_node("Reshape", ["x", "blocks"], ["xb"]),
             helper.make_node("DynamicQuantizeLinear", ["xb"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "q", "xz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["accf", "d"], ["scaled"]),
             helper.make_node("ReduceSum", ["scaled", "axis0"], ["summed"], keepdims=0),
             helper.make_node("Mul", ["summed", "xs"], ["flat"]),
             helper.make_node("Reshape", ["flat", "out"], ["y"])]
    return _model(nodes, inits, opsets=(("", 21),))


FORMS = {
    "nbits8_acc4": (lambda r: nbits(r, 8, 4), {}, True),
    "nbits8_acc0": (lambda r: nbits(r, 8, 0), {}, True),
    "nbits8_acc4_4way": (lambda r: nbits(r, 8, 4, parts=4), {}, True),
    "nbits8_acc4_lut": (lambda r: nbits(r, 8, 4), {"mlas.use_lut_gemm": "1"}, True),
    "mmint_blocks": (mmint_blocks, {}, True),
    "nbits4_acc4": (lambda r: nbits(r, 4, 4), {}, False),
}


def main() -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--slow-calls", type=int, default=2, help="calls per round for nbits8_acc0 (about 1 s each)")
    ap.add_argument("--forms", help="comma-separated forms to build (default: all); a form named twice is built in two "
                    "sessions (name, name#2, ...): how much sessions of one form differ")
    ap.add_argument("--out")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, K), dtype=np.float32)
    started, load = datetime.now(UTC).isoformat(timespec="seconds"), [os.getloadavg()]
    sessions = {}
    names = args.forms.split(",") if args.forms else list(FORMS)
    for i, form in enumerate(names):
        build, config, _ = FORMS[form]
        name = form if form not in sessions else f"{form}#{names[:i + 1].count(form)}"
        o = ort.SessionOptions()
        o.intra_op_num_threads = 1
        for k, v in config.items():
            o.add_session_config_entry(k, v)
        sessions[name] = ort.InferenceSession(build(rng), o, providers=["CPUExecutionProvider"])
        sessions[name].run(None, {"x": x})
    ms: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(args.rounds):
        for name, s in sessions.items():
            calls = args.slow_calls if name == "nbits8_acc0" else args.calls
            c = time.process_time()
            for _ in range(calls):
                s.run(None, {"x": x})
            ms[name].append((time.process_time() - c) * 1e3 / calls)
        load.append(os.getloadavg())
    rows = [{"form": k, "exact_weights": FORMS[k.split("#")[0]][2], "cpu_ms_per_call": round(statistics.median(v), 2),
             "runs_cpu_ms": [round(t, 2) for t in v]} for k, v in ms.items()]
    for r in rows:
        print(f"{r['form']:18s} {r['cpu_ms_per_call']:9.2f} CPU ms per call  exact weights: {r['exact_weights']}")
    if args.out:
        out = {"experiment": "head_forms", "started_utc": started, "shape": [N, K], "block": BLOCK, "threads": 1,
               "onnxruntime": ort.__version__, "rows": rows, "loadavg": load,
               "note": "CPU time of the calling process (one intra-op thread) per call, median over the rounds"}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
