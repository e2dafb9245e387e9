"""The Llama-family decoder reader (every variant edgekv.arch.variants declares: llama, mistral, qwen2, qwen3, phi3,
smollm3, gemma2, gemma3, olmo2, ...) and its per-layer sliding windows."""
from __future__ import annotations

from ..errors import EdgekvError
from .config import Cfg
from .types import Attention, Block, Weight
from .variants import VARIANTS
from .weights import _embed_and_head, _lin, _mlp, _vec


def _decoder(c: Cfg, mt: str) -> tuple[int, int, list[Block], list[Weight]]:
    """A Llama-family decoder: its weights and layers as its variant (edgekv.arch.variants) declares them."""
    v = VARIANTS[mt]
    hidden = c.int("hidden_size", "n_embd", "d_model")
    n_layers = c.int("num_hidden_layers", "n_layer", "num_layers")
    n_heads = c.int("num_attention_heads", "n_head")
    n_kv = c.int("num_key_value_heads", default=n_heads)
    if n_kv == 0 or n_heads % n_kv:
        raise EdgekvError(f"{c.where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    hd = c.int("head_dim", default=hidden // n_heads)
    inter = c.int("intermediate_size")
    vocab = c.int("vocab_size")
    tied = bool(c.get("tie_word_embeddings", default=v.tied))
    qkv_bias, o_bias = v.biases(bool(c.get("attention_bias", default=False)))
    mlp_bias = bool(c.get("mlp_bias", default=False))
    for f in ("attention_chunk_size", "no_rope_layers", "moe_layers", "num_local_experts"):
        if f == "no_rope_layers" and v.nope_layers:  # NoPE layers: the same weights and state
            continue
        if c.get(f, default=None):  # Llama 4-style chunked attention / MoE fields: another layer pattern
            raise EdgekvError(f"{c.where}: '{f}' is set: edgekv's {mt} reader has dense, full or sliding attention "
                              "layers only and cannot read this layer pattern")
    windows = layer_windows(c, mt, n_layers)
    # qk-norm weights: one per head channel ("head": shared by every head) or over the whole projection ("proj")
    qk = {"head": (hd, hd), "proj": (n_heads * hd, n_kv * hd)}.get(v.qk_norm)
    ws: list[Weight] = []
    blocks = []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        _lin(ws, f"{p}.self_attn.q_proj", hidden, n_heads * hd, qkv_bias)
        _lin(ws, f"{p}.self_attn.k_proj", hidden, n_kv * hd, qkv_bias)
        _lin(ws, f"{p}.self_attn.v_proj", hidden, n_kv * hd, qkv_bias)
        _lin(ws, f"{p}.self_attn.o_proj", n_heads * hd, hidden, o_bias)
        if qk:
            _vec(ws, f"{p}.self_attn.q_norm", qk[0])
            _vec(ws, f"{p}.self_attn.k_norm", qk[1])
        _mlp(ws, f"{p}.mlp", hidden, inter, mlp_bias)
        for name in v.norm_names().values():
            _vec(ws, f"{p}.{name}", hidden)
        blocks.append(Block((Attention(n_heads, n_kv, hd, windows[i]),)))
    _vec(ws, "model.norm", hidden)
    _embed_and_head(ws, vocab, hidden, tied)
    return hidden, vocab, blocks, ws


def layer_windows(c: Cfg, mt: str, n_layers: int) -> list[int | None]:
    """Which layers use a native sliding window, following each config class's conventions (the variant's
    `windows` rule, edgekv.arch.variants)."""
    v = VARIANTS[mt]
    sw = c.get("sliding_window", default=None)
    sw = c.int("sliding_window") if sw else None  # 0 / null: no window, as the config classes read it
    types = c.get("layer_types", default=None)
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers:
            raise EdgekvError(f"{c.where}: layer_types has {len(types) if isinstance(types, list) else 'no list of'} "
                              f"entries for {n_layers} layers")
        odd = sorted({str(t) for t in types} - {"full_attention", "sliding_attention"})
        if odd:  # chunked / linear / recurrent layer kinds this reader would otherwise plan as full attention
            raise EdgekvError(f"{c.where}: layer_types names {', '.join(map(repr, odd))}: edgekv reads "
                              f"full_attention and sliding_attention layers of {mt}, nothing else")
        if any(t == "sliding_attention" for t in types) and not sw:
            raise EdgekvError(f"{c.where}: layer_types names sliding_attention layers but sliding_window is not set")
        return [int(sw) if t == "sliding_attention" else None for t in types]
    if v.windows == "even":  # even layers (0, 2, ...) slide, odd layers are global
        return [int(c.int("sliding_window", default=v.window_default)) if i % 2 == 0 else None
                for i in range(n_layers)]
    if v.windows == "pattern":  # every sliding_window_pattern-th layer is global
        pattern = c.int("sliding_window_pattern", "_sliding_window_pattern", default=6)
        w = c.int("sliding_window", default=v.window_default)
        return [None if (i + 1) % pattern == 0 else w for i in range(n_layers)]
    if v.windows == "after_max_window_layers":
        if not c.get("use_sliding_window", default=False) or not sw:
            return [None] * n_layers
        first = c.int("max_window_layers", default=n_layers)
        return [int(sw) if i >= first else None for i in range(n_layers)]
    if v.windows == "every" and sw:
        return [int(sw)] * n_layers
    if sw and v.windows == "refuse":  # the config class has no sliding window: a config naming one is a fork's
        raise EdgekvError(f"{c.where}: sliding_window {sw!r} in a {mt} config (transformers' {v.__name__} attends to every "
                          "token; which layers slide cannot be read): remove it, or give layer_types")
    return [None] * n_layers
