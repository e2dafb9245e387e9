"""The llama-family KV caches: how a layer's keys and values are stored (KVFormat) and which slots they live in
(FullCache: one slot per position; RollingCache: sinks plus a rolling window). One small class per cache kind, in the
spirit of mlx-lm's mlx_lm/models/cache.py (KVCache, RotatingKVCache): `update_and_fetch` stores a call's new rows and
returns what attention reads, `nbytes` counts the layer's state. Unlike mlx-lm's, these caches hold no tensors: the
state is the module's inputs and outputs (edgekv.strategies.StateLayout), so a cache object is the rule a layer's
state follows, and torch.export traces it into a pure function.

Shape symbols: C tokens in the call, T slots of the layer's cache, Hkv key/value heads, D head dim, G = H / Hkv.

Writes go through a one-hot [T, C] matrix (write) and a [T, 1] keep mask: cache * keep + placed (Attention.blend),
so a call's C rows land at their slots with elementwise ops and a bmm. Attention masks are additive (0 or -inf), one
row per query head of a KV head and query (row g*C + c).

A hybrid family's attention layers (LFM2, Granite-4.0-H, Falcon-H1, Zamba2) keep one slot per position: their
format is checked against the layout by hybrid_kv_format and their per-call write / mask is cache_plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import EdgekvError
from ..quant import dequantize, dequantize_static, quantize, quantize_static
from ..strategies import DTYPE_BYTES, StateLayout, parse_strategy
from .base import STATE_TORCH, TORCH_DTYPES
from .layers import slot_plan


class KVFormat:
    """How one key (or value) cache is stored: a plain tensor in a float dtype, or quantized codes + fp16 scale
    (+ fp16 zero below 8 bits) per group of head_dim channels, exactly as edgekv.quant defines them (the planner's
    StateLayout counts the same tensors). Each call quantizes only its new tokens and reads the cache back
    dequantized to fp32, one layer at a time."""

    def __init__(self, dtype: torch.dtype | None, bits: int | None = None, group: int = 0, static: bool = False):
        self.dtype, self.bits, self.group, self.static = dtype, bits, group, static
        # state tensors per key (or value): a static-scale int8 cache (kv-int8c) keeps its codes only
        self.n = 1 if bits is None or static else (2 if bits == 8 else 3)
        self.rounding, self.generator = "nearest", None  # edgekv analyze may switch to stochastic rounding

    def store(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """x [C, Hkv, D] fp32 -> the n tensors that hold it: (x,) for a float cache (cast where it is written),
        (codes, scale[, zero]), or for a static-scale cache (codes,) with scale [Hkv, D] the layer's constant."""
        if self.bits is None:
            return (x,)
        if self.static:
            return (quantize_static(x, scale),)
        codes, scale, zero = quantize(x, self.bits, self.group, self.rounding, self.generator)
        return (codes, scale) if self.bits == 8 else (codes, scale, zero)

    def read(self, parts, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The n state tensors of one cache (or their [Hkv, T, X] slices) -> fp32 [..., D]."""
        if self.bits is None:
            return parts[0].float()
        if self.static:
            return dequantize_static(parts[0], scale[:, None, :])
        return dequantize(parts[0], parts[1], parts[2] if self.bits < 8 else None, self.bits, self.group)

    def write(self, put, x, state, write, keep, scale=None):
        """x [C, Hkv, D] fp32 -> (new state tuple, fp32 cache [Hkv, T, D] for attention)."""
        new = tuple(put(old, part, write, keep) for old, part in zip(state, self.store(x, scale)))
        return new, self.read(tuple(t[0] for t in new), scale)

    def roll(self, put, x, state, write, keep, scale=None):
        """A rolling layer: x [C, Hkv, D] fp32 -> (new state, fp32 [Hkv, T + C, D]: the cache as it was before this
        call, then this call's C tokens as the cache stores them, i.e. rounded to its dtype or its quantizer)."""
        parts = self.store(x, scale)
        old = self.read(tuple(t[0] for t in state), scale)
        if self.bits is None:
            new = x.to(self.dtype).float()
        elif self.static:  # codes [C, Hkv, D]
            new = dequantize_static(parts[0], scale)
        else:
            new = self.read(parts)
        new_state = tuple(put(o, part, write, keep) for o, part in zip(state, parts))
        return new_state, torch.cat((old, new.permute(1, 0, 2)), 1)

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one (token, KV head) row of this cache takes: codes plus fp16 scale (and zero) per group."""
        if self.bits is None:
            return int(head_dim * DTYPE_BYTES[str(self.dtype).removeprefix("torch.")])
        if self.static:
            return head_dim
        groups = head_dim // (self.group or head_dim)
        return head_dim * self.bits // 8 + groups * 2 * (1 if self.bits == 8 else 2)


@dataclass(frozen=True)
class FullCache:
    """One slot per position: slot t holds position t, T = the layout's ctx. Query q sees key k iff k <= q."""
    slots: int
    rolling = False

    def plan(self, pos, positions, g: int, cache_dtype):
        """pos [1], positions [C] -> write [T, C] one-hot fp32, keep [T, 1], mask [G*C, T] additive."""
        c = positions.shape[0]
        slots = torch.arange(self.slots, dtype=torch.int64, device=pos.device)  # [T]
        write = (slots[:, None] == positions[None, :]).float()  # [T, C]
        keep = ((slots < pos) | (slots >= pos + c)).to(cache_dtype)[:, None]  # [T, 1]
        allowed = slots[None, :] <= positions.repeat(g)[:, None]  # [G*C, T]
        return write, keep, torch.where(allowed, 0.0, float("-inf"))

    def update_and_fetch(self, fmt: KVFormat, put, x, state, plan, scale=None):
        """x [C, Hkv, D] -> (new state tuple, fp32 [Hkv, T, D] to attend over with plan's mask); scale: a
        static-scale cache's [Hkv, D]."""
        return fmt.write(put, x, state, plan[0], plan[1], scale)

    def nbytes(self, fmt: KVFormat, hkv: int, head_dim: int) -> int:
        """Bytes of this layer's key and value state."""
        return 2 * hkv * self.slots * fmt.row_bytes(head_dim)


@dataclass(frozen=True)
class RollingCache:
    """A layer whose cache keeps T = sinks + size slots of a longer context (mlx-lm's RotatingKVCache(size, keep)).

    Position p lives in slot p if p < sinks, else in sinks + (p - sinks) mod size. Query q sees key k iff
    k <= q and (q - k < window or k < keep_first) [the window strategy; none if window is None] and q - k < native
    [the model's own sliding window; none if None]. transformers' sliding_window_overlay is kv_idx > q_idx - W, i.e.
    q - k < W. Every key some query can still see is in the cache: see layer_caches for why.

    A call attends over [the cache as it was before the call, this call's own C keys] ([Hkv, T + C, D]), because its
    later tokens may overwrite slots its earlier queries still need; then only the survivors (the sinks, and the
    call's last `size` rolling positions) are written. Keys are stored after RoPE at their true absolute positions (no
    StreamingLLM re-indexing), so a rolling layer computes exactly the masked attention of the full model."""
    sinks: int
    size: int
    window: int | None
    keep_first: int
    native: int | None
    rolling = True

    @property
    def slots(self) -> int:
        return self.sinks + self.size

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
        slots as they were before this call, then this call's C keys).

        Before the call, sink slot s holds position s if s < pos; rolling slot j holds the latest p' < pos with
        slot(p') = j: with m = pos - 1 - sinks, p' = sinks + m - ((m - j) mod size), valid if p' >= sinks.
        The call writes only its survivors: its sinks and its last `size` rolling positions (distinct slots)."""
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

    def update_and_fetch(self, fmt: KVFormat, put, x, state, plan, scale=None):
        """x [C, Hkv, D] -> (new state tuple, fp32 [Hkv, T + C, D]: the old cache, then the call's rows)."""
        return fmt.roll(put, x, state, plan[0], plan[1], scale)

    nbytes = FullCache.nbytes


def window_rule(strategy: str) -> tuple[int | None, int]:
    """The strategy's rolling-window rule (w, sinks), or (None, 0) for a strategy that keeps every position: asked of
    the strategy object (recent_tokens, sink_tokens), not read from its name or its parameter names."""
    st = parse_strategy(strategy)
    w = st.recent_tokens
    return (w, st.sink_tokens) if w is not None else (None, 0)


def layer_caches(n_layers: int, windows: list[int | None] | None,
                 layout: StateLayout) -> list[FullCache | RollingCache]:
    """Per layer, its cache: FullCache where T == ctx, else its RollingCache.

    T = min(ctx, native window Wn, W + S) (edgekv.strategies.build_layout). With the window strategy and
    W + S < Wn, the cache keeps S sinks and a rolling window of W: every visible key is a sink or one of the last W
    positions. Otherwise (a native window Wn <= W + S, or no window strategy) a rolling window of T = Wn with no
    pinned slots holds every visible key, since q - k < Wn; the strategy's rule (q - k < W or k < S) still applies on
    top. With T == ctx every rule is vacuous for positions < ctx, so those layers keep the plain cache exactly."""
    w, s = window_rule(layout.strategy)
    full = FullCache(layout.ctx)
    out = []
    for i in range(n_layers):
        native = windows[i] if windows else None
        t = min(layout.ctx, native or layout.ctx, (w + s) if w is not None else layout.ctx)
        if t == layout.ctx:
            out.append(full)
        elif w is not None and (native is None or w + s < native):
            out.append(RollingCache(s, w, w, s, native))
        else:
            out.append(RollingCache(0, t, w, s, native))
    return out


def check_layout(a, layout: StateLayout) -> tuple[KVFormat, list[FullCache | RollingCache]]:
    """The layout must be, per layer, a key and a value [1, Hkv, T, D] in fp32/fp16, or their quantized codes with
    .scale (and .zero) tensors as edgekv.quant writes them (kv-int8, kv-int4, kv-int2), with T = ctx or the
    layer's rolling size (a: LlamaArgs). Returns how each is stored and each layer's cache."""
    bits = 8 if any(t.dtype == "int8" for t in layout.tensors) else \
        next((t.packed_bits for t in layout.tensors if t.packed_bits), None)
    static = bits == 8 and not any(t.role.endswith(".scale") for t in layout.tensors)  # kv-int8c
    if bits is None or static:
        roles = ["key", "value"]
    elif bits == 8:
        roles = ["key", "key.scale", "value", "value.scale"]
    else:
        roles = ["key", "key.scale", "key.zero", "value", "value.scale", "value.zero"]
    want = [(i, role) for i in range(a.n_layers) for role in roles]
    got = [(t.layer, t.role) for t in layout.tensors]
    if got != want:
        raise EdgekvError(f"strategy {layout.strategy}: the llama export module keeps per layer {roles} "
                          f"(this layout has {sorted({t.role for t in layout.tensors})})")
    stored_d = a.head_dim if bits in (None, 8) else a.head_dim * bits // 8
    caches = layer_caches(a.n_layers, a.windows, layout)
    for t in layout.tensors:
        cache = caches[t.layer]
        if t.role in ("key", "value") and t.shape != (1, a.n_kv_heads, cache.slots, stored_d):
            raise EdgekvError(f"{t.name}: shape {t.shape} is not [1, {a.n_kv_heads}, {cache.slots}, {stored_d}] "
                              f"(layer {t.layer}: {'ctx slots' if not cache.rolling else cache})")
    if static:
        return KVFormat(None, 8, 0, static=True), caches
    if bits is not None:
        return KVFormat(None, bits, a.head_dim // layout.tensors[1].shape[-1]), caches
    dtypes = {t.dtype for t in layout.tensors}
    if len(dtypes) != 1 or not dtypes <= set(TORCH_DTYPES):
        raise EdgekvError(f"strategy {layout.strategy}: cache dtype {', '.join(sorted(dtypes))} is not supported "
                          f"by the export yet (supported: fp32, fp16)")
    return KVFormat(TORCH_DTYPES[dtypes.pop()]), caches


def hybrid_kv_format(layout: StateLayout, attn_layers: list[int], n_kv_heads: int, head_dim: int,
                     other: dict[int, tuple[str, ...]]) -> KVFormat:
    """How the attention layers' KV is stored, checked against the layout: per attention layer a key and a value
    [1, Hkv, T, D] (fp32/fp16), or kv-int8/int4/int2 codes with .scale (and .zero); the other roles as `other` names
    them (layer -> roles), after the KV where a layer has both (Falcon-H1: attention and Mamba-2 in one block). One
    clear line when the layout is another."""
    bits = 8 if any(t.dtype == "int8" and t.role == "key" for t in layout.tensors) else \
        next((t.packed_bits for t in layout.tensors if t.packed_bits), None)
    kv_roles = ("key", "value") if bits is None else (("key", "key.scale", "value", "value.scale") if bits == 8 else
                                                      ("key", "key.scale", "key.zero", "value", "value.scale",
                                                       "value.zero"))
    n = max([*attn_layers, *other], default=-1) + 1
    want = [(i, r) for i in range(n) for r in (kv_roles if i in attn_layers else ()) + other.get(i, ())]
    got = [(t.layer, t.role) for t in layout.tensors]
    if got != want:
        raise EdgekvError(f"strategy {layout.strategy}: this module keeps per attention layer {list(kv_roles)} and "
                          f"per other layer {sorted({r for rs in other.values() for r in rs})} "
                          f"(this layout has {sorted({t.role for t in layout.tensors})})")
    stored_d = head_dim if bits in (None, 8) else head_dim * bits // 8
    for t in layout.tensors:
        if t.role in ("key", "value") and t.shape != (1, n_kv_heads, layout.ctx, stored_d):
            raise EdgekvError(f"{t.name}: shape {t.shape} is not [1, {n_kv_heads}, {layout.ctx}, {stored_d}]")
    if bits is not None:
        scale = next(t for t in layout.tensors if t.role == "key.scale")
        return KVFormat(None, bits, head_dim // scale.shape[-1])
    dtypes = {t.dtype for t in layout.tensors if t.role in ("key", "value")}
    if not dtypes <= {"float32", "float16"} or len(dtypes) > 1:
        raise EdgekvError(f"strategy {layout.strategy}: cache dtype {', '.join(sorted(dtypes))} is not supported by "
                          "the export (fp32, fp16, kv-int8/int4/int2)")
    return KVFormat(STATE_TORCH[dtypes.pop()] if dtypes else torch.float32)


def cache_plan(pos: torch.Tensor, c: int, t_slots: int, g: int, cache_dtype: torch.dtype):
    """pos [1], C tokens -> positions [C], write [T, C] one-hot (slot p <- position p), keep [T, 1], mask [G*C, T]
    additive (0 where slot <= the query's position): edgekv.models.layers.slot_plan in the form
    edgekv.models.llama.Attention takes, computed once per call for every attention layer."""
    positions, write, written, allowed = slot_plan(pos, c, t_slots, repeat=g)
    return positions, write, (~written).to(cache_dtype), torch.where(allowed, 0.0, float("-inf"))
