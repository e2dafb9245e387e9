"""custom_sdpa at one decode step of Gemma-3-270M's global layer (16384 slots, 4 query heads on one KV head, D 256):
per head (the op's GQA: each head reads the whole cache) against the 4 heads as 4 query rows of one head, not causal,
at start - 3 (edgekv.models.swaps.SdpaAttention._custom_sdpa), and torch's matmul-softmax-matmul; CPU ms per call and
max |diff| against an fp32 reference over slots 0..pos.

    OMP_NUM_THREADS=1 python experiments/sdpa_fold.py
"""
import math
import time

import torch

import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (registers llama::custom_sdpa)

torch.set_num_threads(1)
T, D, G, POS = 16384, 256, 4, 16350
SCALE = 1 / math.sqrt(D)
kc, vc = torch.randn(1, T, 1, D), torch.randn(1, T, 1, D)
q = torch.randn(1, 1, G, D)
k3, v3 = kc[0, :POS + 1, 0], vc[0, :POS + 1, 0]


def timed(f, n=20):
    f()
    t0 = time.process_time()
    for _ in range(n):
        f()
    return (time.process_time() - t0) / n * 1e3


def per_head():
    return torch.ops.llama.custom_sdpa(q, kc, vc, POS, None, 0.0, True, SCALE)


def as_rows():
    return torch.ops.llama.custom_sdpa(q.reshape(1, G, 1, D), kc, vc, POS - (G - 1), None, 0.0, False, SCALE)


def torch_mm():
    return torch.softmax(q[0, 0] @ k3.T * SCALE, -1) @ v3


ref = torch_mm()
for name, f in (("per head", per_head), ("as rows", as_rows), ("torch mm", torch_mm)):
    print(f"{name}: {timed(f):.2f} ms CPU, max |diff| {float((f().reshape(G, D) - ref).abs().max()):.1e}")
