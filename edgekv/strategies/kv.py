"""The KV cache: every token's keys and values, in a float dtype (kv) or quantized per group (kv-int8/int4/int2);
and the window, which keeps the first S (sink) tokens and the last W."""
from __future__ import annotations

from ..arch import Arch, Attention
from ..errors import EdgekvError
from .base import NotApplicable, Strategy, register
from .layout import StateTensor, _kv_pair
from .storage import Fp8GroupStorage, FloatStorage, GroupQuantStorage, KvStorage, StaticInt8Storage

RECURRENT_MSG = "a model with recurrent layers: plan it with hybrid/ssm/linear"
RECURRENT_KINDS = {"ssm", "linear", "conv"}  # mixers that carry a recurrent (or conv) state


def _check_cache(arch: Arch) -> None:
    """A KV (or window) cache needs attention layers only: no recurrent layer, no native MLA latent."""
    if arch.kinds & RECURRENT_KINDS:
        raise NotApplicable(RECURRENT_MSG)
    if "mla" in arch.kinds:
        raise NotApplicable("an MLA model caches a latent: use mla")


def _slots(m: Attention, ctx: int) -> int:
    """Rows a layer keeps: every token, or its native sliding window."""
    return ctx if m.window is None else min(ctx, m.window)


@register
class Kv(Strategy):
    name = "kv"
    defaults = {"dtype": "fp16"}
    help = "kv, kv:dtype=fp8"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'kv:fp32': ('none', 'reference precision', 'reference'),
        'kv:fp16': ('none', 'the precision models are trained and served in', 'reference'),
        'kv:bf16': ('none', 'the precision models are trained and served in', 'reference'),
        'kv:fp8': ('low',
            '8-bit KV: llama.cpp PR #7412, q8_0 K/V dPPL 0.0049, KLD 0.00155 (f16 KLD 0.00019)',
            'llama.cpp #7412'),
    }
    plain_kv = True
    full_cache = True
    kv_cache = True
    native_families = ("transformer",)

    @property
    def short(self) -> str:
        return f"kv {self.params['dtype']}"

    @property
    def kv_storage(self) -> KvStorage:
        return FloatStorage(self.params["dtype"])

    def check(self, arch: Arch) -> None:
        _check_cache(arch)

    def attention_state(self, arch: Arch, i: int, m: Attention, ctx: int) -> list[StateTensor]:
        return _kv_pair(i, m.n_kv_heads, _slots(m, ctx), m.head_dim, self)

    def fused_attention(self, runtime: str) -> bool:
        """Its storage says (a float cache: every runtime's fused op reads it)."""
        return self.kv_storage.fused(runtime)

    def quality_key(self, ctx: int, converted: bool) -> str:
        return f"kv:{self.params['dtype']}"

    def reference(self) -> Strategy:
        return Kv({"dtype": "fp32"})


class _QuantizedKv(Kv):
    """Codes (int8, or int4/int2 packed into uint8) plus an fp16 scale per group (and a zero point below 8 bits);
    group 0 = one scale per (token, head)."""
    defaults = {"group": 32}
    integer_params = frozenset({"group"})
    plain_kv = False
    native_families = ()

    @property
    def short(self) -> str:
        return self.name + (f" g{self.params['group']}" if self.params.get("group") else "")

    @property
    def kv_storage(self) -> KvStorage:
        return GroupQuantStorage(self.kv_bits, self.params.get("group") or 0)

    def fused_attention(self, runtime: str) -> bool:
        """ExecuTorch's custom_quantized_sdpa reads per-token int8 codes in place, custom_sdpa the written rows of the
        other kinds dequantized (edgekv.models.swaps.SdpaAttention)."""
        return self.kv_storage.fused(runtime)

    def quality_key(self, ctx: int, converted: bool) -> str:
        return self.name


@register
class KvInt8(_QuantizedKv):
    name = "kv-int8"
    defaults = {"group": 0}  # 0 = one scale per (token, head): group = head_dim
    help = "kv-int8"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'kv-int8': ('low',
            '8-bit KV: llama.cpp PR #7412, q8_0 K/V dPPL 0.0049, KLD 0.00155 (f16 KLD 0.00019)',
            'llama.cpp #7412'),
    }
    kv_bits = 8


@register
class KvInt4(_QuantizedKv):
    name = "kv-int4"
    help = "kv-int4[:group=32]"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'kv-int4': ('medium',
            '4-bit KV: KVQuant (arXiv 2401.18079) <0.1 PPL at 3-bit needs per-channel pre-RoPE keys; plain q4_0 KV '
            "'destroys output quality' (lmstudio-bug-tracker #1740)",
            'KVQuant; lmstudio #1740'),
        'kv-int4:long': ('high',
            'int4 KV tool-call failures past ~40k tokens (minimal-ai #18); KV quantization errors matter more with '
            'context length (ik_llama.cpp PR #1547)',
            'minimal-ai #18'),
    }
    kv_bits = 4

    def quality_key(self, ctx: int, converted: bool) -> str:
        return "kv-int4:long" if ctx > 32768 else "kv-int4"


@register
class KvInt2(_QuantizedKv):
    name = "kv-int2"
    help = "kv-int2"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'kv-int2': ('high',
            "2-bit KV only works with KIVI's scheme (ICML'24: per-channel keys, per-token values, recent tokens in "
            'full precision); uniform per-token 2-bit has no published support',
            'KIVI'),
    }
    kv_bits = 2
    planned_on = "none"


@register
class KvInt8Channel(_QuantizedKv):
    """int8 codes with static scales, one per (layer, KV head, channel) for K and for V, calibrated once at export
    over real text (edgekv.export.calibrate) and kept in the graph as constants: the state is the codes alone
    (past_key_values.{i}.key / .value int8 [1, Hkv, T, D], no .scale tensors). This is the cache ONNX Runtime's
    GroupQueryAttention reads in place (k_quant_type / v_quant_type PER_CHANNEL, kv_cache_bit_width 8; codes
    clip(rint(x / scale), -128, 127), measured in benchmarks/results/ort_quant_cache.json), where edgekv's kv-int8
    (a scale per token, set when a row is written) has to be dequantized whole before attention. Keys per channel
    follow KVQuant (arXiv 2401.18079: outlier channels are per channel); values past the calibrated range
    saturate."""
    name = "kv-int8c"
    defaults = {}
    help = "kv-int8c"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'kv-int8c': ('medium',
            'static per-channel int8 K/V calibrated on 512 tokens: per-channel keys as KVQuant (arXiv 2401.18079); '
            'static per-channel values have no published result: run edgekv analyze --strategy kv-int8c',
            'KVQuant (keys)'),
    }
    kv_bits = 8
    static_scales = True
    planned_on = "none"  # asked for by name (edgekv plan --strategy kv-int8c)

    @property
    def short(self) -> str:
        return "kv-int8c"

    @property
    def kv_storage(self) -> KvStorage:
        return StaticInt8Storage()

    def fused_attention(self, runtime: str) -> bool:
        """ONNX Runtime's GroupQueryAttention reads the codes with their static scales, the .pte's
        custom_quantized_sdpa with the scales folded into the query and the output (edgekv.models.swaps)."""
        return self.kv_storage.fused(runtime)


@register
class KvFp8(_QuantizedKv):
    """fp8 e4m3 codes (one uint8 per value) with an fp16 scale per group (group 0: one per (token, head)):
    Fp8GroupStorage. Read back dequantized by the eager graph on every runtime (no fused op reads it)."""
    name = "kv-fp8"
    defaults = {"group": 0}
    help = "kv-fp8[:group=0]"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'kv-fp8': ('low',
            "fp8 e4m3 KV: vLLM's docs (Quantized KV Cache) report it 'typically only minimally degrades inference "
            "accuracy' with one scale per tensor; here one fp16 scale per group: run edgekv analyze --strategy kv-fp8",
            'vLLM fp8 KV docs'),
    }
    kv_bits = 8
    planned_on = "none"  # asked for by name (edgekv plan --strategy kv-fp8)

    @property
    def kv_storage(self) -> KvStorage:
        return Fp8GroupStorage(self.params.get("group") or 0)


@register
class Window(Strategy):
    name = "window"
    defaults = {"w": 4096, "sinks": 4, "dtype": "fp16"}
    integer_params = frozenset({"w", "sinks"})
    help = "window[:w=4096,sinks=4]"
    shortcut = ("--window", "w")
    kv_cache = True
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'window:short': ('none', 'the whole context fits in the window: nothing is dropped', 'fits the window'),
        'window': ('high',
            'tokens older than the window are dropped: exact recall of them is impossible by construction '
            '(ExecuTorch keeps sink tokens for stability, export_llama --use_attention_sink)',
            'drops old tokens'),
    }

    @classmethod
    def check_params(cls, spec: str, params: dict) -> None:
        if params["w"] < 1:
            raise EdgekvError(f"strategy {spec!r}: window w must be at least 1")

    @property
    def short(self) -> str:
        p = self.params
        return f"window {p['w']}+{p['sinks']}" + ("" if p["dtype"] == "fp16" else f" {p['dtype']}")

    @property
    def window_tokens(self) -> int:
        return self.params["w"] + self.params["sinks"]

    @property
    def recent_tokens(self) -> int:
        return self.params["w"]

    @property
    def sink_tokens(self) -> int:
        return self.params["sinks"]

    def covers(self, ctx: int) -> bool:
        """A window whose W + S reach ctx keeps every token: plain kv's state."""
        return ctx <= self.window_tokens

    @property
    def kv_storage(self) -> KvStorage:
        return FloatStorage(self.params["dtype"])

    def check(self, arch: Arch) -> None:
        _check_cache(arch)

    def attention_state(self, arch: Arch, i: int, m: Attention, ctx: int) -> list[StateTensor]:
        return _kv_pair(i, m.n_kv_heads, min(_slots(m, ctx), self.window_tokens), m.head_dim,
                        Kv({"dtype": self.params["dtype"]}))

    def fused_attention(self, runtime: str) -> bool:
        return self.kv_storage.fused(runtime)

    def quality_key(self, ctx: int, converted: bool) -> str:
        return "window:short" if self.covers(ctx) else "window"

    def reference(self) -> Strategy:
        return Kv({"dtype": "fp32"})
