"""Transient memory of a call (activations, scores, masks, dequantization scratch, extra state copies) and what the
runtime adds once the model is loaded (session, packed copies, kernel code), from the cost models in costs.py."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..arch import MLA, SSM, Arch, Attention
from ..models import fused_attention_type  # the family registry (torch-free)
from ..strategies import FloatStorage, KvStorage, StateLayout, Strategy
from .costs import (GQA, MEASURED, MLA_REBUILD_COPIES, SCAN_COPIES, UNPACK_EXTRA_COPIES, WHERE_WRITTEN_TYPES, _rt,
                    _traits, fused_gqa)
from .item import Item
from .weights import weight_bytes_one
from ..arch.variants import pte_head_block_rows


@dataclass(frozen=True)
class Term:
    """One named part of the workspace: its bytes and how they are computed, as `--explain` prints it."""
    name: str
    bytes: float
    formula: str
    fmt: str | None = ","  # how the bytes print after the formula; None: the formula says it all
    note: str = ""  # said after the bytes

    def __str__(self) -> str:
        return self.formula + ("" if self.fmt is None else f" = {self.bytes:{self.fmt}}") + self.note


def _larger(name: str, a: Term, b: Term, text: str) -> Term:
    """Two terms a memory plan keeps alive one at a time (it lays one over the other): the larger counts."""
    return Term(name, max(a.bytes, b.bytes), text, None)


@dataclass
class _Attention:
    """The largest per-layer sizes of one call over the model's mixers (fp32 bytes, or widths in elements)."""
    qkv: int = 0  # widest q + k + v (or MLA's q + latent) projection, elements per token
    ssm_w: int = 0  # widest SSM in-projection + conv, elements per token
    scores: float = 0  # one copy of the largest materialised [H, C, T] scores
    masks: float = 0  # one copy of the largest [C, T] mask
    probs: float = 0  # the fused (GroupQueryAttention) layers' probability buffers
    ring_scores: float = 0  # a fused .pte's native-window rings: eager scores [H, C, W + C] (RingSdpaAttention)
    scratch: float = 0  # the largest one layer's dequant/reconstruction scratch
    scratch_how: str = ""
    scan: float = 0  # selective-scan inputs
    rolling: bool = False  # a rolling (window) layer reads the old cache + the chunk, not the state it writes
    filled_cols: bool = False  # the scores are held over the filled positions only (scores_filled)
    fused_layers: frozenset = frozenset()


def workspace_bytes(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str, chunk: int,
                    precision: str = "fp32", methods: int = 1, filled: int | None = None,
                    int8_kernel: str = "executorch") -> Item:
    """Transient memory at the worst moment of a prefill chunk or a decode step (fp32 activations):
    chunk activations + attention scores (x the copies the runtime keeps alive, if it materialises them) + logits
    + dequant/reconstruction scratch for one layer + the extra state copies alive during a call; or, where larger, the
    runtime's load-time transient (XNNPACK packing a delegate; ORT packing a tied lm_head from the table's mapped
    pages where the loader keeps them, which edgekv's does not: parts["load_unpaged"] is that transient as an app
    that loads without edgekv's pager holds it). Each is a named Term, and the explanation is theirs. filled: the positions a run has filled when fewer than the state's slots (an
    export run at a shorter context than its max_ctx); a runtime whose scores buffer is written only over the filled
    columns (scores_filled: ONNX Runtime's GroupQueryAttention) then holds that much of it. None: every slot.
    int8_kernel: what reads a .pte's int8 cache (export --pte-kernel; _layer_scratch)."""
    rt = _traits(arch, layout, strategy, runtime)
    a = _attention(arch, layout, strategy, runtime, rt, chunk, filled, int8_kernel)
    copies = rt.get("score_copies", 1)
    n_state, scratch = rt.get("state_copies", 1), a.scratch
    if rt.get("packs_per_method"):  # every method has its own planned buffers: state in + state out, dequant scratch
        n_state, scratch = (1 if rt.get("in_place") else 1 + 2 * methods), scratch * methods
    fused_state = sum(t.nbytes for t in layout.tensors if t.layer in a.fused_layers) if runtime == "onnxruntime" else 0
    extra_state = (n_state - 1) * (layout.nbytes - fused_state) + fused_state
    # the exported step returns the logits of the rows the caller asks for (edgekv.models.head): one in generation
    # and prefill. A memory-planned runtime (ExecuTorch) holds a slot for the most rows a call can ask for: the chunk
    # of a .pte's fixed prefill method; its `forward` (one method, the state in place or explicit caches) gives one
    # row a call (edgekv.export.manifest.entry_point's one_row)
    rows = chunk if rt.get("logits_planned") and methods > 1 else 1
    logits = Term("logits", rows * arch.vocab * 4, f"logits {'chunk' if rows > 1 else '1 row'} x vocab x 4 B")
    terms = [Term("activations", chunk * (4 * arch.hidden + a.qkv + 3 * arch.mlp_width + a.ssm_w) * 4,
                  f"activations {chunk} tok x (4*hidden + qkv + 3*inter{' + ssm' if a.ssm_w else ''}) x 4 B", ",.0f")]
    cols = f"the {filled} filled of T" if a.filled_cols else "T"
    scores = (Term("scores", copies * a.scores, f"scores {copies} x H x chunk x {cols} x 4 B") if rt["scores"]
              else Term("scores", 0, "scores not materialised", None))
    if a.ring_scores and not rt["scores"]:
        n = _rt(runtime).get("score_copies", 1)
        scores = Term("scores", n * a.ring_scores, f"the sliding layers' rings: scores {n} x H x chunk x (W + chunk)"
                                                   " x 4 B")
    if a.probs:
        probs = Term("probs", a.probs, "the global layers' GroupQueryAttention: 1 x H x chunk x T x 4 B",
                     note=" (the larger of the two scores)")
        scores = _larger("scores", scores, probs, f"{scores} + {probs}")
    terms.append(scores)
    masks = a.masks * rt.get("mask_copies", 0)
    if masks:
        terms.append(Term("masks", masks, f"masks {rt['mask_copies']} x chunk x T x 4 B"))
    scratch_t = Term("scratch", scratch, a.scratch_how, ",.0f")
    if scratch and rt.get("logits_over_scratch"):  # a memory plan that lays the logits over the attention's scratch
        terms.append(_larger("logits", logits, scratch_t, f"max({logits}, {scratch_t}) (the plan lays the logits over "
                                                          "the attention's scratch)"))
    else:
        terms += [logits] + ([scratch_t] if scratch else [])
    if a.scan:
        terms.append(Term("scan", a.scan, f"selective-scan inputs {SCAN_COPIES} x chunk x d_inner x d_state x 4 B"))
    attend = sum(t.bytes for t in terms)
    # static caches: attention reads the state the call writes, so the written copies are alive with its scratch;
    # rolling layers: the written state is an output no node reads, and ORT's order runs the attention first, so the
    # call peaks at the larger of the two (edgekv/costs/workspace.json fields.rolling_attends_first: measured).
    if a.rolling:
        step = max(attend, extra_state + logits.bytes)
        more = (f"{n_state - 1} more copies of the explicit layers' state + 1 of the GroupQueryAttention layers'"
                if fused_state else f"{n_state - 1} more state copies")
        f = (f"max(attention: {' + '.join(map(str, terms))} = {attend:,.0f}, end of the call: {more}"
             f" {extra_state:,} + logits) = {step:,.0f} (rolling layers attend before they write)")
    else:
        if extra_state:
            terms.append(Term("state copies", extra_state, f"{n_state - 1} more state copies during a call"))
        step = sum(t.bytes for t in terms)
        f = " + ".join(map(str, terms)) + f" = {step:,.0f}"
    load, packing, unpaged, f = _load_transients(arch, layout, precision, rt, n_state, extra_state, step, f)
    total = max(step, load, packing)
    return Item(total, f + f" [{runtime}: {rt['why']}" + (f"; measured: {MEASURED[runtime]}" if runtime in MEASURED
                                                           else "") + "]",
                {"step": step, "load": load, "packing": packing, "load_unpaged": unpaged})


def _load_transients(arch: Arch, layout: StateLayout, precision: str, rt: dict, n_state: int, extra_state: float,
                     step: float, f: str) -> tuple[float, float, float, str]:
    """What loading holds for a moment, where larger than a call: (tied head, XNNPACK packing, the tied head as an
    app that loads without edgekv's pager holds it (net of the state, as the first), the explanation)."""
    # a plain load packs a tied head from the table's mapped pages, before the state is resident, and keeps the pages
    # until it ends; edgekv's loader pages the file out as the packing reads it (edgekv/costs/workspace.json
    # fields.paged_load: measured), so its load holds no table beside the packed head
    unpaged = _tied_bytes(arch, precision) - layout.nbytes if rt.get("load_transient_tied") else 0
    load = 0 if rt.get("paged_load") else unpaged
    # XNNPACK packs while the methods load: their planned buffers exist, the caller's state does not yet (a loaded
    # ExecuTorch method allocates the buffers of its in-place outputs, where the state then lives, on its first
    # call); the embedding's pages were given back before loading
    pack = _largest_packed(arch, precision) if rt.get("pack_transient") else 0
    packing = pack + extra_state - layout.nbytes if pack else 0
    total = max(step, load, packing)
    if load:
        f = (f"max(step: {f}, load: the tied table's pages read while packing the head, before the state is "
             f"resident {load:,.0f}) = {total:,.0f}")
    elif unpaged > step:
        f += (f" (load: edgekv's loader pages the weight file out while the runtime packs the tied head, so no table "
              f"beside it; an app loading without such a pager holds the table's pages for a moment, before the state "
              f"is resident: {unpaged:,.0f} instead)")
    if packing:
        f = (f"max(step: {f}, load: the largest delegated weight matrix unpacked while XNNPACK packs it {pack:,.0f}"
             + (f" + {n_state - 1} planned state copies" if extra_state else "")
             + f" - the state, not yet resident = {packing:,.0f}) = {total:,.0f}")
    return load, packing, unpaged, f


def _attention(arch: Arch, layout: StateLayout, strategy: Strategy, runtime: str, rt: dict, chunk: int,
               filled: int | None = None, int8_kernel: str = "executorch") -> _Attention:
    """The largest sizes one call's mixers reach (_Attention), layer by layer; filled: as workspace_bytes."""
    a = _Attention()
    a.filled_cols = bool(filled and rt.get("scores_filled") and filled < layout.ctx)
    kept, width = {}, {}
    for t in layout.tensors:
        if t.role in ("key", "latent"):
            kept[t.layer] = t.shape[2] if t.role == "key" else t.shape[1]
            width[t.layer] = t.shape[-1]
    # A model whose sliding layers keep the explicit graph (Gemma 3's .pte; on ONNX Runtime only under the window
    # strategy, since its native windows go to GroupQueryAttention's window cache): each layer with one slot per
    # position is the runtime's fused op all the same (edgekv.models.swaps: the swap is per layer), its state not
    # written in place (that takes every layer). ONNX Runtime, a float cache: a GroupQueryAttention node whose present
    # is a second copy beside the feed, its scratch one [H, C, T] probability buffer, no mask (GQA). ExecuTorch, a
    # fp32 cache (nothing to read back): custom_sdpa, which tiles its scores (ET_SDPA); the state copies stay the
    # runtime's.
    ort_mixed = runtime == "onnxruntime"
    et_mixed = runtime == "executorch" and _storage(strategy) == FloatStorage("fp32")
    mixed = ((ort_mixed or et_mixed) and fused_attention_type(arch.model_type) and strategy.fused_attention(runtime)
             and not fused_gqa(arch, layout, strategy, runtime))
    a.fused_layers = frozenset(i for i, t in kept.items() if mixed and t == layout.ctx)
    for i, b in enumerate(arch.blocks):
        for m in b.mixers:
            if isinstance(m, Attention):
                a.qkv = max(a.qkv, (m.n_heads + 2 * m.n_kv_heads) * m.head_dim)
                t = kept.get(i, 0)
                a.rolling |= 0 < t < layout.ctx and rt.get("rolling_attends_first", False)
                if i in a.fused_layers:
                    if ort_mixed:
                        a.probs = max(a.probs, GQA["score_copies"] * m.n_heads * chunk * t * 4)
                    continue
                if not rt["scores"] and runtime == "executorch" and 0 < t < layout.ctx:
                    # a .pte in place (fused_gqa): the native-window rings keep the eager arithmetic
                    a.ring_scores = max(a.ring_scores, m.n_heads * chunk * (t + chunk) * 4)
                if rt["scores"]:
                    seen = t if t == layout.ctx else t + chunk  # a static cache already holds the chunk
                    if a.filled_cols:  # the columns past the filled positions are never written (scores_filled)
                        seen = min(seen, filled)
                    a.scores = max(a.scores, m.n_heads * chunk * seen * 4)
                    a.masks = max(a.masks, chunk * seen * 4)
                layer, how = _layer_scratch(arch, m, t, width.get(i, 0), strategy, rt, chunk, int8_kernel)
                if layer > a.scratch:
                    a.scratch, a.scratch_how = layer, how
            elif isinstance(m, MLA):
                a.qkv = max(a.qkv, m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.kv_lora_rank)
                if rt["scores"]:
                    a.scores = max(a.scores, m.n_heads * chunk * (kept.get(i, 0) + chunk) * 4)
            elif isinstance(m, SSM):
                a.ssm_w = max(a.ssm_w, 2 * m.d_inner + m.conv_dim)
                a.scan = max(a.scan, SCAN_COPIES * chunk * m.d_inner * m.d_state * 4)
    return a


def _storage(strategy: Strategy) -> KvStorage:
    """The strategy's KV storage; one without a KV cache (a latent, a recurrent state) reads as a float cache of its
    dtype."""
    return strategy.kv_storage or FloatStorage(strategy.params.get("dtype", "fp32"))


def _layer_scratch(arch: Arch, m: Attention, t: int, width: int, strategy: Strategy, rt: dict, chunk: int,
                   int8_kernel: str = "executorch") -> tuple[float, str]:
    """fp32 scratch one attention layer of t slots needs beside its scores, and what it is (for --explain): asked of
    the cache's storage (quantized codes: dequantized; a float dtype other than fp32: cast). int8_kernel "edgekv"
    (export --pte-kernel edgekv): edgekv::int8_sdpa reads a fused .pte's int8 codes in place (storage pte_read
    "int8 codes"), edgekv::fp16_sdpa an fp16 cache and edgekv::packed_sdpa packed int4 / int2 codes, converting a
    block of keys at a time in its own small buffers (or in registers), so no rows are read back."""
    unit = m.n_kv_heads * t * m.head_dim * 4  # one layer's K (or V) for every slot, fp32
    st = _storage(strategy)
    if int8_kernel == "edgekv" and "readback_copies" in rt and st.edgekv_kernel_reads(m.head_dim):
        # the method plans no K-sized fp32 tensor (benchmarks/results/pte_load_steps_llama32_1b_random.json,
        # plan_accuracy_llama32_1b_random_pte.json); the export asks the storage the same (swaps._edgekv_reads)
        return 0, ""
    if strategy.converts_to_latent:  # converted: the fp32 latent + the keys rebuilt and rotated for every slot
        return (t * width * 4 + MLA_REBUILD_COPIES * unit,
                f"one layer's latent in fp32 + {MLA_REBUILD_COPIES} key-sized fp32 tensors while its keys are "
                "rebuilt and rotated for every slot")
    if rt["kv_dequant"] == "head":  # the fused op converts one head of a float cache; codes it reads in place
        if st.quantized or st.kv_read_key == "fp32":
            return 0, ""
        return 2 * (t + chunk) * m.head_dim * 4, f"one head's K,V in fp32 (cast from {st.kv_read_key})"
    if rt["kv_dequant"] != "layer" or not (st.quantized or st.kv_read_key != "fp32"):
        return 0, ""
    src = st.readback_source(m.head_dim)
    if "readback_copies" in rt:
        # a float cache the table does not list (bf16, fp8) is read back by the same cast as fp16's
        key = src if src in rt["readback_copies"] or st.quantized else "fp16"
        copies = rt["readback_copies"][key]
        how = (f"{'dequantized' if st.quantized else 'cast'} from {src}; {copies} K-sized fp32 tensors in each "
               "method's memory plan, shared by the layers" + ("" if key == src else " (as measured for fp16)"))
    elif st.quantized:
        sub = any(p.packed_bits for p in st.parts(m.head_dim))
        copies = 2 + (UNPACK_EXTRA_COPIES if sub else 0)
        how = "dequantized" + (f", + {UNPACK_EXTRA_COPIES} K-sized unpacking planes" if sub else "")
    elif arch.model_type in WHERE_WRITTEN_TYPES and rt.get("where_casts_fp16"):
        copies, how = 4, f"cast from {src}, past and present: ONNX Runtime's Where has no fp16 kernel"
    else:
        copies, how = 2, f"cast from {src}"
    return copies * unit, f"one layer's K,V in fp32 ({how})"


def _kernel_code(arch: Arch, strategy: Strategy, rt: dict) -> float:
    """Code pages of the extra kernels a fused .pte's quantized read-back runs (ET_SDPA kernel_code), else 0."""
    att = next((m for b in arch.blocks for m in b.mixers if isinstance(m, Attention)), None)
    return rt["kernel_code"].get(_storage(strategy).readback_source(att.head_dim), 0) if "kernel_code" in rt and att \
        else 0


@functools.lru_cache(maxsize=512)  # per (Arch, precision): the same for every row of a model
def _largest_packed(arch: Arch, precision: str) -> float:
    """Bytes of the largest matrix XNNPACK packs: a linear, the lm_head, or the embedding a tied lm_head reads; a
    quantized output layer is lowered in row blocks, each its own delegate (edgekv.export.wquant.split_head,
    PTE_HEAD_BLOCK_BYTES), so its largest block; an int4 one's rows as the export stores them (pte_head_row_bytes)."""
    sizes = [weight_bytes_one(w, precision) for w in arch.weights if w.cls == "linear"]
    head = sum(weight_bytes_one(w, precision) for w in arch.weights if w.cls == "lm_head") or \
        _tied_bytes(arch, precision)
    if head and precision in ("int8", "int4") and arch.vocab:
        per_row = pte_head_row_bytes(arch) if precision == "int4" else head / arch.vocab
        head = min(arch.vocab, pte_head_block_rows(arch.vocab, per_row)) * per_row
    return max(sizes + [head])


def pte_head_row_bytes(arch: Arch) -> float:
    """Bytes of one row of an int4 .pte's output layer as the export splits it into blocks (wquant.split_head: the
    4-bit codes + the quantized tensor's other stored tensors): per group, a 2-byte scale and torchao's int8 zero
    point (stored even for symmetric codes), in the output layer's group (edgekv-pte's output, or output_large_head
    where the head outweighs the layers: plan.large_head's rule). Checked against the exports' own blocks: the
    random Llama-3.2-1B 13312 rows (1216 B a row), Gemma-3-270M 47104 (350 B;
    benchmarks/results/pte_load_steps_{llama32_1b_random,gemma3}.json output_layer_blocks)."""
    from ..arch.variants import head_outweighs_layers
    from .costs import PLAN_RUNTIMES
    spec = PLAN_RUNTIMES["edgekv-pte"]["weights"]["value"]["int4"]
    big = spec["output_large_head"]
    out = big if head_outweighs_layers(arch.vocab * arch.hidden, [w.numel for w in arch.weights if w.cls == "linear"],
                                       arch.hidden, big["group"]) else spec["output"]
    return arch.hidden * out["bits"] / 8 + arch.hidden / out["group"] * (out["scale_bytes"] + 1)


@functools.lru_cache(maxsize=512)  # per (Arch, precision): the same for every row of a model
def _tied_bytes(arch: Arch, precision: str) -> float:
    """The embedding table's bytes when the lm_head is tied to it (no lm_head tensor), else 0."""
    if any(w.cls == "lm_head" for w in arch.weights):
        return 0
    return sum(weight_bytes_one(w, precision) for w in arch.weights if w.cls == "embedding")


def paged_table(arch: Arch, weights: dict, runtime: str) -> Item:
    """Stored weight bytes the runtime does not keep resident (subtracted from the weights' total in
    Deployment.bytes): on a runtime whose loader pages a .pte's constant segment out (table_paged: edgekv's stepper,
    edgekv/costs/workspace.json fields.table_paged), the embedding table where the output layer is its own
    (`weights` has an lm_head: an untied model, or a runtime scheme's own output layer) -- only the gather reads it,
    a row per token. The pages of the rows a run reads are not charged. 0 where the table is also the head."""
    table = weights.get("embedding", 0)
    if not _rt(runtime).get("table_paged") or not weights.get("lm_head") or not table:
        return Item(0, "")
    return Item(table, f"the embedding table {table:,.0f} B is not resident: the output layer is its own, so only the "
                       "gather reads the table, from the .pte's constant segment, whose pages edgekv's stepper gives "
                       "back after loading (release_file_pages); a run holds the pages of the rows it reads (not "
                       "charged); an app whose reads also map the neighbouring pages (fault-around) holds up to the "
                       f"whole table, {table:,.0f} B more [{runtime}: fields.table_paged]")


def runtime_load_bytes(arch: Arch, precision: str, runtime: str, methods: int = 1,
                       layout: StateLayout | None = None, strategy: Strategy | None = None) -> Item:
    """Resident bytes the runtime adds to the stored weights once the model is loaded and has run: its per-session
    cost and (XNNPACK) one more packed copy of the delegated weights for every
    method beyond the first (a .pte of a recurrent or blended state has two, prefill and decode; a plain kv cache's
    .pte has one, forward). With the layout and strategy given, a fused graph's traits apply (_traits): its own
    session (ONNX Runtime's GroupQueryAttention graph) and the code pages of the kernels a fused .pte's quantized
    read-back adds."""
    given = layout is not None and strategy is not None
    rt = _traits(arch, layout, strategy, runtime) if given else _rt(runtime)
    sess = rt.get("session_bytes", 0)
    own = sess != _rt(runtime).get("session_bytes", 0)  # the fused graph's own session (GQA)
    packs = 0.0
    if rt.get("packs_per_method") and methods > 1:
        delegated = sum(weight_bytes_one(w, precision) for w in arch.weights if w.cls in ("linear", "lm_head"))
        packs = (methods - 1) * (delegated + _tied_bytes(arch, precision))  # a tied lm_head is packed too
    code = _kernel_code(arch, strategy, rt) if given else 0
    total = sess + packs + code
    f = f"session {sess:,}" + (" (the fused graph's)" if own else "") \
        + (f" + {methods - 1} more XNNPACK-packed copy of linear + lm_head {packs:,.0f}" if packs else "") \
        + (f" + code of the quantized read-back's kernels {code:,.0f}" if code else "") \
        + f" = {total:,.0f} B [{runtime}" + (f"; measured: {MEASURED[runtime]}" if runtime in MEASURED else "") + "]"
    return Item(total, f)
