"""Arch: what a model is made of, read from a Hugging Face config.json, a GGUF header or the built-in catalog.

An Arch is a list of blocks, each with its sequence mixers (attention, MLA, SSM, linear recurrence; a Falcon-H1 block
has two) and the full list of weight tensors with their shapes, derived from the config the way transformers builds
the model. Parameter counts and weight bytes come from those shapes, never from a model's name.

Every reader follows transformers' config class for its model_type (field names, defaults, legacy aliases). A field the
architecture needs that is missing and has no documented default is an error, never a guess.

Modules: types (Attention, MLA, SSM, Linear, Weight, Block, Arch), weights (the weight-list builders), config (Cfg,
LIMITS, trained_ctx_of), variants (the Llama-family variants, one declared class per model_type), one reader module per family (transformer, deepseek, mamba, hybrid, rwkv), readers (the
READERS registry, arch_from_config, read_config_json), gguf (read_gguf), catalog (catalog_*, load_arch).
"""
from .catalog import CATALOG_DIR, catalog_arch, catalog_entry, catalog_names, load_arch
from .config import LIMITS, STRETCHING_ROPE, TRAINED_ROPE, Cfg, trained_ctx_of
from .gguf import GGUF_ARCH, read_gguf
from .readers import LLAMA_EXPORT_TYPES, READERS, SUPPORTED, arch_from_config, read_config_json
from .transformer import layer_windows
from .types import MLA, SSM, UP_PROJ_NAMES, Arch, Attention, Block, Linear, Mixer, ShortConv, Weight
from .variants import VARIANTS, variant

__all__ = ["CATALOG_DIR", "catalog_arch", "catalog_entry", "catalog_names", "load_arch", "LIMITS", "STRETCHING_ROPE",
           "TRAINED_ROPE", "Cfg", "trained_ctx_of", "GGUF_ARCH", "read_gguf", "LLAMA_EXPORT_TYPES", "READERS",
           "SUPPORTED", "arch_from_config", "read_config_json", "layer_windows", "MLA", "SSM", "UP_PROJ_NAMES", "Arch",
           "Attention", "Block", "Linear", "Mixer", "ShortConv", "Weight", "VARIANTS", "variant"]
