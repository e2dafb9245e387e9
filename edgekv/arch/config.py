"""Cfg: a config.json dict read with transformers' manners (documented defaults, legacy aliases, size limits), and the
trained context a config implies."""
from __future__ import annotations

import math

from ..errors import EdgekvError


# Sizes no real model has: a config beyond these is refused in one line before anything is built from it (a
# num_hidden_layers of 1e9 would otherwise list 1e10 weight tensors). Each maximum is several times the largest
# published config.json value known here: layers 126 and hidden 16384, intermediate 53248 (Llama-3.1-405B),
# attention heads 128 (Llama-3.1-405B, DeepSeek-V3), vocab 262,208 (Gemma 3), routed experts 384 (Kimi K2),
# head_dim 256 (Gemma), Mamba d_state 128 (Mamba-2), conv kernel 4, max_position_embeddings 10,485,760 (Llama 4
# Scout). A minimum of 1: a size that cannot be 0.
_HEADS, _DIM = (1, 4096), (1, 4096)
LIMITS = {"num_hidden_layers": (1, 512), "hidden_size": (1, 131072), "intermediate_size": (1, 2**20),
          "moe_intermediate_size": (1, 2**20), "vocab_size": (1, 2**22), "num_attention_heads": _HEADS,
          "num_key_value_heads": _HEADS, "num_heads": _HEADS, "mamba_n_heads": _HEADS, "n_mamba_heads": _HEADS,
          "head_dim": _DIM, "attention_head_dim": _DIM, "v_head_dim": _DIM, "qk_rope_head_dim": _DIM,
          "qk_nope_head_dim": (0, 4096), "mamba_headdim": _DIM, "mamba_d_head": _DIM, "kv_lora_rank": (1, 65536),
          "state_size": (1, 4096), "mamba_d_state": (1, 4096), "conv_kernel": (1, 64), "mamba_d_conv": (1, 64),
          "num_experts": (1, 512), "n_routed_experts": (0, 512), "n_shared_experts": (0, 512),
          "num_experts_per_tok": (0, 512), "attention_hidden_size": (1, 131072), "mamba_d_ssm": (1, 2**20),
          "n_groups": (1, 4096), "mamba_n_groups": (1, 4096), "mamba_ngroups": (1, 4096), "num_mem_blocks": (1, 512),
          "sliding_window": (1, 2**24), "adapter_rank": (0, 65536), "max_position_embeddings": (1, 2**27)}


class Cfg:
    """A config dict with the reader's manners: defaults only where transformers documents them, aliases for
    legacy names, and a one-line error naming the missing field otherwise."""

    def __init__(self, d: dict, where: str):
        self.d, self.where = d, where

    def get(self, *names, default=...):
        for n in names:
            if n in self.d and self.d[n] is not None:
                return self.d[n]
        if default is ...:
            raise EdgekvError(f"{self.where}: config lacks '{names[0]}' (needed for {self.d.get('model_type')})")
        return default

    def int(self, *names, default=...) -> int:
        v = self.get(*names, default=default)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or int(v) != v or v < 0:
            raise EdgekvError(f"{self.where}: '{names[0]}' must be a non-negative integer, got {v!r}")
        lo, hi = LIMITS.get(names[0], (0, 2**40))
        if not lo <= v <= hi:
            shown = f"{int(v):,}" if v < 1e15 else f"{v:.3g}"
            raise EdgekvError(f"{self.where}: '{names[0]}' {shown} cannot be a real model's (expected "
                              f"{lo} to {hi:,})")
        return int(v)


# RoPE scalings that stretch a model trained at original_max_position_embeddings to a longer max_position_embeddings
# at inference (transformers modeling_rope_utils: linear, dynamic NTK, YaRN); llama3 and longrope are the scalings
# Llama 3.1/3.2 and Phi-3 were trained to their max_position_embeddings with (Llama 3 herd paper section 3.4.2
# "long-context pre-training"; Phi-3 report section 2), so there max_position_embeddings is the trained length.
STRETCHING_ROPE = ("linear", "dynamic", "yarn")
TRAINED_ROPE = ("default", "llama3", "longrope", "su", None)


def trained_ctx_of(c: Cfg) -> tuple[int, str] | None:
    """(tokens, source) of the context the model was trained at, read from its config: the rope scaling's
    original_max_position_embeddings where the scaling stretches it at inference, else max_position_embeddings
    (n_positions, context_length: the older and RWKV names); None where the config names none (a bare recurrent
    config: Mamba's has no length field). A rope type it does not know is refused: the trained length depends on it."""
    rope = c.get("rope_scaling", default=None) or c.get("rope_parameters", default=None) or {}
    if not isinstance(rope, dict):
        raise EdgekvError(f"{c.where}: 'rope_scaling' must be an object, got {rope!r}")
    if rope and all(isinstance(v, dict) for v in rope.values()):  # transformers 5: per layer type (Gemma 3)
        rope = rope.get("full_attention") or next(iter(rope.values()))
    kind = rope.get("rope_type", rope.get("type"))
    orig = rope.get("original_max_position_embeddings") or c.get("original_max_position_embeddings", default=None)
    if kind in STRETCHING_ROPE and orig:  # a length: finite and whole (NaN, Infinity refused)
        orig = Cfg({"original_max_position_embeddings": orig}, c.where).int("original_max_position_embeddings")
        return orig, f"config rope_scaling.original_max_position_embeddings ({kind} stretches it at inference)"
    if kind not in TRAINED_ROPE:
        raise EdgekvError(f"{c.where}: rope_scaling type {kind!r} is not one edgekv reads (known: "
                          f"{', '.join(k for k in STRETCHING_ROPE + TRAINED_ROPE if k)}): the trained context "
                          "depends on it")
    for f in ("max_position_embeddings", "n_positions", "context_length"):
        v = c.int(f, default=None)
        if v:
            return v, f"config {f}"
    return None
