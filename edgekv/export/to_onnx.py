"""Stage 2a, lower to ONNX: one graph `forward` with a dynamic token axis named `seq` (chunked prefill and decode).

torch.onnx.export(dynamo=True) from the ExportedProgram. model.onnx holds the graph; every initializer of 1 KiB or
more goes into one external-data file beside it, model.onnx.data (ONNX external data: no 2 GB protobuf limit).
ONNX Runtime maps that file instead of reading the weights into its heap: a packed weight's original is never a heap
copy, and the pages of a table only a Gather reads are paged in as rows are read (OrtStepper gives back those the
packing read), which lowers the resident memory after creating the session at the same decode speed
(docs/export.md#memory-of-a-loaded-artifact).
The graph's inputs and outputs are checked against the manifest's entry point, so the names and shapes an app reads
are the graph's own.
"""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from ..errors import EdgekvError

EXTERNAL_DATA = "model.onnx.data"  # the weights of a model.onnx saved with external data, beside it
ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 3: "int8", 2: "uint8"}


class Lowered:
    """A lowered graph before it is written: the exporter's onnx_ir Model, whose initializers still share the torch
    module's tensors (no copy), and the manifest entry point its inputs and outputs must match. save_onnx writes it
    one tensor at a time."""

    def __init__(self, model, entry: dict):
        self.model, self.entry = model, entry


# Constant folding of an op reading an initializer of more elements than this is left out when the weights are
# folded later (lower_onnx(fold_weights=False)): the exporter's optimizer would otherwise turn every MatMul's
# Transpose(W) into a transposed copy, a second fp32 copy of every linear weight alive beside the module's
# (onnxscript's FoldConstantsPass always folds a Transpose of a single-consumer constant, whatever its size).
FOLD_LIMIT = 1 << 16


def lower_onnx(ep, entry: dict, fold_weights: bool = True, stash=None) -> Lowered:
    """ExportedProgram + manifest entry point -> the graph, its inputs and outputs named as the entry point says.
    fold_weights=False keeps MatMul(x, Transpose(W)) over the module's own W (weights quantized next, one at a time:
    edgekv.export.wquant reads W^T in chunks), so lowering adds no copy of the weights. stash (with fold_weights=False:
    edgekv.export.lazy_weights) holds the exact narrow copies of the weights the module was traced over placeholders
    of: each such initializer is written from its copy when the graph is saved."""
    import torch

    names_in = [t["name"] for t in entry["inputs"]]
    names_out = [t["name"] for t in entry["outputs"]]
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its own progress lines
        prog = torch.onnx.export(ep, (), input_names=names_in, output_names=names_out, dynamo=True,
                                 external_data=False, optimize=fold_weights, verbose=False)
        if not fold_weights:
            from onnxscript.optimizer import optimize_ir
            optimize_ir(prog.model, should_fold=_small_inputs_only)
    # the exporter names each dynamic axis after its sympy symbol (s27): give it the manifest's name (tokens', rows')
    import onnx_ir as ir
    want = {t["name"]: t["shape"] for t in entry["inputs"] + entry["outputs"]}
    for v in list(prog.model.graph.inputs) + list(prog.model.graph.outputs):
        if v.shape is not None and v.name in want:
            dims = [w if isinstance(d, ir.SymbolicDim) and d.value and isinstance(w, str) else d
                    for d, w in zip(v.shape, want[v.name])] + list(v.shape)[len(want[v.name]):]
            v.shape = ir.Shape(dims)
    if stash is not None:
        from .lazy_weights import fill_initializers, unfilled
        fill_initializers(prog.model, stash)
        left = unfilled(prog.model, stash)
        if left:  # would be written as zeros: a lowering that copied or folded a stashed weight
            raise RuntimeError(f"ONNX initializers over an unfilled placeholder: {', '.join(left[:5])}")
    return Lowered(prog.model, entry)


def _small_inputs_only(node):
    """optimize_ir's should_fold: False (keep the node) where it reads an initializer larger than FOLD_LIMIT."""
    for v in node.inputs:
        if v is not None and v.is_initializer() and v.const_value is not None and v.const_value.size > FOLD_LIMIT:
            return False
    return None


def io_of(model) -> tuple[list[dict], list[dict]]:
    def spec(vi):
        dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        return {"name": vi.name, "dtype": ONNX_DTYPES.get(vi.type.tensor_type.elem_type, "?"), "shape": dims}
    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output]


def check_io(model, entry: dict) -> None:
    ins, outs = io_of(model)
    for kind, got, want in (("input", ins, entry["inputs"]), ("output", outs, entry["outputs"])):
        if got != want:
            bad = next((f"{g} != {w}" for g, w in zip(got, want) if g != w), f"{len(got)} vs {len(want)} tensors")
            raise EdgekvError(f"the ONNX graph's {kind}s differ from the manifest: {bad}")


def save_onnx(model, path) -> None:
    """model.onnx + EXTERNAL_DATA beside it (every initializer of 1 KiB or more, one file); an EXTERNAL_DATA already
    there is replaced, not appended to. A Lowered graph is written one tensor at a time (onnx_ir.save: never the
    whole protobuf with its weights in memory) and checked against its entry point; a ModelProto must be in memory
    whole (onnx.load loads external data)."""
    import onnx
    path = Path(path)
    if isinstance(model, Lowered):
        import onnx_ir as ir
        tmp = path.parent / f".{EXTERNAL_DATA}.tmp-{os.getpid()}"
        # written under a temporary name (ir.save refuses to overwrite a file its own tensors may read), then
        # renamed: the graph names EXTERNAL_DATA; large tensors at 64 KiB offsets, as ONNX Runtime maps them
        try:
            ir.save(model.model, str(path), external_data=tmp.name, size_threshold_bytes=1024, alignment=65536)
        except BaseException:
            tmp.unlink(missing_ok=True)  # nothing half-written is left
            raise
        proto = onnx.load(str(path), load_external_data=False)
        for t in proto.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    e.value = EXTERNAL_DATA
        os.replace(tmp, path.parent / EXTERNAL_DATA)
        check_io(proto, model.entry)
        onnx.save_model(proto, str(path))
        return
    (path.parent / EXTERNAL_DATA).unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=EXTERNAL_DATA, size_threshold=1024)


def opset(model) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def opset_of(path) -> int:
    """The default-domain opset of a saved model.onnx (its graph only)."""
    import onnx
    return opset(onnx.load(str(path), load_external_data=False))
