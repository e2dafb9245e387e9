"""Stage 2b, lower to ExecuTorch: methods `prefill` (fixed chunk of tokens) and `decode` (one token) in one .pte,
XNNPACK-delegated (to_edge_transform_and_lower + XnnpackPartitioner, then to_executorch). Weights are stored once
and shared by both methods. Ops XNNPACK does not take (the cache torch.where, embedding, RoPE cos/sin) run on
ExecuTorch's portable kernels.
"""
from __future__ import annotations

from collections import Counter


def lower_pte(eps: dict):
    """{method: ExportedProgram} -> EdgeProgramManager (inspect it with delegation_summary)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    return to_edge_transform_and_lower(eps, partitioner=[XnnpackPartitioner()])


def delegation_summary(edge) -> dict:
    """Per method: XNNPACK delegate calls and the ops left to portable kernels (op name -> count)."""
    out = {}
    for method in edge.methods:
        ops = Counter()
        for n in edge.exported_program(method).graph_module.graph.nodes:
            if n.op == "call_function":
                name = getattr(n.target, "__name__", str(n.target))
                ops[name.removeprefix("aten.").removesuffix(".default")] += 1
        out[method] = {"delegate_calls": ops.pop("executorch_call_delegate", 0),
                     "portable_ops": dict(sorted((k, v) for k, v in ops.items() if k != "getitem"))}
    return out


def to_buffer(edge) -> bytes:
    return edge.to_executorch().buffer
