"""What the export modules share besides layers: reading an HF folder's config and weights, the state's torch dtypes
and the empty (all-zeros) state of a StateLayout."""
from __future__ import annotations

import torch

from ..errors import EdgekvError
from ..strategies import StateLayout
from .weights import load_strict  # noqa: F401  (the modules' builders load through it)

STATE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # a float KV cache
STATE_TORCH = {**STATE_DTYPES, "uint8": torch.uint8}  # and a packed (int4/int2) cache's codes


def config_value(v):
    """transformers writes float('inf') into config.json as {"__float__": "Infinity"}; undo that."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    if isinstance(v, list):
        return [config_value(x) for x in v]
    return v


def read_folder(spec: str, max_ctx: int):
    """spec (HF folder or packaged name) -> (path, config, fp32 state dict, Arch). GGUF is refused: only the llama
    family reads GGUF weights."""
    from ..arch import read_config_json
    from .weights import load_hf_folder, resolve_model

    if max_ctx < 1:
        raise EdgekvError(f"max_ctx must be at least 1, got {max_ctx}")
    path = resolve_model(spec)
    if path.suffix.lower() == ".gguf":
        raise EdgekvError(f"{path}: GGUF weights are read for llama-family models only; pass an HF folder")
    arch = read_config_json(path)
    cfg, sd = load_hf_folder(path)
    return path, {k: config_value(v) for k, v in cfg.items()}, sd, arch


def state_dtype(layout: StateLayout, t) -> torch.dtype:
    if t.dtype not in STATE_DTYPES:
        raise EdgekvError(f"strategy {layout.strategy}: state dtype {t.dtype} ({t.name}) is not supported by the "
                          f"export module yet (supported: {', '.join(STATE_DTYPES)})")
    return STATE_DTYPES[t.dtype]


def empty_state(layout: StateLayout) -> list[torch.Tensor]:
    """The state before any token: zeros in every tensor of the layout, in its dtypes."""
    return [torch.zeros(t.shape, dtype=STATE_TORCH[t.dtype]) for t in layout.tensors]
