"""What int4-mix's float minimum costs per call (issue 38): one 4-bit MatMulNBits projection of SmolLM2-135M's
shapes with and without the remainder term (the input's block sums times a [K/32, N] fp32 matrix,
edgekv.export.wrecipe.remainder_nodes), and the same projection at 8 bits (Q8_0), one token a call, ONNX Runtime
CPU, 1 thread, accuracy_level 4; the graphs' calls interleaved, CPU time per call, median over rounds.

    python experiments/remainder_cost.py --out benchmarks/results/weight_recipe_remainder_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def graph(k: int, n: int, bits: int, remainder: bool, w: np.ndarray):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgekv.export import wrecipe
    inits = []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name
    if bits == 8:
        codes, s = wrecipe.q8_blocks(w)
        ins = [const("B", codes.reshape(n, k // 32, 32)), const("s", s.reshape(-1))]
    else:
        q, s, m = wrecipe.search_blocks_fmin(w, 4)
        z, r = wrecipe.split_minimum(s, m, 4)
        b, sc, zp = wrecipe.pack_matmul(q, s, z, 4)
        ins = [const("B", b), const("s", sc), const("z", zp)]
    y = "y.nbits" if remainder else "y"
    nodes = [helper.make_node("MatMulNBits", ["x", *ins], [y], domain="com.microsoft", K=k, N=n, bits=bits,
                              block_size=32, accuracy_level=4)]
    if remainder:
        nodes += wrecipe.remainder_nodes("x", y, "y", const("R", r.T), k, 32, {}, const)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, n])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    load0 = list(os.getloadavg())
    out = {"experiment": "experiments/remainder_cost.py", "what": __doc__.split("\n\n")[0], "shapes": {}}
    for name, (k, n) in {"gate/up 576 -> 1536": (576, 1536), "down 1536 -> 576": (1536, 576)}.items():
        w = rng.standard_normal((n, k)).astype(np.float32)
        sess = {"4-bit, integer zero point only": graph(k, n, 4, False, w),
                "4-bit + remainder (int4-mix)": graph(k, n, 4, True, w), "8-bit Q8_0": graph(k, n, 8, False, w)}
        x = {"x": rng.standard_normal((1, 1, k)).astype(np.float32)}
        us = {r: [] for r in sess}
        for _ in range(a.rounds):
            for r, s in sess.items():
                t0 = time.process_time()
                for _ in range(a.calls):
                    s.run(None, x)
                us[r].append(1e6 * (time.process_time() - t0) / a.calls)
        out["shapes"][name] = {r: round(float(np.median(v)), 2) for r, v in us.items()}
        print(name, out["shapes"][name], flush=True)
    out["unit"] = "CPU microseconds per call, median of rounds"
    out["loadavg_start"], out["loadavg_end"] = load0, list(os.getloadavg())
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
