"""The model_types of the families other than the Llama-family decoders (those are edgekv.arch.variants), declared
once: one class per config.json model_type, its differences from its sibling as class attributes, read by the
planner's readers (edgekv.arch) and the export modules (edgekv.models). Torch-free. Nothing outside this module and
edgekv.arch.variants compares a model_type string (tests/test_registry_names.py); a reader that serves two model
types asks the declaration for what differs.

Every default is the transformers config class's for that model_type (the value a config.json that leaves the field
out gets).
"""
from __future__ import annotations


class ModelType:
    model_type = ""
    reader = ""  # the edgekv.arch reader function that reads it (edgekv.arch.readers.READERS)
    text_model: str | None = None  # a wrapper config: the model_type of its text_config (planned and exported alone)
    wrapper_fields: tuple[str, ...] = ()  # a wrapper's fields its text model falls back to
    gguf_arch: str | None = None  # GGUF general.architecture; None: not read from a GGUF
    fork_names = False  # a fork wrote the same model_type with its own field names (translated first)


class Mamba(ModelType):
    """MambaConfig: Mamba-1 mixers (a time-step rank, no heads)."""
    model_type, reader = "mamba", "_mamba"
    ssm_layer = "Mamba1"  # mamba_ssm's ssm_cfg.layer for it (the original state-spaces config.json)
    state_size = 16  # MambaConfig.state_size
    gguf_arch = "mamba"
    heads = False  # Mamba-2's multi-head SSD mixer (num_heads, head_dim, n_groups)


class Mamba2(Mamba):
    """Mamba2Config: the multi-head SSD mixer."""
    model_type = "mamba2"
    ssm_layer = "Mamba2"
    state_size = 128
    heads = True
    gguf_arch = "mamba2"


class DeepseekV2(ModelType):
    model_type, reader = "deepseek_v2", "_deepseek"
    score_bias = False  # the router adds e_score_correction_bias before top-k (DeepSeek-V3's noaux_tc routing)


class DeepseekV3(DeepseekV2):
    model_type = "deepseek_v3"
    score_bias = True


class Jamba(ModelType):
    model_type, reader = "jamba", "_jamba"


class FalconH1(ModelType):
    model_type, reader = "falcon_h1", "_falcon_h1"


class Zamba2(ModelType):
    model_type, reader = "zamba2", "_zamba2"
    fork_names = True  # Zyphra's fork (Zamba2-1.2B before transformers 4.48): edgekv.arch.hybrid.from_zamba2_fork


class Rwkv(ModelType):
    model_type, reader = "rwkv", "_rwkv"


class Lfm2(ModelType):
    model_type, reader = "lfm2", "_lfm2"


class GraniteMoeHybrid(ModelType):
    model_type, reader = "granitemoehybrid", "_granite_hybrid"


class Qwen3_5Text(ModelType):
    model_type, reader = "qwen3_5_text", "_qwen3_5"


class Qwen3_5(Qwen3_5Text):
    """Qwen3_5Config, the image-text wrapper (Qwen3_5ForConditionalGeneration): its text_config is the model."""
    model_type = "qwen3_5"
    text_model = "qwen3_5_text"
    wrapper_fields = ("tie_word_embeddings",)


MODEL_TYPES: dict[str, type[ModelType]] = {t.model_type: t for t in (
    Mamba, Mamba2, DeepseekV2, DeepseekV3, Jamba, FalconH1, Zamba2, Rwkv, Lfm2, GraniteMoeHybrid, Qwen3_5Text,
    Qwen3_5)}
# mamba_ssm's ssm_cfg.layer -> the model_type it is in transformers
SSM_LAYERS = {t.ssm_layer: t for t in MODEL_TYPES.values() if issubclass(t, Mamba)}
# GGUF general.architecture -> the declaration it holds
GGUF_TYPES = {t.gguf_arch: t for t in MODEL_TYPES.values() if t.gguf_arch}


def model_type(name) -> type[ModelType] | None:
    """The declaration of a config.json model_type, or None."""
    return MODEL_TYPES.get(name) if isinstance(name, str) else None
