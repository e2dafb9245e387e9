#!/usr/bin/env python
"""Where the quantize-onnx stage's memory goes: the steps of edgekv.export.onnx_quant.quantize_onnx (int4) one at a time on
an fp32 ONNX export, the process's RSS after each, with the eager model's fp32 weights held beside them as the export
holds its module (verify-quant needs it afterwards).

    python experiments/quantize_onnx_memory.py EXPORT_FOLDER --out benchmarks/results/export_cost_quantize_onnx_steps.json

EXPORT_FOLDER is an fp32 ONNX export (model.onnx + model.onnx.data). Its tied head is already fused (FusedMatMul, the
fp32 recipe), so there is nothing to untie here; the export's quantize-onnx unties it first, one more copy of the
embedding table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    steps = [("start (torch, onnx, onnxruntime imported)", 0)]
    import logging

    import numpy as np
    import onnx
    import torch  # noqa: F401 (imported as the export has it)
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    for name in ("", "onnxruntime.quantization.matmul_nbits_quantizer"):  # it logs every node at INFO
        logging.getLogger(name).setLevel(logging.ERROR)
    steps[0] = (steps[0][0], rss())
    data = (a.folder / "model.onnx.data").stat().st_size
    held = np.ones(data // 4, dtype=np.float32)  # the eager module's fp32 weights, alive through the stage
    steps.append(("+ fp32 weights held (the eager module)", rss()))
    model = onnx.load(str(a.folder / "model.onnx"))
    steps.append(("+ onnx.load (graph with its external data)", rss()))
    q = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=False, accuracy_level=4,
                             op_types_to_quantize=("MatMul", "Gather"), quant_axes=(("MatMul", 0), ("Gather", 1)))
    q.process()
    steps.append(("+ MatMulNBitsQuantizer.process() (int4 initializers built)", rss()))
    out = q.model.model
    del q, model
    gc.collect()
    steps.append(("after dropping the fp32 graph", rss()))
    r = {"folder": str(a.folder), "external_data_bytes": data,
         "external_data_gb": round(data / 1e9, 2),
         "steps": [{"step": s, "rss": b, "rss_gb": round(b / 1e9, 2),
                    "copies_of_fp32_weights_above_start": round((b - steps[0][1]) / data, 2)} for s, b in steps],
         "int4_initializer_bytes": sum(len(t.raw_data) for t in out.graph.initializer)}
    del held
    tmp = a.out.with_name(f".{a.out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(r, indent=2) + "\n")
    tmp.replace(a.out)
    for s in r["steps"]:
        print(f"{s['rss_gb']:6.2f} GB  {s['copies_of_fp32_weights_above_start']:5.2f}x  {s['step']}")


if __name__ == "__main__":
    main()
