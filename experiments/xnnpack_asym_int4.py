"""A minimal reproducer: torchao's asymmetric int4 linears (and scales in fp32), lowered to XNNPACK, against the same
eager module (torch + executorch + torchao only; no edgekv import), for an upstream issue (issue 38's .pte part).

One nn.Linear(256 -> 512), random weights, quantized in groups of 32 with each torchao config below, exported,
lowered with XnnpackPartitioner and run by ExecuTorch's Python runtime on the same input as eager torch. A correct
lowering differs from eager only by fp32 summation order (~1e-6 of the output scale); the script prints, per config,
max |pte - eager| over that scale, whether every linear was delegated, and the JSON it writes.

  sym-8da4w        Int8DynamicActivationIntxWeightConfig(int4, PerGroup(32), SYMMETRIC)     (ExecuTorch's own recipe)
  sym-8da4w-bf16   the same with weight_scale_dtype=torch.bfloat16
  asym-8da4w       the same with weight_mapping_type=ASYMMETRIC                             (a zero point per group)
  asym-8da4w-bf16  that with weight_scale_dtype=torch.bfloat16
  asym-w4          IntxWeightOnlyConfig(int4, PerGroup(32), ASYMMETRIC)                      (fp32 activations)
  sym-w4           IntxWeightOnlyConfig(int4, PerGroup(32), SYMMETRIC)

Run: python experiments/xnnpack_asym_int4.py [OUT.json]   (default benchmarks/results/xnnpack_asym_int4.json)
"""
import copy
import json
import sys
from importlib.metadata import version

import numpy as np
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.extension.pybindings import portable_lib
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
from torchao.quantization.granularity import PerGroup
from torchao.quantization.quant_primitives import MappingType

SYM, ASYM = MappingType.SYMMETRIC, MappingType.ASYMMETRIC
CONFIGS = {
    "sym-8da4w": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                       weight_mapping_type=SYM),
    "sym-8da4w-bf16": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                            weight_mapping_type=SYM, weight_scale_dtype=torch.bfloat16),
    "asym-8da4w": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                        weight_mapping_type=ASYM),
    "asym-8da4w-bf16": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                             weight_mapping_type=ASYM,
                                                             weight_scale_dtype=torch.bfloat16),
    "asym-w4": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=ASYM),
    "sym-w4": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=SYM),
}


def run(name, config, lin, x):
    q = copy.deepcopy(lin)
    quantize_(q, config)
    with torch.no_grad():
        want = q(x).numpy()
    edge = to_edge_transform_and_lower(torch.export.export(q, (x,), strict=False), partitioner=[XnnpackPartitioner()])
    left = sorted({str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"
                   and "delegate" not in str(n.target) and "getitem" not in str(n.target)})
    buf = edge.to_executorch().buffer  # kept alive while the program runs
    got = portable_lib._load_for_executorch_from_buffer(buf).forward((x,))[0].numpy()
    scale = float(np.abs(want).max())
    return {"config": name, "max_abs_diff": float(np.abs(got - want).max()), "output_scale": scale,
            "rel": float(np.abs(got - want).max() / scale), "ops_not_delegated": left}


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    lin = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False)).eval()
    x = torch.randn(1, 8, 256)
    rows = []
    for name, config in CONFIGS.items():
        try:
            r = run(name, config, lin, x)
        except Exception as e:  # a lowering that refuses is an answer too
            r = {"config": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/xnnpack_asym_int4.json"
    with open(out, "w") as f:
        json.dump({"question": "do torchao's int4 linears lowered to XNNPACK compute what the eager module does?",
                   "versions": {p: version(p) for p in ("torch", "executorch", "torchao")},
                   "shape": "Linear(256 -> 512), input [1, 8, 256] ~ N(0, 1), groups of 32", "rows": rows}, f,
                  indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
