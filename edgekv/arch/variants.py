"""The Llama-family decoder variants, declared once: one class per config.json model_type, its differences from its
parent as class attributes, in the manner of optimum's exporters/onnx/model_configs.py (`class
Olmo2OnnxConfig(OlmoOnnxConfig)`: a variant is a few declared differences). Torch-free.

Read by the planner's reader (edgekv.arch.transformer: which weights a layer has, the tied-head default, which layers
slide), the export module (edgekv.models.llama: LlamaArgs built from the variant), the GGUF readers (edgekv.arch.gguf,
edgekv.models.weights) and the family registry (edgekv.models.FAMILIES). Adding a variant is a class here, a catalog
config and a test; nothing outside this module compares a model_type string of these (tests/test_registry_names.py).

Every default is the transformers config class's for that model_type (the value a config.json that leaves the field
out gets; tests/test_variants.py checks them against the config classes).
"""
from __future__ import annotations

# Where a decoder layer's norms sit, by layout: slot -> transformers' parameter name. The slots: attn_in normalises
# the attention's input, attn_out its output before the residual add, mlp_in the MLP's input, mlp_out its output.
#   pre       x += attn(attn_in(x)); x += mlp(mlp_in(x))                       (Llama and most decoders)
#   sandwich  x += attn_out(attn(attn_in(x))); x += mlp_out(mlp(mlp_in(x)))   (Gemma 2 / 3)
#   post      x += attn_out(attn(x)); x += mlp_out(mlp(x))                     (OLMo-2: no norm before a sublayer)
NORM_LAYOUTS = {
    "pre": {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"},
    "sandwich": {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                 "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"},
    "post": {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
}
# llama.cpp's per-block norm tensors (gguf-py/gguf/constants.py MODEL_TENSORS) -> the slot they fill
GGUF_NORM_SLOTS = {"attn_norm": "attn_in", "post_attention_norm": "attn_out", "ffn_norm": "mlp_in",
                   "post_ffw_norm": "mlp_out"}
# how a variant's layers slide when the config has no layer_types (edgekv.arch.transformer.layer_windows)
WINDOW_RULES = ("refuse", "every", "after_max_window_layers", "even", "pattern")


class Llama:
    """transformers' LlamaConfig / LlamaForCausalLM: the parent of every variant below."""
    model_type = "llama"
    norms = "pre"  # NORM_LAYOUTS key
    norm_offset = 0.0  # an RMSNorm scales by (norm_offset + w): Gemma's norms store w - 1
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (over each head's D) | "proj" (over the whole
    # projection, every head at once: OLMo-2) | None
    tied = False  # tie_word_embeddings' default
    qkv_bias: bool | None = None  # None: q/k/v/o biased as attention_bias says; True: q/k/v always, o never (Qwen2)
    rms_eps = 1e-6  # rms_norm_eps' default
    rope_theta = 10000.0  # rope_theta's default (a config class's default_theta)
    windows = "refuse"  # WINDOW_RULES: Llama attends to every token, a sliding_window without layer_types is refused
    window_default: int | None = None  # the window when sliding_window is absent ("even" / "pattern" rules)
    embed_scale = False  # embeddings multiplied by sqrt(hidden) (Gemma's scaled word embedding)
    act_field, act = "hidden_act", "silu"  # the MLP activation's config field and its default
    nope_layers = False  # no_rope_layers / no_rope_layer_interval name layers that attend without RoPE (SmolLM3)
    query_pre_attn_scalar: float | None = None  # default of the field that scales scores by its ^-1/2 (Gemma); None:
    # scores scaled by head_dim^-1/2, the field not read
    logit_softcap = False  # final_logit_softcapping is read (tanh(x / cap) * cap on the logits)
    local_rope_theta: float | None = None  # default RoPE base of the sliding layers (rope_local_base_freq), None: one
    # base for every layer
    refused: tuple[str, ...] = ()  # config fields the export module refuses when set (one line naming the field)
    text_model: str | None = None  # a wrapper config: the model_type of its text_config (planned and exported alone)
    wrapper_fields: tuple[str, ...] = ()  # a wrapper's fields its text model falls back to
    exported = True  # edgekv.models.llama builds it (the llama family's model_types)
    rewrite: str | None = None  # "module:function" that rewrites the checkpoint into Llama's shapes first
    mla_convertible = True  # edgekv.models.converted_mla reproduces its attention (no qk-norm, one RoPE base)
    genai_type = "llama"  # ONNX Runtime GenAI's model.type for it
    gemma_terms = False  # an export ships the Gemma Terms of Use notice (edgekv.export.licenses)
    gguf_arch: str | None = "llama"  # GGUF general.architecture; None: not read from a GGUF
    gguf_export = True  # edgekv.models.weights loads its GGUF weights (else: planned from a GGUF only)
    gguf_permuted = True  # convert_hf_to_gguf.py permuted q/k rows for llama.cpp's interleaved RoPE
    gguf_defaults: dict = {}  # config values a GGUF header does not carry, as llama.cpp's loader fixes them
    gguf_scale_by_head_dim = False  # llama.cpp scales the scores by head_dim^-1/2: query_pre_attn_scalar = head_dim
    pte_int4_layers = "int4"  # the decoder layers' linears in edgekv's int4 .pte: "int4" (8da4w) | "int8" (int8 per
    # output channel, the output layer still 8da4w: edgekv.export.wquant.PTE_INT4_LAYERS_INT8; which layers stay int8
    # where a model's layers were measured one by one: pte_int8_kept)

    @classmethod
    def biases(cls, attention_bias: bool) -> tuple[bool, bool]:
        """(q/k/v biased, o biased) for a config whose attention_bias is this."""
        return (True, False) if cls.qkv_bias else (attention_bias, attention_bias)

    @classmethod
    def norm_names(cls) -> dict[str, str]:
        """slot -> transformers' parameter name of each norm a layer has (NORM_LAYOUTS)."""
        return NORM_LAYOUTS[cls.norms]


class Mistral(Llama):
    model_type = genai_type = gguf_arch = "mistral"
    windows = "every"  # MistralConfig.sliding_window: every layer slides


class Qwen2(Llama):
    model_type = genai_type = gguf_arch = "qwen2"
    qkv_bias = True
    windows = "after_max_window_layers"  # use_sliding_window: layers from max_window_layers on slide
    gguf_permuted = False  # NEOX RoPE: stored as HF has it


class Qwen3(Qwen2):
    model_type = gguf_arch = "qwen3"
    genai_type = "llama"
    qkv_bias = None
    qk_norm = "head"
    mla_convertible = False
    gguf_export = False


class Phi3(Llama):
    model_type = gguf_arch = "phi3"
    rms_eps = 1e-5
    windows = "every"
    rewrite = "edgekv.models.phi3:to_llama"  # fused q/k/v and gate/up, partial rotary, longrope
    mla_convertible = False
    gguf_export = False
    gguf_permuted = False  # NEOX RoPE: stored as HF has it (transformers' GGUF reader un-permutes llama's only)


class SmolLM3(Llama):
    model_type = "smollm3"
    tied = True
    rope_theta = 2e6  # SmolLM3Config.default_theta
    nope_layers = True
    mla_convertible = False
    gguf_arch = None


class Gemma2(Llama):
    """Planned only: no export module (attention logit soft-capping)."""
    model_type = gguf_arch = "gemma2"
    norms = "sandwich"
    norm_offset = 1.0
    tied = True
    windows, window_default = "even", 4096  # Gemma2: even layers (0, 2, ...) slide, odd layers are global
    embed_scale = True
    act_field, act = "hidden_activation", "gelu_pytorch_tanh"
    query_pre_attn_scalar = 256.0
    logit_softcap = True
    gemma_terms = True
    exported = mla_convertible = gguf_export = False
    gguf_permuted = False


class Gemma3Text(Gemma2):
    """Gemma3TextConfig: 5 sliding layers per global one, qk-norm, two RoPE bases, no attention soft-capping."""
    model_type = "gemma3_text"
    qk_norm = "head"
    rope_theta = 1_000_000.0
    windows = "pattern"  # sliding_window_pattern (default 6): every 6th layer global
    local_rope_theta = 10_000.0
    refused = ("attn_logit_softcapping", "use_bidirectional_attention")
    exported = gguf_export = True
    gguf_arch = "gemma3"
    # llama.cpp's gemma3 loader (src/llama-model.cpp, LLM_ARCH_GEMMA3): 5 sliding layers per global one
    # (set_swa_pattern(6)), the sliding layers' RoPE base 10k (rope_freq_base_train_swa), scores scaled by
    # 1/sqrt(head_dim) (f_attention_scale, every size but 27B: query_pre_attn_scalar = head_dim, set by the reader);
    # Gemma 3 has no logit softcapping
    gguf_defaults = {"hidden_activation": "gelu_pytorch_tanh", "sliding_window_pattern": 6,
                     "rope_local_base_freq": 10000.0}
    gguf_scale_by_head_dim = True
    # XNNPACK's symmetric 4-bit blocks lose most of the KL on Gemma 3's asymmetric GGUF blocks (measured:
    # docs/export.md#weight-quantization)
    pte_int4_layers = "int8"


class Gemma3(Gemma3Text):
    """Gemma3Config, the image-text wrapper: its text_config is a gemma3_text model."""
    model_type = "gemma3"
    text_model = "gemma3_text"
    exported = gguf_export = False
    gguf_arch = None


class Olmo2(Llama):
    """Olmo2Config: norms after each sublayer only, qk-norm over the whole q / k projection."""
    model_type = "olmo2"
    norms = "post"
    qk_norm = "proj"
    rms_eps = 1e-5
    mla_convertible = False
    gguf_arch = None


VARIANTS: dict[str, type[Llama]] = {v.model_type: v for v in (Llama, Mistral, Qwen2, Qwen3, Gemma3Text, SmolLM3, Phi3,
                                                               Gemma2, Gemma3, Olmo2)}
# the model types edgekv.models.llama exports, in declaration order
EXPORTED = tuple(mt for mt, v in VARIANTS.items() if v.exported)
# GGUF general.architecture -> the variant it holds
GGUF_VARIANTS = {v.gguf_arch: v for v in VARIANTS.values() if v.gguf_arch}


def variant(model_type: str) -> type[Llama] | None:
    """The declared variant of a config.json model_type, or None."""
    return VARIANTS.get(model_type) if isinstance(model_type, str) else None


# Which decoder layers an int4 .pte keeps int8 where a model's layers were measured one by one
# (experiments/pte_layer_mix.py, benchmarks/results/pte_layer_mix_gemma3.json: eager KL against fp32 over 160 tokens of
# the quality text, each layer alone at 8da4w, then layers moved to 8da4w in the order of their own cost): keyed by the
# model's shape (layers, width, vocabulary), the layers kept int8, every other decoder layer 8da4w; only for a model
# whose variant keeps its layers int8 at all (pte_int4_layers "int8"). Gemma-3-270M: 12 of its 18 layers at 8da4w took
# the KL from 0.1448 (every layer int8) to 0.3156 (every layer 8da4w: 0.5933), a quarter less of the bytes a step
# reads; the six kept then were the six costliest alone (0.17-0.21 each against 0.145-0.166). Layers 10 and 4, the last
# two that mix moved to 8da4w, are back at int8 (issue 39: the .pte's KL at a filled 16k was above ONNX's; eager over
# 192 tokens, paired, -0.056 +- 0.008 nats, experiments/pte_kl_gap.py, benchmarks/results/pte_kl_gap_gemma3.json),
# their 4.9 MB paid by the output layer's groups of 64 (edgekv.export.wquant.pte_head_group, 5.2 MB fewer scales).
# A model not listed keeps every decoder layer int8. The export (edgekv.export.wquant.quantize_module) and the plan
# (plan.runtime_cost) both read it.
PTE_INT8_LAYERS_MEASURED = {(18, 640, 262144): (3, 4, 5, 10, 11, 12, 13, 17)}  # Gemma-3-270M


def pte_int8_kept(n_layers: int, hidden: int, vocab: int) -> tuple[int, ...] | None:
    """The decoder layers an int4 .pte keeps int8 for a model of this shape whose variant keeps its layers int8
    (PTE_INT8_LAYERS_MEASURED); None: every decoder layer."""
    return PTE_INT8_LAYERS_MEASURED.get((n_layers, hidden, vocab))


# A .pte's output layer is lowered as row blocks of at most this many stored bytes, each its own XNNPACK delegate
# (edgekv.export.wquant.split_head, edgekv.export.to_pte): ExecuTorch maps a delegate's weights while XNNPACK packs
# them and unmaps them after, so loading holds one block's unpacked bytes beside the packed weights, not the whole
# head's (Gemma-3-270M's int4 head, before and after: benchmarks/results/pte_load_steps_gemma3.json). The plan
# charges the same block (edgekv.memory.workspace._largest_packed).
PTE_HEAD_BLOCK_BYTES = 16 << 20
PTE_HEAD_BLOCK_ALIGN = 1024  # rows: a block of rows is a whole number of these


def pte_head_block_rows(rows: int, bytes_per_row: float) -> int:
    """The output rows of one block of a .pte's output layer (PTE_HEAD_BLOCK_BYTES); rows itself where the whole
    matrix fits in one block."""
    n = max(PTE_HEAD_BLOCK_ALIGN, int(PTE_HEAD_BLOCK_BYTES // bytes_per_row) // PTE_HEAD_BLOCK_ALIGN
            * PTE_HEAD_BLOCK_ALIGN)
    return rows if n >= rows else n


def head_outweighs_layers(head: int, linears, width: int, group: int) -> bool:
    """The int4 output-layer rule (ONNX's MatMulNBits head, edgekv.export.onnx_quant.output_heads; the .pte's,
    edgekv.export.wquant.pte_head_group; the plan's, edgekv.plan.large_head): the output matrix (`head` weights)
    holds more weights than the decoder layers' quantized linears together (`linears`: their weight counts) and its
    width is a multiple of the larger group, which it then takes."""
    return head > sum(linears) and width % group == 0
