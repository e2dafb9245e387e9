"""Export-first torch modules and their weight loaders. Imports torch: never import this from the planner.

    loaded = load_model("smollm2-135m", parse_strategy("kv:dtype=fp32"), max_ctx=512)
    logits, *state = loaded.module(tokens, pos, *loaded.module.empty_state())
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import EdgekvError


@dataclass
class Loaded:
    module: "object"  # edgekv.models.llama.Llama
    args: "object"  # LlamaArgs
    arch: "object"  # edgekv.arch.Arch (drives the StateLayout)
    layout: "object"  # StateLayout
    source: Path
    source_format: str  # "gguf Q4_1" | "safetensors"


def load_model(spec: str, strategy, max_ctx: int) -> Loaded:
    """Resolve spec (file, folder or packaged name), read Arch + weights, build the StateLayout and the module."""
    from ..arch import arch_from_config, read_config_json
    from ..strategies import NotApplicable, build_layout
    from .llama import Llama, args_from_hf_config
    from .weights import load_gguf, load_hf_folder, load_strict, resolve_model

    if max_ctx < 1:
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
    try:
        layout = build_layout(arch, strategy, max_ctx)
    except NotApplicable as e:
        raise EdgekvError(f"{strategy.label} does not apply to {arch.name}: {e}") from None
    args = args_from_hf_config(cfg, str(path))
    args.rope_freq_factors = factors
    if args.max_position and max_ctx > args.max_position:
        raise EdgekvError(f"max_ctx {max_ctx} exceeds the model's trained context {args.max_position}")
    module = Llama(args, layout)
    if args.tied:
        sd.pop("lm_head.weight", None)  # some tied checkpoints still store the (identical) head
    return Loaded(load_strict(module, sd, path, args.model_type), args, arch, layout, path, fmt)


def load_any(spec: str, strategy, max_ctx: int) -> Loaded:
    """Pick the module for the model's family and the strategy: Llama family (kv, kv-int*, window), converted MLA
    (mla on a GQA model), DeepSeek-V2 (native mla), Mamba-1/2 (ssm), RWKV-4 (linear), Jamba (hybrid)."""
    import json

    from .weights import resolve_model

    path = resolve_model(spec)
    mt = "gguf"
    if path.is_dir():
        try:
            mt = json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, json.JSONDecodeError) as e:
            raise EdgekvError(f"{path}/config.json: {e}") from None
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
