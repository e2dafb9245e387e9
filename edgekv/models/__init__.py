"""Export-first torch modules and their weight loaders. Imports torch: never import this from the planner.

    loaded = load_model("smollm2-135m", parse_strategy("kv:dtype=fp32"), max_ctx=512)
    logits, *state = loaded.module(tokens, pos, *loaded.module.empty_state())
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import EdgekvError
from ..jsonfile import read_json


@dataclass
class Loaded:
    module: "object"  # edgekv.models.llama.Llama
    args: "object"  # LlamaArgs
    arch: "object"  # edgekv.arch.Arch (drives the StateLayout)
    layout: "object"  # StateLayout
    source: Path
    source_format: str  # "gguf Q4_1" | "safetensors"


@dataclass
class LlamaSource:
    """A Llama-family checkpoint read once: weights, config, the args the modules take, and its Arch."""
    path: Path
    fmt: str  # "gguf <stored tensor types>" | "safetensors"
    cfg: dict
    sd: dict
    args: "object"  # LlamaArgs, llama.cpp rope factors applied
    arch: "object"  # edgekv.arch.Arch


def read_llama(spec: str, max_ctx: int | None = None) -> LlamaSource:
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
        # the Arch that read_gguf would build, from the same header (parsing a GGUF header twice costs ~3 s)
        arch = arch_from_config(cfg, path.stem, str(path))
    else:
        cfg, sd = load_hf_folder(path)
        factors, fmt = None, "safetensors"
        arch = read_config_json(path)
    args = args_from_hf_config(cfg, str(path))
    args.rope_freq_factors = factors
    if max_ctx is not None and args.max_position and max_ctx > args.max_position:
        raise EdgekvError(f"max_ctx {max_ctx} exceeds the model's trained context {args.max_position}")
    if args.tied:
        sd.pop("lm_head.weight", None)  # some tied checkpoints still store the (identical) head
    return LlamaSource(path, fmt, cfg, sd, args, arch)


def layout_for(arch, strategy, max_ctx: int):
    """The StateLayout, or one clear line when the strategy does not apply to this model."""
    from ..strategies import NotApplicable, build_layout
    try:
        return build_layout(arch, strategy, max_ctx)
    except NotApplicable as e:
        raise EdgekvError(f"{strategy.label} does not apply to {arch.name}: {e}") from None


def load_model(spec: str, strategy, max_ctx: int) -> Loaded:
    """The Llama-family export module for spec with the strategy's state at max_ctx."""
    from .llama import Llama
    from .weights import load_strict

    src = read_llama(spec, max_ctx)
    layout = layout_for(src.arch, strategy, max_ctx)
    module = Llama(src.args, layout)
    return Loaded(load_strict(module, src.sd, src.path, src.args.model_type), src.args, src.arch, layout, src.path,
                  src.fmt)


def load_any(spec: str, strategy, max_ctx: int) -> Loaded:
    """Pick the module for the model's family and the strategy: Llama family (kv, kv-int*, window), converted MLA
    (mla on a GQA model), DeepSeek-V2 (native mla), Mamba-1/2 (ssm), RWKV-4 (linear), Jamba (hybrid)."""

    from .weights import resolve_model

    path = resolve_model(spec)
    mt = "gguf"
    if path.is_dir():
        mt = read_json(path / "config.json").get("model_type")
    if mt in ("mamba", "mamba2"):
        from .mamba import load_mamba
        return load_mamba(spec, strategy, max_ctx)
    if mt == "rwkv":
        from .recurrent import load_rwkv
        return load_rwkv(spec, strategy, max_ctx)
    if mt == "jamba":
        from .hybrid import load_jamba
        return load_jamba(spec, strategy, max_ctx)
    if mt == "deepseek_v2":
        from .mla import load_deepseek
        return load_deepseek(spec, strategy, max_ctx)
    if strategy.name == "mla":
        from .mla import load_converted_mla
        return load_converted_mla(spec, strategy, max_ctx)
    return load_model(spec, strategy, max_ctx)
