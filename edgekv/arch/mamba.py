"""The Mamba-1 / Mamba-2 reader, and the translation of the original mamba_ssm config.json into transformers' names."""
from __future__ import annotations

import math

from ..errors import EdgekvError
from .config import Cfg
from .model_types import MODEL_TYPES, SSM_LAYERS
from .types import Block, Weight
from .weights import _mamba1_mixer, _mamba2_mixer, _vec


def _mamba(c: Cfg, mt: str):
    t = MODEL_TYPES[mt]
    layer = (c.get("ssm_cfg", default=None) or {}).get("layer")
    if layer and layer != t.ssm_layer:
        raise EdgekvError(f"{c.where}: ssm_cfg.layer {layer!r} does not match model_type {mt!r}")
    hidden = c.int("hidden_size", "d_model")
    n_layers = c.int("num_hidden_layers", "n_layer")
    vocab = c.int("vocab_size")
    d_state = c.int("state_size", "d_state", default=t.state_size)
    d_conv = c.int("conv_kernel", "d_conv", default=4)
    expand = c.get("expand", default=2)
    d_inner = int(c.get("intermediate_size", default=int(expand * hidden)))
    tied = bool(c.get("tie_word_embeddings", default=True))
    conv_bias = bool(c.get("use_conv_bias", "conv_bias", default=True))
    proj_bias = bool(c.get("use_bias", "bias", default=False))
    ws, blocks = [], []
    for i in range(n_layers):
        p = f"backbone.layers.{i}"
        if not t.heads:
            dt_rank = c.get("time_step_rank", "dt_rank", default="auto")
            dt_rank = math.ceil(hidden / 16) if dt_rank == "auto" else int(dt_rank)
            m = _mamba1_mixer(ws, f"{p}.mixer", hidden, d_inner, d_state, d_conv, dt_rank, conv_bias, proj_bias)
        else:
            n_heads = c.int("num_heads", "nheads")
            head_dim = c.int("head_dim", "headdim", default=64)
            d_inner = n_heads * head_dim if "intermediate_size" not in c.d else d_inner
            m = _mamba2_mixer(ws, f"{p}.mixer", hidden, d_inner, n_heads, head_dim, c.int("n_groups", "ngroups",
                              default=1), d_state, d_conv, conv_bias, proj_bias)
        _vec(ws, f"{p}.norm", hidden)
        blocks.append(Block((m,)))
    _vec(ws, "backbone.norm_f", hidden)
    ws.insert(0, Weight("backbone.embeddings.weight", (vocab, hidden), "embedding"))
    if not tied:
        ws.append(Weight("lm_head.weight", (vocab, hidden), "lm_head"))
    return hidden, vocab, blocks, ws


def _from_mamba_ssm(config: dict, source: str) -> dict:
    """The original state-spaces/mamba config.json (mamba_ssm MambaConfig: d_model, n_layer, ssm_cfg, no model_type)
    in transformers' field names: the vocabulary padded to pad_vocab_size_multiple as mamba_ssm pads it, ssm_cfg's
    d_state / d_conv / expand / headdim / ngroups, tied embeddings as MambaConfig's default. A config with attention
    layers (attn_layer_idx) is a hybrid this translation does not read."""
    ssm = config["ssm_cfg"]
    layer = ssm.get("layer", "Mamba1")
    if layer not in SSM_LAYERS:
        raise EdgekvError(f"{source}: ssm_cfg.layer {layer!r} is not {' or '.join(SSM_LAYERS)}")
    if config.get("attn_layer_idx"):
        raise EdgekvError(f"{source}: attn_layer_idx is set: a mamba_ssm hybrid with attention layers, which "
                          "edgekv does not read")
    t = SSM_LAYERS[layer]
    d = config["d_model"]
    vocab, pad = config.get("vocab_size"), config.get("pad_vocab_size_multiple", 8)
    if not isinstance(vocab, int) or not isinstance(pad, int) or pad < 1:
        raise EdgekvError(f"{source}: config lacks an integer 'vocab_size' / 'pad_vocab_size_multiple'")
    expand = ssm.get("expand", 2)
    out = {"model_type": t.model_type, "hidden_size": d, "num_hidden_layers": config.get("n_layer"),
           "vocab_size": vocab + (-vocab) % pad, "expand": expand, "intermediate_size": int(expand * d),
           "tie_word_embeddings": config.get("tie_embeddings", True),
           "state_size": ssm.get("d_state", t.state_size), "conv_kernel": ssm.get("d_conv", 4)}
    if t.heads:
        hd = ssm.get("headdim", 64)
        out.update(head_dim=hd, num_heads=int(expand * d) // hd, n_groups=ssm.get("ngroups", 1))
    return out
