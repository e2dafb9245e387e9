"""Stage 1, trace: the eager decode-step module -> torch.export ExportedPrograms, one per entry point.

An entry point is a name and a token count per call: an int for a fixed shape (the .pte `prefill` chunk and the
one-token `decode`), or None for a dynamic axis 1..max_ctx (the single ONNX graph serves prefill and decode).
"""
from __future__ import annotations

import torch


def example_inputs(module, n_tokens: int) -> tuple:
    return (torch.zeros(1, n_tokens, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), *module.empty_state())


def trace(module, entry_points: dict[str, int | None]) -> dict[str, torch.export.ExportedProgram]:
    """{name: tokens per call or None} -> {name: ExportedProgram}. The state inputs are always static."""
    max_ctx = module.layout.ctx
    out = {}
    for name, n in entry_points.items():
        args = example_inputs(module, n or min(2, max_ctx))
        shapes = None
        if n is None:
            # Dim.DYNAMIC, not a named Dim: the matmul/view stride guards (s*Min(D, k*s) == D*s) hold for every
            # s >= 1 but the symbolic solver cannot prove them for a strict named Dim.
            seq = torch.export.Dim.DYNAMIC(min=1, max=max_ctx)
            shapes = ({1: seq}, None, tuple(None for _ in args[2:]))
        out[name] = torch.export.export(module, args, dynamic_shapes=shapes, strict=False)
    return out
