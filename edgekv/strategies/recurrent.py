"""Recurrent states: a pure SSM (Mamba) model's conv + SSM state, a linear-attention / RWKV model's recurrent state,
and a hybrid's blend of a KV (or latent) cache on its attention layers and a recurrent state on the others."""
from __future__ import annotations

from ..arch import MLA, Arch, Attention
from .base import NotApplicable, Strategy, _native_latent, register
from .kv import RECURRENT_KINDS, Kv, KvInt4, KvInt8, _slots
from .layout import StateTensor, _kv_pair


class _Pure(Strategy):
    """The only state of a model whose every layer is this recurrence."""
    defaults = {"dtype": "fp32"}
    int8_state = True
    state_dtype_is_dtype = True
    recurrent = True

    @property
    def short(self) -> str:
        return f"{self.name} {self.params['dtype']}"

    def check(self, arch: Arch) -> None:
        if arch.kinds != {self.name}:
            raise NotApplicable(f"needs a pure {self.name} model")

    def quality_key(self, ctx: int, converted: bool) -> str:
        key = f"{self.name}:{self.params['dtype']}"
        return key if key in self.evidence else f"{self.name}:fp16"  # bf16/fp8 as fp16

    def reference(self) -> Strategy:
        return type(self)({"dtype": "fp32"})


@register
class Ssm(_Pure):
    name = "ssm"
    help = "ssm[:dtype=int8]"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'ssm:fp32': ('low',
            'native state precision; keep A/dt/state in fp32 (state-spaces/mamba #133, llama.cpp PR #5328)',
            'mamba #133'),
        'ssm:fp16': ('medium',
            'SSM state error compounds through the recurrence (S4D edge study arXiv 2506.12480; '
            'openai/parameter-golf #1355)',
            'S4D arXiv 2506.12480'),
        'ssm:int8': ('high',
            'uniform INT8 SSM state halved GSM8K 81%->41% without error feedback (vLLM #55196); per-(head,dim) fp32 '
            'scales recover it (vLLM PR #52962: 85.94% vs 85.35% fp32)',
            'vLLM #55196, #52962'),
    }
    native_families = ("ssm",)
    needs_family = "ssm"

    @classmethod
    def extra_defaults(cls, arch: Arch) -> list[Strategy]:
        return [cls({"dtype": "int8"})] if arch.family == "ssm" else []


@register
class LinearState(_Pure):
    name = "linear"
    help = "linear"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'linear:fp32': ('low', 'native state precision', 'native'),
        'linear:fp16': ('medium',
            'recurrent state error compounds through the recurrence (S4D edge study arXiv 2506.12480)',
            'S4D arXiv 2506.12480'),
        'linear:int8': ('high',
            'INT8 uniform GDN state GSM8K 81%->41% without error feedback (vLLM #55196)',
            'vLLM #55196'),
    }
    native_families = ("linear",)
    needs_family = "linear"


@register
class Hybrid(Strategy):
    name = "hybrid"
    defaults = {"dtype": "fp16", "state_dtype": "fp32"}
    int8_state = True
    help = "hybrid"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'hybrid': ('low', 'native model: attention KV in fp16, recurrent state in fp32', 'native'),
    }
    native_families = ("hybrid",)
    needs_family = "hybrid"
    recurrent = True

    @property
    def short(self) -> str:
        return f"hybrid kv {self.params['dtype']}/state {self.params['state_dtype']}"

    def check(self, arch: Arch) -> None:
        if not (arch.kinds & RECURRENT_KINDS and arch.kinds & {"attention", "mla"}):
            raise NotApplicable("needs a hybrid model (attention and recurrent layers)")

    @classmethod
    def allows_dtype(cls, key: str, value: str) -> bool:
        """int8 for either state; dtype=int4 for the attention layers' cache as well (hybrid_kv)."""
        return super().allows_dtype(key, value) or (key == "dtype" and value == "int4")

    @property
    def attention_kv(self) -> Strategy:
        return hybrid_kv(self)

    @property
    def kv_storage(self):
        return hybrid_kv(self).kv_storage

    def attention_state(self, arch: Arch, i: int, m: Attention, ctx: int) -> list[StateTensor]:
        return _kv_pair(i, m.n_kv_heads, _slots(m, ctx), m.head_dim, hybrid_kv(self))

    def latent_state(self, i: int, m: MLA, ctx: int) -> list[StateTensor]:
        return _native_latent(i, m, ctx, self.params["dtype"])

    def reference(self) -> Strategy:
        return Hybrid({"dtype": "fp32", "state_dtype": "fp32"})


def hybrid_kv(strategy: Strategy) -> Strategy:
    """The cache strategy of a hybrid's attention layers: hybrid:dtype=fp16 -> kv:dtype=fp16; dtype=int8 -> kv-int8
    (one scale per token and head), dtype=int4 -> kv-int4 (groups of 32), edgekv.quant's codes as for a transformer."""
    dt = strategy.params["dtype"]
    quantized = {"int8": KvInt8, "int4": KvInt4}.get(dt)
    if quantized:
        return quantized(dict(quantized.defaults))
    return Kv({"dtype": dt})
