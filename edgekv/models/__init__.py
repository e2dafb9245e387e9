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
    import torch

    from ..arch import arch_from_config, read_config_json
    from ..strategies import NotApplicable, build_layout
    from .llama import Llama, args_from_hf_config
    from .weights import load_gguf, load_hf_folder, resolve_model

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
    missing, unexpected = module.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise EdgekvError(f"{path}: weights do not match a {args.model_type} model "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return Loaded(module, args, arch, layout, path, fmt)
