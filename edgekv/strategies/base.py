"""Strategy: the base class every long-context strategy derives from, and REGISTRY, the one table of strategy names.

A strategy class owns its name, its parameters and their defaults, its parsing, its label, the StateLayout it builds
for an Arch (and whether it applies to that Arch, raising NotApplicable), and the traits the planner, the memory
model, the quality table and the export code ask about instead of comparing names (kv_bits, window_tokens,
converts_to_latent, n_gpus, fused_attention(runtime), ...). An instance is one parsed spec: the class plus its params.
The model is mlx-lm's mlx_lm/models/cache.py (one small class per cache kind); the torch-side cache that writes and
reads the state is edgekv.models' (named by `module`, never imported here: the planner stays torch-free).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..arch import MLA, SSM, Arch, Attention, Linear, ShortConv
from ..errors import EdgekvError
from .layout import KV_DTYPES, StateLayout, StateTensor, _linear_state, _short_conv_state, _ssm_pair
from .storage import KvStorage

REGISTRY: dict[str, type["Strategy"]] = {}  # name -> class, in the order strategies are listed and planned
FLOAT_DTYPES = ("fp32", "fp16", "bf16")


def register(cls: type["Strategy"]) -> type["Strategy"]:
    """Class decorator: add a strategy class to REGISTRY under its name."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"strategy name {cls.name!r} is empty or registered twice")
    REGISTRY[cls.name] = cls
    return cls


class NotApplicable(Exception):
    """The strategy needs another kind of model (ssm on a transformer) or another kind of device."""


class ParamsDoNotFit(EdgekvError):
    """The strategy applies to this kind of model, but not with these parameters (a quantization group that does not
    divide head_dim, a latent rank beyond the KV width)."""


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy spec: 'kv', 'kv:dtype=fp8', 'kv-int4:group=64', 'window:w=4096,sinks=4', 'mla:rank=128',
    'mla:ratio=0.067', 'ssm:dtype=int8', 'linear:dtype=int8' (ssm/linear also take state_dtype= for dtype=),
    'ring:n=8'."""
    params: dict = field(default_factory=dict)

    name: ClassVar[str] = ""
    defaults: ClassVar[dict] = {}
    integer_params: ClassVar[frozenset] = frozenset()
    float_params: ClassVar[frozenset] = frozenset()  # accepted without a default, in (0, 1] (mla ratio)
    optional_params: ClassVar[frozenset] = frozenset()  # accepted without a default (mla rank)
    int8_state: ClassVar[bool] = False  # dtype / state_dtype may be int8 (a recurrent state's)
    state_dtype_is_dtype: ClassVar[bool] = False  # ssm/linear: the recurrent state is the only state
    help: ClassVar[str] = ""  # the spec as the CLI help shows it, e.g. 'window[:w=4096,sinks=4]'
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence: ClassVar[dict] = {}

    # ---- traits the planner, memory model, quality table, export and analyze code ask about ----
    kv_bits: ClassVar[int | None] = None  # quantized KV cache: 8, 4 or 2 bits per value (its kv_storage's bits)
    plain_kv: ClassVar[bool] = False  # a float cache of every token (the baseline a covering window equals)
    full_cache: ClassVar[bool] = False  # one cache row per position up to max_ctx (export's manifest check)
    converts_to_latent: ClassVar[bool] = False  # a GQA cache factorised into a latent K and V are rebuilt from
    splits_over_gpus: ClassVar[bool] = False  # the state is split over n datacenter GPUs (ring)
    exportable: ClassVar[bool] = True  # `edgekv export` builds it
    planned_on: ClassVar[str] = "all"  # planned by default on: all devices | datacenter | none (asked for only)
    native_families: ClassVar[tuple[str, ...] | None] = ()  # Arch families whose own state it is (None: any)
    needs_family: ClassVar[str | None] = None  # the only Arch family it applies to, for plan's alternatives
    recurrent: ClassVar[bool] = False  # keeps a recurrent state (analyze runs it one token per call)
    kv_cache: ClassVar[bool] = False  # keeps K and V per attention layer (kv, kv-int8/int4/int2, window)
    static_scales: ClassVar[bool] = False  # a quantized cache whose scales are constants of the graph (kv-int8c)
    shortcut: ClassVar[tuple[str, str] | None] = None  # (export's option, the parameter it sets): --rank r is mla:rank=r

    # ---- parsing and naming ----

    @classmethod
    def parse(cls, spec: str, rest: str) -> "Strategy":
        params = dict(cls.defaults)
        known = set(cls.defaults) | cls.optional_params | cls.float_params
        if cls.state_dtype_is_dtype:
            known.add("state_dtype")
        for item in filter(None, (s.strip() for s in rest.split(","))):
            k, eq, v = item.partition("=")
            if not eq or k not in known:
                raise EdgekvError(f"strategy {spec!r}: unknown parameter {item!r} (known for {cls.name}: "
                                  f"{', '.join(sorted(known))})")
            if k == "state_dtype" and cls.state_dtype_is_dtype:
                k = "dtype"
            if k in cls.integer_params:
                if not (v.isascii() and v.isdigit()):  # '²'.isdigit() is True and int('²') fails
                    raise EdgekvError(f"strategy {spec!r}: {k} must be a non-negative integer")
                params[k] = int(v)
            elif k in cls.float_params:
                try:
                    if not v.isascii():  # float() reads '٠.٥' as 0.5
                        raise ValueError(v)
                    params[k] = float(v)
                except ValueError:
                    raise EdgekvError(f"strategy {spec!r}: {k} must be a number") from None
                if not 0 < params[k] <= 1:
                    raise EdgekvError(f"strategy {spec!r}: {k} must be in (0, 1]")
            else:
                params[k] = v
        for k in ("dtype", "state_dtype"):
            if k in params and params[k] not in KV_DTYPES and not cls.allows_dtype(k, params[k]):
                raise EdgekvError(f"strategy {spec!r}: {k} must be one of {', '.join(KV_DTYPES)}")
        cls.check_params(spec, params)
        return cls(params)

    @classmethod
    def allows_dtype(cls, key: str, value: str) -> bool:
        """Whether dtype / state_dtype may take a value beyond the float KV dtypes (a recurrent state's int8)."""
        return cls.int8_state and value == "int8"

    @classmethod
    def check_params(cls, spec: str, params: dict) -> None:
        """Refuse parameter values the strategy cannot take (one line naming the spec)."""

    @property
    def label(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params.items())

    @property
    def short(self) -> str:
        """For tables: 'kv fp16', 'kv-int4 g32', 'window 4096+4', 'mla r=128', 'ssm fp32', 'ring x8'."""
        return self.label

    # ---- traits that depend on the params ----

    @property
    def window_tokens(self) -> int | None:
        """Tokens a windowed cache keeps (W + sinks); None: every token."""
        return None

    @property
    def recent_tokens(self) -> int | None:
        """W: the newest tokens a windowed cache keeps beside its sinks; None: every token."""
        return None

    @property
    def sink_tokens(self) -> int:
        """S: the first tokens a windowed cache pins."""
        return 0

    @property
    def attention_kv(self) -> "Strategy | None":
        """The cache strategy of a blended state's attention layers (hybrid); None: the strategy is its own."""
        return None

    @property
    def n_gpus(self) -> int:
        return 1

    @property
    def kv_storage(self) -> "KvStorage | None":
        """How its attention layers store K and V (edgekv.strategies.storage); None: it keeps no KV cache. The layout,
        the memory model, the torch modules, verify and analyze ask this object, not the strategy's bits or dtype."""
        return None

    @property
    def state_dtype(self) -> str:
        """The dtype of a recurrent (SSM / linear) state."""
        return self.params.get("state_dtype", self.params["dtype"])

    def is_native(self, arch: Arch) -> bool:
        """True when the state is exactly what the model was trained with (nothing quantized, windowed or
        converted)."""
        fams = self.native_families
        return (fams is None or arch.family in fams) and self.params.get("dtype") in FLOAT_DTYPES

    def fused_attention(self, runtime: str) -> bool:
        """Whether edgekv's export for this runtime can attend over this cache through the runtime's fused op
        (ONNX Runtime's GroupQueryAttention, ExecuTorch's custom_sdpa); the layout decides the rest
        (edgekv.memory.fused_gqa)."""
        return False

    @classmethod
    def extra_defaults(cls, arch: Arch) -> list["Strategy"]:
        """Variants beyond the defaults `edgekv plan` also tries for this model when no strategy is named."""
        return []

    def check_device(self, datacenter: bool) -> None:
        """Raise NotApplicable when the strategy needs another kind of device."""

    def quality_key(self, ctx: int, converted: bool) -> str:
        """The key of this strategy's published evidence (evidence) at ctx."""
        return self.name

    def reference(self) -> "Strategy":
        """The fp32 version of the state a variant of this strategy changes (edgekv analyze's reference)."""
        raise EdgekvError(f"analyze does not handle strategy {self.name!r}")

    # ---- the layout ----

    def check(self, arch: Arch) -> None:
        """Raise NotApplicable when the model lacks what the strategy needs."""

    def build(self, arch: Arch, ctx: int) -> StateLayout:
        """The state one sequence keeps at ctx tokens. Raises NotApplicable when the model lacks what the strategy
        needs."""
        self.check(arch)
        tensors: list[StateTensor] = []
        for i, b in enumerate(arch.blocks):
            for m in b.mixers:
                if isinstance(m, Attention):
                    tensors += self.attention_state(arch, i, m, ctx)
                elif isinstance(m, MLA):
                    tensors += self.latent_state(i, m, ctx)
                elif isinstance(m, SSM):
                    tensors += _ssm_pair(i, m, self.state_dtype)
                elif isinstance(m, Linear):
                    tensors += _linear_state(i, m, self.state_dtype)
                elif isinstance(m, ShortConv):
                    tensors += _short_conv_state(i, m)
        return StateLayout(self.label, ctx, tuple(tensors))

    def layout(self, arch: Arch, ctx: int) -> StateLayout:
        """What one device holds for one sequence (build's layout; ring: one GPU's share)."""
        return self.build(arch, ctx)

    def attention_state(self, arch: Arch, i: int, m: Attention, ctx: int) -> list[StateTensor]:
        raise NotApplicable(f"{self.name} keeps no attention cache")

    def latent_state(self, i: int, m: MLA, ctx: int) -> list[StateTensor]:
        """A native MLA layer's latent cache: [1, ctx, r + R]."""
        raise NotApplicable("an MLA model caches a latent: use mla")


def _native_latent(i: int, m: MLA, ctx: int, dtype: str) -> list[StateTensor]:
    return [StateTensor(f"past_latent.{i}", f"present_latent.{i}", (1, ctx, m.kv_lora_rank + m.qk_rope_head_dim),
                        KV_DTYPES[dtype], i, "latent")]


def parse_strategy(spec: str) -> Strategy:
    name, _, rest = spec.strip().partition(":")
    name = name.lower()
    cls = REGISTRY.get(name)
    if cls is None:
        raise EdgekvError(f"unknown strategy {spec!r}; strategies: {', '.join(REGISTRY)}")
    return cls.parse(spec, rest)


def native_strategy(arch: Arch) -> str:
    """The strategy that keeps a model's own state as designed."""
    return next(n for n, c in REGISTRY.items() if c.native_families and arch.family in c.native_families)


def defaults_for(arch: Arch, datacenter: bool) -> list[Strategy]:
    """The strategies `edgekv plan` tries when none is named: every registered class planned on this kind of device
    with its defaults, then the extra variants a class adds for this model (extra_defaults)."""
    out = [cls({**cls.defaults}) for cls in REGISTRY.values()
           if cls.planned_on == "all" or (cls.planned_on == "datacenter" and datacenter)]
    for cls in REGISTRY.values():
        out += cls.extra_defaults(arch)
    return out


def build_layout(arch: Arch, strategy: Strategy, ctx: int) -> StateLayout:
    """The state one sequence keeps at ctx tokens. Raises NotApplicable when the model lacks what the strategy needs."""
    return strategy.build(arch, ctx)
