"""One-token custom_sdpa with a KV head's G query heads as G rows of one head, against the per-head call it replaced
(issue 39; edgekv.models.swaps.SdpaAttention._custom_sdpa), in the .pte of a random model with Gemma-3-270M's
attention geometry at a filled context (benchmarks/pte_ring_in_place.py's model: 18 layers, every 6th global, 4 query
heads on 1 KV head of 256, a narrow rest, fp32 weights, kv:dtype=fp32, state in place). Per head, custom_sdpa runs one
attention per query head and each reads the whole cache: a decode step reads each global layer's 16k keys and values
G = 4 times over a one-row product. Variants:
  rows       the export as edgekv makes it (a torch.cond picks the rows call for one token)
  per-head   the same export with every call per head (the .pte before)
Each variant runs in a fresh process, the repeats going round the variants, as pte_ring_in_place.py runs them (its
child_run: the prompt fills ctx - new slots, then new - 1 decode steps, timed per CPU second); the variants' logits
must agree.

Usage: python benchmarks/pte_sdpa_rows.py [--ctx 16384] [--new 17] [--repeats 2] [--work out/pte_sdpa_rows]
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import pte_ring_in_place as ring  # noqa: E402

VARIANTS = ("rows", "per-head")


def child_export(src: str, out: str, variant: str, ctx: int) -> None:
    from edgekv.export.options import ExportOptions
    from edgekv.export.pipeline import export_model
    from edgekv.models import swaps

    if variant == "per-head":
        import torch

        def per_head(self, qg, kc, vc, start, c, pos, rows_ok=True):
            return torch.ops.llama.custom_sdpa(qg, kc, vc, start, None, 0.0, True, self.scale)

        swaps.SdpaAttention._custom_sdpa = per_head
    m = export_model(ExportOptions(model=src, strategy="kv:dtype=fp32", formats=("pte",), max_ctx=ctx, out=Path(out),
                                   verify_steps=0, force=True, threads=1), echo=lambda s: None)
    ops = m["artifacts"][0]["delegation"]["forward"]["portable_ops"]
    assert ("cond" in ops) == (variant == "rows"), ops


def main(argv=None) -> dict:
    return ring.side_by_side("pte_sdpa_rows", VARIANTS, __file__, __doc__.splitlines()[0], "pte_sdpa_rows",
                             "pte_sdpa_rows_gemma3_geometry.json", argv)

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--export":
        child_export(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
