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
from ..strategies import FloatStorage, KvStorage, StateLayout, kv_storage_of, parse_strategy
from .layers import slot_plan


class KVFormat:
    """How one key (or value) cache is stored: its storage (edgekv.strategies.storage: plain values in a float dtype,
    edgekv.quant's codes with per-group scales, static-scale int8 codes) plus the rounding an analyze run asks for.
    Each call stores only its new tokens and reads the cache back in fp32, one layer at a time."""

    def __init__(self, storage: KvStorage):
        self.storage = storage
        self.n = len(storage.suffixes(1))  # state tensors per key (or value): codes, scale, zero
        self.rounding, self.generator = "nearest", None  # edgekv analyze may switch to stochastic rounding

    @property
    def dtype(self) -> torch.dtype | None:
        """A float cache's torch dtype; None for codes."""
        return None if self.storage.quantized else self.storage.torch_dtype

    @property
    def bits(self) -> int | None:
        return self.storage.bits

    @property
    def group(self) -> int:
        return getattr(self.storage, "group", 0)

    @property
    def static(self) -> bool:
        return self.storage.static_scales

    def store(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """x [C, Hkv, D] fp32 -> the n tensors that hold it (scale: a static-scale cache's [Hkv, D] constant)."""
        return self.storage.store(x, scale, self.rounding, self.generator)

    def read(self, parts, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The n state tensors of one cache (or their [Hkv, T, X] slices) -> fp32 [..., D]."""
        return self.storage.read(parts, scale)

    def write(self, put, x, state, write, keep, scale=None):
        """x [C, Hkv, D] fp32 -> (new state tuple, fp32 cache [Hkv, T, D] for attention)."""
        new = tuple(put(old, part, write, keep) for old, part in zip(state, self.store(x, scale)))
        return new, self.read(tuple(t[0] for t in new), scale)

    def roll(self, put, x, state, write, keep, scale=None):
        """A rolling layer: x [C, Hkv, D] fp32 -> (new state, fp32 [Hkv, T + C, D]: the cache as it was before this
        call, then this call's C tokens as the cache stores them, i.e. rounded to its dtype or its quantizer)."""
        parts = self.store(x, scale)
        old = self.read(tuple(t[0] for t in state), scale)
        new = self.storage.as_stored(x, parts, scale)
        new_state = tuple(put(o, part, write, keep) for o, part in zip(state, parts))
        return new_state, torch.cat((old, new.permute(1, 0, 2)), 1)

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one (token, KV head) row of this cache takes: every part its storage declares."""
        return self.storage.row_bytes(head_dim)


def layout_storage(layout: StateLayout) -> KvStorage:
    """The KV storage the layout's strategy declares (a strategy with no KV cache: plain fp32, so that a layout
    of another kind fails the role check with the roles a float cache keeps)."""
    return kv_storage_of(layout) or FloatStorage("fp32")


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
    """The layout must be, per layer, a key and a value [1, Hkv, T, D] with the parts the strategy's storage declares
    (fp32/fp16 values, or codes with .scale (and .zero) tensors as edgekv.quant writes them), with T = ctx or the
    layer's rolling size (a: LlamaArgs). Returns how each is stored and each layer's cache."""
    st = layout_storage(layout)
    roles = [r + s for r in ("key", "value") for s in st.suffixes(a.head_dim)]
    want = [(i, role) for i in range(a.n_layers) for role in roles]
    got = [(t.layer, t.role) for t in layout.tensors]
    if got != want:
        raise EdgekvError(f"strategy {layout.strategy}: the llama export module keeps per layer {roles} "
                          f"(this layout has {sorted({t.role for t in layout.tensors})})")
    stored_d = st.stored_width(a.head_dim)
    caches = layer_caches(a.n_layers, a.windows, layout)
    for t in layout.tensors:
        cache = caches[t.layer]
        if t.role in ("key", "value") and t.shape != (1, a.n_kv_heads, cache.slots, stored_d):
            raise EdgekvError(f"{t.name}: shape {t.shape} is not [1, {a.n_kv_heads}, {cache.slots}, {stored_d}] "
                              f"(layer {t.layer}: {'ctx slots' if not cache.rolling else cache})")
    if not st.exportable:
        dtypes = {t.dtype for t in layout.tensors}
        raise EdgekvError(f"strategy {layout.strategy}: cache dtype {', '.join(sorted(dtypes))} is not supported "
                          f"by the export yet (supported: fp32, fp16)")
    return KVFormat(st), caches


def hybrid_kv_format(layout: StateLayout, attn_layers: list[int], n_kv_heads: int, head_dim: int,
                     other: dict[int, tuple[str, ...]]) -> KVFormat:
    """How the attention layers' KV is stored, checked against the layout: per attention layer a key and a value
    [1, Hkv, T, D] with the parts the strategy's storage declares (fp32/fp16, or kv-int8/int4/int2 codes with .scale
    (and .zero)); the other roles as `other` names them (layer -> roles), after the KV where a layer has both
    (Falcon-H1: attention and Mamba-2 in one block). One clear line when the layout is another."""
    st = layout_storage(layout)
    kv_roles = st.roles(head_dim)
    n = max([*attn_layers, *other], default=-1) + 1
    want = [(i, r) for i in range(n) for r in (kv_roles if i in attn_layers else ()) + other.get(i, ())]
    got = [(t.layer, t.role) for t in layout.tensors]
    if got != want:
        raise EdgekvError(f"strategy {layout.strategy}: this module keeps per attention layer {list(kv_roles)} and "
                          f"per other layer {sorted({r for rs in other.values() for r in rs})} "
                          f"(this layout has {sorted({t.role for t in layout.tensors})})")
    stored_d = st.stored_width(head_dim)
    for t in layout.tensors:
        if t.role in ("key", "value") and t.shape != (1, n_kv_heads, layout.ctx, stored_d):
            raise EdgekvError(f"{t.name}: shape {t.shape} is not [1, {n_kv_heads}, {layout.ctx}, {stored_d}]")
    if not attn_layers:
        return KVFormat(FloatStorage("fp32"))
    if not st.exportable:
        dtypes = {t.dtype for t in layout.tensors if t.role in ("key", "value")}
        raise EdgekvError(f"strategy {layout.strategy}: cache dtype {', '.join(sorted(dtypes))} is not supported by "
                          "the export (fp32, fp16, kv-int8/int4/int2)")
    return KVFormat(st)


def cache_plan(pos: torch.Tensor, c: int, t_slots: int, g: int, cache_dtype: torch.dtype):
    """pos [1], C tokens -> positions [C], write [T, C] one-hot (slot p <- position p), keep [T, 1], mask [G*C, T]
    additive (0 where slot <= the query's position): edgekv.models.layers.slot_plan in the form
    edgekv.models.llama.Attention takes, computed once per call for every attention layer."""
    positions, write, written, allowed = slot_plan(pos, c, t_slots, repeat=g)
    return positions, write, (~written).to(cache_dtype), torch.where(allowed, 0.0, float("-inf"))
