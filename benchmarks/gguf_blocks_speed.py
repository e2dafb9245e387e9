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

    python benchmarks/gguf_blocks_speed.py --model gemma-3-270m --layers 18 --split   # the 5-bit types' forms
    python benchmarks/gguf_blocks_speed.py --model gemma-3-270m --head                # the Q8_0 output head's forms

--layers L chains the MLPs of layers 0 .. L-1 in one graph, so the weights a call reads exceed the last-level cache
as a decode step's do (one layer's fit in it, and a hot matrix flatters the wider codes). --split adds, for the 8-bit
carried Q5_0 matrices (Gemma's gate and up), the exact split
  q5 split 4+2     d * (q - 16) = d * lo + 16 d * (hi - 1), q = lo + 16 hi: a 4-bit MatMulNBits on the low nibbles
                   (zero point 0) plus a 2-bit one on the fifth bit (zero point 1, scale 16 d), outputs added
  q5 low 4 only    the 4-bit part alone (not exact: a lower bound for any 4-bit form of the 5-bit codes)
--head times the tied output head [V, hidden] alone, as carried (8-bit, the file's Q8_0 codes), as the exact split
q8 = 16 hi + lo into two 4-bit MatMulNBits (hi with zero point 8 and scale 16 d, lo with zero point 0), as the high
nibble alone (not exact: what a 4-bit head costs) and as a fp16 MatMul of the dequantized head.
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
    from edgekv.export import gguf_codec as gc

    ws = {n: gc.file_dequantize(gc.unpack(raw, t, kk)) for n, (t, raw, kk) in mats.items()}
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
        entries.update(gc.matrix(n, t, raw, raw.shape[0], kk))
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
            f = gc.unpack(raw, t, kk)
            zp = (-f.offset / np.where(f.scale == 0, 1, f.scale)).astype(np.float32).reshape(-1)
            z = numpy_helper.from_array(zp, nd.input[3] + ".float")
            model.graph.initializer.append(z)
            nd.input[3] = z.name
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return model


def _nbits(x: str, y: str, codes: np.ndarray, scales: np.ndarray, zero: int | None, bits: int, block: int,
           name: str):
    """A MatMulNBits node y = x @ (scales * (codes - zero))^T, codes uint8 [N, K] (one per element), and its
    initializers; zero None: the default 2^(bits-1)."""
    from onnx import helper, numpy_helper

    n, k = codes.shape
    nb = k // block
    c = codes.reshape(n, nb, block).astype(np.uint8)
    per = 8 // bits
    packed = np.zeros((n, nb, block // per), np.uint8)
    for j in range(per):  # element j of each byte in bits j*bits .. (the even element lowest)
        packed |= (c[..., j::per] << (j * bits)).astype(np.uint8)
    inits = [numpy_helper.from_array(packed, name + ".b"),
             numpy_helper.from_array(np.ascontiguousarray(scales, np.float32).reshape(-1), name + ".s")]
    ins = [x, name + ".b", name + ".s"]
    if zero is not None:
        zb = -(-nb * bits // 8)  # bytes per row
        z = np.zeros((n, zb * per), np.uint8)
        z[:, :nb] = zero
        zp = np.zeros((n, zb), np.uint8)
        for j in range(per):
            zp |= (z[:, j::per] << (j * bits)).astype(np.uint8)
        inits.append(numpy_helper.from_array(zp.reshape(-1), name + ".z"))
        ins.append(name + ".z")
    node = helper.make_node("MatMulNBits", ins, [y], name=name, domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=4)
    return [node], inits


def q5_split(model, mats: dict, low_only: bool) -> None:
    """Replace each 8-bit carried Q5_0 MatMulNBits of `model` (gb.carry's output) by the 4 + 2 bit split of the
    module docstring (low_only: by its 4-bit part alone)."""
    from onnx import helper

    from edgekv.export import gguf_codec as gc

    out, drop = [], set()
    for nd in model.graph.node:
        hit = next((n for n, (t, _, _) in mats.items() if t == "Q5_0" and nd.op_type == "MatMulNBits"
                    and nd.input[1].startswith(n.replace(".", "_"))), None)
        if hit is None:
            out.append(nd)
            continue
        t, raw, k = mats[hit]
        f = gc.unpack(raw, t, k)
        q = (f.q + 16).astype(np.uint8)  # the file's 5-bit codes 0..31
        lo, hi = q & 15, q >> 4
        drop |= set(nd.input[1:])
        y = nd.output[0]
        base = hit.replace(".", "_")  # the initializers' names: unique per tensor
        a, ai = _nbits(nd.input[0], y if low_only else y + ".lo", lo, f.scale, 0, 4, 32, base + ".lo")
        out += a
        model.graph.initializer.extend(ai)
        if not low_only:
            b, bi = _nbits(nd.input[0], y + ".hi", hi, 16 * f.scale, 1, 2, 32, base + ".hi")
            out += b + [helper.make_node("Add", [y + ".lo", y + ".hi"], [y], name=base + ".add")]
            model.graph.initializer.extend(bi)
    keep = [i for i in model.graph.initializer if i.name not in drop]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    del model.graph.node[:]
    model.graph.node.extend(out)


def layers_graph(layer_mats: list[dict], form: str, k: int):
    """The MLPs of several layers side by side (each from the same input x), rewritten to `form`."""
    from onnx import TensorProto, helper

    nodes, inits, outs = [], {}, []
    for mats in layer_mats:
        one = graph(mats, "carried shared" if form.startswith(("carried", "q5")) else form, k)
        if form.startswith("q5"):
            q5_split(one, mats, low_only=form == "q5 low 4 only")
        tag = next(iter(mats)).split(".")[1]
        for nd in one.graph.node:  # each layer's own names for its values
            nd.input[:] = [i if i == "x" or any(i == t.name for t in one.graph.initializer) else f"L{tag}.{i}"
                           for i in nd.input]
            nd.output[:] = [f"L{tag}.{o}" for o in nd.output]
            nd.name = f"L{tag}.{nd.name}"
        nodes += list(one.graph.node)
        inits.update({i.name: i for i in one.graph.initializer})  # the block sums' shape constants repeat
        outs += [helper.make_tensor_value_info(f"L{tag}.{o}", TensorProto.FLOAT, None) for o in ("g", "d")]
    m = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                       [1, 1, k])], outs,
                                            list(inits.values())),
                          opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    return m


def head_graph(t: str, raw: np.ndarray, k: int, form: str):
    """x [1, 1, k] -> logits [1, 1, V] from the tied Q8_0 head in `form`."""
    from onnx import TensorProto, helper, numpy_helper

    from edgekv.export import gguf_codec as gc

    f = gc.unpack(raw, t, k)
    c = (f.q + 128).astype(np.uint8)
    nodes, inits = [], []
    if form == "carried 8-bit":
        nodes, inits = _nbits("x", "y", c, f.scale, None, 8, f.block, "head")
    elif form == "split 4+4":
        a, ai = _nbits("x", "y.hi", c >> 4, 16 * f.scale, 8, 4, f.block, "head.hi")
        b, bi = _nbits("x", "y.lo", c & 15, f.scale, 0, 4, f.block, "head.lo")
        nodes = a + b + [helper.make_node("Add", ["y.hi", "y.lo"], ["y"], name="head.add")]
        inits = ai + bi
    elif form == "high nibble only":
        nodes, inits = _nbits("x", "y", c >> 4, 16 * f.scale, 8, 4, f.block, "head.hi")
    elif form == "fp16 MatMul":
        w = gc.file_dequantize(f).astype(np.float16)
        inits = [numpy_helper.from_array(np.ascontiguousarray(w.T), "w16")]
        nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
                 helper.make_node("MatMul", ["x16", "w16"], ["y16"]),
                 helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT)]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--layers", type=int, default=1, help="chain the MLPs of layers 0 .. L-1 (past the cache)")
    ap.add_argument("--split", action="store_true", help="add the Q5_0 4+2 split forms")
    ap.add_argument("--head", action="store_true", help="time the tied output head's forms instead")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import gguf
    import onnxruntime as ort

    from edgekv.models.weights import resolve_model

    path = resolve_model(a.model)
    reader = gguf.GGUFReader(str(path))
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3  # the dropped remainders' initializers are reported unused

    def session(model):
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    tensors = {t.name: t for t in reader.tensors}

    def load(name):
        t = tensors[name]
        k, n = (int(d) for d in t.shape.tolist())
        return t.tensor_type.name, np.asarray(t.data).reshape(n, -1), k

    if a.head:
        t, raw, k = load("token_embd.weight")
        mats = {"token_embd.weight": (t, raw, k)}
        forms = ("carried 8-bit", "split 4+4", "high nibble only", "fp16 MatMul")
        sessions = {f: session(head_graph(t, raw, k, f)) for f in forms}
        ref_form = "carried 8-bit"
    else:
        layer_mats = [{f"blk.{i}.ffn_{p}.weight": load(f"blk.{i}.ffn_{p}.weight") for p in ("gate", "up", "down")}
                      for i in range(a.layer, a.layer + a.layers)]
        mats = {n: m for lm in layer_mats for n, m in lm.items()}
        k = layer_mats[0][f"blk.{a.layer}.ffn_gate.weight"][2]
        forms = ("fp32", "int zp only", "carried shared", "carried apart", "float zp")
        if a.layers > 1 or a.split:  # the slow forms left out of the chained runs
            forms = ("fp32", "int zp only", "carried shared")
        if a.split:
            forms += ("q5 split 4+2", "q5 low 4 only")
        if a.layers == 1 and not a.split:
            sessions = {f: session(graph(layer_mats[0], f, k)) for f in forms}
        else:
            sessions = {f: session(layers_graph(layer_mats, f, k)) for f in forms}
        ref_form = "fp32"
    x = np.random.default_rng(0).standard_normal((1, 1, k)).astype(np.float32)
    ref = sessions[ref_form].run(None, {"x": x})
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
           "threads": 1, "onnxruntime": ort.__version__, "layers": a.layers, "head": a.head,
           "reference_form": ref_form, "forms": {}}
    for f, s in sessions.items():
        got = s.run(None, {"x": x})
        err = max(float(np.abs(g - r).max() / (np.abs(r).max() + 1e-30)) for g, r in zip(got, ref))
        out["forms"][f] = {"cpu_ms_median": round(statistics.median(times[f]), 4),
                           "cpu_ms_rounds": [round(v, 4) for v in times[f]], f"max_rel_err_vs_{ref_form.replace(' ', '_')}": err}
        print(f"{f:<16} {out['forms'][f]['cpu_ms_median']:8.4f} ms  rel err vs {ref_form} {err:.2e}")
    tail = "_head" if a.head else (f"_{a.layers}layers" if a.layers > 1 else "") + ("_split" if a.split else "")
    dst = Path(a.out or ROOT / "benchmarks" / "results" / f"gguf_blocks_speed_{a.model}{tail}.json")
    dst.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dst}")
    return out


if __name__ == "__main__":
    main()
