"""The RWKV-4 reader."""
from __future__ import annotations

from .config import Cfg
from .types import Block, Linear, Weight
from .weights import _lin, _vec


def _rwkv(c: Cfg, mt: str):
    """RWKV-4 (transformers 'rwkv'): a per-channel linear recurrence; 5 hidden-sized fp32 state vectors per layer."""
    hidden = c.int("hidden_size")
    n_layers = c.int("num_hidden_layers")
    vocab = c.int("vocab_size")
    att = c.int("attention_hidden_size", default=hidden)
    inter = c.int("intermediate_size", default=4 * hidden)
    ws, blocks = [], []
    ws.append(Weight("rwkv.embeddings.weight", (vocab, hidden), "embedding"))
    for i in range(n_layers):
        p = f"rwkv.blocks.{i}"
        if i == 0:
            _vec(ws, f"{p}.pre_ln", hidden, bias=True)
        _vec(ws, f"{p}.ln1", hidden, bias=True)
        _vec(ws, f"{p}.ln2", hidden, bias=True)
        for t in ("time_decay", "time_first"):
            ws.append(Weight(f"{p}.attention.{t}", (att,), "small"))
        for t in ("time_mix_key", "time_mix_value", "time_mix_receptance"):
            ws.append(Weight(f"{p}.attention.{t}", (1, 1, hidden), "small"))
        _lin(ws, f"{p}.attention.key", hidden, att)
        _lin(ws, f"{p}.attention.value", hidden, att)
        _lin(ws, f"{p}.attention.receptance", hidden, att)
        _lin(ws, f"{p}.attention.output", att, hidden)
        for t in ("time_mix_key", "time_mix_receptance"):
            ws.append(Weight(f"{p}.feed_forward.{t}", (1, 1, hidden), "small"))
        _lin(ws, f"{p}.feed_forward.key", hidden, inter)
        _lin(ws, f"{p}.feed_forward.receptance", hidden, hidden)
        _lin(ws, f"{p}.feed_forward.value", inter, hidden)
        blocks.append(Block((Linear(n_heads=att, d_k=1, d_v=1, n_vectors=5, width=hidden),)))
    _vec(ws, "rwkv.ln_out", hidden, bias=True)
    if not c.get("tie_word_embeddings", default=False):
        ws.append(Weight("head.weight", (vocab, hidden), "lm_head"))
    return hidden, vocab, blocks, ws
