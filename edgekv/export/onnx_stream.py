"""int8 / int4 ONNX quantization, streamed (edgekv.export.onnx_quant.quantize_onnx's path for a graph without
subgraphs): the graph is loaded without its external data, each MatMul's B and (int4) each Gather's table is read
in chunks of whole output columns, quantized with ONNX Runtime's MatMulNBitsQuantizer's own per-matrix kernels and
appended to the new external-data file one tensor at a time, so the fp32 weights are never in memory whole.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .wquant import BITS, GROUP, HEAD_GROUP, ORT_ACCURACY_LEVEL, ORT_SYMMETRIC, trim

# elements of fp32 weight read per chunk (64 MB): a weight is quantized in slices of whole output columns (whole rows
# of the torch weight W, whose transpose B is), which MatMulNBits quantizes independently, so the chunks' codes,
# scales and zero points are ORT's own for the whole matrix, laid end to end
CHUNK_ELEMS = 1 << 24
ALIGN, ALIGN_ABOVE = 65536, 1 << 20  # large tensors at 64 KiB offsets (as edgekv.export.to_onnx.save_onnx writes)


class _Data:
    """Initializers of a graph loaded without its external data, read a slice at a time; and the new external-data
    file, appended to one tensor at a time (nothing is held but the tensor being written)."""

    def __init__(self, base: Path, out: Path, location: str):
        self.base, self.out, self.location = base, out, location
        self.f = open(out, "wb")

    def rows(self, t, a: int | None = None, b: int | None = None) -> np.ndarray:
        """Rows a..b (axis 0) of initializer t, read from its file (or its inline data)."""
        from onnx import TensorProto, helper, numpy_helper
        a, b = a or 0, t.dims[0] if b is None else b
        if t.data_location != TensorProto.EXTERNAL:
            return numpy_helper.to_array(t)[a:b]
        info = {e.key: e.value for e in t.external_data}
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        row = int(np.prod(t.dims[1:], dtype=np.int64))
        with open(self.base / info["location"], "rb") as f:
            f.seek(int(info.get("offset", 0)) + a * row * dtype.itemsize)
            data = np.fromfile(f, dtype=dtype, count=(b - a) * row)
        return data.reshape([b - a, *t.dims[1:]])

    def write(self, t, data: bytes | memoryview | np.ndarray) -> None:
        """Tensor proto t (name, type, dims set) gets data: inline under 1 KiB (as save_onnx), else appended."""
        from onnx import TensorProto
        raw = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        if raw.nbytes < 1024:
            t.raw_data = raw.tobytes()
            return
        pos = self.f.tell()
        if raw.nbytes > ALIGN_ABOVE and pos % ALIGN:
            self.f.write(b"\0" * (ALIGN - pos % ALIGN))
            pos = self.f.tell()
        self.f.write(raw)
        t.ClearField("raw_data")
        del t.external_data[:]
        for key, value in (("location", self.location), ("offset", str(pos)), ("length", str(raw.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        t.data_location = TensorProto.EXTERNAL

    def copy(self, t) -> None:
        """An initializer kept as it is: its bytes into the new file."""
        from onnx import TensorProto
        if t.data_location != TensorProto.EXTERNAL:
            return
        info = {e.key: e.value for e in t.external_data}
        with open(self.base / info["location"], "rb") as f:
            f.seek(int(info.get("offset", 0)))
            data = f.read(int(info["length"]))
        del t.external_data[:]
        self.write(t, data)


def _stream_weights(model) -> dict:
    """{MatMul node's index: (W initializer, transposed, K, N)} for every MatMul whose B is a 2-D fp32 initializer or
    Transpose(W) of one (a graph lowered with fold_weights=False keeps every linear's weight so)."""
    from onnx import TensorProto
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    out = {}
    for at, n in enumerate(model.graph.node):
        if n.op_type != "MatMul":
            continue
        b, t = n.input[1], producer.get(n.input[1])
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None) if t is not None else None
        if b in inits:
            w, tr = inits[b], False
        elif t is not None and t.op_type == "Transpose" and t.input[0] in inits and perm in (None, [1, 0]):
            w, tr = inits[t.input[0]], True
        else:
            continue
        if len(w.dims) == 2 and w.data_type == TensorProto.FLOAT:
            out[at] = (w, tr, *(reversed(w.dims) if tr else w.dims))
    return out


def _output_columns(w, transposed: bool, k: int, cols: int, data: _Data):
    """A MatMul's weight read a chunk of whole output columns at a time (each column's blocks are independent):
    yields (first column, end, fp32 [end - first, K] rows, contiguous). A folded B [K, N] is read whole once: its
    columns are not contiguous on disk."""
    step = max(2, CHUNK_ELEMS // max(k, 1))
    whole = None if transposed else data.rows(w)
    for a in range(0, cols, step):
        b = min(cols, a + step)
        yield a, b, np.ascontiguousarray(data.rows(w, a, b) if transposed else whole[:, a:b].T, dtype=np.float32)


def _nbits_matmul(n, w, transposed: bool, k: int, cols: int, bits: int, block: int, data: _Data, new_inits: list):
    """ORT's DefaultWeightOnlyQuantizer.quantize_matmul (QOperator) for one MatMul, its B read in column chunks."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, \
        DefaultWeightOnlyQuantizer

    sym = ORT_SYMMETRIC[f"int{bits}"]
    q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=sym,
                                                                accuracy_level=ORT_ACCURACY_LEVEL, bits=bits))
    parts = [q.qbits_block_quant(np.ascontiguousarray(rows.T)) for _, _, rows in _output_columns(w, transposed, k,
                                                                                                    cols, data)]
    return _nbits_node(n, parts, not sym, k, cols, bits, block, data, new_inits)


def _nbits_node(n, parts: list, zero_points: bool, k: int, cols: int, bits: int, block: int, data: _Data,
                new_inits: list):
    """The MatMulNBits node for MatMul n from its chunks' (codes, scales[, zero points]), each initializer written
    to the external data as it is joined."""
    from onnx import TensorProto, helper

    name = n.input[1]
    tensors = [(f"{name}_Q{bits}", TensorProto.UINT8, 0), (f"{name}_scales", TensorProto.FLOAT, 1)]
    if zero_points:
        tensors.append((f"{name}_zero_points", TensorProto.UINT8, 2))
    for tname, dtype, i in tensors:
        arr = np.concatenate([p[i] for p in parts])
        t = TensorProto(name=tname, data_type=dtype, dims=list(arr.shape))
        data.write(t, arr)
        new_inits.append(t)
        del arr
    attrs = {"K": k, "N": cols, "bits": bits, "block_size": block}
    if ORT_ACCURACY_LEVEL:
        attrs["accuracy_level"] = ORT_ACCURACY_LEVEL
    return helper.make_node("MatMulNBits", [n.input[0]] + [t[0] for t in tensors], [n.output[0]],
                            name=n.name + f"_Q{bits}" if n.name else "", domain="com.microsoft", **attrs)


def _recipe_matmul(n, w, transposed: bool, k: int, cols: int, bits: int, data: _Data, new_inits: list,
                   importance=None, sums: dict | None = None, shared: dict | None = None) -> list:
    """--weights int4-mix: one MatMul as MatMulNBits with edgekv.export.wrecipe's blocks, its weight read in chunks of
    whole output columns (each column's blocks are independent). 4 bits: a searched scale and float minimum per block
    (importance-weighted where given), the integer zero point plus an fp32 remainder term (wrecipe.remainder_nodes);
    8 bits: Q8_0's blocks, the default zero point; a tied head's codes are the table's (shared). Returns the nodes."""
    from . import wrecipe
    if bits == 8:
        codes, scales = _q8_rows(w, transposed, k, cols, data, new_inits, shared)
        t = _init(f"{w.name}_scales.{n.name}", scales.reshape(-1), data, new_inits)
        return [_nbits_from(n, [codes, t], k, cols, 8, wrecipe.BLOCK)]
    parts, rems = [], []
    for _, _, rows in _output_columns(w, transposed, k, cols, data):
        q, s, m = wrecipe.search_blocks_fmin(rows, bits, importance=importance)
        z, r = wrecipe.split_minimum(s, m, bits)
        parts.append(wrecipe.pack_matmul(q, s, z, bits))
        rems.append(r)
    y = n.output[0]
    node = _nbits_node(n, parts, True, k, cols, bits, wrecipe.BLOCK, data, new_inits)
    del node.output[:]
    node.output.append(y + ".nbits")
    rname = _init(f"{n.input[1]}_remainder", np.ascontiguousarray(np.concatenate(rems).T), data, new_inits)

    def const(name, value):
        return name if name in {t.name for t in new_inits} else _init(name, value, data, new_inits)
    return [node, *wrecipe.remainder_nodes(n.input[0], y + ".nbits", y, rname, k, wrecipe.BLOCK, sums, const)]


def _init(name: str, arr: np.ndarray, data: _Data, new_inits: list) -> str:
    """One initializer (any dtype) appended to the new external data; its name."""
    from onnx import TensorProto, helper
    arr = np.ascontiguousarray(arr)
    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype), dims=list(arr.shape))
    data.write(t, arr)
    new_inits.append(t)
    return name


def _q8_rows(w, transposed: bool, k: int, cols: int, data: _Data, new_inits: list, shared: dict | None):
    """Q8_0 blocks (wrecipe.q8_blocks) of a weight [cols, K], codes written once as MatMulNBits' B [cols, K/32, 32];
    (codes' name, scales [cols, K/32]). shared: {weight name: that pair}, so a tied table's Gather and head read one
    copy of the codes."""
    from . import wrecipe
    if shared is not None and w.name in shared:
        return shared[w.name]
    codes, scales = [], []
    for a, b, rows in _output_columns(w, transposed, k, cols, data):
        q, s = wrecipe.q8_blocks(rows)
        codes.append(q.reshape(b - a, k // wrecipe.BLOCK, wrecipe.BLOCK))
        scales.append(s)
    out = _init(f"{w.name}_Q8", np.concatenate(codes), data, new_inits), np.concatenate(scales)
    if shared is not None:
        shared[w.name] = out
    return out


def _nbits_from(n, ins: list, k: int, cols: int, bits: int, block: int):
    from onnx import helper
    attrs = {"K": k, "N": cols, "bits": bits, "block_size": block}
    if ORT_ACCURACY_LEVEL:
        attrs["accuracy_level"] = ORT_ACCURACY_LEVEL
    return helper.make_node("MatMulNBits", [n.input[0], *ins], [n.output[0]], name=n.name + f"_Q{bits}" if n.name else "",
                            domain="com.microsoft", **attrs)


def _recipe_gather(n, table, data: _Data, new_inits: list, shared: dict) -> list:
    """--weights int4-mix, a tied table: GatherBlockQuantized on the head's 8-bit codes (one copy, _q8_rows), its
    own scales [N, K/32, 1], then the rows reshaped to [..., K] (edgekv.export.gguf_blocks' form for a Q8_0 table)."""
    from onnx import helper

    from . import wrecipe
    rows, width = table.dims
    nb = width // wrecipe.BLOCK
    codes, scales = _q8_rows(table, True, width, rows, data, new_inits, shared)
    s3 = _init(f"{table.name}_scales3", scales.reshape(rows, nb, 1), data, new_inits)
    ids, out = n.input[1], n.output[0]
    width_t = _init(f"{table.name}_width", np.array([width], np.int64), data, new_inits)
    return [helper.make_node("GatherBlockQuantized", [codes, ids, s3], [out + ".blocks"], name=n.name + ".gbq",
                             domain="com.microsoft", gather_axis=0, quantize_axis=2, block_size=wrecipe.BLOCK, bits=8),
            helper.make_node("Shape", [ids], [out + ".ids_shape"], name=n.name + ".shape"),
            helper.make_node("Concat", [out + ".ids_shape", width_t], [out + ".shape"], name=n.name + ".concat", axis=0),
            helper.make_node("Reshape", [out + ".blocks", out + ".shape"], [out], name=n.name)]


def _role(weight_name: str, cols: int, vocab: int) -> tuple[str, int | None]:
    """(role, layer) of a linear's weight by its module name (edgekv.models' HF-style names): head, attn_v,
    ffn_down, or the projection's own name; the layer index from `layers.<i>.`."""
    import re
    if cols == vocab:
        return "head", None
    m = re.search(r"layers\.(\d+)\.", weight_name)
    proj = re.search(r"(\w+?)(?:_proj)?\.weight$", weight_name)
    role = proj.group(1).split(".")[-1] if proj else weight_name
    return {"v": "attn_v", "qkv": "attn_qkv", "down": "ffn_down"}.get(role, role), int(m.group(1)) if m else None


def _block_gather(n, table, block: int, data: _Data, new_inits: list):
    """ORT's DefaultWeightOnlyQuantizer.quantize_gather (int4, blocks along axis 1) for one table, read in chunks of
    an even number of rows (each row's blocks are independent; an even count keeps the packed nibbles byte-aligned)."""
    from onnx import TensorProto, helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    sym = ORT_SYMMETRIC["int4"]
    rows, width = table.dims
    step = max(2, (CHUNK_ELEMS // max(width, 1)) // 2 * 2)
    parts = []
    for a in range(0, rows, step):
        parts.append(DefaultWeightOnlyQuantizer.quantize_ndarray(data.rows(table, a, min(rows, a + step)), 1,
                                                                 block, sym))
    qtype = TensorProto.INT4 if sym else TensorProto.UINT4
    scales = np.concatenate([p[1] for p in parts])
    tensors = [(f"{table.name}_Q4", qtype, list(table.dims), np.concatenate([p[0] for p in parts])),
               (f"{table.name}_scales", TensorProto.FLOAT, list(scales.shape), scales)]
    if not sym:
        tensors.append((f"{table.name}_zero_points", qtype, list(scales.shape), np.concatenate([p[2] for p in parts])))
    del parts, scales
    for tname, dtype, dims, arr in tensors:
        t = TensorProto(name=tname, data_type=dtype, dims=dims)
        data.write(t, arr)
        new_inits.append(t)
    axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
    return helper.make_node("GatherBlockQuantized", [tensors[0][0], n.input[1]] + [t[0] for t in tensors[1:]],
                            [n.output[0]], name=n.name + "_Q4" if n.name else "", domain="com.microsoft",
                            gather_axis=axis, quantize_axis=1, block_size=block)


def fuse_tied_head_file(path: Path) -> list[str]:
    """fuse_tied_head on a saved model.onnx, its weights left on disk; the external-data file rewritten without what
    the fused graph no longer reads (a folded transposed table), one tensor at a time."""
    import os

    import onnx

    from .to_onnx import EXTERNAL_DATA
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    from .onnx_quant import fuse_tied_head
    fused = fuse_tied_head(model, str(path.parent))
    if fused:
        tmp = path.parent / f".{EXTERNAL_DATA}.tmp-{os.getpid()}"
        data = _Data(path.parent, tmp, EXTERNAL_DATA)
        try:
            for i in model.graph.initializer:
                data.copy(i)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            data.f.close()
        _publish(model, tmp, path)
    return fused


def _publish(model, data_tmp: Path, dst: Path) -> None:
    """The new external-data file (written in full at data_tmp) into place beside dst, then the graph that reads it
    (saved to a temporary and renamed): each file is whole when it appears."""
    import os

    import onnx

    from .to_onnx import EXTERNAL_DATA
    os.replace(data_tmp, dst.parent / EXTERNAL_DATA)
    gtmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    onnx.save_model(model, str(gtmp))
    os.replace(gtmp, dst)


def streams(model) -> bool:
    """Whether quantize_onnx can stream this graph: no node holds a subgraph (whose body may read an outer weight)."""
    from onnx import AttributeProto
    return not any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for n in model.graph.node
                   for a in n.attribute)


def quantize_stream(model, src: Path, dst: Path, weights: str, entry: dict,
                    importance: dict | None = None) -> tuple[str, bool, dict]:
    """int8 / int4 on a graph loaded without its weights: each MatMul's B and (int4) each Gather's table read,
    quantized and appended to the new external-data file one at a time, in chunks; the kept initializers copied
    after. The codes, scales and zero points are ONNX Runtime's MatMulNBitsQuantizer's (its per-matrix kernels on
    the same blocks), the nodes the ones it writes; int4-mix: edgekv.export.wrecipe's bits and blocks. Returns (tool,
    untied, per tensor: what int4-mix chose for each weight, else {}). importance (int4-mix): {weight initializer's
    name: the importance per input channel [K]} (wrecipe.importance), where one was measured."""
    import os

    from onnx import TensorProto

    from .to_onnx import EXTERNAL_DATA

    bits = BITS[weights]
    mix = weights == "int4-mix"
    mats = _stream_weights(model)
    nodes = list(model.graph.node)
    sizes = {nodes[at].name: k * cols for at, (_, _, k, cols) in mats.items()}
    vocab = entry["outputs"][0]["shape"][-1]
    heads = {nodes[at].name for at, m in mats.items() if m[3] == vocab}
    head = sum(sizes[h] for h in heads)
    heads = heads if HEAD_GROUP[weights] != GROUP and head > sum(sizes.values()) - head else set()
    n_layers = 1 + max([int(r[1]) for at, m in mats.items() if (r := _role(m[0].name, m[3], vocab))[1] is not None]
                       or [-1])
    per_tensor = {}
    inits = {i.name: i for i in model.graph.initializer}
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    tmp = Path(dst).parent / f".{EXTERNAL_DATA}.tmp-{os.getpid()}"
    data = _Data(Path(src).parent, tmp, EXTERNAL_DATA)
    new_nodes, new_inits, untied = [], [], False
    sums, shared = {}, {}  # int4-mix: the inputs' block sums, the tied table's 8-bit codes
    tied = {m[0].name for m in mats.values() if m[3] == vocab and m[1] and m[0].name in gathered}
    try:
        for at, n in enumerate(nodes):
            if at in mats:
                w, tr, k, cols = mats[at]
                untied |= tr and w.name in gathered
                if mix:
                    from .wrecipe import mix_bits
                    role, layer = _role(w.name, cols, vocab)
                    b = mix_bits(role, layer, n_layers)
                    imp = (importance or {}).get(w.name) if b == 4 else None
                    imp = imp if imp is not None and len(imp) == k else None
                    per_tensor[w.name] = {"role": role, "layer": layer, "bits": b, "shape": [cols, k], "node": n.name,
                                          "blocks": ("searched scale and float minimum" + (", importance-weighted"
                                                     if imp is not None else "")) if b == 4 else "Q8_0"}
                    new_nodes.extend(_recipe_matmul(n, w, tr, k, cols, b, data, new_inits, imp, sums, shared))
                else:
                    block = HEAD_GROUP[weights] if n.name in heads else GROUP
                    new_nodes.append(_nbits_matmul(n, w, tr, k, cols, bits, block, data, new_inits))
                trim()
            elif mix and n.op_type == "Gather" and n.input[0] in tied:
                new_nodes.extend(_recipe_gather(n, inits[n.input[0]], data, new_inits, shared))
                per_tensor[n.input[0] + " (table)"] = {"role": "embed", "layer": None, "bits": 8,
                                                       "blocks": "Q8_0, the head's codes (GatherBlockQuantized)"}
                trim()
            elif bits == 4 and n.op_type == "Gather" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2 \
                    and inits[n.input[0]].data_type == TensorProto.FLOAT:
                new_nodes.append(_block_gather(n, inits[n.input[0]], GROUP, data, new_inits))
                if mix:
                    per_tensor[n.input[0] + " (table)"] = {"role": "embed", "layer": None, "bits": 4,
                                                           "blocks": "ONNX Runtime's min/max (GatherBlockQuantized)"}
                trim()
            else:
                new_nodes.append(n)
        del model.graph.node[:]
        model.graph.node.extend(new_nodes)
        # what nothing reads any more: the transposes of the weights just quantized, then their initializers
        used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        dead = {n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.output[0] not in used
                and n.input[0] in inits}
        keep = [n for n in model.graph.node if not (n.op_type == "Transpose" and n.output[0] in dead)]
        del model.graph.node[:]
        model.graph.node.extend(keep)
        used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        kept = [i for i in model.graph.initializer if i.name in used]
        for i in kept:
            data.copy(i)
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept + new_inits)
        vi = [v for v in model.graph.value_info if v.name not in dead]
        del model.graph.value_info[:]
        model.graph.value_info.extend(vi)
    except BaseException:
        data.f.close()
        tmp.unlink(missing_ok=True)  # nothing half-written is left beside dst
        raise
    data.f.close()
    # the opsets ORT's quantizer sets: its contrib domain; int4 tensors need opset 21 and IR version 10
    _set_opset(model, "com.microsoft", 1)
    if bits == 4:
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx") and o.version < 21:
                o.version = 21
        model.ir_version = max(model.ir_version, 10)
    _publish(model, tmp, Path(dst))
    if mix:
        from . import wrecipe
        tool = (f"edgekv.export.wrecipe (int4-mix: llama.cpp Q4_K_M's per-tensor bits as 4 / 8-bit MatMulNBits, "
                f"blocks of {wrecipe.BLOCK}; 4-bit blocks' scale and float minimum searched"
                f"{' with an importance matrix' if importance else ''} (an fp32 block-sum remainder term); 8-bit "
                f"Q8_0, a tied table sharing the head's codes; accuracy_level {ORT_ACCURACY_LEVEL}), one weight at "
                f"a time")
        return tool, untied, per_tensor
    tool = (f"onnxruntime.quantization.MatMulNBitsQuantizer's kernels (bits {bits}, block {GROUP}"
            f"{f' (the output head {HEAD_GROUP[weights]})' if heads else ''}, "
            f"{'symmetric' if ORT_SYMMETRIC[weights] else 'asymmetric (zero points)'}, "
            f"accuracy_level {ORT_ACCURACY_LEVEL}), one weight at a time")
    return tool, untied, per_tensor


def _set_opset(model, domain: str, version: int) -> None:
    from onnx import helper
    for o in model.opset_import:
        if o.domain == domain:
            o.version = version
            return
    model.opset_import.append(helper.make_opsetid(domain, version))
