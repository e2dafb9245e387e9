"""MLA: a latent cache. A native MLA model (DeepSeek-V2/V3) caches its latent [1, T, r + R]; a GQA model converted
to MLA caches a rank-r factorisation of K and V ([1, T, r]) and rebuilds them every step."""
from __future__ import annotations

from ..arch import MLA, Arch, Attention
from .base import NotApplicable, ParamsDoNotFit, Strategy, _native_latent, register
from .kv import RECURRENT_KINDS, RECURRENT_MSG, Kv, _slots
from .layout import KV_DTYPES, StateTensor


def mla_rank(arch: Arch, strategy: Strategy) -> int:
    """The latent width r a converted-MLA cache keeps per token and layer (K and V share one latent)."""
    attn = arch.mixers("attention")
    if not attn:
        raise NotApplicable("no attention layers to convert")
    m = attn[0][1]
    full = 2 * m.n_kv_heads * m.head_dim
    if "rank" in strategy.params:
        r = strategy.params["rank"]
    elif "ratio" in strategy.params:
        r = max(1, round(full * strategy.params["ratio"]))
    else:
        r = m.n_kv_heads * m.head_dim
    if not 1 <= r <= full:
        raise ParamsDoNotFit(f"{strategy.label}: rank must be between 1 and {full} (2 x kv_heads x head_dim)")
    return r


@register
class Mla(Strategy):
    name = "mla"
    defaults = {"dtype": "fp16"}  # rank= or ratio=; default for converted models: rank = Hkv*D (half the KV)
    integer_params = frozenset({"rank"})
    optional_params = frozenset({"rank"})
    float_params = frozenset({"ratio"})
    help = "mla[:rank=R|ratio=F]"
    shortcut = ("--rank", "rank")
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'mla:native': ('low',
            'the model was trained with its latent cache (DeepSeek-V2: -93.3% KV vs DeepSeek 67B)',
            'DeepSeek-V2'),
        'mla:converted': ('unknown',
            'no published result for post-hoc low-rank conversion of a GQA cache without fine-tuning; run edgekv '
            'analyze --strategy mla to measure it',
            'no published result'),
    }
    full_cache = True
    converts_to_latent = True
    native_families = ("mla",)

    @property
    def short(self) -> str:
        p = self.params
        return "mla" + (f" r={p['rank']}" if "rank" in p else f" {p['ratio']:.1%}" if "ratio" in p else "")

    def check(self, arch: Arch) -> None:
        if arch.kinds & RECURRENT_KINDS:
            raise NotApplicable(RECURRENT_MSG)

    def attention_state(self, arch: Arch, i: int, m: Attention, ctx: int) -> list[StateTensor]:
        r = mla_rank(arch, self)
        return [StateTensor(f"past_latent.{i}", f"present_latent.{i}", (1, _slots(m, ctx), r),
                            KV_DTYPES[self.params["dtype"]], i, "latent")]

    def latent_state(self, i: int, m: MLA, ctx: int) -> list[StateTensor]:
        return _native_latent(i, m, ctx, self.params["dtype"])

    def quality_key(self, ctx: int, converted: bool) -> str:
        return "mla:converted" if converted else "mla:native"

    def reference(self) -> Strategy:
        return Kv({"dtype": "fp32"})
