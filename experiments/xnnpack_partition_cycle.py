"""A minimal reproducer of XNNPACK's partitioner failing with "Invalid partition, found dependency cycles" (torch +
executorch only; no edgekv import), for an upstream issue (docs/upstream_xnnpack_partition_cycle.md).

One attention layer as edgekv's .pte traced Gemma 3's global layers under an int8 cache: q/k/v projections, an RMSNorm
on k, RoPE's rotate_half as a matmul by a constant, the new K/V rows quantized per token (abs, amax, div, round,
clamp: XNNPACK takes abs/div/clamp/mul, not amax/round), the codes and fp16 scales written into the caches with a
functional index_put at the call's positions (a dynamic token count, a start position read from a tensor), and the
written rows read back (a slice, quantized_decomposed::dequantize_per_token) for ExecuTorch's llama::custom_sdpa.

Run: python experiments/xnnpack_partition_cycle.py [GRAPH.pt2] [--guarded]; it prints the exception, or "lowered".
--guarded lowers with the workaround edgekv uses (edgekv/export/to_pte.py _partitioner: the ops between a new row and
its index_put, and between an index_put and the attention, kept off XNNPACK), copied here so that the script stays
standalone. The one layer built here lowers with the default partitioner too: the cycle needs more of the model. A
GRAPH.pt2 written by `python experiments/xnnpack_partition_cycle.py --save-edgekv-gemma3 GRAPH.pt2` (that step needs
edgekv; loading it needs torch + executorch only) is the graph that fails (docs/upstream_xnnpack_partition_cycle.md).
"""
import sys

import torch
import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (torch.ops.llama.custom_sdpa)
import executorch.kernels.quantized  # noqa: F401 (dequantize_per_token's out variant)
from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower

H, HKV, D, HID, T = 4, 2, 16, 64, 32


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(HID, H * D, bias=False)
        self.k = torch.nn.Linear(HID, HKV * D, bias=False)
        self.v = torch.nn.Linear(HID, HKV * D, bias=False)
        self.o = torch.nn.Linear(H * D, HID, bias=False)
        self.k_norm = torch.nn.Parameter(torch.randn(D))
        rot = torch.zeros(D, D)
        rot[torch.arange(D // 2, D), torch.arange(D // 2)] = -1.0
        rot[torch.arange(D // 2), torch.arange(D // 2, D)] = 1.0
        self.register_buffer("rot", rot)

    def forward(self, x, pos, k_codes, k_scales, v_codes, v_scales):
        c = x.shape[1]
        start = pos[0].item()
        torch._check(start >= 0)
        torch._check(start + c <= T)
        positions = torch.arange(c) + pos
        q = self.q(x).view(c, H, D)
        k = self.k(x).view(c, HKV, D)
        v = self.v(x).view(c, HKV, D)
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.k_norm)
        k = k + (k.reshape(-1, D) @ self.rot).reshape(c, HKV, D)  # RoPE's rotate_half (cos = sin = 1 here)
        q = q + (q.reshape(-1, D) @ self.rot).reshape(c, H, D)

        def write(codes, scales, rows):  # rows [C, Hkv, D] -> int8 codes [1, Hkv, T, D], fp16 scales [1, Hkv, T, 1]
            s = (rows.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8).to(torch.float16)
            q8 = torch.round(rows / s.float()).clamp(-127, 127).to(torch.int8)
            codes = torch.ops.aten.index_put(codes, [None, None, positions], q8.permute(1, 0, 2)[None])
            scales = torch.ops.aten.index_put(scales, [None, None, positions], s.permute(1, 0, 2)[None])
            n = start + c
            zero = torch.zeros(1, HKV, n, 1, dtype=torch.int64)
            read = torch.ops.quantized_decomposed.dequantize_per_token(
                codes[:, :, :n], scales[:, :, :n].float(), zero, -128, 127, torch.int8, torch.float32)
            read = read.view(HKV, n, 1, D)
            return codes, scales, read

        k_codes, k_scales, kc = write(k_codes, k_scales, k)
        v_codes, v_scales, vc = write(v_codes, v_scales, v)
        qg = q.view(c, HKV, H // HKV, D).permute(1, 0, 2, 3)
        out = torch.ops.llama.custom_sdpa(qg, kc, vc, start, None, 0.0, True, D ** -0.5)
        return self.o(out.permute(1, 0, 2, 3).reshape(1, c, H * D)), k_codes, k_scales, v_codes, v_scales


def guarded():
    """XnnpackPartitioner whose configs refuse a node on a state write or read path (edgekv's workaround)."""
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS

    def is_put(n):
        return n.op == "call_function" and "index_put" in str(n.target)

    def reads(node, depth=10):
        return any(isinstance(a, torch.fx.Node) and a.op == "call_function"
                   and (is_put(a) or (depth > 1 and reads(a, depth - 1))) for a in node.args)

    def feeds(node, depth=12):
        return any(is_put(u) or (depth > 1 and u.op == "call_function" and feeds(u, depth - 1)) for u in node.users)

    def wrap(cfg):
        class Guarded(cfg):
            def check_constraints(self, node, ep):
                return not (reads(node) or feeds(node)) and super().check_constraints(node, ep)
        return Guarded

    return XnnpackPartitioner(configs=[wrap(c) for c in ALL_PARTITIONER_CONFIGS])


def save_edgekv_gemma3(path: str) -> None:
    """Writes the ExportedProgram that reproduces the cycle for certain: edgekv's trace of a tiny random Gemma 3
    (tests/test_families.py's config: 4 layers, layer 2 global, sliding window 8) under kv-int8, its global layer
    swapped for custom_sdpa. Needs edgekv (run from the repository root); the .pt2 then needs torch + executorch only."""
    import tempfile
    from pathlib import Path

    sys.path.insert(0, "tests")
    from test_families import tiny_hf

    from edgekv.export.trace import trace
    from edgekv.models import load_any
    from edgekv.models.swaps import for_runtime
    from edgekv.strategies import parse_strategy

    with tempfile.TemporaryDirectory() as tmp:
        tiny_hf("gemma3", Path(tmp))
        module, _ = for_runtime(load_any(tmp, parse_strategy("kv-int8"), 64).module.eval(), "executorch")
        torch.export.save(trace(module, {"forward": None}, max_tokens=8)["forward"], path)


def main() -> int:
    pt2 = next((a for a in sys.argv[1:] if a.endswith(".pt2")), None)
    if "--save-edgekv-gemma3" in sys.argv:
        save_edgekv_gemma3(pt2)
        print(f"wrote {pt2}")
        return 0
    if pt2:
        ep = torch.export.load(pt2)
    else:
        torch.manual_seed(0)
        c = 2
        args = (torch.randn(1, c, HID), torch.tensor([0]), torch.zeros(1, HKV, T, D, dtype=torch.int8),
                torch.zeros(1, HKV, T, 1, dtype=torch.float16), torch.zeros(1, HKV, T, D, dtype=torch.int8),
                torch.zeros(1, HKV, T, 1, dtype=torch.float16))
        dyn = {"x": {1: torch.export.Dim.DYNAMIC(min=1, max=8)}, "pos": None, "k_codes": None, "k_scales": None,
               "v_codes": None, "v_scales": None}
        ep = torch.export.export(Layer().eval(), args, dynamic_shapes=dyn, strict=False)
    part = guarded() if "--guarded" in sys.argv else XnnpackPartitioner()
    try:
        to_edge_transform_and_lower(ep, partitioner=[part])
    except AssertionError as e:
        print(f"{type(e).__name__}: {e}")
        return 1
    print("lowered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
