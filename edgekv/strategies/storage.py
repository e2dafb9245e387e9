"""How a KV cache stores one key (or value) row: one class per storage kind, in the manner of mlx-lm's
mlx_lm/models/cache.py (KVCache, QuantizedKVCache(group_size, bits)). A cache strategy names its storage
(Strategy.kv_storage); everything that used to branch on a strategy's bits or on a tensor's dtype asks the storage
instead:

  the layout (strategies/layout.py)       its state tensors per key / value: role suffix, dtype, width (parts)
  the memory model (memory/costs.py,      bytes per row, the runtimes.json kv_read key (and kv_read, where a
   memory/workspace.py)                   runtime's read depends on more than the key), what a fused .pte reads its
                                          rows back from, whether it is quantized (a dequantized copy) or packed
  the torch modules (models/cache.py)     store / read / the rows as stored (torch imported lazily, here only)
  the fused attention swaps (swaps.py)    which runtimes' fused op attends over it (fused), how the .pte's op
                                          reads it (pte_read: in place, int8 codes, fp32 rows)
  verify (export/verify.py)               its tolerance key (verify.REL_TOL)
  the manifest                            its tensors' dtypes (parts)
  analyze, hybrid_alias                   its bits, its hybrid dtype

Kinds here: FloatStorage (fp32 / fp16 / bf16 / fp8 values), GroupQuantStorage (edgekv.quant's int8 / int4 / int2
codes with an fp16 scale, and zero below 8 bits, per group of channels), StaticInt8Storage (int8 codes whose
per-channel scales are constants of the graph: kv-int8c). Adding a storage: a subclass here, and a strategy class
whose kv_storage returns it.

The planner imports this module, so nothing here imports torch at module level.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "float8_e4m3fn": 1.0, "int8": 1.0, "uint8": 1.0}
KV_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}
# the float caches edgekv's torch modules write (a bf16 or fp8 cache is planned, not exported)
EXPORTED_FLOATS = ("fp32", "fp16")
EDGEKV_PACKED_BITS = (4, 2)  # the packed caches edgekv::packed_sdpa reads (kv-int4, kv-int2)


def per_token_int8(bits: int | None, group: int | None, head_dim: int) -> bool:
    """Whether a cache is int8 with one scale per token and head (group 0 or head_dim): the cache a fused .pte
    reads back with ExecuTorch's one quantized kernel (edgekv.models.swaps.SdpaAttention), and that the planner
    counts as such (GroupQuantStorage.readback_source). One rule for both."""
    return bits == 8 and group in (0, head_dim)


def _check_group(label: str, d: int, group: int) -> None:
    """A storage with a scale per group of `group` channels (0: the whole head) needs head_dim a multiple of it."""
    from .base import ParamsDoNotFit
    g = group or d
    if d % g:
        raise ParamsDoNotFit(f"{label}: head_dim {d} is not a multiple of group {g}")


@dataclass(frozen=True)
class Part:
    """One state tensor of a key (or value) cache: role suffix ('' for the values or codes, '.scale', '.zero'), dtype,
    width of the last axis for head_dim d (width(d)), and packed_bits where sub-byte codes are packed into uint8."""
    suffix: str
    dtype: str
    per: int = 1  # stored width = d // per (a packed cache's codes per byte, a scale's group)
    packed_bits: int | None = None

    def width(self, d: int) -> int:
        return d // self.per


class KvStorage:
    """The base of every storage kind: what the planner, the torch modules, verify and analyze ask of it."""
    bits: ClassVar[int | None] = None  # bits per stored value of a quantized cache; None: plain float values
    static_scales: ClassVar[bool] = False  # scales are constants of the graph, not state
    fused_runtimes: ClassVar[tuple[str, ...]] = ()  # runtimes whose fused attention op reads this cache in place

    # ---- the layout ----

    def parts(self, d: int) -> tuple[Part, ...]:
        raise NotImplementedError

    def check(self, label: str, d: int) -> None:
        """Refuse a head_dim the storage cannot hold (ParamsDoNotFit, one line naming the strategy)."""

    def suffixes(self, d: int) -> tuple[str, ...]:
        return tuple(p.suffix for p in self.parts(d))

    def roles(self, d: int) -> tuple[str, ...]:
        """The roles of one layer's state tensors, in layout order: key's parts, then value's."""
        return tuple(r + s for r in ("key", "value") for s in self.suffixes(d))

    def stored_width(self, d: int) -> int:
        """The last axis of the key (value) tensor itself: d, or fewer bytes per row for packed codes."""
        return self.parts(d)[0].width(d)

    def row_bytes(self, d: int) -> int:
        """Bytes one (token, KV head) row of a key (or value) cache takes, every part counted."""
        return int(sum(p.width(d) * DTYPE_BYTES[p.dtype] for p in self.parts(d)))

    # ---- the memory model ----

    @property
    def quantized(self) -> bool:
        """Codes that attention reads through a dequantization (not a cast)."""
        return self.bits is not None

    @property
    def kv_read_key(self) -> str:
        """Its key in edgekv/costs/runtimes.json kv_read."""
        raise NotImplementedError

    @property
    def default_kv_read(self) -> str:
        """How a runtime that does not list the storage reads it."""
        return "dequantized copy" if self.quantized else "cast"

    def readback_source(self, d: int) -> str:
        """What a fused .pte reads its cache rows back from (workspace.json's readback_copies / kernel_code keys)."""
        return self.kv_read_key

    def fused(self, runtime: str) -> bool:
        """Whether edgekv's export for this runtime attends over this cache through the runtime's fused op."""
        return runtime in self.fused_runtimes

    def pte_read(self, d: int) -> str:
        """How edgekv's fused .pte reads this cache (edgekv.models.swaps.SdpaAttention): "in place" (custom_sdpa on a
        view of a fp32 cache), "int8 codes" (custom_quantized_sdpa on int8 codes in place) or "fp32 rows" (the
        written rows read back as fp32, then custom_sdpa)."""
        return "fp32 rows"

    def edgekv_kernel_reads(self, d: int) -> bool:
        """Whether edgekv's own kernels (export --pte-kernel edgekv, edgekv/native) read this cache in place in a
        fused .pte, where the default reads the rows written so far back into fp32 every call: int8 codes with one
        scale per token and head, or static ones (edgekv::int8_sdpa); an fp16 cache (FloatStorage: edgekv::fp16_sdpa);
        packed int4 / int2 codes (GroupQuantStorage: edgekv::packed_sdpa). The export (edgekv.models.swaps) and the
        plan's workspace (edgekv.memory.workspace) both ask it."""
        return self.pte_read(d) == "int8 codes"

    def kv_read(self, cost_model: str, table: dict) -> str:
        """How a runtime (a memory cost model) reads this cache: its kv_read table (edgekv/costs/runtimes.json) at
        kv_read_key, else default_kv_read."""
        return table.get(self.kv_read_key, self.default_kv_read)

    @property
    def hybrid_dtype(self) -> str | None:
        """The hybrid strategy's dtype for a family that keeps this cache only in its hybrid form (hybrid_alias);
        None: no hybrid form."""
        return None

    # ---- verify ----

    @property
    def tolerance(self) -> str:
        """Its key in edgekv.export.verify.REL_TOL: how far an artifact may drift from the eager module."""
        raise NotImplementedError

    # ---- the torch side (imported lazily: the planner never calls these) ----

    @property
    def exportable(self) -> bool:
        """Whether edgekv's torch modules write this storage."""
        return True

    def store(self, x, scale=None, rounding: str = "nearest", generator=None) -> tuple:
        """x [C, Hkv, D] fp32 -> the tensors that hold it (one per part); scale: a static-scale cache's [Hkv, D]."""
        raise NotImplementedError

    def read(self, parts, scale=None):
        """The part tensors of one cache (or their [Hkv, T, X] slices) -> fp32 [..., D]; scale: static scales
        broadcast against them."""
        raise NotImplementedError

    def as_stored(self, x, parts, scale=None):
        """This call's rows x [C, Hkv, D] as the cache stores them (store's parts), in fp32."""
        return self.read(parts, scale)


@dataclass(frozen=True)
class FloatStorage(KvStorage):
    """Plain values in a float dtype (fp32, fp16, bf16, fp8): mlx-lm's KVCache."""
    dtype: str = "fp32"  # fp32 | fp16 | bf16 | fp8

    def fused(self, runtime: str) -> bool:
        return True  # every runtime's fused attention op reads plain values

    def pte_read(self, d: int) -> str:
        return "in place" if self.dtype == "fp32" else "fp32 rows"

    def edgekv_kernel_reads(self, d: int) -> bool:
        return self.dtype == "fp16"

    def parts(self, d: int) -> tuple[Part, ...]:
        return (Part("", KV_DTYPES[self.dtype]),)

    @property
    def kv_read_key(self) -> str:
        return self.dtype

    @property
    def hybrid_dtype(self) -> str:
        return self.dtype

    @property
    def tolerance(self) -> str:
        return KV_DTYPES[self.dtype]

    @property
    def exportable(self) -> bool:
        return self.dtype in EXPORTED_FLOATS

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, KV_DTYPES[self.dtype])

    def store(self, x, scale=None, rounding: str = "nearest", generator=None) -> tuple:
        return (x,)  # cast where it is written

    def read(self, parts, scale=None):
        return parts[0].float()

    def as_stored(self, x, parts, scale=None):
        return x.to(self.torch_dtype).float()


@dataclass(frozen=True)
class GroupQuantStorage(KvStorage):
    """edgekv.quant's codes: int8 symmetric with an fp16 scale per group, or int4 / int2 asymmetric packed into uint8
    with an fp16 scale and zero per group (group 0: one per (token, head)): mlx-lm's QuantizedKVCache(group, bits)."""
    bits: int = 8  # 8 | 4 | 2
    group: int = 0
    # .pte: custom_quantized_sdpa on per-token int8 codes, else custom_sdpa over the rows dequantized
    fused_runtimes: ClassVar[tuple[str, ...]] = ("executorch",)

    def parts(self, d: int) -> tuple[Part, ...]:
        g = self.group or d
        if self.bits == 8:
            return Part("", "int8"), Part(".scale", "float16", g)
        per_byte = 8 // self.bits
        return (Part("", "uint8", per_byte, self.bits), Part(".scale", "float16", g), Part(".zero", "float16", g))

    def check(self, label: str, d: int) -> None:
        _check_group(label, d, self.group)

    @property
    def kv_read_key(self) -> str:
        return f"int{self.bits}"

    def readback_source(self, d: int) -> str:
        if self.bits < 8:
            return "packed"
        return "int8" if per_token_int8(self.bits, self.group, d) else "int8 groups"

    def pte_read(self, d: int) -> str:
        return "int8 codes" if per_token_int8(self.bits, self.group, d) else "fp32 rows"

    def edgekv_kernel_reads(self, d: int) -> bool:
        return self.bits in EDGEKV_PACKED_BITS or super().edgekv_kernel_reads(d)

    def kv_read(self, cost_model: str, table: dict) -> str:
        """runtimes.json keys int8 caches by bits alone; on edgekv's .pte only one scale per token and head is read
        in place (pte_read), so int8 with smaller groups is a dequantized copy there (group 0 stands for the head)."""
        if cost_model == "executorch" and self.bits == 8 and self.group:
            return "dequantized copy"
        return super().kv_read(cost_model, table)

    @property
    def hybrid_dtype(self) -> str | None:
        return f"int{self.bits}" if self.bits in (8, 4) else None

    @property
    def tolerance(self) -> str:
        return "int8" if self.bits == 8 else "uint8"

    def store(self, x, scale=None, rounding: str = "nearest", generator=None) -> tuple:
        from ..quant import quantize
        codes, s, zero = quantize(x, self.bits, self.group, rounding, generator)
        return (codes, s) if self.bits == 8 else (codes, s, zero)

    def read(self, parts, scale=None):
        from ..quant import dequantize
        return dequantize(parts[0], parts[1], parts[2] if self.bits < 8 else None, self.bits, self.group)


@dataclass(frozen=True)
class StaticInt8Storage(KvStorage):
    """int8 codes whose scales, one per (layer, KV head, channel), are constants of the graph calibrated at export
    (kv-int8c): the state is the codes alone. ONNX Runtime's GroupQueryAttention reads them in place; the .pte's
    custom_quantized_sdpa too, the key scales folded into the query and the value scales into the output
    (edgekv.models.swaps.SdpaAttention)."""
    bits: ClassVar[int] = 8
    static_scales: ClassVar[bool] = True
    fused_runtimes: ClassVar[tuple[str, ...]] = ("onnxruntime", "executorch")

    def pte_read(self, d: int) -> str:
        return "int8 codes"

    def parts(self, d: int) -> tuple[Part, ...]:
        return (Part("", "int8"),)

    @property
    def kv_read_key(self) -> str:
        return "int8-channel"

    def readback_source(self, d: int) -> str:
        return "int8 groups"

    @property
    def hybrid_dtype(self) -> str:
        return "int8"

    @property
    def tolerance(self) -> str:
        return "int8"

    def store(self, x, scale=None, rounding: str = "nearest", generator=None) -> tuple:
        from ..quant import quantize_static
        return (quantize_static(x, scale),)

    def read(self, parts, scale=None):
        """Cache slices [Hkv, T, D] against the layer's [Hkv, D] scales."""
        from ..quant import dequantize_static
        return dequantize_static(parts[0], scale[:, None, :])

    def as_stored(self, x, parts, scale=None):
        """A call's codes [C, Hkv, D] against the [Hkv, D] scales."""
        from ..quant import dequantize_static
        return dequantize_static(parts[0], scale)


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn (S.1111.110)


def _e4m3_exponent(a):
    """a >= 0 fp32 (at most E4M3_MAX) -> max(floor(log2 a), -6), exactly: counted with comparisons against powers of
    two rather than taken from a log, which is inexact at the powers themselves. -6 is the smallest normal exponent;
    below 2^-6 the subnormals share its step."""
    import torch
    e = torch.full_like(a, -6.0)
    for k in range(-5, 9):
        e = e + (a >= 2.0 ** k).float()
    return e


@dataclass(frozen=True)
class Fp8GroupStorage(KvStorage):
    """fp8 e4m3 codes with an fp16 scale per group (group 0: one per (token, head)): x / scale is rounded to the
    nearest float8_e4m3fn (round half to even, scale = amax / 448 so that nothing saturates) and its bit pattern
    (sign, 4 exponent bits biased by 7, 3 mantissa bits) is kept as one uint8 per value. The graph computes the
    codes and reads them back with elementwise float ops (comparisons, Pow, Round, Where), so any runtime runs it: no
    float8 tensor type or bitcast is needed in the exported program. vLLM's fp8 cache (docs: Quantized KV Cache) is
    the same format with one scale per tensor."""
    bits: ClassVar[int] = 8
    group: int = 0

    def parts(self, d: int) -> tuple[Part, ...]:
        return Part("", "uint8"), Part(".scale", "float16", self.group or d)

    def check(self, label: str, d: int) -> None:
        _check_group(label, d, self.group)

    @property
    def kv_read_key(self) -> str:
        return "fp8-group"

    @property
    def tolerance(self) -> str:
        # a code one step off moves a value by 1/16 to 1/8 of itself (3 mantissa bits): nearer an int4 step (1/15 of
        # a group's range) than an int8 one (1/254), so it takes the packed codes' limit
        return "uint8"

    def _grouped(self, x):
        d = x.shape[-1]
        g = self.group or d
        return x.reshape(*x.shape[:-1], d // g, g)

    def store(self, x, scale=None, rounding: str = "nearest", generator=None) -> tuple:
        import torch

        from ..quant import EPS, SCALE_DTYPE
        xg = self._grouped(x.float())
        s = (xg.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(EPS).to(SCALE_DTYPE)
        y = xg / s.float()
        a = y.abs().clamp(max=E4M3_MAX)
        step = torch.pow(2.0, _e4m3_exponent(a) - 3)  # 3 mantissa bits: 8 steps per binade
        if rounding == "nearest":
            n = torch.round(a / step)
        elif rounding == "stochastic":
            n = torch.floor(a / step + torch.rand(a.shape, generator=generator, dtype=a.dtype, device=a.device))
        else:
            raise ValueError(f"rounding must be nearest or stochastic, got {rounding!r}")
        q = (n * step).clamp(max=E4M3_MAX)  # the fp8 value; rounding up may reach the next binade
        e = _e4m3_exponent(q)
        code = torch.where(q >= 2.0 ** -6, 8 * e + 48 + q / torch.pow(2.0, e - 3), q * 512.0)  # normal | subnormal
        code = code + 128.0 * (y < 0).float()
        return code.reshape(x.shape).to(torch.uint8), s.squeeze(-1)

    def read(self, parts, scale=None):
        import torch
        c = parts[0].float()
        neg = (c >= 128).float()
        m = c - 128.0 * neg
        ex = torch.floor(m / 8)
        man = m - 8 * ex
        v = torch.where(ex > 0, (8 + man) * torch.pow(2.0, ex - 10), man / 512.0) * (1 - 2 * neg)
        return (self._grouped(v) * parts[1].float().unsqueeze(-1)).reshape(c.shape)
