"""Export-first torch modules and their weight loaders. Imports torch: never import this from the planner.

    loaded = load_any("smollm2-135m", parse_strategy("kv:dtype=fp32"), max_ctx=512)
    logits, *state = loaded.module(tokens, pos, *loaded.module.empty_state())

Families: every exportable model family is one entry of FAMILIES (below): the config.json model_types and GGUF
architectures it reads, the strategies its module exports, how to read a checkpoint (`read`: weights, config, the
module's args and the model's Arch) and how to build the loaded module for a StateLayout (`build`). The StateLayout
itself is the planner's (edgekv.strategies.build_layout of the Arch `read` returns), so export, plan and profile
count the same tensors. load_any picks the family by the checkpoint's model_type; a model type no family reads ends
in one line naming those that are exported. This module imports no torch: `read` and `build` are "module:function"
paths imported when used.
"""
from __future__ import annotations

import importlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..arch import LLAMA_EXPORT_TYPES
from ..arch.model_types import (DeepseekV2, FalconH1, GraniteMoeHybrid, Jamba, Lfm2, Mamba, Mamba2, Qwen3_5,
                                Qwen3_5Text, Rwkv, Zamba2)
from ..arch.variants import VARIANTS
from ..errors import EdgekvError
from ..jsonfile import read_config
from ..strategies import REGISTRY

if TYPE_CHECKING:  # annotations only: this module imports no torch
    from ..arch import Arch
    from ..strategies import StateLayout
    from .protocol import ExportModule, FamilyArgs

# the registered strategies that keep K and V per attention layer (kv, kv-int8/int4/int2, window): what a GQA
# decoder's module exports
KV_STRATEGIES = tuple(n for n, c in REGISTRY.items() if c.kv_cache and c.exportable)
# the llama-family model types whose attention edgekv.models.converted_mla.ConvertedMLA reproduces (no qk-norm, one
# RoPE base, Llama's norms and MLP; the variant's mla_convertible): mla on these converts the GQA cache to a latent
MLA_CONVERTIBLE = tuple(mt for mt, v in VARIANTS.items() if v.mla_convertible)


@dataclass(frozen=True)
class Family:
    """One exportable model family (see the module docstring)."""
    name: str
    model_types: tuple[str, ...]  # config.json model_type values this family's module implements
    strategies: tuple[str, ...]  # strategy names its module (or a routed one) exports
    read: str  # "module:function" (spec, max_ctx) -> Source
    build: str  # "module:function" (Source, StateLayout) -> the module with its weights loaded, in eval mode
    gguf_archs: tuple[str, ...] = ()  # GGUF general.architecture values `read` reads
    routes: tuple[tuple[str, str], ...] = ()  # (strategy, family): a strategy another family's module exports
    what: str = ""  # one line for listings
    state_dtypes: tuple[str, ...] = ("fp32", "fp16")  # the float/int dtypes its module stores the state in
    ctx_capped: bool = False  # its reader refuses max_ctx > max_position_embeddings
    kv_quantized: bool = False  # a hybrid whose attention layers also keep int8/int4 caches (hybrid:dtype=int8|int4)
    fused_attention: bool = False  # its attention layers take the runtime's fused op (edgekv.models.swaps), as the
    # planner prices them (edgekv.memory.fused_gqa)


FAMILIES = (
    Family("llama", LLAMA_EXPORT_TYPES, KV_STRATEGIES + ("mla",),
           "edgekv.models:read_llama", "edgekv.models.llama:build", gguf_archs=tuple(v.gguf_arch for v in VARIANTS.values() if v.gguf_arch and v.gguf_export),
           routes=(("mla", "converted-mla"),), ctx_capped=True, fused_attention=True,
           what="GQA + RoPE decoders: Llama-2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3 (qk-norm), Gemma 3 "
                "(sliding + global layers), SmolLM3 (NoPE layers), Phi-3 / Phi-4-mini (fused projections split, "
                "partial rotary, longrope), OLMo-2 (post-sublayer norms, whole-projection qk-norm)"),
    Family("converted-mla", (), ("mla",), "edgekv.models:read_llama", "edgekv.models.converted_mla:build_converted",
           what="a llama-family model with its KV converted to a low-rank latent (mla on a GQA model)"),
    Family("deepseek-v2", (DeepseekV2.model_type,), ("mla",), "edgekv.models.mla:read_deepseek",
           "edgekv.models.mla:build_deepseek", what="native MLA", ctx_capped=True),
    Family("mamba", (Mamba.model_type, Mamba2.model_type), ("ssm",), "edgekv.models.mamba:read_mamba",
           "edgekv.models.mamba:build_mamba",
           what="Mamba-1 / Mamba-2", state_dtypes=("fp32", "fp16", "bf16", "int8")),
    Family("rwkv-4", (Rwkv.model_type,), ("linear",), "edgekv.models.recurrent:read_rwkv",
           "edgekv.models.recurrent:build_rwkv", what="RWKV-4", state_dtypes=("fp32", "fp16", "bf16", "int8")),
    Family("jamba", (Jamba.model_type,), ("hybrid",), "edgekv.models.jamba:read_jamba",
           "edgekv.models.jamba:build_jamba",
           what="Mamba-1 + attention + MoE", state_dtypes=("fp32", "fp16", "bf16")),
    Family("lfm2", (Lfm2.model_type,), ("hybrid",), "edgekv.models.lfm2:read_lfm2", "edgekv.models.lfm2:build_lfm2",
           what="LFM2 / LFM2.5: gated short convolutions + GQA attention (qk-norm)", state_dtypes=("fp32", "fp16"),
           ctx_capped=True, kv_quantized=True),
    Family("granite-hybrid", (GraniteMoeHybrid.model_type,), ("hybrid",),
           "edgekv.models.granite_hybrid:read_granite_hybrid",
           "edgekv.models.granite_hybrid:build_granite_hybrid", state_dtypes=("fp32", "fp16"), ctx_capped=True,
           kv_quantized=True, what="Granite-4.0-H, dense configs: Mamba-2 + GQA attention (NoPE)"),
    Family("falcon-h1", (FalconH1.model_type,), ("hybrid",), "edgekv.models.falcon_h1:read_falcon_h1",
           "edgekv.models.falcon_h1:build_falcon_h1", state_dtypes=("fp32", "fp16"), ctx_capped=True,
           kv_quantized=True, what="Falcon-H1: attention and Mamba-2 side by side in every layer, muP multipliers"),
    Family("zamba2", (Zamba2.model_type,), ("hybrid",), "edgekv.models.zamba2:read_zamba2",
           "edgekv.models.zamba2:build_zamba2",
           state_dtypes=("fp32", "fp16"), ctx_capped=True, kv_quantized=True,
           what="Zamba2: Mamba-2 layers, shared attention blocks with per-layer LoRA at the hybrid layers"),
    Family("qwen3_5", (Qwen3_5Text.model_type, Qwen3_5.model_type), ("hybrid",),
           "edgekv.models.qwen3_5:read_qwen3_5",
           "edgekv.models.qwen3_5:build_qwen3_5", what="Qwen3.5: Gated DeltaNet + gated full attention",
           state_dtypes=("fp32", "fp16", "bf16"), ctx_capped=True, kv_quantized=True),
)
FAMILY = {f.name: f for f in FAMILIES}


def family_for_type(model_type: str) -> tuple[Family, tuple[str, ...]] | None:
    """The family that exports this config.json model_type and the strategies it builds for it (mla only where the
    GQA -> latent conversion reproduces the attention: MLA_CONVERTIBLE), or None."""
    for f in FAMILIES:
        if model_type in f.model_types:
            routed = dict(f.routes)
            return f, tuple(s for s in f.strategies
                            if not (routed.get(s) == "converted-mla" and model_type not in MLA_CONVERTIBLE))
    return None


def fused_attention_type(model_type: str) -> bool:
    """Whether the family that exports this model_type attends through the runtime's fused op (Family.fused_attention)."""
    found = family_for_type(model_type)
    return found is not None and found[0].fused_attention


def supported_line() -> str:
    """Every exported model type, by family, in one line."""
    return "; ".join(f"{f.name}: {', '.join(f.model_types)}" for f in FAMILIES if f.model_types)


@dataclass
class Loaded:
    """A family's export module for one strategy's StateLayout, with where it came from."""
    module: ExportModule  # the family's torch module (edgekv.models.llama.Llama, ...)
    args: FamilyArgs  # its args dataclass (LlamaArgs, MambaArgs, ...)
    arch: Arch  # drives the StateLayout
    layout: StateLayout
    source: Path
    source_format: str  # "gguf Q4_1" | "safetensors"


@dataclass
class Source:
    """A checkpoint read once: weights, config, the args the family's module takes, and its Arch."""
    path: Path
    fmt: str  # "gguf <stored tensor types>" | "safetensors"
    cfg: dict
    sd: dict
    args: FamilyArgs  # the family's args (LlamaArgs: llama.cpp rope factors applied)
    arch: Arch



def _function(path: str):
    mod, name = path.split(":")
    return getattr(importlib.import_module(mod), name)


def gguf_architecture(path: Path) -> str:
    """general.architecture of a GGUF file, from its header (gguf-py's GGUFReader parses every tensor's info first).
    The GGUF spec (ggml/docs/gguf.md) has it as the first key/value, as every llama.cpp writer puts it; otherwise the
    full reader finds it."""
    try:
        with open(path, "rb") as f:
            magic, _version, _n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
            if magic == b"GGUF" and n_kv:
                (klen,) = struct.unpack("<Q", f.read(8))
                key = f.read(min(klen, 64))  # lengths as claimed: a hostile one must not size a read
                (vtype,) = struct.unpack("<I", f.read(4))
                if key == b"general.architecture" and vtype == 8:  # GGUF_TYPE_STRING
                    (slen,) = struct.unpack("<Q", f.read(8))
                    if slen <= 64:
                        return f.read(slen).decode("utf-8")
    except (OSError, struct.error, UnicodeDecodeError):
        pass
    from ..arch.gguf import open_gguf
    reader = open_gguf(path)
    try:
        return reader.fields["general.architecture"].contents()
    except Exception as e:  # a missing key, or a value of the wrong type
        raise EdgekvError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def family_of(path: Path) -> Family:
    """The family whose module reads this checkpoint (a resolved path: HF folder or .gguf)."""
    if path.is_dir():
        cfg = read_config(path / "config.json")
        mt = cfg.get("model_type") if isinstance(cfg, dict) else None
        for f in FAMILIES:
            if mt in f.model_types:
                return f
        raise EdgekvError(f"{path}: model_type {mt!r} has no export module; exported: {supported_line()}")
    arch = gguf_architecture(path)
    for f in FAMILIES:
        if arch in f.gguf_archs:
            return f
    archs = ", ".join(a for f in FAMILIES for a in f.gguf_archs)
    raise EdgekvError(f"{path}: GGUF architecture {arch!r} has no export module (GGUF: {archs}; other families "
                      f"load from an HF folder: {supported_line()})")


def check_strategy(family: Family, strategy) -> Family:
    """The family whose module exports the strategy (the family itself or its route), or one clear line."""
    if strategy.name not in family.strategies:
        raise EdgekvError(f"{strategy.label} does not apply to a {family.name}-family model "
                          f"(its export module keeps: {', '.join(family.strategies)})")
    return FAMILY[dict(family.routes).get(strategy.name, family.name)]


def load_family(family: Family | str, spec: str, strategy, max_ctx: int) -> Loaded:
    """Read spec with the family's reader, build the strategy's StateLayout from its Arch, build the module."""
    fam = FAMILY[family] if isinstance(family, str) else family
    src = _function(fam.read)(spec, max_ctx)
    fam = check_strategy(fam, strategy)
    layout = layout_for(src.arch, strategy, max_ctx)
    from .weights import no_init
    with no_init():  # every weight comes from src: the module is never in memory twice
        module = _function(fam.build)(src, layout)
    return Loaded(module, src.args, src.arch, layout, src.path, src.fmt)


def load_any(spec: str, strategy, max_ctx: int) -> Loaded:
    """The export module of spec's family (FAMILIES, by its config.json model_type or GGUF architecture) with the
    strategy's state at max_ctx."""
    from .weights import resolve_model

    if max_ctx is not None and max_ctx < 1:
        raise EdgekvError(f"max_ctx must be at least 1, got {max_ctx}")
    fam = family_of(resolve_model(spec))
    strategy = hybrid_alias(fam, strategy)
    fam = check_strategy(fam, strategy)  # before any weight is read
    return load_family(fam, spec, strategy, max_ctx)


def hybrid_alias(family: Family, strategy):
    """A transformer's cache strategy on a family that keeps only the hybrid form of it (LFM2, Granite-4.0-H): kv:dtype=D is its
    native state with the KV in D (hybrid:dtype=D,state_dtype=fp32: what analyze's fp32 reference, kv:dtype=fp32, asks
    of a model with attention layers); a quantized cache is hybrid:dtype=<its storage's hybrid_dtype> (kv-int8 /
    kv-int4: int8 / int4) where the family's attention layers keep quantized caches (Family.kv_quantized). Any other
    strategy is returned as is."""
    from ..strategies import parse_strategy
    if "hybrid" not in family.strategies or strategy.name in family.strategies:
        return strategy
    st = strategy.kv_storage  # its storage names the hybrid dtype that keeps the same cache (None: none does)
    if strategy.plain_kv or (st is not None and st.quantized and family.kv_quantized):
        if st.hybrid_dtype:
            return parse_strategy(f"hybrid:dtype={st.hybrid_dtype},state_dtype=fp32")
    return strategy


def read_llama(spec: str, max_ctx: int | None = None) -> Source:
    """Resolve spec (file, folder or packaged name) and read it; max_ctx is checked against the trained context."""
    from ..arch import arch_from_config, read_config_json
    from .llama import args_from_hf_config
    from .weights import load_gguf, load_hf_folder, resolve_model

    if max_ctx is not None and max_ctx < 1:
        raise EdgekvError(f"max_ctx must be at least 1, got {max_ctx}")
    path = resolve_model(spec)
    if path.suffix.lower() == ".gguf":
        cfg, sd, factors, types = load_gguf(path)
        fmt = "gguf " + "+".join(types)
        # the Arch that read_gguf would build, from the same header (not parsed a second time)
        arch = arch_from_config(cfg, path.stem, str(path))
    else:
        cfg, sd = load_hf_folder(path)
        factors, fmt = None, "safetensors"
        arch = read_config_json(path)
        v = VARIANTS.get(cfg.get("model_type"))
        if v is not None and v.rewrite:  # a checkpoint in other shapes (Phi-3's fused q/k/v and gate/up, partial
            # rotary, longrope: edgekv.models.phi3) rewritten into Llama's first
            cfg, sd, factors = _function(v.rewrite)(cfg, sd, max_ctx, str(path / "config.json"))
    args = args_from_hf_config(cfg, str(path))
    args.rope_freq_factors = factors
    if max_ctx is not None and args.max_position and max_ctx > args.max_position:
        raise EdgekvError(f"max_ctx {max_ctx} exceeds the model's trained context {args.max_position}")
    if args.tied:
        sd.pop("lm_head.weight", None)  # some tied checkpoints still store the (identical) head
    return Source(path, fmt, cfg, sd, args, arch)


def layout_for(arch, strategy, max_ctx: int):
    """The StateLayout, or one clear line when the strategy does not apply to this model."""
    from ..strategies import NotApplicable, build_layout
    try:
        return build_layout(arch, strategy, max_ctx)
    except NotApplicable as e:
        raise EdgekvError(f"{strategy.label} does not apply to {arch.name}: {e}") from None


def load_model(spec: str, strategy, max_ctx: int) -> Loaded:
    """The llama-family export module for spec with the strategy's state at max_ctx."""
    return load_family("llama", spec, strategy, max_ctx)
