"""How an export holds its weights' memory low: the narrow route from the load on, verify-quant's fp32 reference
computed once, and the weights released as soon as nothing after reads them. The stages of edgekv.export.pipeline call
these; edgekv.export.lazy_weights has the mechanics (the stash of narrow copies, placeholders, materialized).

  pte_narrow / narrow_load   which exports load a bf16 / fp16 checkpoint narrow, and that load (the fp32 module over
                             placeholders, the stash of exact narrow copies)
  quantize_narrow            the quantize stage of a .pte-only int8 / int4 export loaded narrow: one linear at a time
  fp32_reference             verify-quant's fp32 logits over the quality text (short_state: with n slots, not max_ctx)
  release_quantized          the .pte's quantized eager module dropped after its verification (narrow route)
  release_weights            the eager module's weights dropped (but those a traced copy shares)

`x` is the export in progress (pipeline.Export).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from .options import QUALITY_TOKENS

if TYPE_CHECKING:
    from .pipeline import Export


def pte_narrow(x: Export) -> bool:
    """A .pte-only int8 / int4 export: its module is quantized one linear at a time from the narrow weights
    (quantize_narrow), so the fp32 module is never built (budget.narrow_export says the same before the export
    starts)."""
    return tuple(x.opts.formats) == ("pte",) and x.opts.weights in ("int8", "int4")


def narrow_load(spec: str, strategy, max_ctx: int):
    """load_any with a bf16 / fp16 checkpoint's large weights kept as stored and the module over placeholders for
    them (lazy_weights.narrow_loading) -> (Loaded, the Stash, or None where nothing was kept narrow). Where a loader
    made new tensors of the kept ones (a checkpoint rewritten into another layout) and so left a placeholder out of
    the module, it is loaded again the fp32 way: a module must never compute over a placeholder's zeros."""
    from ..models import load_any
    from .lazy_weights import narrow_loading
    with narrow_loading() as stash:
        loaded = load_any(spec, strategy, max_ctx)
    if not stash.by_ptr:  # nothing kept narrow (an fp32 checkpoint, a GGUF): the module is the fp32 one
        stash.release()
        return loaded, None
    owned = {p.untyped_storage().data_ptr() for p in loaded.module.parameters()}
    if set(stash.by_ptr) <= owned:
        return loaded, stash
    stash.release()
    del loaded
    return load_any(spec, strategy, max_ctx), None


def quantize_narrow(x: Export) -> None:
    """The .pte's module from a narrow load (pte_narrow): verify-quant's fp32 logits first (each layer widened only
    while it runs: fp32_reference), then a copy sharing the placeholders, each linear widened from its bf16 / fp16
    copy just before torchao quantizes it (quantize_module's value), what the quantizer left over a placeholder
    widened, and the narrow copies dropped. The fp32 module never exists whole; after this stage the .pte's module
    holds the quantized codes and nothing else of the weights (x.module is placeholders only)."""
    from .lazy_weights import fp32_value, over_placeholders, sharing_copy, widen_left
    from .wquant import quantize_module, trim
    with x.st.stage("quantize", f"{x.opts.weights} weights for the .pte (torchao, one linear at a time from the "
                    f"{x.stash.kept_bytes / 1e9:.2f} GB of narrow weights; the fp32 reference computed first)"):
        fp32_reference(x, release=False)
        q = sharing_copy(x.module, x.stash)
        x.quantization["pte"] = quantize_module(q, x.opts.weights, x.loaded.source_format, fp32_value(x.stash))
        widen_left(q, x.stash)
        left = over_placeholders(q, x.stash)
        assert not left, f"the .pte's module still reads placeholders: {left[:3]}"
        x.qmodule, x.narrow_pte = q, True
        x.stash.release()
        x.stash = None
        trim()


def fp32_reference(x: Export, release: bool = True) -> list[int]:
    """verify-quant's fp32 side, once for every format: the eager module's logits over the quality text
    (quality.teacher_forced). That is the module's last use but for tracing: with release its weights are freed after
    it, before a quantized artifact's runtime loads (an ONNX-only int8 / int4 export computes it before tracing and
    frees them as the graph no longer needs them: OnnxTarget). Returns the tokens."""
    from .lazy_weights import materialized
    from .quality import quality_tokens, teacher_forced
    from .runtime import EagerStepper
    from .tokenizer import bos_prefix
    from .wquant import trim
    tokens = quality_tokens(x.tokenizer, x.args.vocab, QUALITY_TOKENS, bos_prefix(x.tok_entry))
    if x.fp32_rows is None:
        # over placeholders (narrow_load) each layer is widened to fp32 only while it runs, once per call: the text is
        # then read in prefill calls only (2 at 128 tokens a call, not 1 and 127 one-token steps), which gives the
        # same logits up to fp32 rounding (a causal model's row i depends on tokens[:i + 1] only)
        whole = len(tokens) - 1 if x.stash is not None else None
        with short_state(x.module, x.layout.to_json(), len(tokens)) as state, materialized(x.module, x.stash):
            x.fp32_rows = teacher_forced(EagerStepper({**state, "artifacts": x.artifacts}, x.module), tokens, whole)
        trim()
        x.n_params = sum(p.numel() for p in x.module.parameters())
    if x.opts.weights == "int4-mix" and x.importance is None and x.tokenizer is not None:
        from . import wrecipe
        # over placeholders (narrow_load) the calibration runs on the widened values too: without them the layers'
        # inputs are those of the placeholders, and every channel's importance the same
        with materialized(x.module, x.stash):
            x.importance = wrecipe.eager_importance(
                x.module, lambda n: short_state(x.module, x.layout.to_json(), n),
                lambda state: EagerStepper({**state, "artifacts": x.artifacts}, x.module),
                list(bos_prefix(x.tok_entry)) + wrecipe.calibration_ids(lambda t: x.tokenizer.encode(t).ids,
                                                                        wrecipe.CALIBRATION_TOKENS))
        trim()
    if release:
        release_weights(x.module)
    return tokens


@contextmanager
def short_state(module, layout: dict, n: int):
    """The state verify-quant's fp32 side runs with (layout: StateLayout.to_json()): where every attention layer
    keeps one slot per position (edgekv.models.cache.FullCache) and every state tensor is [1, Hkv, ctx, D], the
    same layers with n slots for the n tokens of the quality text, and the state with n; else the export's own.
    The logits are the same: a slot past the text is masked out (an exact zero weight) at any ctx. What it saves
    is the ctx-sized state twice over (a step writes a new state beside the old) and attention over ctx slots,
    every step: at an 8k export of Llama-3.2-1B, 0.54 GB of the pass's peak and most of its time."""
    from ..models.cache import FullCache
    ctx = layout["ctx"]
    layers = [m for m in module.modules() if hasattr(m, "cache") and m.cache is not None]
    fits = (n < ctx and layers and all(type(m.cache) is FullCache and m.cache.slots == ctx for m in layers)
            and all(len(t["shape"]) == 4 and t["shape"][2] == ctx for t in layout["tensors"])
            and all(type(c) is FullCache for c in getattr(module, "caches", [None])))
    if not fits:
        yield {"max_ctx": ctx, "state": layout}
        return
    short = FullCache(n)
    tensors = [{**t, "shape": [*t["shape"][:2], n, t["shape"][3]], "bytes": t["bytes"] // ctx * n}
               for t in layout["tensors"]]
    saved = [m.cache for m in layers]
    try:
        for m in layers:
            m.cache = short
        yield {"max_ctx": n, "state": {**layout, "ctx": n, "tensors": tensors,
                                       "bytes": sum(t["bytes"] for t in tensors)}}
    finally:
        for m, c in zip(layers, saved):
            m.cache = c


def release_quantized(x: Export) -> None:
    """Drop the .pte's quantized eager module (x.qmodule and its swapped copy x.pte_module): nothing after verify-pte
    reads it on the narrow route (pte_narrow)."""
    import gc

    from .wquant import trim
    x.qmodule = x.pte_module = None
    gc.collect()
    trim()


def release_weights(module, keep=None) -> None:
    """Drop the eager module's weights (each parameter keeps its object and dtype, not its storage), but those whose
    storage `keep` (a module: the runtime's swapped copy being traced) shares; and collect."""
    import gc

    import torch
    kept = set() if keep is None else {t.untyped_storage().data_ptr()
                                       for t in (*keep.parameters(), *keep.buffers())}
    for p in module.parameters():
        if p.numel() and p.untyped_storage().data_ptr() not in kept:
            p.data = torch.empty(0, dtype=p.dtype)
    gc.collect()
    from .wquant import trim
    trim()
