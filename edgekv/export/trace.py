"""Stage 1, trace: the eager decode-step module -> torch.export ExportedPrograms, one per entry point.

An entry point is a name and a token count per call: an int for a fixed shape (the .pte `prefill` chunk and the
one-token `decode` of a recurrent or blended state), or None for a dynamic axis 1..max_tokens (the single ONNX graph,
max_tokens = max_ctx, and the single `forward` method of a .pte whose state is written in place, max_tokens = its
prefill chunk: ExecuTorch plans its memory for the largest call).
"""
from __future__ import annotations

import torch

from .manifest import ROWS


def example_inputs(module, n_tokens: int, lazy_state: bool = False) -> tuple:
    """tokens, pos and the state at zero; lazy_state: the state uninitialised (torch.empty), its pages never
    touched, so never resident: the exporter reads its shapes and dtypes, not its values, and an ExportedProgram
    keeps its example inputs for as long as it lives (an 8k state of Llama-3.2-1B: 0.27 GB through lowering)."""
    if lazy_state:
        with torch.device("meta"):  # the shapes and dtypes of the module's own state, no memory
            shapes = module.empty_state()
        state = [torch.empty(t.shape, dtype=t.dtype) for t in shapes]
    else:
        state = module.empty_state()
    return (torch.zeros(1, n_tokens, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), *state)


def example_rows(n_tokens: int, one: bool = False) -> torch.Tensor:
    """The `rows` input (edgekv.models.head; the modules' keyword is the manifest's input name, ROWS) of a traced
    call: every row (2 for a dynamic axis: torch.export specialises a size of 1), or one: the last."""
    return torch.tensor([n_tokens - 1]) if one else torch.arange(n_tokens, dtype=torch.int64)


def trace(module, entry_points: dict[str, int | None], max_tokens: int | None = None, lazy_state: bool = False,
          one_row: bool = False) -> dict[str, torch.export.ExportedProgram]:
    """{name: tokens per call, or None for 1..max_tokens (default max_ctx)} -> {name: ExportedProgram} with inputs
    (tokens, pos, *state, rows). The state inputs are always static. A dynamic axis needs max_tokens >= 2
    (torch.export specialises a range of one). one_row: `rows` is [1] in every entry point (one row of logits a
    call: edgekv.export.manifest.entry_point's one_row)."""
    most = max_tokens or module.layout.ctx
    out = {}
    for name, n in entry_points.items():
        if n is None and most < 2:
            raise ValueError(f"a dynamic token axis needs at least 2 tokens per call, not {most}")
        args = example_inputs(module, n or 2, lazy_state)
        rows = example_rows(n or 2, one_row)
        # Dim.DYNAMIC, not a named Dim: the matmul/view stride guards (s*Min(D, k*s) == D*s) hold for every
        # s >= 1 but the symbolic solver cannot prove them for a strict named Dim. `rows` is its own axis, 1..C (a
        # one-token call's is [1]).
        seq = None if n else {1: torch.export.Dim.DYNAMIC(min=1, max=most)}
        shapes = {"tokens": seq, "pos": None, "state": tuple(None for _ in args[2:]),
                  ROWS: None if n == 1 or one_row else {0: torch.export.Dim.DYNAMIC(min=1, max=n or most)}}
        out[name] = torch.export.export(module, args, {ROWS: rows}, dynamic_shapes=shapes, strict=False)
    return out
