"""The llama family's attention layer as eager torch computes it, on the explicit-state cache of edgekv.models.cache.

Shape symbols: C tokens in the call, T slots of the layer's cache, d hidden, H query heads, Hkv key/value heads,
G = H / Hkv, D head dim.

Where this differs from transformers' LlamaAttention, and why the numbers are the same:
  - the cache is a fixed [1, Hkv, T, D] tensor; a call writes its C positions through a one-hot [T, C] matrix
    (cache * keep + placed: blend) and attends over all T slots with an additive mask (-inf for slots the query may
    not see). Unwritten or stale slots are always masked, so they contribute exp(-inf) = 0. No index_put, no
    torch.where, no 4-D broadcast matmul inside a layer: with a fp32 cache every op in a layer is one XNNPACK
    delegates, so the layers form one partition. A fp16 cache adds two casts per cache.
  - GQA without repeat_kv: the query is reshaped to [Hkv, G*C, D] so each KV head is read once (query head h uses
    KV head h // G, as repeat_kv does).
  - a fp16 or quantized cache stores keys/values rounded (or quantized) and attention runs in fp32 on the values
    read back.

A runtime may attend through its own fused op instead: edgekv.models.swaps replaces this module, layer by layer, by
a subclass that does (ONNX Runtime's GroupQueryAttention, ExecuTorch's custom_sdpa).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..strategies import FloatStorage
from .cache import KVFormat
from .layers import RMSNorm, rotate_half

FLOAT_FMT = KVFormat(FloatStorage("fp32"))  # the exact rows a calibration call attends over


def _calibration_cache(cache, c: int):
    """The cache a calibration call attends through (edgekv.export.calibrate: one call of C tokens from position 0):
    a full cache of C slots in place of the layer's T, so its fp32 rows and scores are [Hkv, C, D] and [Hkv, G*C, C],
    not [.., T]. Slots C..T-1 hold no position yet and the full cache's mask gives them -inf for every query, so the
    attention is the same, and a calibration's memory no longer grows with the export's --max-ctx (benchmarks/README.md,
    "What an export costs": the 1B's .pte at 32k). A rolling cache (T = sinks + window) stays as it is."""
    from dataclasses import replace

    from .cache import FullCache
    return replace(cache, slots=c) if isinstance(cache, FullCache) and c < cache.slots else cache


class Call:
    """What every layer of one forward call shares (pos [1], positions [C], G), and values computed once per call
    for all layers alike: once(key, make) runs make() for the first layer that asks and returns its result to the
    others (a cache's write / keep / mask plan, a runtime op's sequence lengths)."""

    def __init__(self, pos: torch.Tensor, c: int, g: int):
        self.pos, self.c, self.g = pos, c, g
        self.positions = pos + torch.arange(c, dtype=torch.int64, device=pos.device)  # [C]
        self._once = {}

    def once(self, key, make):
        if key not in self._once:
            self._once[key] = make()
        return self._once[key]


def blend(cache, new, write, keep):
    """cache [1, Hkv, T, X] with the C rows of new [C, Hkv, X] written at the one-hot slots of write [T, C]
    -> [1, Hkv, T, X] in the cache dtype. X is head_dim for a plain cache; for a quantized one the packed codes,
    the scales or the zeros (integer codes < 2^24 pass through fp32 exactly).

    keep [T, 1] is 1 where a slot keeps its value, 0 where this call writes it. Slots are blended arithmetically
    (cache * keep + placed) rather than with torch.where: XNNPACK delegates mul/add but not where, and a partition
    break per cache costs a portable-kernel copy per layer per step. Exact: one operand of the sum is always 0."""
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


class Attention(nn.Module):
    """GQA with RoPE, optional q/k/v biases and qk-norm. `cache` (FullCache or RollingCache) and `fmt` (KVFormat) say
    how this layer's state is kept; the model sets them from its StateLayout (edgekv.models.llama.Llama)."""

    def __init__(self, a):
        super().__init__()
        self.h, self.hkv, self.dh = a.n_heads, a.n_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.hidden, bias=a.o_bias)
        self.scale = a.attn_scale if a.attn_scale is not None else 1.0 / math.sqrt(a.head_dim)
        # qk-norm: per head over D (Qwen3RMSNorm / Gemma3RMSNorm of q and k), or over the whole projection before the
        # heads are split (Olmo2Attention: q_norm of H*D, k_norm of Hkv*D channels)
        self.qk_whole = a.qk_norm == "proj"
        if a.qk_norm:
            dq, dk = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim) if self.qk_whole else (a.head_dim, a.head_dim)
            self.q_norm, self.k_norm = RMSNorm(dq, a.rms_eps, a.norm_offset), RMSNorm(dk, a.rms_eps, a.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.cache = self.fmt = None  # set by the model (Llama) from its layout
        # the query rounded to int8 per (token, head) before it meets the cache, as the .pte's
        # custom_quantized_sdpa rounds it (edgekv.models.swaps.kernel_reference sets it on a reference copy)
        self.query_int8 = False
        self.calib = None  # a static-scale cache's calibration: [key, value] largest |value| per (Hkv, D) so far

    def use_static_scales(self) -> None:
        """Give the layer the constants of a static-scale int8 cache (kv-int8c): kv_scale [2, Hkv, D] (keys, values),
        ones until edgekv.export.calibrate sets them. Not in the state dict: the checkpoint has no such tensor."""
        self.register_buffer("kv_scale", torch.ones(2, self.hkv, self.dh), persistent=False)

    def _rotated(self, q, k, v, cos, sin):
        """q [1, C, H*D], k, v [1, C, Hkv*D] -> q [C, H, D], k, v [C, Hkv, D], q and k rotated (RoPE at their
        absolute positions)."""
        if self.qk_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.reshape(-1, self.h, self.dh), k.reshape(-1, self.hkv, self.dh), v.reshape(-1, self.hkv, self.dh)
        if self.q_norm is not None and not self.qk_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is None:  # a NoPE layer (SmolLM3)
            return q, k, v
        return q * cos + self._half(q) * sin, k * cos + self._half(k) * sin, v

    def _half(self, x):
        """rotate_half(x) for x [C, heads, D]."""
        return rotate_half(x)

    def _qkv(self, x, cos, sin, delta=None):
        """delta: (dq, dk, dv) added to the projections before the heads are split (a layer's own low-rank adapters
        on shared projections: Zamba2), or None."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if delta is not None:
            q, k, v = q + delta[0], k + delta[1], v + delta[2]
        return self._rotated(q, k, v, cos, sin)

    def forward(self, x, cos, sin, *args):
        """Two calls, the same step:
          (x, cos, sin, k_state, v_state, call): the layer's own cache and fmt, its plan made once per call (Llama);
          (x, cos, sin, write, keep, mask, k_state, v_state, fmt[, rolling]): a plan and format the caller made (the
            families that reuse this layer with their own state order: explicit()).
        x [1, C, d]; cos, sin [C, 1, D] (None: no rotation); k_state, v_state: the layer's key / value state tensors as
        fmt describes them ((cache [1, Hkv, T, D],) or (codes, scale[, zero]))  ->  out [1, C, d], new k_state,
        new v_state."""
        if len(args) == 3:
            k_state, v_state, call = args
            cache, fmt = self.cache, self.fmt
            g = self.h // self.hkv
            if fmt.static and self.calib is not None:  # calibrating: the call's own rows (_calibration_cache)
                cache = _calibration_cache(cache, call.c)
                plan = call.once(("calibration", cache), lambda: cache.plan(call.pos, call.positions, g, torch.float32))
            else:
                plan = call.once(cache, lambda: cache.plan(call.pos, call.positions, g, fmt.dtype or torch.float32))
            if fmt.static:
                return self._attend(x, cos, sin, plan[2], k_state, v_state,
                                    lambda new, st, which: self._store_static(cache, fmt, new, st, which, plan))
            return self._attend(x, cos, sin, plan[2], k_state, v_state,
                                lambda new, st, which: cache.update_and_fetch(fmt, blend, new, st, plan))
        return self.explicit(x, cos, sin, *args)

    def _store_static(self, cache, fmt, new, st, which: int, plan):
        """A static-scale int8 cache (kv-int8c): the rows quantized with this layer's kv_scale[which] ([2, Hkv, D]:
        keys, values). While calibrating (self.calib a list, edgekv.export.calibrate) the state is left as it is,
        each channel's largest |value| recorded, and attention reads the exact fp32 rows: calibration is one call
        from position 0, so the call's own rows are all it sees."""
        if self.calib is None:
            return cache.update_and_fetch(fmt, blend, new, st, plan, self.kv_scale[which])
        x = new.detach()
        if which == 0:  # keys: a RoPE pair (j, j + D/2) turns with the position, so each of its channels may later
            # hold up to the pair's norm |(x_j, x_j+D/2)| (rotate_half pairs); both channels get that bound
            half = x.shape[-1] // 2
            norm = (x[..., :half] ** 2 + x[..., half:] ** 2).sqrt()
            x = torch.cat((norm, norm), -1)
        m = x.abs().amax(0)  # [Hkv, D]
        self.calib[which] = m if self.calib[which] is None else torch.maximum(self.calib[which], m)
        zero = torch.zeros(plan[0].shape[0], dtype=torch.float32)  # the plan's T slots: [1, Hkv, T, D]
        zero = zero.view(1, 1, -1, 1).expand(1, st[0].shape[1], -1, st[0].shape[-1]).contiguous()
        return st, cache.update_and_fetch(FLOAT_FMT, blend, new, (zero,), plan)[1]

    def _rounded_query(self, q):
        """q [C, H, D] as custom_quantized_sdpa sees it: each (token, head) row rounded to int8
        (edgekv.quant.fake_quantize_per_token); with static scales the op takes q * s_k (the key scales folded into
        the query), so that product is what is rounded."""
        from ..quant import fake_quantize_per_token
        if not self.fmt.static:
            return fake_quantize_per_token(q)
        ks = self.kv_scale[0].repeat_interleave(self.h // self.hkv, 0)  # [H, D]: head kv*G + j takes KV head kv's
        return fake_quantize_per_token(q * ks) / ks

    def explicit(self, x, cos, sin, write, keep, mask, k_state, v_state, fmt, rolling: bool = False, delta=None):
        """The step on a given plan: write [T, C] one-hot (slot t <- token c), keep [T, 1], mask [G*C, T] additive
        ([G*C, T + C] for a rolling cache: RollingCache.plan); delta as _qkv takes it."""
        put = fmt.roll if rolling else fmt.write
        return self._attend(x, cos, sin, mask, k_state, v_state,
                            lambda new, st, which: put(blend, new, st, write, keep), delta)

    def _attend(self, x, cos, sin, mask, k_state, v_state, store, delta=None):
        """store(new rows [C, Hkv, D], state, 0 for keys | 1 for values) -> (new state, fp32 rows to attend over:
        [Hkv, T, D], or [Hkv, T + C, D] for a rolling cache). Matmuls are 3-D (bmm): no broadcast expand copies."""
        c, g = x.shape[1], self.h // self.hkv
        q, k, v = self._qkv(x, cos, sin, delta)
        if self.query_int8:
            q = self._rounded_query(q)
        k_state, kf = store(k, k_state, 0)
        v_state, vf = store(v, v_state, 1)
        # query head h = kv*G + g (repeat_kv's order) -> row g*C + c of KV head kv
        qg = q.view(c, self.hkv, g, self.dh).permute(1, 2, 0, 3).reshape(self.hkv, g * c, self.dh)
        scores = torch.bmm(qg, kf.transpose(1, 2)) * self.scale + mask  # [Hkv, G*C, T (+C)]
        out = torch.bmm(torch.softmax(scores, dim=-1), vf)  # [Hkv, G*C, D]
        out = out.view(self.hkv, g, c, self.dh).permute(2, 0, 1, 3).reshape(1, c, self.h * self.dh)
        return self.o_proj(out), k_state, v_state
