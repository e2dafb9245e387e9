"""Weight quantization through each runtime's own tooling, and the check that the result is still the model.

    --weights fp32 | fp16 | int8 | int4 | gguf

gguf (.onnx from a .gguf only): the file's own blocks carried into MatMulNBits / GatherBlockQuantized, no second
quantization (edgekv.export.gguf_blocks; edgekv.export.onnx_quant.quantize_onnx hands it over).

.pte  (before torch.export, on the eager module): torchao `quantize_` on every nn.Linear, the output matrix included
      int8 = Int8DynamicActivationIntxWeightConfig(int8, PerAxis(0))    dynamic int8 activations, int8 weights per
                                                                         output channel
      int4 = Int8DynamicActivationIntxWeightConfig(int4, PerGroup(32))   "8da4w": ExecuTorch's own llama recipe
             (Gemma 3: the output layer 8da4w, the decoder layers int8 per channel, PTE_INT4_LAYERS_INT8, but for
             the layers PTE_INT8_LAYERS_MEASURED moves to 8da4w)
      fp16 = refused (see PTE_FP16)
      XnnpackPartitioner takes each quantized linear as a dynamically quantized (qd8) GEMM.
.onnx (after export, on the fp32 model.onnx): ONNX Runtime's quantization tools
      int8 = MatMulNBitsQuantizer(bits 8, block 32, symmetric, accuracy_level 4) -> MatMulNBits (int8 blocks)
      int4 = MatMulNBitsQuantizer(bits 4, block 32, asymmetric, accuracy_level 4) -> MatMulNBits (int4 blocks,
             a uint4 zero point per block)
             fp32 scales; accuracy_level 4 = activations quantized to int8 per block at run time, as ONNX Runtime
             GenAI does on CPU. Not quantize_dynamic: its per-tensor uint8 activations (and 7-bit weights) fail
             verify-quant on SmolLM2; accuracy_level 0 (fp32 activations) decodes int8 much slower than fp32
             (docs/export.md#weight-quantization).
      fp16 = onnxruntime.transformers.float16 with keep_io_types: weights and arithmetic fp16, the graph's inputs and
             outputs stay exactly what the manifest lists

The tied output matrix: our modules compute logits as F.linear(x, embed_tokens.weight), which is no nn.Linear and, in
ONNX, a MatMul on Transpose(embedding). Both paths untie it first (a separate copy of the matrix), so the output
projection (V x d, read in full every step) is quantized like every other linear. The ONNX embedding table is int4
blocks where the weights are (GatherBlockQuantized); the .pte's gathers the quantized head's own codes
(gather_head_codes: ExecuTorch's embedding_byte / embedding_4bit, as its own llama export's --embedding-quantize).

A quantized artifact is never trusted: edgekv.export.quality (verify-quant) holds it to fp32 over real text.
"""
from __future__ import annotations



from ..errors import EdgekvError

WEIGHTS = ("fp32", "fp16", "int8", "int4", "int4-mix", "gguf")
# gguf: the file's own mix (its record's bytes); int4-mix: 4 or 8 bits per tensor (edgekv.export.wrecipe), a tied
# table the head's 8-bit codes
BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int4-mix": 4}
ORT_ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations quantized per block (ORT GenAI's CPU setting)
# int4 blocks carry a zero point (uint4) beside the scale: the GGUFs edgekv reads store asymmetric blocks (Q4_1, Q4_K:
# scale and minimum), which a symmetric grid fits worse; on Gemma-3-270M's Q4_K_M weights symmetric int4 failed
# verify-quant and asymmetric passes (the measurements: docs/export.md#weight-quantization).
ORT_SYMMETRIC = {"int8": True, "int4": False, "int4-mix": False}
# The output head (V x d, read in full every step) in int4 blocks of 64 when it holds more weights than every other
# quantized matrix together (Gemma-3-270M: 262,144 x 640 against 18 layers of 640-wide blocks): MatMulNBits'
# per-block work, not only the bytes, sets its time, and there blocks of 64 cut a large part of the step for a small
# KL cost; where the head is the smaller part (SmolLM2-135M) they save little and cost more (docs/export.md)
HEAD_GROUP = {"int8": 32, "int4": 64, "int4-mix": 32}  # int4-mix: its head is 8-bit (edgekv.export.wrecipe)
GROUP = 32  # int4 block / group size (the runtimes' kernels and ExecuTorch's 8da4w recipe use 32..256)
# int4 for the .pte on Gemma 3: the output layer 8da4w, the decoder layers' linears int8 per output channel (8da8w).
# XNNPACK's 4-bit kernels hold symmetric blocks only (no zero points), and Gemma's Q4_K_M weights (scale and minimum
# per block) requantized to that grid lose most of the KL, and weight-only int4 loses as much, so it is the grid, not
# the int8 activations; int8 decoder layers recover most of it. The head stays int4: it is most of the bytes read
# per step. The measurements: docs/export.md#weight-quantization.
PTE_INT4_LAYERS_INT8 = ("the decoder layers' linears int8 per channel, the output layer 8da4w: XNNPACK's 4-bit "
                        "blocks are symmetric, and Gemma 3's asymmetric GGUF blocks requantized to them lose most "
                        "of the KL (docs/export.md#weight-quantization)")
# Which decoder layers stay int8: edgekv.arch.variants.PTE_INT8_LAYERS_MEASURED (the plan charges the same rule)
# A .pte from a GGUF: ExecuTorch's quantized linears hold symmetric blocks with no float minimum (XNNPACK's asymmetric
# int4 is not usable: experiments/xnnpack_asym_int4.py), so the file's blocks are dequantized and quantized a second
# time; the export says so beside verify-quant's KL against the file's own weights (issue 38)
PTE_REQUANTIZED = ("the {source} file's blocks dequantized and quantized again by torchao (ExecuTorch's quantized "
                   "linears cannot carry them: symmetric blocks only, no float minimum); --format onnx --weights "
                   "gguf carries them as they are")
PTE_FP16 = ("fp16 weights are not supported for the pte format: XNNPACK's fp16 kernels need ARMv8.2 fp16 "
            "arithmetic, which this export cannot run and verify on x86; use --weights int8 or int4 (or fp32)")

GGUF_ONLY = ("--weights gguf carries a GGUF file's own weight blocks: the model must be a .gguf file "
             "(an HF folder has none; use fp32, fp16, int8 or int4)")
MIX_ONNX = ("--weights int4-mix is edgekv's own recipe for the onnx format (MatMulNBits 4 and 8-bit blocks): "
            "use --format onnx, or int4 for the .pte")
MIX_SUBGRAPH = ("--weights int4-mix quantizes the graph one weight at a time and this model's graph holds subgraphs "
                "(a Scan or Loop body); use --weights int4")
GGUF_PTE = ("--weights gguf is for the onnx format only: ExecuTorch's quantized linears hold integer zero points "
            "only, which cannot carry Q4_1 / Q4_K blocks exactly; use --format onnx, or int8 / int4 for the .pte")


def parse_weights(text: str) -> str:
    w = str(text).strip().lower()
    if w not in WEIGHTS:
        raise EdgekvError(f"--weights {text!r}: choose one of {', '.join(WEIGHTS)}")
    return w


# ---- .pte: torchao on the eager module, before torch.export ----


def untie_head(module, value=None) -> bool:
    """Give a tied-embedding module its own nn.Linear output layer holding a copy of the embedding matrix [V, d], so
    quantize_ sees it. Our modules read `self.lm_head.weight` when lm_head is set, else the embedding's weight:
    the logits are unchanged. Returns whether it untied. value: quantize_module's (the table's fp32 values where the
    module holds a placeholder for them), made the head's own weight without a second fp32 copy."""
    import torch
    from torch import nn

    if not hasattr(module, "lm_head") or module.lm_head is not None:
        return False
    vocab = module.args.vocab
    emb = next(m for m in module.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == vocab)
    wide = value(emb.weight) if value is not None else emb.weight
    if wide is not emb.weight:  # already a new fp32 tensor: it becomes the head's weight as it is
        head = nn.Linear(emb.embedding_dim, vocab, bias=False, device="meta")
        head.weight = nn.Parameter(wide.detach(), requires_grad=False)
    else:
        head = nn.Linear(emb.embedding_dim, vocab, bias=False)
        with torch.no_grad():
            head.weight.copy_(emb.weight)
    module.lm_head = head
    return True


def quantize_rows(linear, config, rows: int | None = None) -> None:
    """quantize_(linear, config) done on blocks of `rows` output rows (views of the weight, each a temporary
    nn.Linear), the blocks' codes, scales and zero points then joined into one weight tensor of the same class and
    attributes. The same weight as one call gives: every recipe here quantizes each row's groups on their own (block
    size (1, group), PerGroup or PerAxis(0); tests/test_wquant_rows.py)."""
    import torch
    from torch import nn
    from torchao.quantization import quantize_

    from ..models.head import EAGER_QUANTIZED_ROWS
    rows = rows or EAGER_QUANTIZED_ROWS
    w = linear.weight
    n = w.shape[0]
    if n <= rows:
        quantize_(nn.Sequential(linear), config)
        return
    parts = []
    for start in range(0, n, rows):
        part = nn.Linear(w.shape[1], min(rows, n - start), bias=False, device="meta")
        part.weight = nn.Parameter(w.detach()[start:start + rows], requires_grad=False)
        quantize_(nn.Sequential(part), config)
        parts.append(part.weight.detach())
    q = parts[0]
    names, _ = q.__tensor_flatten__()
    data = {k: torch.cat([getattr(p, k) for p in parts]) for k in names}
    del parts, part
    joined = type(q)(**data, **{k: getattr(q, k) for k in q.tensor_attribute_names})
    linear.weight = nn.Parameter(joined, requires_grad=False)


def pte_head_group(module, weights: str) -> int:
    """The group size of an int4 .pte's output layer: HEAD_GROUP (64) where the output matrix holds more weights than
    every other quantized linear together, the rule ONNX's MatMulNBits head follows (onnx_quant.output_heads), else
    GROUP. Gemma-3-270M (262,144 x 640 against 18 layers of 640-wide linears): groups of 64 halve the head's bf16
    scales, 5.2 MB of the packed weights a step reads (and, the table being gathered from the head's codes, the
    table's scales too), for no KL cost that 192 positions could tell (+0.0024 +- 0.0098 nats, eager,
    benchmarks/results/pte_kl_gap_gemma3.json "head g64"); the bytes pay for two more int8 decoder layers
    (edgekv.arch.variants.PTE_INT8_LAYERS_MEASURED). SmolLM2-135M's head is the smaller part: groups of 32."""
    from torch import nn

    from ..arch.variants import head_outweighs_layers

    if weights != "int4" or HEAD_GROUP.get(weights, GROUP) == GROUP:
        return GROUP
    head = getattr(module, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return GROUP
    rest = [m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear) and m is not head
            and m.in_features % GROUP == 0]
    big = head_outweighs_layers(head.weight.numel(), rest, head.in_features, HEAD_GROUP[weights])
    return HEAD_GROUP[weights] if big else GROUP


def torchao_config(weights: str, group: int = GROUP):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup
    import torch

    if weights == "int8":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    if weights == "int4":
        # symmetric codes -8..7 with the scale that clips neither end (max(-min / 8, max / 7)), not torchao's default
        # max|w| / 7.5, which clips a group's positive extreme to 7 steps (lower KL against fp32 with the same
        # kernels: docs/export.md#weight-quantization); int8 per channel gains nothing from it
        # weight_scale_dtype bf16: XNNPACK stores a blockwise (per-group) weight's scales as bfloat16
        # (executorch/backends/xnnpack/operators/node_visitor.py, get_quant_params: per_channel_group), so fp32
        # scales in the eager module leave the .pte up to 2^-9 off per group, a different model from the one
        # verify-quant measured; bf16 scales here (torchao requantizes the codes with them) make the two the same
        # model (tests/test_wquant.py: the .pte against eager torch)
        from torchao.quantization.quant_primitives import MappingType
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group),
                                                     weight_mapping_type=MappingType.SYMMETRIC_NO_CLIPPING_ERR,
                                                     weight_scale_dtype=torch.bfloat16)
    raise EdgekvError(PTE_FP16 if weights == "fp16" else f"no torchao recipe for weights {weights!r}")


def int8_layers(module, weights: str) -> bool:
    """Whether an int4 .pte keeps this model's decoder-layer linears at int8 (PTE_INT4_LAYERS_INT8)."""
    from ..arch.variants import variant

    declared = variant(getattr(getattr(module, "args", None), "model_type", "") or "")
    return weights == "int4" and declared is not None and declared.pte_int4_layers == "int8"


def _kept_int8(module, name: str) -> bool:
    """Whether decoder-layer linear `name` (model.layers.<i>. ...) stays int8 (PTE_INT8_LAYERS_MEASURED)."""
    import re

    from ..arch.variants import pte_int8_kept

    a = getattr(module, "args", None)
    kept = pte_int8_kept(getattr(a, "n_layers", 0), getattr(a, "hidden", 0), getattr(a, "vocab", 0))
    i = re.search(r"layers\.(\d+)\.", name)
    return kept is None or i is None or int(i[1]) in kept


def quantize_module(module, weights: str, source_format: str = "", value=None) -> dict:
    """Quantize the eager module in place for the .pte path (call it on a copy: the fp32 module stays the reference).
    Every nn.Linear whose input width is a multiple of GROUP, the untied output layer included; int4 on a model
    PTE_INT4_LAYERS_INT8 names: the output layer 8da4w, the decoder layers' linears int8 per channel. Returns what
    was done, for the manifest; source_format (the loaded model's, e.g. "gguf Q4_K_M"): a GGUF's is recorded as
    quantized a second time (PTE_REQUANTIZED). value: (tensor, last) -> its fp32 values (the tensor itself where it
    holds them), for a module whose large weights are placeholders (edgekv.export.lazy_weights.fp32_value; last: no
    later read needs it): each linear's weight is widened just before torchao quantizes it (its filter is asked right
    before the replacement), so one linear's fp32 exists at a time, never the module's."""
    import contextlib
    import io
    import logging
    import re

    from torch import nn

    if weights == "fp32":
        return {"dtype": "float32"}
    # torchao lists its optional CUDA kernels on first import (stderr), and registering its KernelPreference enum
    # makes torch's pytree log a deprecation warning (torch.utils._pytree, a logger whose handler kept the original
    # stderr): neither concerns the user
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from torchao.quantization import quantize_
        config = torchao_config(weights)
        untied = untie_head(module, value)
        linears = {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear)}
        take = {n for n, m in linears.items() if m.in_features % GROUP == 0}
        wide = {n for n in take if n != "lm_head" and _kept_int8(module, n)} if int8_layers(module, weights) else set()

        def hit(names):
            def filter_fn(m, fqn):
                if fqn not in names:
                    return False
                _widen(m, value)
                return True
            return filter_fn
        if wide:
            quantize_(module, torchao_config("int8"), filter_fn=hit(wide))
        quantize_(module, config, filter_fn=hit(take - wide - {"lm_head"}))
        head_group = pte_head_group(module, weights) if "lm_head" in take else GROUP
        if "lm_head" in take:  # the largest matrix (a tied table copied by untie_head): in blocks of rows
            _widen(module.lm_head, value)
            quantize_rows(module.lm_head, torchao_config(weights, head_group))
    finally:
        pytree_log.setLevel(level)
    embedding = gather_head_codes(module, weights, untied, value)
    blocks = split_head(module, weights)
    layers = sorted({int(i) for n in wide for i in re.findall(r"layers\.(\d+)\.", n)})
    more = {"layers_int8": {"linears": len(wide), "layers": layers, "scheme": "Int8DynamicActivationIntxWeightConfig"
                            + _describe_config(torchao_config("int8")), "why": PTE_INT4_LAYERS_INT8}} if wide else {}
    if head_group != GROUP:
        more["output_layer_group"] = head_group
    if blocks:
        more["output_layer_blocks"] = blocks
    if str(source_format).lower().startswith("gguf"):
        more["requantized"] = PTE_REQUANTIZED.format(source=source_format)
    return {"dtype": weights, "tool": f"torchao {_version('torchao')} quantize_",
            "scheme": type(config).__name__ + _describe_config(config), **more,
            "linears_quantized": len(take), "linears_kept_fp32": sorted(set(linears) - take),
            "output_layer": "untied copy, quantized" if untied else "own linear, quantized",
            "embedding": embedding or "float32"}


# An int4 table's scales are the output layer's (gather_head_codes), bf16 values (torchao_config: XNNPACK's blockwise
# scales), which fp16 holds exactly where they are at least 2^-14 (fp16's 11-bit significand, 5-bit exponent; a group
# of zero codes, whose scale is float32's tiny, gathers zeros with a scale of 0);
# ExecuTorch's embedding_4bit reads fp16 scales into its fp32 output (checked in a .pte: the same rows to the bit,
# tests/test_wquant.py). Half the scales' bytes: 10.5 MB of Gemma-3-270M's table at groups of 32. A table whose
# scales are not all exact keeps fp32 ones.
FP16_TABLE_SCALES = True


def quantized_embedding(codes, scales, bits: int):
    """An embedding table as ExecuTorch's LLM export stores one (export_llama --embedding-quantize,
    examples/models/llama/source_transformation/quantize.py QuantizedGroupEmbedding): int8 codes [V, d] with one
    fp32 scale per row read by quantized_decomposed::embedding_byte, or int4 codes two to a byte (the even column
    in the high nibble, each code + 8) with one fp32 scale per group of d / G columns read by
    quantized_decomposed::embedding_4bit (fp16 where they are exactly fp16: FP16_TABLE_SCALES); symmetric, no zero
    points. codes: int8 [V, d] in -2^(bits-1)..;
    scales [V, G] (G = 1 for int8). The gathered row is code * scale, in fp32.

    Traced (torch.export) it is the ExecuTorch op, which its quantized kernel library runs in the .pte; eager it
    gathers the rows first and multiplies only those: the same products (one fp32 multiply per value either way),
    without the op's eager reference, which dequantizes the whole table on every call (671 MB of fp32 for
    Gemma-3-270M's 262144 x 640)."""
    import torch
    from torch import nn

    from executorch.exir.passes import _quant_patterns_and_replacements  # noqa: F401 (registers the ops)

    class QuantizedEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.bits, self.num_embeddings, self.embedding_dim = bits, codes.shape[0], codes.shape[1]
            self.group = codes.shape[1] // scales.shape[1]
            c = codes.to(torch.int8)
            if bits == 4:
                u = (c.to(torch.int16) + 8).to(torch.uint8)
                c = u[:, 0::2] * 16 + u[:, 1::2]
            self.register_buffer("codes", c.contiguous())
            s = scales.to(torch.float32)
            if bits == 4:  # a group of zero codes gathers zeros whatever its scale (torchao gives it float32's tiny)
                zero = (codes.reshape(s.shape[0], s.shape[1], -1) == 0).all(-1)
                s = torch.where(zero, torch.zeros_like(s), s)
            if bits == 4 and FP16_TABLE_SCALES and torch.equal(s.to(torch.float16).to(torch.float32), s):
                s = s.to(torch.float16)  # FP16_TABLE_SCALES: the head's bf16 scales, exact in fp16
            self.register_buffer("scales", (s.reshape(-1) if bits == 8 else s).contiguous())

        def forward(self, tokens):
            ops = torch.ops.quantized_decomposed
            if torch.compiler.is_exporting():
                if self.bits == 8:
                    return ops.embedding_byte.dtype(self.codes, self.scales, None, -128, 127, tokens,
                                                    dtype=torch.float32)
                return ops.embedding_4bit.dtype(self.codes, self.scales, None, -8, 7, tokens, dtype=torch.float32)
            rows = self.codes[tokens]
            if self.bits == 4:
                rows = torch.stack(((rows >> 4).to(torch.int8) - 8, (rows & 15).to(torch.int8) - 8),
                                   dim=-1).flatten(-2)
            s = self.scales[tokens].to(torch.float32)
            s = s.unsqueeze(-1) if self.bits == 8 else s.repeat_interleave(self.group, dim=-1)
            return rows.to(torch.float32) * s

    return QuantizedEmbedding()


def _widen(linear, value, last: bool = True) -> None:
    """The linear's weight as its fp32 values (value: quantize_module's), a new Parameter of this module only (the
    placeholder it replaces may be shared with the fp32 module). last: the quantizer's is the weight's last read."""
    if value is None:
        return
    import torch
    w = value(linear.weight, last)
    if w is not linear.weight:
        linear.weight = torch.nn.Parameter(w.detach(), requires_grad=False)


def gather_head_codes(module, weights: str, untied: bool, value=None) -> str | None:
    """After quantize_: the module's input embedding table -> quantized_embedding, with the output layer's own codes
    and scales where untie_head copied the table into it (a tied model: the gather reads the same quantized matrix
    the head multiplies, as the tied fp32 model reads one matrix), else the table quantized on its own with the
    output layer's recipe. Returns the manifest's description, or None where the table stays fp32 (fp32 weights, no
    quantized output layer of the table's shape).

    Why: the fp32 table was most of an int4 .pte's file (Gemma-3-270M: 671 MB of 867 MB) and of the memory its load
    maps; ExecuTorch's own LLM export quantizes it with --embedding-quantize (4,32 in its Llama recipes). The
    table's bytes fall to a quarter (int8) or an eighth (int4) plus the scales, and a step still gathers one row."""
    import torch
    from torch import nn

    if weights not in ("int8", "int4"):
        return None
    vocab = getattr(getattr(module, "args", None), "vocab", None)
    found = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Embedding) and m.num_embeddings == vocab]
    head = getattr(module, "lm_head", None)
    if len(found) != 1 or not isinstance(head, nn.Linear) or tuple(head.weight.shape) != tuple(found[0][1].weight.shape):
        return None
    name, emb = found[0]
    w = head.weight
    if not untied:  # the head is the model's own matrix: the table gets the same recipe on its own
        lin = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False, device="meta")
        lin.weight = emb.weight
        _widen(lin, value, last=False)  # a table left unquantized (below) stays a placeholder: widen_left
        from torchao.quantization import quantize_
        quantize_(nn.Sequential(lin), torchao_config(weights))
        w = lin.weight
    if not hasattr(w, "qdata") or (getattr(w, "zero_point", None) is not None and bool(w.zero_point.any())):
        return None  # the output layer was not quantized (its width is no multiple of GROUP), or not symmetric
    bits = BITS[weights]
    table = quantized_embedding(w.qdata.detach(), w.scale.detach().reshape(w.shape[0], -1), bits)
    parent, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, table)
    kind = "fp16" if table.scales.dtype == torch.float16 else "fp32"
    groups = "one fp32 scale per row" if bits == 8 else f"groups of {table.group}, {kind} scales"
    op = "embedding_byte" if bits == 8 else "embedding_4bit"
    whose = "the output layer's own codes (tied)" if untied else "quantized like the output layer"
    return f"int{bits} {groups}, {whose}; quantized_decomposed::{op} (ExecuTorch's quantized kernels)"


def split_head(module, weights: str) -> list[int] | None:
    """After gather_head_codes: a quantized output layer larger than PTE_HEAD_BLOCK_BYTES (edgekv.arch.variants)
    becomes HeadBlocks (edgekv.models.head), row blocks of the same codes, scales and zero points (each block its own
    copy: a view would carry the whole matrix's storage into the program), which edgekv.export.to_pte lowers each as
    its own XNNPACK delegate, so loading the .pte holds one block's unpacked bytes while XNNPACK packs it, not the
    whole head's. The same logits. Returns the blocks' rows, or None where the head stays one matrix."""
    from torch import nn

    from ..arch.variants import pte_head_block_rows
    from ..models.head import HeadBlocks

    head = getattr(module, "lm_head", None)
    w = getattr(head, "weight", None)
    if not isinstance(head, nn.Linear) or not hasattr(w, "qdata"):
        return None
    names, _ = w.__tensor_flatten__()
    rows = w.shape[0]
    stored = sum(getattr(w, k).numel() * getattr(w, k).element_size() for k in names if k != "qdata")
    per_row = (w.qdata.numel() * BITS[weights] / 8 + stored) / rows
    n = pte_head_block_rows(rows, per_row)
    if n >= rows:
        return None
    attrs = {k: getattr(w, k) for k in w.tensor_attribute_names}
    blocks = []
    for start in range(0, rows, n):
        data = {k: getattr(w, k)[start:start + n].clone() for k in names}
        b = nn.Linear(head.in_features, data["qdata"].shape[0], bias=False, device="meta")
        b.weight = nn.Parameter(type(w)(**data, **attrs), requires_grad=False)
        blocks.append(b)
    module.lm_head = HeadBlocks(blocks)
    return [b.out_features for b in blocks]


def _describe_config(config) -> str:
    keys = ("weight_dtype", "weight_granularity", "weight_mapping_type", "granularity")
    parts = [f"{k}={getattr(config, k)}" for k in keys if hasattr(config, k)]
    return "(" + ", ".join(parts).replace("torch.", "") + ")"


def _version(pkg: str) -> str:
    from importlib.metadata import version
    return version(pkg)


def trim() -> None:
    """Give the C heap's free pages back to the kernel (glibc malloc_trim). An eager step at a long context frees
    cache-sized tensors that glibc's adaptive mmap threshold then serves from its heap; without a trim the freed
    space stays resident and the process grows step after step. A no-op where there is no glibc."""
    import ctypes
    import ctypes.util
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 (absent outside glibc)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None
