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
from pathlib import Path

from ..errors import EdgekvError

EXTERNAL_DATA = "model.onnx.data"  # the weights of a model.onnx saved with external data, beside it
ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 3: "int8", 2: "uint8"}


def lower_onnx(ep, entry: dict):
    """ExportedProgram + manifest entry point -> onnx.ModelProto with the entry point's input/output names."""
    import torch

    names_in = [t["name"] for t in entry["inputs"]]
    names_out = [t["name"] for t in entry["outputs"]]
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its own progress lines
        prog = torch.onnx.export(ep, (), input_names=names_in, output_names=names_out, dynamo=True,
                                 external_data=False, optimize=True, verbose=False)
    model = prog.model_proto
    # the exporter names each dynamic axis after its sympy symbol (s27): give it the manifest's name (tokens', rows')
    want = {t["name"]: t["shape"] for t in entry["inputs"] + entry["outputs"]}
    for vi in list(model.graph.input) + list(model.graph.output):
        for d, w in zip(vi.type.tensor_type.shape.dim, want.get(vi.name, [])):
            if d.dim_param and isinstance(w, str):
                d.dim_param = w
    check_io(model, entry)
    return model


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
    """model.onnx + EXTERNAL_DATA beside it (every initializer of 1 KiB or more, one file). The model must be in
    memory whole (onnx.load loads external data): an EXTERNAL_DATA already there is replaced, not appended to."""
    import onnx
    (Path(path).parent / EXTERNAL_DATA).unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=EXTERNAL_DATA, size_threshold=1024)


def opset(model) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
