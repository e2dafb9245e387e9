"""Reader of Qwen3.5 (Gated DeltaNet + gated full attention)."""
from __future__ import annotations

from ..errors import EdgekvError
from .config import Cfg
from .model_types import MODEL_TYPES
from .hybrid import _check_kinds
from .types import Attention, Block, Linear, Weight
from .weights import _embed_and_head, _lin, _mlp, _vec


def _qwen3_5(c: Cfg, mt: str):
    """Qwen3.5 (transformers' Qwen3_5TextConfig / Qwen3_5ForCausalLM; a qwen3_5 config, Qwen3_5ForConditionalGeneration,
    nests it in text_config and its text weights under model.language_model, counted here under model.): Gated
    DeltaNet layers (linear_attention: a causal conv over q, k, v and a [Hv, Dk, Dv] recurrent matrix) and gated full
    attention layers (q_proj also emits a sigmoid gate per channel; qk-norm; partial RoPE), every
    full_attention_interval-th layer (default 4) full attention."""
    if MODEL_TYPES[mt].text_model:
        text = c.get("text_config", default=None)
        if not isinstance(text, dict):
            raise EdgekvError(f"{c.where}: a qwen3_5 config needs its text_config")
        c = Cfg(text, f"{c.where} text_config")
    hidden = c.int("hidden_size")
    n_layers = c.int("num_hidden_layers")
    n_heads = c.int("num_attention_heads")
    n_kv = c.int("num_key_value_heads", default=n_heads)
    hd = c.int("head_dim", default=256)
    inter = c.int("intermediate_size")
    vocab = c.int("vocab_size")
    hk, hv = c.int("linear_num_key_heads", default=16), c.int("linear_num_value_heads", default=32)
    dk, dv = c.int("linear_key_head_dim", default=128), c.int("linear_value_head_dim", default=128)
    k_conv = c.int("linear_conv_kernel_dim", default=4)
    kinds = c.get("layer_types", default=None)
    if kinds is None:
        every = c.int("full_attention_interval", default=4)
        kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    _check_kinds(c, "layer_types", kinds, n_layers, ("linear_attention", "full_attention"))
    if hv % hk or n_heads % n_kv:
        raise EdgekvError(f"{c.where}: linear_num_value_heads {hv} / linear_num_key_heads {hk} and "
                          f"num_attention_heads {n_heads} / num_key_value_heads {n_kv} must divide")
    bias = bool(c.get("attention_bias", default=False))
    ws, blocks = [], []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        if kinds[i] == "full_attention":
            _lin(ws, f"{p}.self_attn.q_proj", hidden, 2 * n_heads * hd, bias)  # query and its output gate
            _lin(ws, f"{p}.self_attn.k_proj", hidden, n_kv * hd, bias)
            _lin(ws, f"{p}.self_attn.v_proj", hidden, n_kv * hd, bias)
            _lin(ws, f"{p}.self_attn.o_proj", n_heads * hd, hidden, bias)
            _vec(ws, f"{p}.self_attn.q_norm", hd)
            _vec(ws, f"{p}.self_attn.k_norm", hd)
            m = Attention(n_heads, n_kv, hd)
        else:
            conv = 2 * hk * dk + hv * dv
            _lin(ws, f"{p}.linear_attn.in_proj_qkv", hidden, conv)
            _lin(ws, f"{p}.linear_attn.in_proj_z", hidden, hv * dv)
            _lin(ws, f"{p}.linear_attn.in_proj_b", hidden, hv)
            _lin(ws, f"{p}.linear_attn.in_proj_a", hidden, hv)
            ws.append(Weight(f"{p}.linear_attn.conv1d.weight", (conv, 1, k_conv), "small"))
            _vec(ws, f"{p}.linear_attn.dt_bias", hv)
            _vec(ws, f"{p}.linear_attn.A_log", hv)
            _vec(ws, f"{p}.linear_attn.norm", dv)
            _lin(ws, f"{p}.linear_attn.out_proj", hv * dv, hidden)
            m = Linear(n_heads=hv, d_k=dk, d_v=dv, conv_dim=conv, d_conv=k_conv)
        _mlp(ws, f"{p}.mlp", hidden, inter)
        _vec(ws, f"{p}.input_layernorm", hidden)
        _vec(ws, f"{p}.post_attention_layernorm", hidden)
        blocks.append(Block((m,)))
    _vec(ws, "model.norm", hidden)
    _embed_and_head(ws, vocab, hidden, bool(c.get("tie_word_embeddings", default=False)))
    return hidden, vocab, blocks, ws
