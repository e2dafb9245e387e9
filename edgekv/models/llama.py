"""Llama-family decode step, written for export: forward(tokens, pos, *state) -> (logits, *new_state).

Covers the decoders transformers builds as LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM,
Qwen3ForCausalLM and Gemma3ForCausalLM (Llama-2/3.x, SmolLM2, Qwen2/2.5, Mistral, Qwen3, Gemma 3 text): GQA attention
with RoPE (default, linear or llama3 scaling, or llama.cpp's per-frequency `rope_freqs` factors), RMSNorm, a SwiGLU MLP
and optional q/k/v biases; and the parts Qwen3 and Gemma 3 add (LlamaArgs):
  - qk-norm (Qwen3, Gemma 3): an RMSNorm over each head's D channels of q and k, before RoPE.
  - Gemma 3: RMSNorms that scale by (1 + w) (Gemma3RMSNorm), a norm after attention and around the MLP as well
    (post_attention / pre_feedforward / post_feedforward), embeddings scaled by sqrt(d), a GeGLU MLP (gelu with the
    tanh approximation), scores scaled by query_pre_attn_scalar^-1/2 instead of D^-1/2, separate RoPE bases for the
    sliding layers (rope_local_base_freq, 10k) and the global ones (rope_theta, 1M), the final logits soft-capped
    (tanh(x / cap) * cap) when final_logit_softcapping is set. Its sliding layers are Ring layers (below): W slots
    each, the global layers one slot per position -- the model's native state.
  - SmolLM3: NoPE layers (no_rope_layers[i] == 0: every 4th layer) attend without any rotary embedding.

Shape symbols:
  C   tokens in this call (chunked prefill: C > 1; decode: C = 1)
  T   cache slots per layer (the StateLayout's ctx, i.e. max_ctx)
  d   hidden size          F  MLP width            V  vocabulary
  H   query heads          Hkv key/value heads      G  = H / Hkv query heads per KV head      D  head dim

The state is exactly the StateLayout (edgekv.strategies.build_layout): for `kv`, per block i, past_key_values.{i}.key
and past_key_values.{i}.value of shape [1, Hkv, T, D] in the strategy's dtype. Nothing lives in module buffers, so
the same module traces to a pure function for torch.export / ONNX / ExecuTorch. Where this differs from
transformers' LlamaModel, and why the numbers are the same:
  - the cache is a fixed [1, Hkv, T, D] tensor; slot t holds the key/value of position t. A call writes its C
    positions through a one-hot [T, C] matrix (cache * keep + placed; see Attention._write) and attends over all T
    slots with an additive mask (-inf for slots > the query's position). Unwritten or stale slots are always masked,
    so they contribute exp(-inf) = 0, exactly as if they did not exist. No index_put, no torch.where, no 4-D
    broadcast matmul inside a layer: with a fp32 cache every op in a layer is one XNNPACK delegates, so the layers
    form one partition (with torch.where and 4-D matmuls each layer was cut into 8 partitions with portable-kernel
    copies of the cache between them). A fp16 cache adds two casts per cache, which XNNPACK does not take.
  - GQA without repeat_kv: the query is reshaped to [Hkv, G*C, D] so each KV head is read once (query head h uses
    KV head h // G, as repeat_kv does).
  - RMSNorm's mean over d is taken as a 4-D mean over the two innermost dims (the form XNNPACK delegates).
  - cos/sin are computed from the positions on the fly (position * inv_freq in fp32, as LlamaRotaryEmbedding does),
    not read from a [max_ctx, D] table.
  - a fp16 cache stores keys/values rounded to fp16 and computes attention in fp32 after reading them back.
Positions at or past T are not written (the one-hot row is all zero); callers must keep pos + C <= T.

Rolling layers (T < ctx): the `window:w=W,sinks=S` strategy, and native sliding-window layers (Mistral's
sliding_window, Qwen2's windowed layers; S = 0, W = window). See Ring: position p lives in slot p if p < S, else in
S + (p - S) mod W, and query q sees key k iff k <= q and (q - k < W or k < S) -- transformers' sliding_window_overlay
(kv_idx > q_idx - sliding_window) for S = 0. A call attends over [the cache as it was before the call, this call's own
C keys] ([Hkv, T + C, D]), because its later tokens may overwrite ring slots its earlier queries still need; then only
the survivors (the sinks, and the call's last W ring positions) are written. Keys are stored after RoPE at their true
absolute positions: no StreamingLLM re-indexing of positions inside the cache, so a window layer computes exactly the
masked attention of the full model, and positions stay bounded by max_ctx (the model's RoPE range), not by T.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from ..arch import LLAMA_EXPORT_TYPES, Cfg, _layer_windows
from ..errors import EdgekvError
from ..quant import dequantize, dequantize_planar, planar_order, quantize
from ..strategies import StateLayout, parse_strategy, per_token_int8
from .base import STATE_TORCH, TORCH_DTYPES
from .head import head, output_weight
from .layers import MLP, RMSNorm, rope_cos_sin, rope_inv_freq, rotate_half



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
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    gemma: bool = False  # (1 + w) norms, post-attention / pre- and post-MLP norms, sqrt(d)-scaled embeddings
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


def _gemma_rope(cfg: dict, where: str) -> tuple[dict, float]:
    """Gemma 3's two RoPEs -> (the global layers' rope dict as the other models spell it, the local base).
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
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
    if local.get("rope_type", "default") != "default":
        raise EdgekvError(f"{where}: sliding-layer rope type {local['rope_type']!r} is not supported (default)")
    return full, local_theta


def args_from_hf_config(cfg: dict, where: str = "config.json") -> LlamaArgs:
    """transformers' config.json -> LlamaArgs, with transformers' defaults for the fields it defaults."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_TYPES:
        raise EdgekvError(f"{where}: model_type {mt!r} has no export module yet "
                          f"(supported: {', '.join(SUPPORTED_TYPES)})")
    gemma = mt == "gemma3_text"
    act = cfg.get("hidden_activation" if gemma else "hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        raise EdgekvError(f"{where}: activation {act!r} is not supported (the llama module implements "
                          f"{', '.join(ACTIVATIONS)})")
    if gemma and cfg.get("attn_logit_softcapping") is not None:
        raise EdgekvError(f"{where}: attn_logit_softcapping is not supported (Gemma 3 checkpoints leave it unset)")
    if gemma and cfg.get("use_bidirectional_attention"):
        raise EdgekvError(f"{where}: use_bidirectional_attention (an encoder) is not a decoder to export")

    c = Cfg(cfg, where)
    need = c.int  # a required non-negative integer, one line naming it if missing

    hidden, n_heads = need("hidden_size"), need("num_attention_heads")
    local_theta = None
    if gemma:
        rope, local_theta = _gemma_rope(cfg, where)
        cfg = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    else:
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
    legacy = cfg.get("rope_scaling") or {}  # transformers 4.x / most checkpoints on the hub
    if legacy:
        rope.update(legacy)
        if "type" in legacy and "rope_type" not in legacy:
            rope["rope_type"] = legacy["type"]
    # SmolLM3Config.default_theta 2e6 where the config names none; the others' 1e4
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 2e6 if mt == "smollm3" else 10000.0)))
    rtype = rope.get("rope_type", "default")
    if rtype not in ("default", "linear", "llama3"):
        raise EdgekvError(f"{where}: rope type {rtype!r} is not supported yet (default, linear, llama3)")
    return LlamaArgs(
        vocab=need("vocab_size"), hidden=hidden, n_layers=need("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads), intermediate=need("intermediate_size"),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=rope if rtype != "default" else None,
        qkv_bias=True if mt == "qwen2" else bool(cfg.get("attention_bias", False)),
        o_bias=False if mt == "qwen2" else bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)), tied=bool(cfg.get("tie_word_embeddings", gemma)),
        max_position=cfg.get("max_position_embeddings"), model_type=mt,
        # the planner's own reading of which layers slide (edgekv.arch), so this module and its StateLayout agree
        windows=_layer_windows(c, mt, need("num_hidden_layers")),
        qk_norm=mt in ("qwen3", "gemma3_text"), gemma=gemma, act=ACTIVATIONS[act],
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        final_softcap=float(cfg["final_logit_softcapping"]) if gemma and cfg.get("final_logit_softcapping") else None,
        local_rope_theta=local_theta, rope_layers=_rope_layers(cfg, mt, need("num_hidden_layers"), where))


def _rope_layers(cfg: dict, mt: str, n: int, where: str) -> list[bool] | None:
    """SmolLM3's no_rope_layers (1 = RoPE, 0 = NoPE; SmolLM3Config derives it from no_rope_layer_interval, default 4:
    layer i rotates iff (i + 1) % 4 != 0) -> per layer whether it rotates; None for every other model type."""
    if mt != "smollm3":
        return None
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if len(flags) < n:
        raise EdgekvError(f"{where}: no_rope_layers has {len(flags)} entries for {n} layers")
    return [bool(f) for f in flags[:n]]


# ---- building blocks ----


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.h, self.hkv, self.dh = a.n_heads, a.n_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.hidden, bias=a.o_bias)
        self.scale = a.attn_scale if a.attn_scale is not None else 1.0 / math.sqrt(a.head_dim)
        if a.qk_norm:  # per head, over D (Qwen3RMSNorm / Gemma3RMSNorm of q and k)
            off = 1.0 if a.gemma else 0.0
            self.q_norm, self.k_norm = RMSNorm(a.head_dim, a.rms_eps, off), RMSNorm(a.head_dim, a.rms_eps, off)
        else:
            self.q_norm = self.k_norm = None

    @staticmethod
    def _write(cache, new, write, keep):
        """cache [1, Hkv, T, X] with the C rows of new [C, Hkv, X] written at the one-hot slots of write [T, C]
        -> [1, Hkv, T, X] in the cache dtype. X is head_dim for a plain cache; for a quantized one the packed codes,
        the scales or the zeros (integer codes < 2^24 pass through fp32 exactly).

        keep [T, 1] is 1 where a slot keeps its value, 0 where this call writes it. Slots are blended
        arithmetically (cache * keep + placed) rather than with torch.where: XNNPACK delegates mul/add but not
        where, and a partition break per cache costs a portable-kernel copy per layer per step. Exact: one operand
        of the sum is always 0 (the cache holds finite values; an inf in a fp16 cache would already be a broken
        model)."""
        c, hkv, d = new.shape
        t = write.shape[0]
        if isinstance(c, int) and c == 1:  # decode: a broadcast multiply, [T, 1] * [Hkv, 1, X]
            placed = write * new.permute(1, 0, 2).float()
        else:  # prefill: [1, T, C] @ [1, C, Hkv*X], exact (one non-zero term per written slot); a bmm, because
            # XNNPACK's mm wants a constant weight
            placed = torch.bmm(write.view(1, t, c), new.float().reshape(1, c, hkv * d)).view(t, hkv, d).permute(1, 0, 2)
        k = keep if keep.dtype == cache.dtype else keep.to(cache.dtype)
        stored = cache.view(hkv, t, d) * k + placed.to(cache.dtype)
        return stored.view(1, hkv, t, d)

    def _rotated(self, q, k, v, cos, sin, rot=None):
        """q [1, C, H*D], k, v [1, C, Hkv*D] -> q [C, H, D], k, v [C, Hkv, D], q and k rotated (RoPE at their
        absolute positions)."""
        q, k, v = q.reshape(-1, self.h, self.dh), k.reshape(-1, self.hkv, self.dh), v.reshape(-1, self.hkv, self.dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is None:  # a NoPE layer (SmolLM3)
            return q, k, v
        return q * cos + self._half(q, rot) * sin, k * cos + self._half(k, rot) * sin, v

    def _half(self, x, rot=None):
        """rotate_half(x) for x [C, heads, D]; with rot (the .pte trace, Llama.executorch_ops) as a matmul by that
        constant [D, D] signed permutation: exact (one nonzero term per output), and XNNPACK takes it with a dynamic
        token count, where the two slices of rotate_half would each leave XNNPACK for a portable kernel."""
        if rot is None:
            return rotate_half(x)
        return (x.reshape(-1, self.dh) @ rot).reshape(-1, x.shape[1], self.dh)

    def _qkv(self, x, cos, sin, rot=None):
        return self._rotated(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, rot)

    def fused(self, x, cos, sin, lens, k_cache, v_cache, rope=None):
        """The same step as forward() on a plain cache, as one ONNX Runtime GroupQueryAttention node (com.microsoft,
        the attention op ONNX Runtime GenAI's models use). For the ONNX trace only: eager torch has no such op.

        x [1, C, d]; lens (seqlens_k [1] int32 = pos + C - 1, total_sequence_length [] int32 = pos + C);
        k_cache, v_cache [1, Hkv, T, D] fp32 or fp16 -> out [1, C, d], (new key cache,), (new value cache,).
        The node writes the C new keys/values at slots pos..pos+C-1 and attends causally over slots 0..pos+C-1
        only, not over all T: the cost of a step grows with the position, not with max_ctx. Its present outputs
        have the past inputs' shape, and when the caller binds each present to its past's buffer ORT writes the
        C rows in place (past_present_share_buffer): no copy of the cache per step (OrtStepper does this).
        q/k/v go in as the cache dtype (the op takes one dtype), so a fp16 cache also rounds q and the attention
        output to fp16: within verify's fp16 tolerance (benchmarks and tests compare it with eager)."""
        import torch.onnx.ops  # noqa: F401 (torch.onnx loads its submodules lazily)

        c = x.shape[1]
        # one matmul for q, k and v (qkv_proj: their weights stacked, made by Llama.onnx_gqa for the trace), as
        # ONNX Runtime GenAI's models have it: one weight read and one kernel call instead of three
        qkv = self.qkv_proj(x)
        dt = k_cache.dtype
        attrs = {"num_heads": self.h, "kv_num_heads": self.hkv, "scale": self.scale}
        if rope is not None:
            # fp32 cache: the packed q/k/v go in as they are and the op rotates q and k itself (do_rotary, from
            # rope = (cos, sin) tables [max_ctx, D/2] of the same inv_freq, at positions pos..pos+C-1)
            inputs = [qkv, None, None, k_cache, v_cache, *lens, *rope]
            attrs["do_rotary"] = 1
        else:  # fp16 cache: rotate in fp32 here, then round q, k, v to the cache dtype (the op takes one dtype)
            parts = qkv.split([self.h * self.dh, self.hkv * self.dh, self.hkv * self.dh], dim=-1)
            q, k, v = self._rotated(*parts, cos, sin)
            inputs = [*(t.reshape(1, c, -1).to(dt) for t in (q, k, v)), k_cache, v_cache, *lens]
        out, nk, nv = torch.onnx.ops.symbolic_multi_out(
            "com.microsoft::GroupQueryAttention", inputs, attrs,
            dtypes=[dt, dt, dt], shapes=[[1, c, self.h * self.dh], list(k_cache.shape), list(v_cache.shape)],
            version=1)
        return self.o_proj(out.float()), (nk,), (nv,)

    def custom(self, x, cos, sin, start, positions, k_state, v_state, kv: "KVFormat", rot=None, zero=None,
               perm=None):
        """The same step as forward() on a plain or quantized cache, attended by ExecuTorch's llama::custom_sdpa (its
        LLM custom ops, executorch/extension/llm/custom_ops, as in ExecuTorch's own Llama export). For the .pte trace
        only (Llama.executorch_ops); eager torch runs it too once the ops' AOT library is loaded.

        x [1, C, d]; start: pos as a SymInt; positions [C]; k_state, v_state: the layer's key / value state tensors
        as kv describes them ((cache [1, Hkv, T, D] fp32 or fp16,) or (codes, scale[, zero]), edgekv.quant's
        layout); zero: [1, Hkv, start+C, 1] int64 zeros for an int8 cache with one scale per token and head;
        perm: for a packed (int4/int2) cache, the [D, D] permutation matrix of edgekv.quant's planar channel order
        (below) -> out [1, C, d], new k_state, new v_state. Each state tensor gets the C rows with an index_put at slots
        positions (the graph stays functional; edgekv.export.to_pte turns it into index_put_ on the past.* input, so the
        .pte writes the caller's state in place and returns it as present.*). The op wants [B, T, heads, D] (sequence at
        dim 1): a [1, Hkv, T, D] cache is exactly a contiguous [Hkv, T, 1, D] tensor, i.e. a batch of Hkv one-head
        caches, and a query [Hkv, C, G, D] attends each KV head with its G query heads (repeat_kv's order), so the state
        keeps its shape. custom_sdpa attends causally over slots 0..start+C-1 only: a step costs what its position
        needs, not what max_ctx reserves.
        A fp16 or quantized cache is read back as fp32 rows 0..start+C-1 (a slice of dynamic length) and attended in
        fp32, as forward() does, dequantized by edgekv.quant.dequantize on those rows only; an int8 cache with one scale
        per token and head in one pass: quantized_decomposed::dequantize_per_token (ExecuTorch's quantized kernels; zero
        points 0, exact: the same products). A packed int4/int2 cache is read back by edgekv.quant.dequantize_planar: K
        and V in planar channel order, not interleaved (the interleave was a portable per-value cat: 27 of a 71 ms
        SmolLM2 kv-int4 step). q is permuted into the same order (q @ perm, exact: q.k is invariant to one permutation
        of both) and the output, which comes in V's order, back (@ perm^T) before o_proj.
        On SmolLM2 at position 560 a cast to fp32 and a multiply took 12.7 ms of a 42 ms decode step (portable
        _to_dim_order_copy alone 11.1 ms); the one op is 2.4x faster than the two (1.2 vs 3.0 ns a value). Not the
        ops' own paths: custom_sdpa's fp16 path computes in fp16 (q rounded too) and on x86, without fp16
        arithmetic, took 97 of a 168 ms SmolLM2 decode step at position 500 (fp32: 11 ms); custom_quantized_sdpa
        takes the query as int8 codes too (its attention equals fp32 attention over the dequantized query and cache to
        4e-6), and that rounding alone (one scale per token and head) moved the logits by 2.5e-2 of their scale on
        SmolLM2 and 3.0e-2 on the tiny test Llama (teacher-forced, a 34-token prompt + 14 steps), beyond an int8
        cache's verify tolerance of 2e-2; reading the rows back in fp32 moves them by 8.0e-3 and 7e-7."""
        c, t, g = x.shape[1], k_state[0].shape[2], self.h // self.hkv
        q, k, v = self._qkv(x, cos, sin, rot)  # [C, H, D], [C, Hkv, D], [C, Hkv, D]

        def put(state, rows):  # rows [C, Hkv, X] -> the state tensor with them at slots positions
            return torch.ops.aten.index_put(state, [None, None, positions], rows.permute(1, 0, 2)[None])

        if kv.bits:  # codes, fp16 scales (and zeros below 8 bits) of the C rows, as forward() stores them
            k_state, v_state = (tuple(put(s, r) for s, r in zip(st, quantize(z, kv.bits, kv.group)[:kv.n]))
                                for st, z in ((k_state, k), (v_state, v)))
        else:
            dt = k_state[0].dtype
            k_state, v_state = (put(k_state[0], k.to(dt)),), (put(v_state[0], v.to(dt)),)
        if len(k_state) == 1 and k_state[0].dtype == torch.float32:
            kc, vc = (st[0].view(self.hkv, t, 1, self.dh) for st in (k_state, v_state))
        else:  # the written rows read back in fp32, as forward() reads them
            n = start + c

            def rows(st):
                part = [s[:, :, :n] for s in st]
                if not kv.bits:
                    r = part[0].float()
                elif zero is not None:
                    r = torch.ops.quantized_decomposed.dequantize_per_token(
                        part[0], part[1].float(), zero, -128, 127, torch.int8, torch.float32)
                elif perm is not None:
                    r = dequantize_planar(*part, kv.bits, kv.group)
                else:
                    r = dequantize(part[0], part[1], part[2] if kv.bits < 8 else None, kv.bits, kv.group)
                return r.view(self.hkv, n, 1, self.dh)

            kc, vc = rows(k_state), rows(v_state)
        if perm is not None:
            q = (q.reshape(-1, self.dh) @ perm).reshape(-1, self.h, self.dh)
        qg = q.view(-1, self.hkv, g, self.dh).permute(1, 0, 2, 3)  # [Hkv, C, G, D]
        out = torch.ops.llama.custom_sdpa(qg, kc, vc, start, None, 0.0, True, self.scale)
        if perm is not None:
            out = (out.reshape(-1, self.dh) @ perm.t()).reshape(out.shape)
        out = out.permute(1, 0, 2, 3).reshape(1, -1, self.h * self.dh)
        return self.o_proj(out), k_state, v_state

    def forward(self, x, cos, sin, write, keep, mask, k_state, v_state, kv: "KVFormat", rolling: bool = False):
        """x [1, C, d]; cos, sin [C, 1, D]; write [T, C] one-hot (slot t <- token c); keep [T, 1];
        mask [G*C, T] additive (0 or -inf); k_state, v_state: the layer's key / value state tensors as kv describes
        them ((cache [1, Hkv, T, D],) or (codes, scale[, zero]))  ->  out [1, C, d], new k_state, new v_state.
        rolling (a Ring layer): attend over the old cache and this call's keys, mask [G*C, T + C] (Ring.plan).
        Matmuls are 3-D (bmm): no broadcast expand copies."""
        c = x.shape[1]
        g = self.h // self.hkv
        q, k, v = self._qkv(x, cos, sin)
        put = kv.roll if rolling else kv.write
        k_state, kf = put(self._write, k, k_state, write, keep)  # kf, vf: [Hkv, T, D] fp32 ([Hkv, T + C, D] rolling)
        v_state, vf = put(self._write, v, v_state, write, keep)
        # query head h = kv*G + g (repeat_kv's order) -> row g*C + c of KV head kv
        qg = q.view(c, self.hkv, g, self.dh).permute(1, 2, 0, 3).reshape(self.hkv, g * c, self.dh)
        scores = torch.bmm(qg, kf.transpose(1, 2)) * self.scale + mask  # [Hkv, G*C, T (+C)]
        out = torch.bmm(torch.softmax(scores, dim=-1), vf)  # [Hkv, G*C, D]
        out = out.view(self.hkv, g, c, self.dh).permute(2, 0, 1, 3).reshape(1, c, self.h * self.dh)
        return self.o_proj(out), k_state, v_state


class KVFormat:
    """How one key (or value) cache is stored: a plain tensor in a float dtype, or quantized codes + fp16 scale
    (+ fp16 zero below 8 bits) per group of head_dim channels, exactly as edgekv.quant defines them (the planner's
    StateLayout counts the same tensors). Each call quantizes only its new tokens and reads the whole cache back
    dequantized to fp32, one layer at a time: the runtime behaviour the planner's workspace and bytes-read model."""

    def __init__(self, dtype: torch.dtype | None, bits: int | None = None, group: int = 0):
        self.dtype, self.bits, self.group = dtype, bits, group
        self.n = 1 if bits is None else (2 if bits == 8 else 3)  # state tensors per key (or value)
        self.rounding, self.generator = "nearest", None  # edgekv analyze may switch to stochastic rounding

    def write(self, put, x, state, write, keep):
        """x [C, Hkv, D] fp32 -> (new state tuple, fp32 cache [Hkv, T, D] for attention)."""
        if self.bits is None:
            stored = put(state[0], x, write, keep)
            return (stored,), stored.float()[0]
        codes, scale, zero = quantize(x, self.bits, self.group, self.rounding, self.generator)
        parts = (codes, scale) if self.bits == 8 else (codes, scale, zero)
        new = tuple(put(old, part, write, keep) for old, part in zip(state, parts))
        return new, dequantize(new[0][0], new[1][0], new[2][0] if self.bits < 8 else None, self.bits, self.group)

    def roll(self, put, x, state, write, keep):
        """A rolling layer: x [C, Hkv, D] fp32 -> (new state, fp32 [Hkv, T + C, D]: the cache as it was before this
        call, then this call's C tokens as the cache stores them, i.e. rounded to its dtype or its quantizer)."""
        if self.bits is None:
            old, new = state[0].float()[0], x.to(self.dtype).float().permute(1, 0, 2)
            return (put(state[0], x, write, keep),), torch.cat((old, new), 1)
        codes, scale, zero = quantize(x, self.bits, self.group, self.rounding, self.generator)
        parts = (codes, scale) if self.bits == 8 else (codes, scale, zero)
        z = self.bits < 8
        old = dequantize(state[0][0], state[1][0], state[2][0] if z else None, self.bits, self.group)
        new = dequantize(codes, scale, zero if z else None, self.bits, self.group).permute(1, 0, 2)
        return tuple(put(o, part, write, keep) for o, part in zip(state, parts)), torch.cat((old, new), 1)


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        off = 1.0 if a.gemma else 0.0
        self.input_layernorm = RMSNorm(a.hidden, a.rms_eps, off)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.rms_eps, off)
        if a.gemma:  # Gemma3DecoderLayer: post_attention_layernorm normalises the attention output instead
            self.pre_feedforward_layernorm = RMSNorm(a.hidden, a.rms_eps, off)
            self.post_feedforward_layernorm = RMSNorm(a.hidden, a.rms_eps, off)
        self.gemma = a.gemma

    def residual(self, x, h):
        """x + the attention output h, then the MLP's residual: x -> the block's output."""
        if self.gemma:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """Parameter names as transformers' LlamaModel, so an HF state dict loads with strict=True."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.hidden, a.rms_eps, 1.0 if a.gemma else 0.0)


# ---- rolling (ring-buffer) layers ----


@dataclass(frozen=True)
class Ring:
    """A layer whose cache keeps T = sinks + size slots of a longer context (mlx-lm's RotatingKVCache(size, keep)).

    Position p lives in slot p if p < sinks, else in sinks + (p - sinks) mod size. Query q sees key k iff
    k <= q and (q - k < window or k < keep_first) [the window strategy; none if window is None] and q - k < native
    [the model's own sliding window; none if None]. transformers' sliding_window_overlay is kv_idx > q_idx - W, i.e.
    q - k < W. Every key some query can still see is in the cache: see layer_rings for why."""
    sinks: int
    size: int
    window: int | None
    keep_first: int
    native: int | None

    def sees(self, q, k):
        """Broadcastable int64 positions -> bool: may query q attend to key k."""
        ok = k <= q
        if self.window is not None:
            ok = ok & ((q - k < self.window) | (k < self.keep_first))
        if self.native is not None:
            ok = ok & (q - k < self.native)
        return ok

    def plan(self, pos, positions, g: int, cache_dtype):
        """pos [1], positions [C] -> write [T, C] one-hot fp32, keep [T, 1], mask [G*C, T + C] additive (over the
        slots as they were before this call, then this call's C keys; rows g*C + c as in the plain mask).

        Before the call, sink slot s holds position s if s < pos; ring slot j holds the latest p' < pos with
        slot(p') = j: with m = pos - 1 - sinks, p' = sinks + m - ((m - j) mod size), valid if p' >= sinks.
        The call writes only its survivors: its sinks and its last `size` ring positions (distinct slots)."""
        s, r, c = self.sinks, self.size, positions.shape[0]
        slots = torch.arange(s + r, dtype=torch.int64, device=pos.device)  # [T]
        m = pos - 1 - s
        held = torch.where(slots < s, slots, s + m - torch.remainder(m - (slots - s), r))  # [T]
        valid = (held < pos) & ((slots < s) | (held >= s))  # no bool torch.where: ONNX Runtime lacks it
        q = positions.repeat(g)[:, None]  # [G*C, 1]
        allowed = torch.cat((valid[None, :] & self.sees(q, held[None, :]), self.sees(q, positions[None, :])), 1)
        mask = torch.where(allowed, 0.0, float("-inf"))
        dest = torch.where(positions < s, positions, s + torch.remainder(positions - s, r))  # [C]
        survives = (positions < s) | (positions >= pos + c - r)
        write = ((slots[:, None] == dest[None, :]) & survives[None, :]).float()  # [T, C]
        keep = (write.sum(1, keepdim=True) == 0).to(cache_dtype)  # [T, 1]
        return write, keep, mask


def layer_rings(a: LlamaArgs, layout: StateLayout) -> list[Ring | None]:
    """Per layer: None where the cache has a slot per position (T == ctx: the plain path), else its Ring.

    T = min(ctx, native window Wn, W + S) (edgekv.strategies.build_layout). With the window strategy and
    W + S < Wn, the cache keeps S sinks and a ring of W: every visible key is a sink or one of the last W positions.
    Otherwise (a native window Wn <= W + S, or no window strategy) a ring of T = Wn with no pinned slots holds every
    visible key, since q - k < Wn; the strategy's rule (q - k < W or k < S) still applies on top. With T == ctx
    every rule is vacuous for positions < ctx, so those layers keep the plain cache exactly."""
    w = s = None
    if layout.strategy.startswith("window"):
        p = parse_strategy(layout.strategy).params
        w, s = p["w"], p["sinks"]
    out = []
    for i in range(a.n_layers):
        native = a.windows[i] if a.windows else None
        t = min(layout.ctx, native or layout.ctx, (w + s) if w is not None else layout.ctx)
        if t == layout.ctx:
            out.append(None)
        elif w is not None and (native is None or w + s < native):
            out.append(Ring(s, w, w, s, native))
        else:
            out.append(Ring(0, t, w, s or 0, native))
    return out


# ---- the decode step ----


def check_layout(a: LlamaArgs, layout: StateLayout) -> tuple[KVFormat, list[Ring | None]]:
    """The layout must be, per layer, a key and a value [1, Hkv, T, D] in fp32/fp16, or their quantized codes with
    .scale (and .zero) tensors as edgekv.quant writes them (kv-int8, kv-int4, kv-int2), with T = ctx or the
    layer's rolling size. Returns how each is stored and each layer's Ring (None: one slot per position)."""
    bits = 8 if any(t.dtype == "int8" for t in layout.tensors) else \
        next((t.packed_bits for t in layout.tensors if t.packed_bits), None)
    roles = ["key", "value"] if bits is None else (["key", "key.scale", "value", "value.scale"] if bits == 8 else
                                                   ["key", "key.scale", "key.zero", "value", "value.scale", "value.zero"])
    want = [(i, role) for i in range(a.n_layers) for role in roles]
    got = [(t.layer, t.role) for t in layout.tensors]
    if got != want:
        raise EdgekvError(f"strategy {layout.strategy}: the llama export module keeps per layer {roles} "
                          f"(this layout has {sorted({t.role for t in layout.tensors})})")
    stored_d = a.head_dim if bits in (None, 8) else a.head_dim * bits // 8
    rings = layer_rings(a, layout)
    for t in layout.tensors:
        ring = rings[t.layer]
        want_t = layout.ctx if ring is None else ring.sinks + ring.size
        if t.role in ("key", "value") and t.shape != (1, a.n_kv_heads, want_t, stored_d):
            raise EdgekvError(f"{t.name}: shape {t.shape} is not [1, {a.n_kv_heads}, {want_t}, {stored_d}] "
                              f"(layer {t.layer}: {'ctx slots' if ring is None else ring})")
    if bits is not None:
        return KVFormat(None, bits, a.head_dim // layout.tensors[1].shape[-1]), rings
    dtypes = {t.dtype for t in layout.tensors}
    if len(dtypes) != 1 or not dtypes <= set(TORCH_DTYPES):
        raise EdgekvError(f"strategy {layout.strategy}: cache dtype {', '.join(sorted(dtypes))} is not supported "
                          f"by the export yet (supported: fp32, fp16)")
    return KVFormat(TORCH_DTYPES[dtypes.pop()]), rings


class Llama(nn.Module):
    """forward(tokens [1, C] int64, pos [1] int64, *state) -> (logits [1, C, V] fp32, *new_state).

    pos is the position of tokens[0, 0]; state is the tensors of `layout` in its order (per layer: key, value).
    Layers with a Ring (window strategy, native sliding windows) keep a rolling cache; the others one slot per
    position, computed exactly as before rolling layers existed (the plain kv graph is unchanged)."""

    def __init__(self, args: LlamaArgs, layout: StateLayout):
        super().__init__()
        self.args, self.layout = args, layout
        self.kv, self.rings = check_layout(args, layout)
        self.cache_dtype = self.kv.dtype or torch.float32  # quantized caches: keep is cast per tensor
        self.model = Body(args)
        self.lm_head = None if args.tied else nn.Linear(args.hidden, args.vocab, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        # Gemma 3: the sliding layers' own RoPE base (default rope, no scaling)
        self.local_rope = args.local_rope_theta is not None
        if self.local_rope:
            local = replace(args, rope_theta=args.local_rope_theta, rope_scaling=None, rope_freq_factors=None)
            self.register_buffer("inv_freq_local", rope_inv_freq(local), persistent=False)
        self.embed_scale = args.hidden ** 0.5 if args.gemma else None  # Gemma3TextScaledWordEmbedding
        self.gqa = False  # set only while tracing for ONNX (onnx_gqa): every layer becomes GroupQueryAttention
        self.et_ops = False  # set only while tracing for ExecuTorch (executorch_ops): LLM kernels, in place

    def fusable(self) -> bool:
        """Whether ONNX Runtime's GroupQueryAttention runs this module's attention: a float cache (the op has no
        quantized cache) with one slot per position in every layer. A rolling layer keeps the explicit graph, whose
        outputs are computed from its inputs and must not be bound to the same buffers, so a model with any rolling
        layer is not fused at all (the manifest's state_in_place covers the whole state). The planner's rule,
        edgekv.memory.fused_gqa, is the same; tests/test_export_strategies.py checks that they agree."""
        return self.kv.bits is None and all(r is None for r in self.rings)

    def pte_in_place(self) -> bool:
        """Whether the .pte attends through ExecuTorch's LLM kernels with its state written in place
        (executorch_ops): every cache with one slot per position in every layer (no rolling layer), float or
        quantized; a fp16 or quantized cache's written rows are read back in fp32 for custom_sdpa
        (Attention.custom). The planner's rule, edgekv.memory.fused_gqa, is the same."""
        return all(r is None for r in self.rings)

    @contextlib.contextmanager
    def onnx_gqa(self):
        """Within, when fusable(): forward() traces every layer's attention as a GroupQueryAttention node
        (Attention.fused) fed by one stacked q/k/v projection, and every RMSNorm in the form ONNX Runtime fuses. The
        stacked projections exist only inside (they share no storage with q/k/v_proj; the eager module is unchanged)."""
        self.gqa = self.fusable()
        norms = [m for m in self.modules() if isinstance(m, RMSNorm)]
        fused = [blk.self_attn for blk in self.model.layers] if self.gqa else []
        try:
            for n in norms:
                n.onnx_form = self.gqa
            for at in fused:
                parts = (at.q_proj, at.k_proj, at.v_proj)
                qkv = nn.Linear(at.q_proj.in_features, sum(p.out_features for p in parts),
                                bias=at.q_proj.bias is not None)
                with torch.no_grad():
                    qkv.weight.copy_(torch.cat([p.weight for p in parts]))
                    if qkv.bias is not None:
                        qkv.bias.copy_(torch.cat([p.bias for p in parts]))
                at.qkv_proj = qkv
            # the op's rotary tables, [max_ctx, D/2], initializers (one RoPE for every layer, none between the
            # projection and the rotation: a qk-norm or a second RoPE base rotates in the graph instead)
            if fused and self.kv.dtype == torch.float32 and not self.args.qk_norm and not self.local_rope \
                    and self.args.rope_layers is None:
                freqs = torch.arange(self.layout.ctx, dtype=torch.int64).float()[:, None] * self.inv_freq[None, :]
                self.register_buffer("gqa_cos", freqs.cos(), persistent=False)
                self.register_buffer("gqa_sin", freqs.sin(), persistent=False)
            yield self.gqa
        finally:
            self.gqa = False
            for n in norms:
                n.onnx_form = False
            for at in fused:
                del at.qkv_proj
            for name in ("gqa_cos", "gqa_sin"):
                if hasattr(self, name):
                    delattr(self, name)

    @contextlib.contextmanager
    def executorch_ops(self):
        """Within, when pte_in_place(): forward() traces every layer's attention as Attention.custom (an index_put
        of the call's rows into each state tensor, which edgekv.export.to_pte makes an in-place write of that input,
        and ExecuTorch's llama::custom_sdpa over the written slots only). Yields whether it applies. Registers the
        ops' AOT libraries (ExecuTorch's LLM custom ops and quantized kernels); a runtime needs their kernels to run
        the .pte."""
        self.et_ops = self.pte_in_place()
        if self.et_ops:
            import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (registers torch.ops.llama.*)
            import executorch.kernels.quantized  # noqa: F401 (dequantize_per_token's out variant, for an int8 cache)
            from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401 (the op itself)
            d, h = self.args.head_dim, self.args.head_dim // 2
            rot = torch.zeros(d, d)  # x @ rot = cat(-x[h:], x[:h]) = rotate_half(x) (Attention._half)
            rot[torch.arange(h, d), torch.arange(h)] = -1.0
            rot[torch.arange(h), torch.arange(h, d)] = 1.0
            self.register_buffer("rope_rot", rot, persistent=False)
            bits = self.kv.bits or 8
            if bits < 8 and (self.kv.group or d) % (8 // bits) == 0:  # packed: read back in planar order
                planar = torch.zeros(d, d)
                planar[planar_order(d, bits), torch.arange(d)] = 1.0  # (x @ planar)[p] = x[planar_order[p]]
                self.register_buffer("planar", planar, persistent=False)
        try:
            yield self.et_ops
        finally:
            for name in ("rope_rot", "planar"):
                if hasattr(self, name):
                    delattr(self, name)
            self.et_ops = False

    def empty_state(self) -> list[torch.Tensor]:
        return [torch.zeros(t.shape, dtype=STATE_TORCH[t.dtype]) for t in self.layout.tensors]

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor,
                rows: torch.Tensor | None = None):
        c, t_slots = tokens.shape[1], self.layout.ctx
        g = self.args.n_heads // self.args.n_kv_heads
        positions = pos + torch.arange(c, dtype=torch.int64, device=pos.device)  # [C]
        plans = {}  # Ring (None: plain) -> (write, keep, mask), computed once per call for all layers alike
        if self.gqa:
            lens = (pos + c - 1).to(torch.int32), (pos + c).to(torch.int32).reshape(())
        elif self.et_ops:
            start = pos[0].item()
            torch._check(start >= 0)
            torch._check(start + c <= t_slots)
            # an int8 cache's zero points for its read-back (Attention.custom), one tensor for every layer
            zero = None
            if per_token_int8(self.kv.bits, self.kv.group, self.args.head_dim):
                zero = torch.zeros(1, self.args.n_kv_heads, start + c, 1, dtype=torch.int64)
        elif None in self.rings:
            slots = torch.arange(t_slots, dtype=torch.int64, device=pos.device)  # [T]
            write = (slots[:, None] == positions[None, :]).float()  # [T, C]
            keep = ((slots < pos) | (slots >= pos + c)).to(self.cache_dtype)[:, None]  # [T, 1]
            allowed = slots[None, :] <= positions.repeat(g)[:, None]  # [G*C, T]
            plans[None] = write, keep, torch.where(allowed, 0.0, float("-inf"))
        for ring in dict.fromkeys(r for r in self.rings if r is not None):
            plans[ring] = ring.plan(pos, positions, g, self.cache_dtype)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [C, 1, D]
        if self.local_rope:
            lcos, lsin = rope_cos_sin(positions, self.inv_freq_local)
            lcos, lsin = lcos[:, None, :], lsin[:, None, :]
        g_cos, g_sin = cos, sin

        x = self.model.embed_tokens(tokens)  # [1, C, d]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        new_state = []
        n = self.kv.n  # state tensors per key (and per value)
        windows = self.args.windows or [None] * self.args.n_layers
        for i, blk in enumerate(self.model.layers):
            b = 2 * n * i
            ring = self.rings[i]
            cos, sin = (lcos, lsin) if self.local_rope and windows[i] is not None else (g_cos, g_sin)
            if self.args.rope_layers is not None and not self.args.rope_layers[i]:
                cos = sin = None  # NoPE
            if self.et_ops:
                h, k, v = blk.self_attn.custom(blk.input_layernorm(x), cos, sin, start, positions,
                                               state[b:b + n], state[b + n:b + 2 * n], self.kv, self.rope_rot, zero,
                                               getattr(self, "planar", None))
            elif self.gqa:
                h, k, v = blk.self_attn.fused(blk.input_layernorm(x), cos, sin, lens, state[b], state[b + n],
                                              (self.gqa_cos, self.gqa_sin) if hasattr(self, "gqa_cos") else None)
            else:
                h, k, v = blk.self_attn(blk.input_layernorm(x), cos, sin, *plans[ring],
                                        state[b:b + n], state[b + n:b + 2 * n], self.kv, ring is not None)
            x = blk.residual(x, h)
            new_state += [*k, *v]
        w = output_weight(self.model.embed_tokens, self.lm_head)
        logits = head(x, self.model.norm, w, rows)
        if self.args.final_softcap is not None:
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return (logits, *new_state)


def build(src, layout: StateLayout) -> Llama:
    """The family registry's builder (edgekv.models.FAMILIES): the module for the layout, src's weights loaded."""
    from .weights import load_strict
    return load_strict(Llama(src.args, layout), src.sd, src.path, src.args.model_type)
