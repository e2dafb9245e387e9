"""Readers of the attention + SSM hybrids: Jamba, Falcon-H1, Zamba2."""
from __future__ import annotations

import math

from ..errors import EdgekvError
from .config import Cfg
from .types import Attention, Block, Weight
from .weights import _embed_and_head, _lin, _mamba1_mixer, _mamba2_mixer, _mlp, _vec


def _jamba(c: Cfg, mt: str):
    hidden = c.int("hidden_size")
    n_layers = c.int("num_hidden_layers")
    n_heads = c.int("num_attention_heads")
    n_kv = c.int("num_key_value_heads", default=n_heads)
    hd = hidden // n_heads
    inter = c.int("intermediate_size")
    vocab = c.int("vocab_size")
    n_experts = c.int("num_experts", default=16)
    top_k = c.int("num_experts_per_tok", default=2)
    d_state = c.int("mamba_d_state", default=16)
    d_conv = c.int("mamba_d_conv", default=4)
    d_inner = int(c.get("mamba_expand", default=2) * hidden)
    dt_rank = c.get("mamba_dt_rank", default="auto")
    dt_rank = math.ceil(hidden / 16) if dt_rank == "auto" else int(dt_rank)
    kinds = c.get("layers_block_type", default=None)
    if kinds is None:
        period, off = c.int("attn_layer_period", default=8), c.int("attn_layer_offset", default=4)
        kinds = ["attention" if i % period == off else "mamba" for i in range(n_layers)]
    _check_kinds(c, "layers_block_type", kinds, n_layers, ("attention", "mamba"))
    eperiod, eoff = c.int("expert_layer_period", default=2), c.int("expert_layer_offset", default=1)
    ws, blocks = [], []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        if kinds[i] == "attention":
            _lin(ws, f"{p}.self_attn.q_proj", hidden, n_heads * hd)
            _lin(ws, f"{p}.self_attn.k_proj", hidden, n_kv * hd)
            _lin(ws, f"{p}.self_attn.v_proj", hidden, n_kv * hd)
            _lin(ws, f"{p}.self_attn.o_proj", n_heads * hd, hidden)
            m = Attention(n_heads, n_kv, hd, c.get("sliding_window", default=None))
        else:
            m = _mamba1_mixer(ws, f"{p}.mamba", hidden, d_inner, d_state, d_conv, dt_rank,
                              bool(c.get("mamba_conv_bias", default=True)), bool(c.get("mamba_proj_bias",
                              default=False)), jamba_norms=True)
        if n_experts > 1 and i % eperiod == eoff:
            ws.append(Weight(f"{p}.feed_forward.router.weight", (n_experts, hidden), "small"))
            for e in range(n_experts):
                _mlp(ws, f"{p}.feed_forward.experts.{e}", hidden, inter, frac=top_k / n_experts)
        else:
            _mlp(ws, f"{p}.feed_forward", hidden, inter)
        _vec(ws, f"{p}.input_layernorm", hidden)
        _vec(ws, f"{p}.pre_ff_layernorm", hidden)
        blocks.append(Block((m,)))
    _vec(ws, "model.final_layernorm", hidden)
    _embed_and_head(ws, vocab, hidden, bool(c.get("tie_word_embeddings", default=False)))
    return hidden, vocab, blocks, ws


def _check_kinds(c: Cfg, field_name: str, kinds, n_layers: int, known: tuple[str, ...]) -> None:
    """A per-layer kind list must name every layer with a kind the reader builds (one line naming the field)."""
    if not isinstance(kinds, list) or len(kinds) != n_layers:
        raise EdgekvError(f"{c.where}: {field_name} must list one kind per layer ({n_layers} layers)")
    odd = sorted({str(k) for k in kinds} - set(known))
    if odd:
        raise EdgekvError(f"{c.where}: {field_name} names {', '.join(map(repr, odd))}: edgekv reads "
                          f"{', '.join(known)} layers of {c.d.get('model_type')}")


def _falcon_h1(c: Cfg, mt: str):
    """Falcon-H1: every block runs attention and a Mamba-2 mixer in parallel, then an MLP."""
    hidden = c.int("hidden_size")
    n_layers = c.int("num_hidden_layers")
    n_heads = c.int("num_attention_heads")
    n_kv = c.int("num_key_value_heads", default=n_heads)
    hd = c.int("head_dim", default=hidden // n_heads)
    inter = c.int("intermediate_size")
    vocab = c.int("vocab_size")
    m_heads = c.int("mamba_n_heads")
    m_hd = c.int("mamba_d_head")
    d_ssm = c.int("mamba_d_ssm", default=m_heads * m_hd)
    groups = c.int("mamba_n_groups", default=1)
    d_state = c.int("mamba_d_state")
    d_conv = c.int("mamba_d_conv", default=4)
    attn_bias = bool(c.get("attention_bias", default=False))
    ws, blocks = [], []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        _lin(ws, f"{p}.self_attn.q_proj", hidden, n_heads * hd, attn_bias)
        _lin(ws, f"{p}.self_attn.k_proj", hidden, n_kv * hd, attn_bias)
        _lin(ws, f"{p}.self_attn.v_proj", hidden, n_kv * hd, attn_bias)
        _lin(ws, f"{p}.self_attn.o_proj", n_heads * hd, hidden, attn_bias)
        ssm = _mamba2_mixer(ws, f"{p}.mamba", hidden, d_ssm, m_heads, m_hd, groups, d_state, d_conv,
                            bool(c.get("mamba_conv_bias", default=True)), bool(c.get("mamba_proj_bias",
                            default=False)), gated_norm=bool(c.get("mamba_rms_norm", default=False)),
                            out_bias=bool(c.get("projectors_bias", default=False)))
        _mlp(ws, f"{p}.feed_forward", hidden, inter, bool(c.get("mlp_bias", default=False)))
        _vec(ws, f"{p}.input_layernorm", hidden)
        _vec(ws, f"{p}.pre_ff_layernorm", hidden)
        blocks.append(Block((Attention(n_heads, n_kv, hd), ssm)))
    _vec(ws, "model.final_layernorm", hidden)
    _embed_and_head(ws, vocab, hidden, bool(c.get("tie_word_embeddings", default=False)))
    return hidden, vocab, blocks, ws


def _zamba2(c: Cfg, mt: str):
    """Zamba2: a Mamba-2 backbone; 'hybrid' layers also run one of num_mem_blocks shared transformer blocks
    (attention over concat(hidden, original embeddings), so width 2*hidden) with per-layer LoRA adapters and a
    per-layer linear projection back into the stream. Each hybrid layer keeps its own KV cache."""
    hidden = c.int("hidden_size")
    n_layers = c.int("num_hidden_layers")
    vocab = c.int("vocab_size")
    kinds = c.get("layers_block_type")
    if isinstance(kinds, list):  # transformers >= 5 writes a Mamba layer as "linear_attention" (its legacy "mamba")
        kinds = ["mamba" if k == "linear_attention" else k for k in kinds]
    _check_kinds(c, "layers_block_type", kinds, n_layers, ("mamba", "hybrid"))
    n_heads = c.int("num_attention_heads")
    n_kv = c.int("num_key_value_heads", default=n_heads)
    attn_hidden = c.int("attention_hidden_size", default=2 * hidden)
    hd = c.int("attention_head_dim", default=attn_hidden // n_heads)
    inter = c.int("intermediate_size", default=4 * hidden)
    n_mem = c.int("num_mem_blocks", default=1)
    rank = c.int("adapter_rank", default=128)
    shared_attn_adapter = bool(c.get("use_shared_attention_adapter", default=False))
    d_inner = int(c.get("mamba_expand", default=2) * hidden)
    m_hd = c.int("mamba_headdim", default=64)
    m_heads = c.int("n_mamba_heads", default=d_inner // m_hd)
    groups = c.int("mamba_ngroups", default=1)
    d_state = c.int("mamba_d_state", default=64)
    d_conv = c.int("mamba_d_conv", default=4)
    add_bias = bool(c.get("add_bias_linear", default=False))
    ws, blocks = [], []
    for j in range(n_mem):  # the shared transformer blocks
        p = f"model.blocks.{j}"
        _lin(ws, f"{p}.self_attn.q_proj", attn_hidden, n_heads * hd)
        _lin(ws, f"{p}.self_attn.k_proj", attn_hidden, n_kv * hd)
        _lin(ws, f"{p}.self_attn.v_proj", attn_hidden, n_kv * hd)
        _lin(ws, f"{p}.self_attn.o_proj", n_heads * hd, hidden)
        _lin(ws, f"{p}.feed_forward.gate_up_proj", hidden, 2 * inter, add_bias)  # the MLP reads hidden, not 2x
        _lin(ws, f"{p}.feed_forward.down_proj", inter, hidden, add_bias)
        _vec(ws, f"{p}.input_layernorm", attn_hidden)
        _vec(ws, f"{p}.pre_ff_layernorm", hidden)
    hybrid_i = 0
    for i in range(n_layers):
        p = f"model.layers.{i}"
        mixers = []
        ssm = _mamba2_mixer(ws, f"{p}.mamba", hidden, d_inner, m_heads, m_hd, groups, d_state, d_conv,
                            True, add_bias)  # Zamba2MambaMixer's conv1d always has a bias (use_conv_bias unread)
        _vec(ws, f"{p}.input_layernorm", hidden)
        mixers.append(ssm)
        if kinds[i] == "hybrid":
            j = hybrid_i % n_mem
            _lin(ws, f"{p}.linear", hidden, hidden)
            # LoRA adapters live in the shared block's module lists, one per hybrid layer (transformers: the shared
            # block's feed_forward.gate_up_proj_adapter_list and self_attn.linear_{q,k,v}_adapter_list)
            _lin(ws, f"{p}.ffn_adapter.0", hidden, rank)
            _lin(ws, f"{p}.ffn_adapter.1", rank, 2 * inter)
            if shared_attn_adapter:
                for t in ("q", "k", "v"):
                    _lin(ws, f"{p}.attn_adapter_{t}.0", attn_hidden, rank)
                    _lin(ws, f"{p}.attn_adapter_{t}.1", rank, (n_heads if t == "q" else n_kv) * hd)
            mixers.insert(0, Attention(n_heads, n_kv, hd))
            hybrid_i += 1
        blocks.append(Block(tuple(mixers)))
    _vec(ws, "model.final_layernorm", hidden)
    _embed_and_head(ws, vocab, hidden, bool(c.get("tie_word_embeddings", default=True)))
    return hidden, vocab, blocks, ws


# Zyphra's own Zamba2 config (its transformers fork, written before transformers 4.48 read Zamba2; e.g.
# Zyphra/Zamba2-1.2B at revision 4f8e85cd) -> transformers' Zamba2Config names. One to one, except that transformers
# derives n_mamba_heads' head size (mamba_headdim = mamba_expand * hidden_size // n_mamba_heads) where the fork
# stores the head size itself.
_ZAMBA2_FORK_NAMES = {"state_size": "mamba_d_state", "conv_dimension": "mamba_d_conv",
                      "expansion_factor": "mamba_expand", "lora_rank": "adapter_rank",
                      "use_shared_attention_lora": "use_shared_attention_adapter",
                      "ffn_hidden_size": "intermediate_size"}
_ZAMBA2_FORK_KINDS = {"m": "mamba", "g": "hybrid"}


def is_zamba2_fork(config: dict) -> bool:
    """Does this zamba2 config use the fork's names ('m'/'g' layer kinds, state_size, expansion_factor, ...)?"""
    kinds = config.get("layers_block_type")
    return (any(k in config for k in ("state_size", "conv_dimension", "expansion_factor"))
            or (isinstance(kinds, list) and any(k in _ZAMBA2_FORK_KINDS for k in kinds)))


def from_zamba2_fork(config: dict, source: str) -> dict:
    """The fork's config in transformers' Zamba2Config names; a field given under both names with different values
    is refused (which one the checkpoint was built with is unknown)."""
    out = dict(config)
    for fork, name in _ZAMBA2_FORK_NAMES.items():
        if fork not in config:
            continue
        v = out.pop(fork)
        if name in config and config[name] != v:
            raise EdgekvError(f"{source}: zamba2 config gives both {fork} {v!r} (Zyphra's fork's name) and "
                              f"{name} {config[name]!r} (transformers'); they must agree")
        out[name] = v
    kinds = config.get("layers_block_type")
    if isinstance(kinds, list):
        out["layers_block_type"] = [_ZAMBA2_FORK_KINDS.get(k, k) if isinstance(k, str) else k for k in kinds]
    hd = config.get("mamba_headdim")
    if "n_mamba_heads" not in config and isinstance(hd, int) and not isinstance(hd, bool) and hd > 0:
        hidden, expand = config.get("hidden_size"), out.get("mamba_expand", 2)
        if isinstance(hidden, int) and isinstance(expand, (int, float)) and math.isfinite(expand):
            out["n_mamba_heads"] = int(expand * hidden) // hd
    return out
