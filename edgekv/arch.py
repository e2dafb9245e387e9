"""Arch: what a model is made of, read from a Hugging Face config.json, a GGUF header or the built-in catalog.

An Arch is a list of blocks, each with its sequence mixers (attention, MLA, SSM, linear recurrence; a Falcon-H1 block
has two) and the full list of weight tensors with their shapes, derived from the config the way transformers builds
the model. Parameter counts and weight bytes come from those shapes, never from a model's name.

Every reader follows transformers' config class for its model_type (field names, defaults, legacy aliases). A field the
architecture needs that is missing and has no documented default is an error, never a guess.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EdgekvError

# ---- mixers: the part of a block that carries state across tokens ----


@dataclass(frozen=True)
class Attention:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    window: int | None = None  # native sliding window (tokens), None = global
    kind: str = "attention"


@dataclass(frozen=True)
class MLA:
    n_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    kind: str = "mla"


@dataclass(frozen=True)
class SSM:
    version: int  # 1 = Mamba-1 (selective scan per channel), 2 = Mamba-2 (SSD, per head)
    d_inner: int
    d_state: int
    d_conv: int
    n_heads: int = 0  # Mamba-2
    head_dim: int = 0  # Mamba-2
    n_groups: int = 1  # Mamba-2

    kind: str = "ssm"

    @property
    def conv_dim(self) -> int:
        """Channels that pass through the causal conv (and so are kept in the conv state)."""
        return self.d_inner if self.version == 1 else self.d_inner + 2 * self.n_groups * self.d_state


@dataclass(frozen=True)
class Linear:
    """A linear-attention / RWKV recurrence. State per layer: n_vectors x width (RWKV-4) or n_heads x d_k x d_v."""
    n_heads: int
    d_k: int
    d_v: int
    n_vectors: int = 0  # RWKV-4 keeps 5 hidden-sized vectors per layer (transformers order: x_ffn, x_att, num, den, max)
    width: int = 0
    kind: str = "linear"


@dataclass(frozen=True)
class ShortConv:
    """LFM2's gated short convolution (transformers' Lfm2ShortConv): a depthwise causal conv of kernel d_conv over
    width channels between an input and an output gate. State per layer: its last d_conv - 1 inputs."""
    width: int
    d_conv: int
    kind: str = "conv"


Mixer = Attention | MLA | SSM | Linear | ShortConv


@dataclass(frozen=True)
class Weight:
    """One weight tensor. cls decides its quantization: linear | embedding | lm_head | small (norms, conv, A, D, biases).
    read_fraction < 1 for routed MoE experts: a decode step reads top_k of n_experts of them."""
    name: str
    shape: tuple[int, ...]
    cls: str
    read_fraction: float = 1.0
    gguf_type: str | None = None  # the stored type when read from a GGUF
    gguf_bytes: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Block:
    mixers: tuple[Mixer, ...]


@dataclass(eq=False)  # identity: Archs are cached and hashed by object
class Arch:
    name: str
    model_type: str
    family: str  # transformer | mla | ssm | linear | hybrid
    hidden: int
    vocab: int
    blocks: tuple[Block, ...]
    weights: tuple[Weight, ...]
    max_position: int | None = None
    source: str = ""
    gguf_path: str | None = None
    notes: list[str] = field(default_factory=list)
    # the context the model was trained at and where that number comes from (trained_ctx_of); None = unknown
    trained_ctx: tuple[int, str] | None = None

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @functools.cached_property
    def n_params(self) -> int:
        return sum(w.numel for w in self.weights)

    @functools.cached_property
    def n_active_params(self) -> float:
        """Parameters one decode token touches (routed experts weighted by top_k / n_experts)."""
        return sum(w.numel * w.read_fraction for w in self.weights)

    @property
    def non_embedding_params(self) -> int:
        return sum(w.numel for w in self.weights if w.cls not in ("embedding",))

    def mixers(self, kind: str) -> list[tuple[int, Mixer]]:
        """(block index, mixer) for every mixer of that kind, in order."""
        return [(i, m) for i, b in enumerate(self.blocks) for m in b.mixers if m.kind == kind]

    @property
    def kinds(self) -> set[str]:
        return {m.kind for b in self.blocks for m in b.mixers}

    @property
    def mlp_width(self) -> int:
        """The widest MLP up projection's output width: transformers names it `*up_proj.weight`, GGUF
        `blk.N.ffn_up.weight`; 4 x hidden when there is none."""
        ups = [w.shape[0] for w in self.weights if w.name.endswith(UP_PROJ_NAMES)]
        return max(ups, default=4 * self.hidden)


# the names of an MLP's up projection: transformers' `up_proj` / `gate_up_proj`, GGUF's `ffn_up`
UP_PROJ_NAMES = ("up_proj.weight", "ffn_up.weight")


# ---- helpers that build weight lists like transformers' modules do ----


def _lin(ws: list, name: str, n_in: int, n_out: int, bias: bool = False, cls: str = "linear", frac: float = 1.0):
    ws.append(Weight(f"{name}.weight", (n_out, n_in), cls, frac))
    if bias:
        ws.append(Weight(f"{name}.bias", (n_out,), "small", frac))


def _vec(ws: list, name: str, n: int, bias: bool = False):
    ws.append(Weight(f"{name}.weight", (n,), "small"))
    if bias:
        ws.append(Weight(f"{name}.bias", (n,), "small"))


def _mlp(ws: list, p: str, hidden: int, inter: int, bias: bool = False, frac: float = 1.0):
    _lin(ws, f"{p}.gate_proj", hidden, inter, bias, frac=frac)
    _lin(ws, f"{p}.up_proj", hidden, inter, bias, frac=frac)
    _lin(ws, f"{p}.down_proj", inter, hidden, bias, frac=frac)


def _embed_and_head(ws: list, vocab: int, hidden: int, tied: bool, head_name: str = "lm_head"):
    ws.insert(0, Weight("model.embed_tokens.weight", (vocab, hidden), "embedding"))
    if not tied:
        ws.append(Weight(f"{head_name}.weight", (vocab, hidden), "lm_head"))


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


# ---- per model_type readers ----


def _decoder(c: Cfg, mt: str) -> tuple[int, int, list[Block], list[Weight]]:
    """Llama-family decoders: llama, mistral, qwen2, qwen3, phi3, smollm3, gemma2, gemma3(_text)."""
    hidden = c.int("hidden_size", "n_embd", "d_model")
    n_layers = c.int("num_hidden_layers", "n_layer", "num_layers")
    n_heads = c.int("num_attention_heads", "n_head")
    n_kv = c.int("num_key_value_heads", default=n_heads)
    if n_kv == 0 or n_heads % n_kv:
        raise EdgekvError(f"{c.where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    hd = c.int("head_dim", default=hidden // n_heads)
    inter = c.int("intermediate_size")
    vocab = c.int("vocab_size")
    gemma = mt.startswith("gemma")
    # transformers: True for Gemma and SmolLM3, False for the others
    tied = bool(c.get("tie_word_embeddings", default=gemma or mt == "smollm3"))
    qkv_bias = {"qwen2": True}.get(mt, bool(c.get("attention_bias", default=False)))
    mlp_bias = bool(c.get("mlp_bias", default=False))
    for f in ("attention_chunk_size", "no_rope_layers", "moe_layers", "num_local_experts"):
        if f == "no_rope_layers" and mt == "smollm3":  # SmolLM3's NoPE layers: the same weights and state
            continue
        if c.get(f, default=None):  # Llama 4-style chunked attention / MoE fields: another layer pattern
            raise EdgekvError(f"{c.where}: '{f}' is set: edgekv's {mt} reader has dense, full or sliding attention "
                              "layers only and cannot read this layer pattern")
    windows = _layer_windows(c, mt, n_layers)
    ws: list[Weight] = []
    blocks = []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        _lin(ws, f"{p}.self_attn.q_proj", hidden, n_heads * hd, qkv_bias)
        _lin(ws, f"{p}.self_attn.k_proj", hidden, n_kv * hd, qkv_bias)
        _lin(ws, f"{p}.self_attn.v_proj", hidden, n_kv * hd, qkv_bias)
        _lin(ws, f"{p}.self_attn.o_proj", n_heads * hd, hidden, bool(c.get("attention_bias", default=False)))
        if mt in ("qwen3",) or mt.startswith("gemma3"):
            _vec(ws, f"{p}.self_attn.q_norm", hd)
            _vec(ws, f"{p}.self_attn.k_norm", hd)
        _mlp(ws, f"{p}.mlp", hidden, inter, mlp_bias)
        _vec(ws, f"{p}.input_layernorm", hidden)
        _vec(ws, f"{p}.post_attention_layernorm", hidden)
        if gemma:
            _vec(ws, f"{p}.pre_feedforward_layernorm", hidden)
            _vec(ws, f"{p}.post_feedforward_layernorm", hidden)
        blocks.append(Block((Attention(n_heads, n_kv, hd, windows[i]),)))
    _vec(ws, "model.norm", hidden)
    _embed_and_head(ws, vocab, hidden, tied)
    return hidden, vocab, blocks, ws


def _layer_windows(c: Cfg, mt: str, n_layers: int) -> list[int | None]:
    """Which layers use a native sliding window, following each config class's conventions."""
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
    if mt == "gemma2":
        # transformers Gemma2: even layers (0, 2, ...) slide, odd layers are global
        return [int(c.int("sliding_window", default=4096)) if i % 2 == 0 else None for i in range(n_layers)]
    if mt.startswith("gemma3"):
        pattern = c.int("sliding_window_pattern", "_sliding_window_pattern", default=6)
        w = c.int("sliding_window", default=4096)
        return [None if (i + 1) % pattern == 0 else w for i in range(n_layers)]
    if mt == "qwen2" or mt == "qwen3":
        if not c.get("use_sliding_window", default=False) or not sw:
            return [None] * n_layers
        first = c.int("max_window_layers", default=n_layers)
        return [int(sw) if i >= first else None for i in range(n_layers)]
    if mt in ("mistral", "phi3") and sw:
        return [int(sw)] * n_layers
    if sw and mt == "llama":  # transformers' Llama has no sliding window: a config naming one is a fork's
        raise EdgekvError(f"{c.where}: sliding_window {sw!r} in a llama config (transformers' Llama attends to every "
                          "token; which layers slide cannot be read): remove it, or give layer_types")
    return [None] * n_layers


def _moe_mlp(ws: list, p: str, hidden: int, inter: int, n_experts: int, top_k: int, n_shared: int,
             router_bias: bool = False, score_bias: bool = False):
    ws.append(Weight(f"{p}.gate.weight", (n_experts, hidden), "small" if n_experts * hidden < 2**16 else "linear"))
    if score_bias:
        ws.append(Weight(f"{p}.gate.e_score_correction_bias", (n_experts,), "small"))
    frac = top_k / n_experts
    for e in range(n_experts):
        _mlp(ws, f"{p}.experts.{e}", hidden, inter, frac=frac)
    if n_shared:
        _mlp(ws, f"{p}.shared_experts", hidden, inter * n_shared)


def _deepseek(c: Cfg, mt: str):
    hidden = c.int("hidden_size")
    n_layers = c.int("num_hidden_layers")
    n_heads = c.int("num_attention_heads")
    vocab = c.int("vocab_size")
    r = c.int("kv_lora_rank")
    rope = c.int("qk_rope_head_dim")
    nope = c.int("qk_nope_head_dim")
    vhd = c.int("v_head_dim")
    q_rank = c.get("q_lora_rank", default=None)
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
            _moe_mlp(ws, f"{p}.mlp", hidden, moe_inter, n_routed, top_k, n_shared, score_bias=(mt == "deepseek_v3"))
        else:
            _mlp(ws, f"{p}.mlp", hidden, inter)
        _vec(ws, f"{p}.input_layernorm", hidden)
        _vec(ws, f"{p}.post_attention_layernorm", hidden)
        blocks.append(Block((MLA(n_heads, r, rope, nope, vhd),)))
    _vec(ws, "model.norm", hidden)
    _embed_and_head(ws, vocab, hidden, tied)
    return hidden, vocab, blocks, ws


def _mamba1_mixer(ws: list, p: str, hidden: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int,
                  conv_bias: bool, proj_bias: bool, jamba_norms: bool = False) -> SSM:
    _lin(ws, f"{p}.in_proj", hidden, 2 * d_inner, proj_bias)
    ws.append(Weight(f"{p}.conv1d.weight", (d_inner, 1, d_conv), "small"))
    if conv_bias:
        ws.append(Weight(f"{p}.conv1d.bias", (d_inner,), "small"))
    _lin(ws, f"{p}.x_proj", d_inner, dt_rank + 2 * d_state)
    _lin(ws, f"{p}.dt_proj", dt_rank, d_inner, True)
    ws.append(Weight(f"{p}.A_log", (d_inner, d_state), "small"))
    ws.append(Weight(f"{p}.D", (d_inner,), "small"))
    _lin(ws, f"{p}.out_proj", d_inner, hidden, proj_bias)
    if jamba_norms:
        _vec(ws, f"{p}.dt_layernorm", dt_rank)
        _vec(ws, f"{p}.b_layernorm", d_state)
        _vec(ws, f"{p}.c_layernorm", d_state)
    return SSM(1, d_inner, d_state, d_conv)


def _mamba2_mixer(ws: list, p: str, hidden: int, d_inner: int, n_heads: int, head_dim: int, n_groups: int,
                  d_state: int, d_conv: int, conv_bias: bool, proj_bias: bool, gated_norm: bool = True) -> SSM:
    if n_heads * head_dim != d_inner:
        raise EdgekvError(f"{p}: mamba2 heads {n_heads} x head_dim {head_dim} != d_inner {d_inner}")
    conv_dim = d_inner + 2 * n_groups * d_state
    _lin(ws, f"{p}.in_proj", hidden, 2 * d_inner + 2 * n_groups * d_state + n_heads, proj_bias)
    ws.append(Weight(f"{p}.conv1d.weight", (conv_dim, 1, d_conv), "small"))
    if conv_bias:
        ws.append(Weight(f"{p}.conv1d.bias", (conv_dim,), "small"))
    ws.append(Weight(f"{p}.dt_bias", (n_heads,), "small"))
    ws.append(Weight(f"{p}.A_log", (n_heads,), "small"))
    ws.append(Weight(f"{p}.D", (n_heads,), "small"))
    if gated_norm:
        _vec(ws, f"{p}.norm", d_inner)
    _lin(ws, f"{p}.out_proj", d_inner, hidden, proj_bias)
    return SSM(2, d_inner, d_state, d_conv, n_heads, head_dim, n_groups)


def _mamba(c: Cfg, mt: str):
    layer = (c.get("ssm_cfg", default=None) or {}).get("layer")
    if layer and {"Mamba1": "mamba", "Mamba2": "mamba2"}.get(layer) != mt:
        raise EdgekvError(f"{c.where}: ssm_cfg.layer {layer!r} does not match model_type {mt!r}")
    hidden = c.int("hidden_size", "d_model")
    n_layers = c.int("num_hidden_layers", "n_layer")
    vocab = c.int("vocab_size")
    d_state = c.int("state_size", "d_state", default=16 if mt == "mamba" else 128)
    d_conv = c.int("conv_kernel", "d_conv", default=4)
    expand = c.get("expand", default=2)
    d_inner = int(c.get("intermediate_size", default=int(expand * hidden)))
    tied = bool(c.get("tie_word_embeddings", default=True))
    conv_bias = bool(c.get("use_conv_bias", "conv_bias", default=True))
    proj_bias = bool(c.get("use_bias", "bias", default=False))
    ws, blocks = [], []
    for i in range(n_layers):
        p = f"backbone.layers.{i}"
        if mt == "mamba":
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
                            default=False)), gated_norm=bool(c.get("mamba_rms_norm", default=False)))
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
                            bool(c.get("use_conv_bias", default=True)), add_bias)
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


READERS = {
    "llama": _decoder, "mistral": _decoder, "qwen2": _decoder, "qwen3": _decoder, "phi3": _decoder, "smollm3": _decoder,
    "gemma2": _decoder, "gemma3": _decoder, "gemma3_text": _decoder,
    "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
    "mamba": _mamba, "mamba2": _mamba,
    "jamba": _jamba, "falcon_h1": _falcon_h1, "zamba2": _zamba2, "rwkv": _rwkv,
    "lfm2": _lfm2, "granitemoehybrid": _granite_hybrid,
}
SUPPORTED = sorted(READERS)


def _family(blocks: list[Block]) -> str:
    kinds = {m.kind for b in blocks for m in b.mixers}
    if len(kinds) > 1 or kinds == {"conv"}:  # a conv-only LFM2 config: plain recurrent layers, planned as a hybrid
        return "hybrid"
    return {"attention": "transformer", "mla": "mla", "ssm": "ssm", "linear": "linear"}[kinds.pop()]


def _from_mamba_ssm(config: dict, source: str) -> dict:
    """The original state-spaces/mamba config.json (mamba_ssm MambaConfig: d_model, n_layer, ssm_cfg, no model_type)
    in transformers' field names: the vocabulary padded to pad_vocab_size_multiple as mamba_ssm pads it, ssm_cfg's
    d_state / d_conv / expand / headdim / ngroups, tied embeddings as MambaConfig's default. A config with attention
    layers (attn_layer_idx) is a hybrid this translation does not read."""
    ssm = config["ssm_cfg"]
    layer = ssm.get("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise EdgekvError(f"{source}: ssm_cfg.layer {layer!r} is not Mamba1 or Mamba2")
    if config.get("attn_layer_idx"):
        raise EdgekvError(f"{source}: attn_layer_idx is set: a mamba_ssm hybrid with attention layers, which "
                          "edgekv does not read")
    mt = "mamba" if layer == "Mamba1" else "mamba2"
    d = config["d_model"]
    vocab, pad = config.get("vocab_size"), config.get("pad_vocab_size_multiple", 8)
    if not isinstance(vocab, int) or not isinstance(pad, int) or pad < 1:
        raise EdgekvError(f"{source}: config lacks an integer 'vocab_size' / 'pad_vocab_size_multiple'")
    expand = ssm.get("expand", 2)
    out = {"model_type": mt, "hidden_size": d, "num_hidden_layers": config.get("n_layer"),
           "vocab_size": vocab + (-vocab) % pad, "expand": expand, "intermediate_size": int(expand * d),
           "tie_word_embeddings": config.get("tie_embeddings", True),
           "state_size": ssm.get("d_state", 16 if mt == "mamba" else 128), "conv_kernel": ssm.get("d_conv", 4)}
    if mt == "mamba2":
        hd = ssm.get("headdim", 64)
        out.update(head_dim=hd, num_heads=int(expand * d) // hd, n_groups=ssm.get("ngroups", 1))
    return out


def arch_from_config(config: dict, name: str, source: str) -> Arch:
    if not isinstance(config, dict):
        raise EdgekvError(f"{source}: config must be a JSON object")
    if "model_type" not in config and isinstance(config.get("ssm_cfg"), dict) and "d_model" in config:
        config = _from_mamba_ssm(config, source)
    mt = config.get("model_type")
    if mt == "gemma3" and isinstance(config.get("text_config"), dict):  # the multimodal wrapper: plan the text model
        config = {**config["text_config"], "model_type": "gemma3_text"}
        mt = "gemma3_text"
    if not isinstance(mt, str) or mt not in READERS:
        raise EdgekvError(f"{source}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED)}")
    c = Cfg(config, source)
    try:
        hidden, vocab, blocks, ws = READERS[mt](c, mt)
    except (TypeError, ValueError, KeyError, IndexError, ArithmeticError, AttributeError) as e:
        raise EdgekvError(f"{source}: malformed {mt} config ({type(e).__name__}: {e})") from None
    if not blocks:
        raise EdgekvError(f"{source}: config has no layers")
    max_pos = c.int("max_position_embeddings", "n_positions", "context_length", default=None)
    return Arch(name=name, model_type=mt, family=_family(blocks), hidden=hidden, vocab=vocab, blocks=tuple(blocks),
                weights=tuple(ws), max_position=int(max_pos) if max_pos else None, source=source,
                trained_ctx=trained_ctx_of(c))


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
    if kind in STRETCHING_ROPE and orig:
        return int(orig), f"config rope_scaling.original_max_position_embeddings ({kind} stretches it at inference)"
    if kind not in TRAINED_ROPE:
        raise EdgekvError(f"{c.where}: rope_scaling type {kind!r} is not one edgekv reads (known: "
                          f"{', '.join(k for k in STRETCHING_ROPE + TRAINED_ROPE if k)}): the trained context "
                          "depends on it")
    for f in ("max_position_embeddings", "n_positions", "context_length"):
        v = c.get(f, default=None)
        if v:
            return int(v), f"config {f}"
    return None


def read_config_json(path: str | Path) -> Arch:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise EdgekvError(f"{path}: no config.json there")
    from .jsonfile import read_json
    config = read_json(p)
    name = p.parent.name if p.name == "config.json" else p.stem
    return arch_from_config(config, name or "model", str(p))


# ---- GGUF: the header gives the shapes and the exact stored bytes of every tensor ----

# the model types edgekv.models.llama exports (GQA + RoPE + RMSNorm + SwiGLU decoders), here so that torch-free code
# (the planner's memory model) and the export module read the same list
LLAMA_EXPORT_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "smollm3")

GGUF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3": "gemma3_text", "phi3": "phi3", "mamba": "mamba", "mamba2": "mamba2"}


def _gguf_class(name: str) -> str:
    if name.startswith("token_embd"):
        return "embedding"
    if name.startswith("output."):
        return "lm_head"
    if name.endswith(".bias") or "norm" in name or any(t in name for t in ("ssm_conv", "ssm_a", "ssm_d", "ssm_dt.bias")):
        return "small"
    return "linear"


def read_gguf(path: str | Path) -> Arch:
    p = Path(path)
    if not p.is_file():
        raise EdgekvError(f"{path}: no such GGUF file")
    try:
        import gguf  # pure Python, numpy only
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # the reader raises many kinds of error on a damaged file
        raise EdgekvError(f"{p}: not a readable GGUF file (truncated or corrupt?: {type(e).__name__}: {e})") from None
    size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise EdgekvError(f"{p}: truncated GGUF (tensor {t.name} ends past the end of the file)")

    def field(key, default=...):
        f = reader.fields.get(key)
        if f is None:
            if default is ...:
                raise EdgekvError(f"{p}: GGUF metadata lacks '{key}'")
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch not in GGUF_ARCH:
        raise EdgekvError(f"{p}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCH))}")
    tensors = {t.name: t for t in reader.tensors}
    try:
        cfg = _gguf_config(arch, field, reader, tensors)
    except (TypeError, ValueError, KeyError, IndexError, ArithmeticError, AttributeError) as e:
        raise EdgekvError(f"{p}: malformed GGUF metadata ({type(e).__name__}: {e})") from None
    base = arch_from_config(cfg, p.stem, str(p))
    weights = tuple(Weight(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), _gguf_class(t.name),
                           gguf_type=t.tensor_type.name, gguf_bytes=int(t.n_bytes)) for t in reader.tensors)
    ftype = field("general.file_type", None)
    base.weights = weights
    base.gguf_path = str(p)
    base.notes.append(f"weights as stored in the GGUF (file_type {ftype}): exact bytes per tensor")
    return base


def _gguf_config(arch: str, field, reader, tensors) -> dict:
    """A config.json-style dict from a GGUF's metadata (llama.cpp's key names)."""
    vocab = field(f"{arch}.vocab_size", None) or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {"model_type": GGUF_ARCH[arch], "vocab_size": int(vocab),
           "hidden_size": field(f"{arch}.embedding_length"), "num_hidden_layers": field(f"{arch}.block_count"),
           "max_position_embeddings": field(f"{arch}.context_length", None),
           "tie_word_embeddings": "output.weight" not in tensors}
    if arch.startswith("mamba"):
        cfg.update(intermediate_size=field(f"{arch}.ssm.inner_size"), state_size=field(f"{arch}.ssm.state_size"),
                   conv_kernel=field(f"{arch}.ssm.conv_kernel"), time_step_rank=field(f"{arch}.ssm.time_step_rank"))
    else:
        heads = field(f"{arch}.attention.head_count")
        if not heads:
            raise ValueError(f"{arch}.attention.head_count is {heads!r}")
        cfg.update(num_attention_heads=heads, num_key_value_heads=field(f"{arch}.attention.head_count_kv", heads),
                   intermediate_size=field(f"{arch}.feed_forward_length"),
                   head_dim=field(f"{arch}.attention.key_length", cfg["hidden_size"] // heads),
                   sliding_window=field(f"{arch}.attention.sliding_window", None))
    return cfg


# ---- the built-in catalog ----

CATALOG_DIR = Path(__file__).resolve().parent / "catalog"


def catalog_names() -> list[str]:
    return sorted(p.stem for p in CATALOG_DIR.glob("*.json"))


def catalog_entry(name: str) -> dict:
    p = CATALOG_DIR / f"{name.lower()}.json"
    if not p.is_file() and ("/" in name or "\\" in name or name.lower().endswith((".json", ".gguf"))):
        raise EdgekvError(f"{name}: no such file or folder (a model is a catalog name, a config.json, an HF model "
                          "folder or a .gguf file, on this machine: nothing is downloaded; `edgekv models` lists the catalog)")
    if not p.is_file():
        raise EdgekvError(f"unknown model {name!r}; catalog models: {', '.join(catalog_names())} "
                          f"(or pass a config.json, an HF model folder or a .gguf file)")
    return json.loads(p.read_text())


@functools.lru_cache(maxsize=None)
def catalog_arch(name: str) -> Arch:
    """Cached: catalog Archs are built once per process and must not be mutated."""
    e = catalog_entry(name)
    a = arch_from_config(e["config"], e["name"], e.get("config_source", str(CATALOG_DIR / f"{name}.json")))
    if e.get("trained_ctx"):  # the catalog's cited training length overrides what the config implies
        a.trained_ctx = (int(e["trained_ctx"]["value"]), e["trained_ctx"]["source"])
    a.notes.append(f"catalog: {e.get('display_name', e['name'])} ({e.get('hf_repo', '')})")
    return a


def load_arch(spec: str) -> Arch:
    """A catalog name, an HF model folder, a config.json, or a .gguf file."""
    p = Path(spec)
    if p.suffix.lower() == ".gguf":
        return read_gguf(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").is_file() and ggufs:
            return read_gguf(ggufs[0])
        return read_config_json(p)
    if p.suffix.lower() == ".json" or p.exists():
        return read_config_json(p)
    return catalog_arch(spec)
