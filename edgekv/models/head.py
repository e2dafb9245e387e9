"""The output head every decode-step module shares: the last norm and the output matrix, over only the rows of a
call whose logits the caller wants.

An exported entry point takes `rows` (int64 [R], 1 <= R <= tokens: indices into the call's tokens) after its state
and returns logits [1, R, V]. Generation and chunked prefill ask for the last row only, so a 32-token prefill call
computes one row of the vocabulary projection instead of 32 (for a small model the head is a large share of a
token's multiply-adds) and holds one row of logits; verification asks for every row (ExecuTorch's own Llama export
does the same with generate_full_logits=False, without the choice)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


# output rows a weight-quantized head is handled in at a time, the one block size for both places that would otherwise
# hold fp32 temporaries of the whole head: an eager call here (torchao's eager linear dequantizes the whole matrix to
# fp32, and an int32 step besides, on every call: the .pte's verify-pte reference of a 1B's 128256-row head) and
# torchao's quantizer (edgekv.export.wquant.quantize_rows). A block of rows gives the same logits (each output column is its own row's
# dot product, tests/test_head_blocks.py). A traced head (torch.export: the .pte) is one linear a block (HeadBlocks).
EAGER_QUANTIZED_ROWS = 16384


class HeadBlocks(torch.nn.Module):
    """An output layer as row blocks, each its own nn.Linear (edgekv.export.wquant.split_head: a .pte's quantized
    head, each block its own XNNPACK delegate, edgekv.export.to_pte). The logits are the blocks' outputs side by
    side: the same numbers as the whole matrix's (each output column is its own row's dot product)."""

    def __init__(self, blocks: list[torch.nn.Linear]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    @property
    def out_features(self) -> int:
        return sum(b.out_features for b in self.blocks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():  # each block's nodes traced inside this module (edgekv.export.to_pte)
            return torch.cat([b(h) for b in self.blocks], dim=-1)
        return torch.cat([_linear(h, b.weight) for b in self.blocks], dim=-1)


def _linear(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n = EAGER_QUANTIZED_ROWS
    if type(w) not in (torch.Tensor, torch.nn.Parameter) and w.shape[0] > n and not torch.compiler.is_exporting():
        return torch.cat([F.linear(h, w[s:s + n]) for s in range(0, w.shape[0], n)], dim=-1)
    return F.linear(h, w)


def head(x: torch.Tensor, norm, w, rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, C, d] -> logits [1, R, V] of the chosen rows (rows None: all C). w: the output matrix, or HeadBlocks."""
    if rows is not None:
        x = x.index_select(1, rows)
    h = norm(x)
    if isinstance(w, HeadBlocks):
        return w(h)
    return _linear(h, w)


def output_weight(embed_tokens, lm_head):
    """The output matrix [V, d]: the embedding table when the model ties them (lm_head None), else lm_head's (a
    HeadBlocks itself)."""
    if isinstance(lm_head, HeadBlocks):
        return lm_head
    return embed_tokens.weight if lm_head is None else lm_head.weight

