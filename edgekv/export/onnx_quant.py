"""int8 / int4 / int4-mix / fp16 / gguf weights for the .onnx format: ONNX Runtime's tools on the exported fp32 graph
(the recipes and their constants: edgekv.export.wquant, which also quantizes the eager module for the .pte).

The tied output layer is untied first (a separate copy of the matrix, quantized like every other linear); the int8 /
int4 table is int4 blocks where the weights are (GatherBlockQuantized); gguf hands over to edgekv.export.gguf_blocks.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from .wquant import (BITS, GGUF_ONLY, GROUP, HEAD_GROUP, MIX_SUBGRAPH, ORT_ACCURACY_LEVEL, ORT_SYMMETRIC,
                     _version)


def _transposed_heads(model, folded: bool = False, base_dir: str = ""):
    """(MatMul, W) pairs where the MatMul's B is W transposed, W an initializer: the tied output layer (nn.Linear
    over the embedding table the Gather reads). B is Transpose(W) where the exporter does not fold a large table's
    transpose; with folded=True also a B initializer equal to W^T of a table a Gather reads (a small one it folded)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    tables = {n.input[0] for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits}
    for n in model.graph.node:
        if n.op_type != "MatMul":
            continue
        t = producer.get(n.input[1])
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None) if t is not None else None
        if t is not None and t.op_type == "Transpose" and t.input[0] in inits and perm in (None, [1, 0]):
            yield n, t.input[0]
        elif folded and n.input[1] in inits:
            b = inits[n.input[1]]
            for w in tables:
                if list(inits[w].dims) == list(b.dims)[::-1] and inits[w].data_type == b.data_type and \
                        np.array_equal(numpy_helper.to_array(inits[w], base_dir).T, numpy_helper.to_array(b, base_dir)):
                    yield n, w
                    break


def _drop_unused(model, names: set) -> None:
    """Remove the Transpose nodes and initializers among `names` (outputs / initializer names) that no node reads
    any more (only these: a subgraph's body, e.g. RWKV's Scan, reads outer initializers no top-level node lists)."""
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    keep = [n for n in model.graph.node if n.op_type != "Transpose" or n.output[0] not in names - used]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    used = {i for n in model.graph.node for i in n.input}
    inits = [i for i in model.graph.initializer if i.name not in names - used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)


def output_heads(model, entry: dict) -> list[str]:
    """The MatMul nodes whose constant B has the vocabulary's width (entry's logits: [.., V]): the output head; []
    unless they hold more weights than the other constant MatMuls together (HEAD_GROUP's rule)."""
    vocab = entry["outputs"][0]["shape"][-1]
    inits = {i.name: i for i in model.graph.initializer}
    size = {n.name: int(np.prod(inits[n.input[1]].dims)) for n in model.graph.node
            if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2}
    heads = [n.name for n in model.graph.node if n.name in size and inits[n.input[1]].dims[1] == vocab]
    head = sum(size[h] for h in heads)
    return heads if head > sum(size.values()) - head else []


def untie_onnx_head(model) -> list[str]:
    """MatMul(x, Transpose(W)) with W an initializer (the tied output layer) -> MatMul(x, W^T) with W^T a new
    initializer, so ORT's weight quantizers (which need a constant B) take it. W itself stays for the Gather.
    Returns the untied MatMul nodes' names."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    untied, dead = [], set()
    for n, w in list(_transposed_heads(model)):
        dead.add(n.input[1])
        name = w + ".T"
        if name not in inits:
            t = np.ascontiguousarray(numpy_helper.to_array(inits[w]).T)
            model.graph.initializer.append(numpy_helper.from_array(t, name))
            inits[name] = model.graph.initializer[-1]
        n.input[1] = name
        untied.append(n.name)
    _drop_unused(model, dead)
    return untied


def fuse_tied_head(model, base_dir: str = "") -> list[str]:
    """MatMul(x, Transpose(W)) with W an initializer -> com.microsoft FusedMatMul(x, W, transB=1): ONNX Runtime packs
    the output layer straight from the table the Gather reads. Left as a Transpose, ORT's constant folding makes a
    transposed copy of the table at load (resident, and once more at the load peak) and then packs that;
    a small table's transpose the exporter folds itself, into a second copy in the file. Fusing lowers the resident
    memory and the load peak at the same decode speed. For fp32 weights only (fp16 and the quantized recipes keep MatMul).
    Returns the fused nodes' names."""
    from onnx import helper

    fused, dead = [], set()
    for n, w in list(_transposed_heads(model, folded=True, base_dir=base_dir)):
        dead.add(n.input[1])  # Transpose(W)'s output, or the folded copy of W^T
        at = list(model.graph.node).index(n)
        model.graph.node.remove(n)
        model.graph.node.insert(at, helper.make_node("FusedMatMul", [n.input[0], w], list(n.output),
                                                     name=n.name, domain="com.microsoft", transB=1))
        fused.append(n.name)
    if fused and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _drop_unused(model, dead)
    return fused


def quantize_onnx(src: Path, dst: Path, weights: str, entry: dict, source: Path | None = None,
                  importance: dict | None = None) -> dict:
    """Quantize the fp32 model at src into dst (may be the same path). The graph's inputs and outputs are checked
    against the manifest entry point afterwards. weights gguf: the GGUF file `source`'s own blocks
    (edgekv.export.gguf_blocks); importance: int4-mix's importance matrix (edgekv.export.wrecipe.eager_importance).
    Returns what was done, for the manifest."""
    import contextlib
    import io
    import logging

    import onnx

    from .to_onnx import save_onnx

    if weights == "fp32":
        return {"dtype": "float32"}
    if weights in ("int8", "int4", "int4-mix", "gguf"):  # the graph alone first: streamed where it has no subgraph
        model = onnx.load(str(src), load_external_data=False)
        from .onnx_stream import quantize_stream, streams
        if weights == "gguf" and streams(model):
            return _carry_onnx(model, dst, entry, source, streamed_from=Path(src))
        if weights == "int4-mix" and not streams(model):
            raise EdgekvError(MIX_SUBGRAPH)
        if streams(model):
            before = Counter(n.op_type for n in model.graph.node)
            tool, untied, per_tensor = quantize_stream(model, src, dst, weights, entry, importance)
            return {**_record(dst, entry, weights, tool, before, untied),
                    **({"per_tensor": per_tensor} if per_tensor else {})}
        del model
    model = onnx.load(str(src))
    if weights == "gguf":
        return _carry_onnx(model, dst, entry, source)
    untied = untie_onnx_head(model) if weights in ("int8", "int4") else []  # fp16 needs no second copy
    before = Counter(n.op_type for n in model.graph.node)
    # ORT's quantizers log every node at INFO on their own module loggers
    quiet = [logging.getLogger(), logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if weights in ("int8", "int4"):
                from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
                bits = BITS[weights]
                # int4 also quantizes the embedding table (GatherBlockQuantized, blocks of 32 along the hidden
                # axis), as ORT GenAI's int4 models do: about a seventh of the fp32 table's bytes. ORT's
                # quantizer has no 8-bit Gather, so int8 keeps a fp32 table.
                ops = ("MatMul", "Gather") if bits == 4 else ("MatMul",)
                heads = output_heads(model, entry) if HEAD_GROUP[weights] != GROUP else []

                def nbits(m, block: int, op_types, **which):
                    q = MatMulNBitsQuantizer(m, bits=bits, block_size=block, is_symmetric=ORT_SYMMETRIC[weights],
                                             accuracy_level=ORT_ACCURACY_LEVEL, op_types_to_quantize=op_types,
                                             quant_axes=(("MatMul", 0), ("Gather", 1)), **which)
                    q.process()
                    return q.model.model

                model = nbits(model, GROUP, ops, nodes_to_exclude=heads)
                if heads:  # the head in its own blocks, a second pass over it alone
                    model = nbits(model, HEAD_GROUP[weights], ("MatMul",), nodes_to_include=heads)
                save_onnx(model, dst)
                tool = (f"onnxruntime.quantization.MatMulNBitsQuantizer(bits {bits}, block {GROUP}"
                        f"{f' (the output head {HEAD_GROUP[weights]})' if heads else ''}, "
                        f"{'symmetric' if ORT_SYMMETRIC[weights] else 'asymmetric (zero points)'}, "
                        f"accuracy_level {ORT_ACCURACY_LEVEL})")
            elif weights == "fp16":
                from onnxruntime.transformers.float16 import convert_float_to_float16
                save_onnx(convert_float_to_float16(model, keep_io_types=True), dst)
                tool = "onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types)"
            else:
                raise EdgekvError(f"no ONNX Runtime recipe for weights {weights!r}")
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    return _record(dst, entry, weights, tool, before, bool(untied))


def _record(dst: Path, entry: dict, weights: str, tool: str, before: Counter, untied: bool) -> dict:
    """The quantized graph at dst checked against the entry point; what was done, for the manifest."""
    import onnx

    from .to_onnx import check_io
    out = onnx.load(str(dst), load_external_data=False)
    check_io(out, entry)
    after = Counter(n.op_type for n in out.graph.node)
    new_ops = {k: v for k, v in sorted(after.items()) if v > before.get(k, 0)}
    return {"dtype": weights, "tool": f"onnxruntime {_version('onnxruntime')}: {tool}", "new_ops": new_ops,
            "matmuls_left_float": after.get("MatMul", 0),
            "output_layer": "untied copy, quantized" if untied else "tied" if weights == "fp16" else "own MatMul",
            "embedding": {"fp16": "float16", "int4": "int4 (GatherBlockQuantized)"}.get(weights, "float32")}


def _carry_onnx(model, dst: Path, entry: dict, source: Path | None, streamed_from: Path | None = None) -> dict:
    """--weights gguf: the GGUF's blocks into the graph (gguf_blocks.carry), saved to dst and checked like the
    other recipes. streamed_from: the saved model `model` was loaded from without its external data (a graph without
    subgraphs): carried one matrix at a time into a new external-data file; None: `model` is in memory whole."""
    import os

    import onnx

    from .gguf_blocks import carry
    from .gguf_codec import gguf_matrices
    from .onnx_stream import _Data, _publish
    from .to_onnx import EXTERNAL_DATA, check_io, save_onnx

    if source is None or Path(source).suffix.lower() != ".gguf":
        raise EdgekvError(GGUF_ONLY)
    before = Counter(n.op_type for n in model.graph.node)
    if streamed_from is None:
        record = carry(model, gguf_matrices(source), ORT_ACCURACY_LEVEL)
        save_onnx(model, dst)
    else:  # streamed: one matrix at a time into the new external-data file, published whole when done
        mats = gguf_matrices(source)
        data = _Data(streamed_from.parent, Path(dst).parent / f".{EXTERNAL_DATA}.tmp-{os.getpid()}", EXTERNAL_DATA)
        try:
            record = carry(model, mats, ORT_ACCURACY_LEVEL, data=data)
        except BaseException:
            data.f.close()
            data.out.unlink(missing_ok=True)  # nothing half-written is left beside dst
            raise
        data.f.close()
        _publish(model, data.out, Path(dst))
    out = onnx.load(str(dst), load_external_data=False)
    check_io(out, entry)
    after = Counter(n.op_type for n in out.graph.node)
    new_ops = {k: v for k, v in sorted(after.items()) if v > before.get(k, 0)}
    # a MatMul over a constant weight the file did not supply (the remainders' small matrices are not weights)
    weights_left = {i.name for i in out.graph.initializer if len(i.dims) == 2 and ".remainder." not in i.name}
    weights_left |= {n.output[0] for n in out.graph.node if n.op_type == "Transpose" and n.input[0] in weights_left}
    return {"dtype": "gguf", "source": Path(source).name, "source_format": "gguf",
            "tool": f"edgekv.export.gguf_blocks: the file's blocks as com.microsoft MatMulNBits / GatherBlockQuantized "
                    f"(onnxruntime {_version('onnxruntime')}, accuracy_level {ORT_ACCURACY_LEVEL})",
            "new_ops": new_ops, "matmuls_left_float": sum(1 for n in out.graph.node if n.op_type == "MatMul"
                                                          and n.input[1] in weights_left),
            **record}
