"""--weights gguf for ONNX: a GGUF's weight blocks carried into the graph as they are, no second quantization.

carry rewrites the traced fp32 graph: each MatMul (and embedding Gather) whose constant weight is a GGUF matrix's fp32
copy runs on the file's own blocks instead, in the form edgekv.export.gguf_codec packs them (its docstring: each
type's form, and why it is exact).

The embedding table: com.microsoft.GatherBlockQuantized on the same codes, scales and zero points as the output
head's MatMulNBits when the table is tied and its type is 8-bit without a remainder (Q8_0, Q5_0, Q6_K): one copy of the
codes in the file, read by both. A table that needs a remainder, or a 4-bit one (Q4_0), stays the fp32 dequantized
table (exact, larger).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from .gguf_codec import (SIZES, Packed, concat, fingerprint, nbits_b, nbits_zero_points, pack, pack_rows, row_steps,
                         unpack)


def split_rows(w: np.ndarray, mats: dict, by_first_row: dict) -> list[tuple] | None:
    """W [N, K] as consecutive GGUF matrices along N (a fused projection), each matched by its fingerprint -> their
    mats entries in order, or None."""
    out, at = [], 0
    while at < w.shape[0]:
        hit = None
        for n_rows, key in by_first_row.get(fingerprint(w[at]), ()):
            if at + n_rows <= w.shape[0] and fingerprint(w[at:at + n_rows]) == key:
                hit = mats[key]
                break
        if hit is None:
            return None
        out.append(hit)
        at += n_rows
    return out


# ---- the graph: MatMul / Gather on a GGUF tensor's fp32 copy -> MatMulNBits / GatherBlockQuantized on its blocks ----


def _describe(p: Packed, table: bool = False) -> str:
    zp = "default zero point" if p.zero_points is None else f"uint{p.bits} zero points"
    op = "GatherBlockQuantized" if table else "MatMulNBits"
    return f"{op} {p.bits}-bit block {p.block}, {zp}" + (", fp32 block-sum remainder" if p.remainder is not None
                                                          else "")


def _equal(p: Packed, w: np.ndarray) -> bool:
    """Whether p dequantizes to exactly w [N, K] (fp32 values: -0.0 == +0.0), compared a slice of rows at a time."""
    n, k = p.shape
    if w.shape != (n, k):
        return False
    per = k // p.block
    for a, b in row_steps(n, k):
        part = Packed(p.type, p.bits, p.block, p.codes[a:b], p.scales[a:b].reshape(b - a, per),
                      None if p.zero_points is None else p.zero_points[a:b],
                      None if p.remainder is None else p.remainder[a:b])
        if not np.array_equal(part.dequantize(), np.asarray(w[a:b], np.float32)):
            return False
    return True


def carry(model, mats: dict, accuracy_level: int, data=None) -> dict:
    """Rewrite `model` (onnx.ModelProto) in place: every MatMul whose constant B is a GGUF matrix's
    fp32 copy (B = W^T, or Transpose(W) for a tied head) becomes MatMulNBits on the file's blocks (plus the
    remainder term where the type has a fractional minimum); a Gather on a table that needs no remainder becomes
    GatherBlockQuantized on the same codes. mats: gguf_matrices(the file). Returns the record for the manifest: per GGUF tensor its type, the
    ONNX form and whether the packed form is bit-identical to the fp32 weight the graph held (`exact`).

    data None: `model` is in memory whole (its initializers hold their values). Else `model` was loaded without its
    external data and `data` is an edgekv.export.onnx_stream._Data: each weight is read from the old file when its
    node is reached, packed, its new tensors appended to the new file and freed, one matrix at a time; the kept
    initializers are copied after. So the export holds one fp32 matrix and its codes, not the graph's weights and
    every packed matrix at once."""
    from onnx import TensorProto, helper, numpy_helper

    from .onnx_quant import _drop_unused
    from .wquant import trim

    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    arrays: dict[str, np.ndarray] = {}
    written: set[str] = set()  # names of the initializers carry adds
    new_inits = []  # streamed: the new initializers, already in the new file

    def array(name):
        if data is not None:  # read per use, not kept (a tied table is read twice: its Gather, its head)
            return data.rows(inits[name])
        if name not in arrays:
            arrays[name] = numpy_helper.to_array(inits[name])
        return arrays[name]

    def const(name, value):
        written.add(name)
        value = np.asarray(value)
        if data is None:
            model.graph.initializer.append(numpy_helper.from_array(value, name))
            return name
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(value.dtype), dims=list(value.shape))
        data.write(t, value)
        new_inits.append(t)
        return name

    def weight_of(node):
        """(the fp32 W [N, K] in transformers' layout, the names that die with the rewrite) or None."""
        b = node.input[1]
        t = producer.get(b)
        if t is not None and t.op_type == "Transpose" and t.input[0] in inits:
            perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None)
            w = array(t.input[0])
            if perm in (None, [1, 0]) and w.ndim == 2 and w.dtype == np.float32:
                return w, {b, t.input[0]}  # W itself goes too where nothing else reads it (_drop_unused)
        if b in inits and inits[b].data_type == TensorProto.FLOAT and len(inits[b].dims) == 2:
            return array(b).T, {b}
        return None

    by_first_row: dict[str, list] = {}  # a matrix's first row -> (its rows, its key): to find fused projections
    for key, (_, type_name, raw, k) in mats.items():
        if type_name in SIZES:
            w0 = pack(unpack(raw[:1], type_name, k)).dequantize()
            by_first_row.setdefault(fingerprint(w0[0]), []).append((raw.shape[0], key))
    record, packs, dead = {}, {}, set()
    sums: dict[tuple, str] = {}  # (input, K, block) -> its block sums, shared by the projections of one input
    nodes = []
    for node in model.graph.node:
        found = weight_of(node) if node.op_type == "MatMul" else None
        if node.op_type == "Gather" and node.input[0] in inits and len(inits[node.input[0]].dims) == 2 and \
                inits[node.input[0]].data_type == TensorProto.FLOAT:
            found = array(node.input[0]), {node.input[0]}
        hit = mats.get(fingerprint(found[0])) if found is not None else None
        hits = [hit] if hit is not None else \
            split_rows(found[0], mats, by_first_row) if found is not None and node.op_type == "MatMul" else None
        if not hits or any(h[1] not in SIZES for h in hits):
            for h in hits or ():
                record[h[0]] = {"type": h[1], "onnx": f"{node.op_type} on the file's {h[1]} values as fp32",
                                "exact": True}
            nodes.append(node)
            continue
        name = "+".join(h[0] for h in hits)
        type_name = "+".join(dict.fromkeys(h[1] for h in hits))
        w, gone = found
        del found
        if name not in packs:
            p = concat([pack_rows(raw, t, k) for _, t, raw, k in hits])
            # equal values: a fused part without a remainder adds +0.0, which turns gguf's -0.0 (a zero code times a
            # negative scale) into +0.0, the same number
            packs[name] = (p, _equal(p, w), p.nbytes())
        p, exact, _ = packs[name]
        del w  # streamed: the fp32 matrix goes before the next is read
        n, k = p.shape
        base = name.replace(".", "_")
        nb = k // p.block
        codes = base + ".codes"
        if codes not in written:
            const(codes, nbits_b(p))
            if data is not None:  # written: a second use (a tied head) needs the shape, scales and zero points only
                p.codes = np.broadcast_to(np.uint8(0), p.codes.shape)
        if node.op_type == "Gather":
            if p.remainder is not None or p.bits != 8:  # the fp32 table stays (exact, not smaller)
                record.setdefault(name + " (table)", {"type": type_name, "onnx": "Gather on the fp32 dequantized "
                                                      "table", "exact": exact})
                nodes.append(node)
                continue
            ids, out = node.input[1], node.output[0]
            s3 = const(base + ".scales3", p.scales.reshape(n, nb, 1))
            ins = [codes, ids, s3]
            if p.zero_points is not None:
                ins.append(const(base + ".zp3", p.zero_points.reshape(n, nb, 1)))
            nodes += [
                helper.make_node("GatherBlockQuantized", ins, [out + ".blocks"], name=node.name + ".gbq",
                                 domain="com.microsoft", gather_axis=0, quantize_axis=2, block_size=p.block, bits=8),
                helper.make_node("Shape", [ids], [out + ".ids_shape"], name=node.name + ".shape"),
                helper.make_node("Concat", [out + ".ids_shape", const(base + ".width", np.array([k], np.int64))],
                                 [out + ".shape"], name=node.name + ".concat", axis=0),
                helper.make_node("Reshape", [out + ".blocks", out + ".shape"], [out], name=node.name)]
            record[name + " (table)"] = {"type": type_name, "onnx": _describe(p, table=True), "exact": exact}
            dead |= gone
            trim()
            continue
        x, out = node.input[0], node.output[0]
        ins = [x, codes, const(base + f".scales.{len(nodes)}", p.scales.reshape(-1))]
        if p.zero_points is not None:
            ins.append(const(base + f".zp.{len(nodes)}", nbits_zero_points(p)))
        y = out if p.remainder is None else out + ".nbits"
        nodes.append(helper.make_node("MatMulNBits", ins, [y], name=node.name, domain="com.microsoft", K=k, N=n,
                                      bits=p.bits, block_size=p.block, accuracy_level=accuracy_level))
        if p.remainder is not None:
            key = (x, k, p.block)
            if key not in sums:
                s = f"{x}.blocksums{p.block}"
                nodes += [
                    helper.make_node("Shape", [x], [s + ".xs"], name=s + ".shape"),
                    helper.make_node("Slice", [s + ".xs", const(s + ".0", np.array([0], np.int64)),
                                               const(s + ".-1", np.array([-1], np.int64))], [s + ".lead"],
                                     name=s + ".slice"),
                    helper.make_node("Concat", [s + ".lead", const(s + ".tail", np.array([nb, p.block], np.int64))],
                                     [s + ".shape"], name=s + ".concat", axis=0),
                    helper.make_node("Reshape", [x, s + ".shape"], [s + ".blocks"], name=s + ".reshape"),
                    helper.make_node("ReduceSum", [s + ".blocks", const(s + ".axes", np.array([-1], np.int64))],
                                     [s], name=s, keepdims=0)]
                sums[key] = s
            r = const(base + f".remainder.{len(nodes)}", np.ascontiguousarray(p.remainder.T))
            nodes += [helper.make_node("MatMul", [sums[key], r], [out + ".rem"], name=node.name + ".remainder"),
                      helper.make_node("Add", [y, out + ".rem"], [out], name=node.name + ".add")]
        for h in hits:  # a fused projection: each GGUF tensor, and the one MatMulNBits it is part of
            record[h[0]] = {"type": h[1], "onnx": _describe(p) + (f" (fused: {name})" if len(hits) > 1 else ""),
                            "exact": exact}
        dead |= gone
        trim()
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _drop_unused(model, dead)
    if data is not None:  # the initializers kept into the new file, then carry's own (already there)
        for i in model.graph.initializer:
            data.copy(i)
        model.graph.initializer.extend(new_inits)
    return {"tensors": dict(sorted(record.items())),
            "bytes": int(sum(b for _, _, b in packs.values())),
            "source_types": dict(sorted(Counter(t["type"] for t in record.values()).items())),
            "exact": all(t["exact"] for t in record.values())}
