"""The forms a GGUF block with a fractional minimum (Q4_1, Q4_K) can take in ONNX Runtime, timed at one decode step.

    python benchmarks/gguf_blocks_speed.py                    # SmolLM2-135M's layer 0 (Q4_1), 1 thread
    python benchmarks/gguf_blocks_speed.py --model gemma-3-270m --layer 0

One layer's MLP input projections (gate and up, which read the same input) and its down projection, as MatMulNBits
at accuracy_level 4 on a one-token input, in these forms (edgekv.export.gguf_blocks builds the carried ones):
  int zp only      the file's codes and scales with the integer zero point nearest the minimum, no remainder: what
                   a 4-bit asymmetric recipe costs (not exact: the reference for the remainder's cost)
  carried shared   + the fp32 block-sum remainder, the block sums of one input computed once (edgekv's form)
  carried apart    + the remainder, each projection summing its input's blocks itself
  float zp         MatMulNBits with fp32 zero points -m / d (exact to rounding; ONNX Runtime's slow path)
  fp32             MatMul on the dequantized weights
Median CPU ms per call of the whole graph over --calls calls, the configurations going round; the JSON lands in
benchmarks/results/gguf_blocks_speed_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def graph(mats: dict, form: str, k: int):
    """x [1, 1, k] -> gate, up (from x) and down (from up's output), each a MatMul on W^T, rewritten to `form`."""
    from onnx import TensorProto, helper, numpy_helper

    from edgekv.export import gguf_blocks as gb

    ws = {n: gb.file_dequantize(gb.unpack(raw, t, kk)) for n, (t, raw, kk) in mats.items()}
    names = list(mats)
    nodes = [helper.make_node("MatMul", ["x", f"{names[0]}.t"], ["g"], name="gate"),
             helper.make_node("MatMul", ["x", f"{names[1]}.t"], ["u"], name="up"),
             helper.make_node("MatMul", ["u", f"{names[2]}.t"], ["d"], name="down")]
    inits = [numpy_helper.from_array(np.ascontiguousarray(ws[n].T), f"{n}.t") for n in names]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("g", "d")]
    model = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                            [1, 1, k])], outs, inits),
                              opset_imports=[helper.make_opsetid("", 18)])
    if form == "fp32":
        return model
    entries = {}
    for n, (t, raw, kk) in mats.items():
        entries.update(gb.matrix(n, t, raw, raw.shape[0], kk))
    if form == "carried shared":
        gb.carry(model, entries, 4)
        return model
    if form == "carried apart":  # a distinct input name per projection: nothing to share
        nodes[1].input[0] = "x2"
        model.graph.node.insert(0, helper.make_node("Identity", ["x"], ["x2"], name="copy"))
        gb.carry(model, entries, 4)
        return model
    gb.carry(model, entries, 4)
    # int zp only / float zp: drop the remainder's MatMul + Add and the block sums; float zp: the file's minimum
    # as a float zero point -m / d instead of the integer one
    keep, rename = [], {}
    for nd in model.graph.node:
        if nd.name.endswith((".remainder", ".add")) or ".blocksums" in nd.name:
            if nd.name.endswith(".add"):
                rename[nd.input[0]] = nd.output[0]
            continue
        keep.append(nd)
    for nd in keep:
        for i, o in enumerate(nd.output):
            if o in rename:
                nd.output[i] = rename[o]
    if form == "float zp":
        for nd in keep:
            if nd.op_type != "MatMulNBits" or len(nd.input) < 4:
                continue
            name = next(n for n in names if nd.input[1].startswith(n.replace(".", "_")))
            t, raw, kk = mats[name]
            f = gb.unpack(raw, t, kk)
            zp = (-f.offset / np.where(f.scale == 0, 1, f.scale)).astype(np.float32).reshape(-1)
            z = numpy_helper.from_array(zp, nd.input[3] + ".float")
            model.graph.initializer.append(z)
            nd.input[3] = z.name
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import gguf
    import onnxruntime as ort

    from edgekv.models.weights import resolve_model

    path = resolve_model(a.model)
    reader = gguf.GGUFReader(str(path))
    want = [f"blk.{a.layer}.ffn_{p}.weight" for p in ("gate", "up", "down")]
    mats = {}
    for t in reader.tensors:
        if t.name in want:
            k, n = (int(d) for d in t.shape.tolist())
            mats[t.name] = (t.tensor_type.name, np.asarray(t.data).reshape(n, -1), k)
    mats = {n: mats[n] for n in want}
    k = mats[want[0]][2]
    forms = ("fp32", "int zp only", "carried shared", "carried apart", "float zp")
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3  # the dropped remainders' initializers are reported unused
    sessions = {f: ort.InferenceSession(graph(mats, f, k).SerializeToString(), so,
                                        providers=["CPUExecutionProvider"]) for f in forms}
    x = np.random.default_rng(0).standard_normal((1, 1, k)).astype(np.float32)
    ref = sessions["fp32"].run(None, {"x": x})
    times = {f: [] for f in forms}
    for _ in range(a.rounds):
        for f, s in sessions.items():
            s.run(None, {"x": x})
            t = time.process_time()
            for _ in range(a.calls):
                s.run(None, {"x": x})
            times[f].append((time.process_time() - t) / a.calls * 1e3)
    out = {"benchmark": "gguf_blocks_speed", "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
           "model": a.model, "tensors": {n: m[0] for n, m in mats.items()}, "calls": a.calls, "rounds": a.rounds,
           "threads": 1, "onnxruntime": ort.__version__, "forms": {}}
    for f, s in sessions.items():
        got = s.run(None, {"x": x})
        err = max(float(np.abs(g - r).max() / (np.abs(r).max() + 1e-30)) for g, r in zip(got, ref))
        out["forms"][f] = {"cpu_ms_median": round(statistics.median(times[f]), 4),
                           "cpu_ms_rounds": [round(v, 4) for v in times[f]], "max_rel_err_vs_fp32": err}
        print(f"{f:<16} {out['forms'][f]['cpu_ms_median']:8.4f} ms  rel err vs fp32 {err:.2e}")
    dst = Path(a.out or ROOT / "benchmarks" / "results" / f"gguf_blocks_speed_{a.model}.json")
    dst.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dst}")
    return out


if __name__ == "__main__":
    main()
