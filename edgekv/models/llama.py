"""Llama-family decode step, written for export: forward(tokens, pos, *state) -> (logits, *new_state).

Covers every decoder edgekv.arch.variants declares exported (Llama-2/3.x, SmolLM2, Qwen2/2.5, Mistral, Qwen3, SmolLM3,
Gemma 3 text, OLMo-2, Phi-3 through its rewrite): GQA attention with RoPE (default, linear or llama3 scaling, or
llama.cpp's per-frequency `rope_freqs` factors), RMSNorm, a gated MLP and optional q/k/v biases; and what the variants
declare beyond that, each a LlamaArgs field read from the variant:
  - norms: where a layer's RMSNorms sit (pre: before attention and MLP; sandwich: Gemma's, before and after each;
    post: OLMo-2's, after each only), norm_offset 1 for Gemma's (1 + w) norms.
  - qk_norm: an RMSNorm of q and k before RoPE, over each head's D channels ("head": Qwen3, Gemma 3) or over the whole
    projection ("proj": OLMo-2).
  - Gemma 3: embeddings scaled by sqrt(d), a GeGLU MLP (gelu with the tanh approximation), scores scaled by
    query_pre_attn_scalar^-1/2 instead of D^-1/2, separate RoPE bases for the sliding layers (rope_local_base_freq)
    and the global ones (rope_theta), the final logits soft-capped (tanh(x / cap) * cap) when
    final_logit_softcapping is set. Its sliding layers keep a RollingCache of W slots, the global layers one slot per
    position: the model's native state.
  - SmolLM3: NoPE layers (no_rope_layers[i] == 0) attend without any rotary embedding.

Shape symbols:
  C   tokens in this call (chunked prefill: C > 1; decode: C = 1)
  T   cache slots per layer (the StateLayout's ctx, or a rolling layer's sinks + size)
  d   hidden size          F  MLP width            V  vocabulary
  H   query heads          Hkv key/value heads      G  = H / Hkv query heads per KV head      D  head dim

The state is exactly the StateLayout (edgekv.strategies.build_layout): per block i, past_key_values.{i}.key and
past_key_values.{i}.value of shape [1, Hkv, T, D] in the strategy's dtype (or their quantized codes, scales and
zeros). Nothing lives in module buffers, so the same module traces to a pure function for torch.export / ONNX /
ExecuTorch. Each layer's attention (edgekv.models.attention) keeps its state as its cache says
(edgekv.models.cache: one slot per position, or a rolling window for the window strategy and native sliding-window
layers); a runtime's fused attention replaces it layer by layer (edgekv.models.swaps). cos/sin are computed from the
positions on the fly (position * inv_freq in fp32, as LlamaRotaryEmbedding does), not read from a [max_ctx, D] table.
Positions at or past T are not written; callers keep pos + C <= max_ctx.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from ..arch import LLAMA_EXPORT_TYPES, Cfg, layer_windows
from ..arch.variants import NORM_LAYOUTS, variant
from ..errors import EdgekvError
from ..strategies import StateLayout
from .attention import Attention, Call
from .base import DecoderShell
from .cache import check_layout
from .layers import MLP, RMSNorm, rope_cos_sin, rope_inv_freq



@dataclass
class LlamaArgs:
    """The numbers the forward pass needs, read from a config.json (transformers field names) or a GGUF header."""
    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", ...} as transformers spells it
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tied: bool = False
    max_position: int | None = None
    model_type: str = "llama"
    windows: list[int | None] | None = None  # per layer: native sliding window in tokens, None = global
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (each head's D: Qwen3, Gemma 3) | "proj"
    # (the whole projection: OLMo-2) | None
    norms: str = "pre"  # where the layer's norms sit (edgekv.arch.variants.NORM_LAYOUTS): pre | sandwich | post
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + w): 1 for Gemma's
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden) (Gemma)
    act: str = "silu"  # the MLP's gate: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma)
    attn_scale: float | None = None  # the scores' scale; None: 1 / sqrt(head_dim)
    final_softcap: float | None = None  # logits -> tanh(logits / cap) * cap
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3); None: rope_theta
    rope_layers: list[bool] | None = None  # per layer: False = NoPE, no rotation at all (SmolLM3); None: all rotate
    rope_freq_factors: list[float] | None = field(default=None, repr=False)  # llama.cpp rope_freqs.weight (D/2)

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise EdgekvError(f"{self.n_heads} query heads is not a multiple of {self.n_kv_heads} KV heads")

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("rope_freq_factors")
        d["rope_freq_factors"] = self.rope_freq_factors is not None
        return d


SUPPORTED_TYPES = LLAMA_EXPORT_TYPES
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _two_ropes(cfg: dict, v, where: str) -> tuple[dict, float]:
    """A variant with two RoPE bases (Gemma 3) -> (the global layers' rope dict as the other models spell it, the
    local base).
    transformers >= 5 nests them per layer type in rope_parameters ({"full_attention": {...}, "sliding_attention":
    {...}}); published configs carry rope_theta, rope_local_base_freq and rope_scaling (the global layers' scaling),
    with Gemma3TextConfig's defaults 1e6 and 1e4 (default_theta)."""
    nested = cfg.get("rope_parameters") or {}
    full = dict(nested.get("full_attention") or {})
    local = dict(nested.get("sliding_attention") or {})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
        if "type" in full and "rope_type" not in full:
            full["rope_type"] = full["type"]
    full.setdefault("rope_theta", cfg.get("rope_theta", v.rope_theta))
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", v.local_rope_theta)))
    if local.get("rope_type", "default") != "default":
        raise EdgekvError(f"{where}: sliding-layer rope type {local['rope_type']!r} is not supported (default)")
    return full, local_theta


def args_from_hf_config(cfg: dict, where: str = "config.json") -> LlamaArgs:
    """transformers' config.json -> LlamaArgs: what the model_type's variant (edgekv.arch.variants) declares, and its
    config class's defaults for the fields the config leaves out."""
    mt = cfg.get("model_type")
    v = variant(mt)
    if mt not in SUPPORTED_TYPES or v is None:
        raise EdgekvError(f"{where}: model_type {mt!r} has no export module yet "
                          f"(supported: {', '.join(SUPPORTED_TYPES)})")
    act = cfg.get(v.act_field, v.act)
    if act not in ACTIVATIONS:
        raise EdgekvError(f"{where}: activation {act!r} is not supported (the llama module implements "
                          f"{', '.join(ACTIVATIONS)})")
    for f in v.refused:
        if cfg.get(f):
            raise EdgekvError(f"{where}: {f} is set: the llama module does not implement it for {mt} (its published "
                              "checkpoints leave it unset)")

    c = Cfg(cfg, where)
    need = c.int  # a required non-negative integer, one line naming it if missing

    hidden, n_heads, n_layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    local_theta = None
    if v.local_rope_theta is not None:
        rope, local_theta = _two_ropes(cfg, v, where)
        cfg = {k: val for k, val in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    else:
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
    legacy = cfg.get("rope_scaling") or {}  # transformers 4.x / most checkpoints on the hub
    if legacy:
        rope.update(legacy)
        if "type" in legacy and "rope_type" not in legacy:
            rope["rope_type"] = legacy["type"]
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", v.rope_theta)))
    rtype = rope.get("rope_type", "default")
    if rtype not in ("default", "linear", "llama3"):
        raise EdgekvError(f"{where}: rope type {rtype!r} is not supported yet (default, linear, llama3)")
    qkv_bias, o_bias = v.biases(bool(cfg.get("attention_bias", False)))
    cap = cfg.get("final_logit_softcapping") if v.logit_softcap else None
    return LlamaArgs(
        vocab=need("vocab_size"), hidden=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads), intermediate=need("intermediate_size"),
        rms_eps=float(cfg.get("rms_norm_eps", v.rms_eps)), rope_theta=theta,
        rope_scaling=rope if rtype != "default" else None, qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)), tied=bool(cfg.get("tie_word_embeddings", v.tied)),
        max_position=cfg.get("max_position_embeddings"), model_type=mt,
        # the planner's own reading of which layers slide (edgekv.arch), so this module and its StateLayout agree
        windows=layer_windows(c, mt, n_layers),
        qk_norm=v.qk_norm, norms=v.norms, norm_offset=v.norm_offset, embed_scale=v.embed_scale, act=ACTIVATIONS[act],
        attn_scale=(float(cfg.get("query_pre_attn_scalar", v.query_pre_attn_scalar)) ** -0.5
                    if v.query_pre_attn_scalar is not None else None),
        final_softcap=float(cap) if cap else None,
        local_rope_theta=local_theta, rope_layers=_rope_layers(cfg, v, n_layers, where))


def attention_args(src, **differences) -> LlamaArgs:
    """LlamaArgs for a hybrid family's attention (and MLP) layers, from its own args: the fields both name alike
    (vocab, hidden, n_layers, n_heads, n_kv_heads, head_dim, intermediate, rope_theta, tied, max_position,
    model_type), its eps (`eps` or `rms_eps`) and attention_bias (q/k/v and o; none where it has no such field), then
    the family's declared differences (edgekv.models.lfm2, granite_hybrid, falcon_h1, zamba2, qwen3_5)."""
    same = {f: getattr(src, f) for f in ("vocab", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                         "intermediate", "rope_theta", "tied", "max_position", "model_type")
            if f not in differences}
    bias = bool(getattr(src, "attention_bias", False))
    eps = src.rms_eps if hasattr(src, "rms_eps") else src.eps
    return LlamaArgs(**same, **{"rms_eps": eps, "qkv_bias": bias, "o_bias": bias, **differences})


def _rope_layers(cfg: dict, v, n: int, where: str) -> list[bool] | None:
    """A variant with NoPE layers (SmolLM3): no_rope_layers (1 = RoPE, 0 = NoPE; SmolLM3Config derives it from
    no_rope_layer_interval, default 4: layer i rotates iff (i + 1) % 4 != 0) -> per layer whether it rotates; None
    for the variants without."""
    if not v.nope_layers:
        return None
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if len(flags) < n:
        raise EdgekvError(f"{where}: no_rope_layers has {len(flags)} entries for {n} layers")
    return [bool(f) for f in flags[:n]]


# ---- the model ----


class Block(nn.Module):
    """One decoder layer; its norms sit where the variant's layout (LlamaArgs.norms, NORM_LAYOUTS) puts them, under
    transformers' parameter names: x += attn_out(attn(attn_in(x))); x += mlp_out(mlp(mlp_in(x))), a slot the layout
    leaves out passing its input through."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.slots = NORM_LAYOUTS[a.norms]
        for name in self.slots.values():
            setattr(self, name, RMSNorm(a.hidden, a.rms_eps, a.norm_offset))

    def norm(self, slot: str, x):
        name = self.slots.get(slot)
        return x if name is None else getattr(self, name)(x)

    def residual(self, x, h):
        """x + the attention output h, then the MLP's residual: x -> the block's output."""
        x = x + self.norm("attn_out", h)
        return x + self.norm("mlp_out", self.mlp(self.norm("mlp_in", x)))


class Llama(DecoderShell):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state).

    pos is the position of tokens[0, 0]; state is the tensors of `layout` in its order (per layer: key, value, and a
    quantized cache's scales and zeros). `caches` is each layer's cache (FullCache or RollingCache), `kv` how every
    cache is stored (KVFormat). Parameter names as transformers' LlamaForCausalLM (model.embed_tokens, model.layers,
    model.norm, lm_head), so an HF state dict loads with strict=True."""

    def __init__(self, args: LlamaArgs, layout: StateLayout):
        super().__init__(args, layout)
        self.kv, self.caches = check_layout(args, layout)
        self.make_body([Block(args) for _ in range(args.n_layers)], RMSNorm(args.hidden, args.rms_eps,
                                                                            args.norm_offset))
        for blk, cache in zip(self.model.layers, self.caches):
            blk.self_attn.cache, blk.self_attn.fmt = cache, self.kv
            if self.kv.static:
                blk.self_attn.use_static_scales()
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        # Gemma 3: the sliding layers' own RoPE base (default rope, no scaling)
        self.local_rope = args.local_rope_theta is not None
        if self.local_rope:
            local = replace(args, rope_theta=args.local_rope_theta, rope_scaling=None, rope_freq_factors=None)
            self.register_buffer("inv_freq_local", rope_inv_freq(local), persistent=False)
        self.embed_scale = args.hidden ** 0.5 if args.embed_scale else None  # Gemma3TextScaledWordEmbedding

    def fusable(self) -> bool:
        """Whether ONNX Runtime's GroupQueryAttention serves every layer (edgekv.models.swaps), so the graph writes the
        whole state in place (the manifest's state_in_place): a float cache with one slot per position in every
        layer. The planner's rule, edgekv.memory.fused_gqa, is the same; tests/test_window.py checks they agree."""
        from .swaps import plan_swaps
        return all(plan_swaps(self, "onnxruntime"))

    def pte_in_place(self) -> bool:
        """Whether every layer is swapped for ExecuTorch (edgekv.models.swaps), so the .pte writes the whole state in
        place: custom_sdpa on one slot per position, float or quantized, or a native sliding window's ring
        (RingSdpaAttention). The planner's rule, edgekv.memory.fused_gqa, is the same."""
        from .swaps import plan_swaps
        return all(plan_swaps(self, "executorch"))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        a = self.args
        call = Call(pos, tokens.shape[1], a.n_heads // a.n_kv_heads)
        cos, sin = rope_cos_sin(call.positions, self.inv_freq)
        glob = cos[:, None, :], sin[:, None, :]  # [C, 1, D]
        local = glob
        if self.local_rope:
            lcos, lsin = rope_cos_sin(call.positions, self.inv_freq_local)
            local = lcos[:, None, :], lsin[:, None, :]

        x = self.model.embed_tokens(tokens)  # [1, C, d]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        new_state = []
        n = self.kv.n  # state tensors per key (and per value)
        windows = a.windows or [None] * a.n_layers
        for i, blk in enumerate(self.model.layers):
            b = 2 * n * i
            rope = local if windows[i] is not None else glob
            if a.rope_layers is not None and not a.rope_layers[i]:
                rope = (None, None)  # NoPE
            h, k, v = blk.self_attn(blk.norm("attn_in", x), *rope, state[b:b + n], state[b + n:b + 2 * n], call)
            x = blk.residual(x, h)
            new_state += [*k, *v]
        logits = self.logits(x, rows)
        if a.final_softcap is not None:
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return (logits, *new_state)


def build(src, layout: StateLayout) -> Llama:
    """The family registry's builder (edgekv.models.FAMILIES): the module for the layout, src's weights loaded."""
    from .weights import load_strict
    return load_strict(Llama(src.args, layout), src.sd, src.path, src.args.model_type)
