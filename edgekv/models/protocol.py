"""The interface every export module keeps (edgekv.models.FAMILIES builds one per family), written down.

Export (edgekv.export.trace), verification (EagerStepper), analyze and profile call nothing else on a module. A new
family's module is any torch module with these members; edgekv.models.base.DecoderShell provides empty_state and
the output head.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..strategies import StateLayout


class FamilyArgs(Protocol):
    """What every family's args dataclass carries (LlamaArgs, MambaArgs, DeepseekArgs, RwkvArgs, JambaArgs, ...)."""
    vocab: int
    hidden: int
    n_layers: int

    def to_json(self) -> dict: ...


@runtime_checkable
class ExportModule(Protocol):
    """A decode step with explicit state.

    layout   the StateLayout (edgekv.strategies.build_layout) whose tensors are the state, in its order: per tensor a
             program input (past_*) and output (present_*) with its shape and dtype.
    args     the family's args dataclass (FamilyArgs).

    forward(tokens, pos, *state, rows=None) -> (logits, *new_state)
      tokens  [1, C] int64, C >= 1 tokens of one sequence (chunked prefill: C > 1; decode: C = 1)
      pos     [1] int64, the position of tokens[0, 0] (recurrent families accept and ignore it); pos + C <= ctx
      state   one tensor per layout tensor, in layout order, with its shape and dtype
      rows    [R] int64 indices into the call's C tokens whose logits to return (None: all C)
      logits  [1, R, V] float32;  new_state: the layout's tensors after the call, same shapes and dtypes
    empty_state() -> the state before any token (all zeros), as tensors of the layout's shapes and dtypes."""

    layout: StateLayout
    args: FamilyArgs

    def empty_state(self) -> list[torch.Tensor]: ...

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]: ...

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                 rows: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]: ...
