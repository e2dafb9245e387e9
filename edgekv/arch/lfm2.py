"""Reader of LFM2 (Liquid AI): gated short-convolution layers + GQA attention layers."""
from __future__ import annotations

from ..errors import EdgekvError
from .config import Cfg
from .hybrid import _check_kinds
from .types import Attention, Block, ShortConv, Weight
from .weights import _embed_and_head, _lin, _vec


def _lfm2(c: Cfg, mt: str):
    """LFM2 (Lfm2Config / Lfm2ForCausalLM): layer_types (or full_attn_idxs) picks, per layer, GQA attention with
    qk-norm and RoPE or a gated short conv; every layer then runs a SwiGLU MLP (w1, w3, w2) whose width
    block_auto_adjust_ff_dim derives from intermediate_size (block_ff_dim) as Lfm2MLP does."""
    hidden = c.int("hidden_size")
    n_layers = c.int("num_hidden_layers")
    n_heads = c.int("num_attention_heads")
    n_kv = c.int("num_key_value_heads", default=8)
    if n_kv == 0 or n_heads % n_kv:
        raise EdgekvError(f"{c.where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    hd = c.int("head_dim", default=hidden // n_heads)
    inter = c.int("block_ff_dim", "intermediate_size", default=12288)
    if c.get("block_auto_adjust_ff_dim", default=True):
        inter = int(2 * inter / 3)
        mult = c.get("block_ffn_dim_multiplier", default=1.0)
        if mult is not None:
            of = c.int("block_multiple_of", default=256)
            inter = of * ((int(mult * inter) + of - 1) // of)
    vocab = c.int("vocab_size", default=65536)
    d_conv = c.int("conv_L_cache", default=3)
    bias = bool(c.get("conv_bias", default=False))
    kinds = c.get("layer_types", default=None)
    if kinds is None:
        attn = c.get("full_attn_idxs", default=list(range(n_layers)))
        kinds = ["full_attention" if i in attn else "conv" for i in range(n_layers)]
    _check_kinds(c, "layer_types", kinds, n_layers, ("full_attention", "conv"))
    ws, blocks = [], []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        if kinds[i] == "conv":
            ws.append(Weight(f"{p}.conv.conv.weight", (hidden, 1, d_conv), "small"))
            if bias:
                ws.append(Weight(f"{p}.conv.conv.bias", (hidden,), "small"))
            _lin(ws, f"{p}.conv.in_proj", hidden, 3 * hidden, bias)
            _lin(ws, f"{p}.conv.out_proj", hidden, hidden, bias)
            m = ShortConv(hidden, d_conv)
        else:
            _lin(ws, f"{p}.self_attn.q_proj", hidden, n_heads * hd)
            _lin(ws, f"{p}.self_attn.k_proj", hidden, n_kv * hd)
            _lin(ws, f"{p}.self_attn.v_proj", hidden, n_kv * hd)
            _lin(ws, f"{p}.self_attn.out_proj", n_heads * hd, hidden)
            _vec(ws, f"{p}.self_attn.q_layernorm", hd)
            _vec(ws, f"{p}.self_attn.k_layernorm", hd)
            m = Attention(n_heads, n_kv, hd)
        _lin(ws, f"{p}.feed_forward.w1", hidden, inter)
        _lin(ws, f"{p}.feed_forward.w3", hidden, inter)
        _lin(ws, f"{p}.feed_forward.w2", inter, hidden)
        _vec(ws, f"{p}.operator_norm", hidden)
        _vec(ws, f"{p}.ffn_norm", hidden)
        blocks.append(Block((m,)))
    _vec(ws, "model.embedding_norm", hidden)
    _embed_and_head(ws, vocab, hidden, bool(c.get("tie_word_embeddings", "tie_embedding", default=True)))
    return hidden, vocab, blocks, ws
