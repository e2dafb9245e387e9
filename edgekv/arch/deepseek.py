"""The DeepSeek-V2/V3 reader: multi-head latent attention (MLA) and routed MoE layers."""
from __future__ import annotations

from ..errors import EdgekvError
from .config import Cfg
from .model_types import MODEL_TYPES
from .types import MLA, Block
from .weights import _embed_and_head, _lin, _mlp, _moe_mlp, _vec


def _deepseek(c: Cfg, mt: str):
    hidden = c.int("hidden_size")
    n_layers = c.int("num_hidden_layers")
    n_heads = c.int("num_attention_heads")
    vocab = c.int("vocab_size")
    r = c.int("kv_lora_rank")
    rope = c.int("qk_rope_head_dim")
    nope = c.int("qk_nope_head_dim")
    vhd = c.int("v_head_dim")
    q_rank = c.int("q_lora_rank", default=None)  # null in V2-Lite: no query compression
    inter = c.int("intermediate_size")
    moe_inter = c.int("moe_intermediate_size")
    n_routed = c.int("n_routed_experts", default=0)
    n_shared = c.int("n_shared_experts", default=0)
    top_k = c.int("num_experts_per_tok", default=0)
    first_dense = c.int("first_k_dense_replace", default=0)
    freq = c.int("moe_layer_freq", default=1)
    tied = bool(c.get("tie_word_embeddings", default=False))
    ws, blocks = [], []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if q_rank:
            _lin(ws, f"{a}.q_a_proj", hidden, q_rank, bool(c.get("attention_bias", default=False)))
            _vec(ws, f"{a}.q_a_layernorm", q_rank)
            _lin(ws, f"{a}.q_b_proj", q_rank, n_heads * (nope + rope))
        else:
            _lin(ws, f"{a}.q_proj", hidden, n_heads * (nope + rope))
        _lin(ws, f"{a}.kv_a_proj_with_mqa", hidden, r + rope, bool(c.get("attention_bias", default=False)))
        _vec(ws, f"{a}.kv_a_layernorm", r)
        _lin(ws, f"{a}.kv_b_proj", r, n_heads * (nope + vhd))
        _lin(ws, f"{a}.o_proj", n_heads * vhd, hidden, bool(c.get("attention_bias", default=False)))
        if n_routed and i >= first_dense and i % freq == 0:
            if not top_k:
                raise EdgekvError(f"{c.where}: config lacks 'num_experts_per_tok' for its MoE layers")
            _moe_mlp(ws, f"{p}.mlp", hidden, moe_inter, n_routed, top_k, n_shared,
                     score_bias=MODEL_TYPES[mt].score_bias)
        else:
            _mlp(ws, f"{p}.mlp", hidden, inter)
        _vec(ws, f"{p}.input_layernorm", hidden)
        _vec(ws, f"{p}.post_attention_layernorm", hidden)
        blocks.append(Block((MLA(n_heads, r, rope, nope, vhd),)))
    _vec(ws, "model.norm", hidden)
    _embed_and_head(ws, vocab, hidden, tied)
    return hidden, vocab, blocks, ws
