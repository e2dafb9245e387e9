"""Reader of Granite-4.0-H (IBM's GraniteMoeHybrid): Mamba-2 layers + GQA attention layers, dense or MoE."""
from __future__ import annotations

from ..errors import EdgekvError
from .config import Cfg
from .hybrid import _check_kinds
from .types import Attention, Block, Weight
from .weights import _embed_and_head, _lin, _mamba2_mixer, _vec


def _granite_hybrid(c: Cfg, mt: str):
    """Granite-4.0-H (GraniteMoeHybridConfig / GraniteMoeHybridForCausalLM): layer_types picks, per layer, a Mamba-2
    mixer ("mamba" / "linear_attention") or GQA attention (RoPE only with position_embedding_type "rope"); every
    layer then runs the shared SwiGLU MLP (input_linear -> 2 x shared_intermediate_size) and, when
    num_local_experts > 0, a top-k MoE of intermediate_size experts beside it."""
    hidden = c.int("hidden_size")
    n_layers = c.int("num_hidden_layers")
    n_heads = c.int("num_attention_heads")
    n_kv = c.int("num_key_value_heads", default=n_heads)
    if n_kv == 0 or n_heads % n_kv:
        raise EdgekvError(f"{c.where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    hd = hidden // n_heads
    vocab = c.int("vocab_size")
    bias = bool(c.get("attention_bias", default=False))
    m_heads = c.int("mamba_n_heads", default=128)
    d_inner = int(c.get("mamba_expand", default=2) * hidden)
    m_hd = c.get("mamba_d_head", default="auto")
    m_hd = d_inner // m_heads if m_hd == "auto" else c.int("mamba_d_head")
    groups, d_state = c.int("mamba_n_groups", default=1), c.int("mamba_d_state", default=256)
    d_conv = c.int("mamba_d_conv", default=4)
    n_exp, top_k = c.int("num_local_experts", default=8), c.int("num_experts_per_tok", default=2)
    shared = c.int("shared_intermediate_size", default=1024)
    kinds = c.get("layer_types", "layers_block_type", default=["linear_attention"] * n_layers)
    # published configs say mamba / attention, transformers >= 5 writes linear_attention / full_attention
    _check_kinds(c, "layer_types", kinds, n_layers, ("mamba", "linear_attention", "attention", "full_attention"))
    ws, blocks = [], []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        if kinds[i] in ("attention", "full_attention"):
            _lin(ws, f"{p}.self_attn.q_proj", hidden, n_heads * hd, bias)
            _lin(ws, f"{p}.self_attn.k_proj", hidden, n_kv * hd, bias)
            _lin(ws, f"{p}.self_attn.v_proj", hidden, n_kv * hd, bias)
            _lin(ws, f"{p}.self_attn.o_proj", n_heads * hd, hidden, bias)
            m = Attention(n_heads, n_kv, hd)
        else:
            m = _mamba2_mixer(ws, f"{p}.mamba", hidden, d_inner, m_heads, m_hd, groups, d_state, d_conv,
                              bool(c.get("mamba_conv_bias", default=True)), bool(c.get("mamba_proj_bias",
                                                                                       default=False)))
        if n_exp > 0:
            inter = c.int("intermediate_size")
            ws.append(Weight(f"{p}.block_sparse_moe.router.layer.weight", (n_exp, hidden), "small"))
            ws.append(Weight(f"{p}.block_sparse_moe.input_linear.weight", (n_exp, 2 * inter, hidden), "linear",
                             top_k / n_exp))
            ws.append(Weight(f"{p}.block_sparse_moe.output_linear.weight", (n_exp, hidden, inter), "linear",
                             top_k / n_exp))
        _lin(ws, f"{p}.shared_mlp.input_linear", hidden, 2 * shared)
        _lin(ws, f"{p}.shared_mlp.output_linear", shared, hidden)
        _vec(ws, f"{p}.input_layernorm", hidden)
        _vec(ws, f"{p}.post_attention_layernorm", hidden)
        blocks.append(Block((m,)))
    _vec(ws, "model.norm", hidden)
    _embed_and_head(ws, vocab, hidden, bool(c.get("tie_word_embeddings", default=False)))
    return hidden, vocab, blocks, ws
