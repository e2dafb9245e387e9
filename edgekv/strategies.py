"""Strategy -> StateLayout: which bytes a decoding step keeps per sequence.

A StateLayout is the list of state tensors one decode step reads and writes (name, shape at a given ctx, dtype),
including the scale/zero tensors of quantized caches. The same layout drives the planner's arithmetic, the exported
program's extra inputs/outputs, the manifest, the profiler's expectation and the analyzer's quantizers.

Shape symbols: T = tokens kept (ctx, or min(ctx, window)), Hkv = KV heads, D = head dim, G = quantization group,
r = MLA latent rank, R = decoupled RoPE dim, Di = SSM inner width, N = SSM state size, K = conv kernel.

Names follow ONNX Runtime GenAI / transformers.js: past_key_values.{i}.key -> present.{i}.key, past_latent.{i},
past_ssm.{i}, past_conv.{i}, past_recurrent.{i}; quantized tensors add .scale (and .zero). {i} is the block index.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .arch import MLA, SSM, Arch, Attention, Linear, ShortConv
from .errors import EdgekvError

DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "float8_e4m3fn": 1.0, "int8": 1.0, "uint8": 1.0}
KV_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}
NAMES = ("kv", "kv-int8", "kv-int4", "kv-int2", "window", "mla", "ssm", "linear", "hybrid", "ring")


@dataclass(frozen=True)
class StateTensor:
    name: str  # the program input, e.g. past_key_values.3.key
    output: str  # the program output, e.g. present.3.key
    shape: tuple[int, ...]
    dtype: str
    layer: int
    role: str  # key | value | latent | ssm | conv | recurrent, with .scale / .zero for quantization parameters
    packed_bits: int | None = None  # int4/int2 codes packed into uint8 along the last axis

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape) * DTYPE_BYTES[self.dtype])

    def to_json(self) -> dict:
        d = {"input": self.name, "output": self.output, "shape": list(self.shape), "dtype": self.dtype,
             "layer": self.layer, "role": self.role, "bytes": self.nbytes}
        if self.packed_bits:
            d["packed_bits"] = self.packed_bits
        return d


@dataclass(frozen=True)
class StateLayout:
    strategy: str
    ctx: int
    tensors: tuple[StateTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def bytes_by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.role] = out.get(t.role, 0) + t.nbytes
        return out

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "ctx": self.ctx, "bytes": self.nbytes,
                "tensors": [t.to_json() for t in self.tensors]}


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy spec: 'kv', 'kv:dtype=fp8', 'kv-int4:group=64', 'window:w=4096,sinks=4', 'mla:rank=128',
    'mla:ratio=0.067', 'ssm:dtype=int8', 'linear:dtype=int8' (ssm/linear also take state_dtype= for dtype=),
    'ring:n=8'."""
    name: str
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params.items())

    @property
    def short(self) -> str:
        """For tables: 'kv fp16', 'kv-int4 g32', 'window 4096+4', 'mla r=128', 'ssm fp32', 'ring x8'."""
        p, n = self.params, self.name
        if n in ("kv", "ssm", "linear"):
            return f"{n} {p['dtype']}"
        if n in ("kv-int4", "kv-int2", "kv-int8"):
            return n + (f" g{p['group']}" if p.get("group") else "")
        if n == "window":
            return f"window {p['w']}+{p['sinks']}" + ("" if p["dtype"] == "fp16" else f" {p['dtype']}")
        if n == "mla":
            return "mla" + (f" r={p['rank']}" if "rank" in p else f" {p['ratio']:.1%}" if "ratio" in p else "")
        if n == "hybrid":
            return f"hybrid kv {p['dtype']}/state {p['state_dtype']}"
        if n == "ring":
            return f"ring x{p['n']}"
        return self.label

    @property
    def kv_bits(self) -> int | None:
        return {"kv-int8": 8, "kv-int4": 4, "kv-int2": 2}.get(self.name)


DEFAULTS = {
    "kv": {"dtype": "fp16"},
    "kv-int8": {"group": 0},  # 0 = one scale per (token, head): group = head_dim
    "kv-int4": {"group": 32},
    "kv-int2": {"group": 32},
    "window": {"w": 4096, "sinks": 4, "dtype": "fp16"},
    "mla": {"dtype": "fp16"},  # rank= or ratio=; default for converted models: rank = Hkv*D (half the KV)
    "ssm": {"dtype": "fp32"},
    "linear": {"dtype": "fp32"},
    "hybrid": {"dtype": "fp16", "state_dtype": "fp32"},
    "ring": {"n": 8, "dtype": "fp16"},
}
_NUMERIC = {"group", "w", "sinks", "rank", "n"}


def parse_strategy(spec: str) -> Strategy:
    name, _, rest = spec.strip().partition(":")
    name = name.lower()
    if name not in DEFAULTS:
        raise EdgekvError(f"unknown strategy {spec!r}; strategies: {', '.join(NAMES)}")
    params = dict(DEFAULTS[name])
    known = set(DEFAULTS[name]) | ({"rank", "ratio"} if name == "mla" else set())
    if name in ("ssm", "linear"):  # their recurrent state is the only state: state_dtype (hybrid's word) = dtype
        known.add("state_dtype")
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq or k not in known:
            raise EdgekvError(f"strategy {spec!r}: unknown parameter {item!r} (known for {name}: "
                              f"{', '.join(sorted(known))})")
        if k == "state_dtype" and name in ("ssm", "linear"):
            k = "dtype"
        if k in _NUMERIC:
            if not (v.isascii() and v.isdigit()):  # '²'.isdigit() is True and int('²') fails
                raise EdgekvError(f"strategy {spec!r}: {k} must be a non-negative integer")
            params[k] = int(v)
        elif k == "ratio":
            try:
                if not v.isascii():  # float() reads '٠.٥' as 0.5
                    raise ValueError(v)
                params[k] = float(v)
            except ValueError:
                raise EdgekvError(f"strategy {spec!r}: ratio must be a number") from None
            if not 0 < params[k] <= 1:
                raise EdgekvError(f"strategy {spec!r}: ratio must be in (0, 1]")
        else:
            params[k] = v
    for k in ("dtype", "state_dtype"):
        if k in params and params[k] not in KV_DTYPES and not (name in ("ssm", "linear", "hybrid") and params[k] == "int8") \
                and not (name == "hybrid" and k == "dtype" and params[k] == "int4"):
            raise EdgekvError(f"strategy {spec!r}: {k} must be one of {', '.join(KV_DTYPES)}")
    if name == "window" and params["w"] < 1:
        raise EdgekvError(f"strategy {spec!r}: window w must be at least 1")
    if name == "ring" and params["n"] < 1:
        raise EdgekvError(f"strategy {spec!r}: ring n must be at least 1")
    return Strategy(name, params)


def per_token_int8(bits: int | None, group: int | None, head_dim: int) -> bool:
    """Whether a cache is int8 with one scale per token and head (group 0 or head_dim): the cache a fused .pte
    reads back with ExecuTorch's one quantized kernel (edgekv.models.llama.Attention.custom), and that the planner
    counts as such (edgekv.memory._readback_source). One rule for both."""
    return bits == 8 and group in (0, head_dim)


class NotApplicable(Exception):
    """The strategy needs another kind of model (ssm on a transformer) or another kind of device."""


class ParamsDoNotFit(EdgekvError):
    """The strategy applies to this kind of model, but not with these parameters (a quantization group that does not
    divide head_dim, a latent rank beyond the KV width)."""


# ---- building the layout ----


def _kv_pair(i: int, hkv: int, t: int, d: int, strategy: Strategy) -> list[StateTensor]:
    """K and V for one attention layer: plain dtype, or quantized codes plus per-group scale (and zero)."""
    out = []
    for role, (inp, outp) in (("key", (f"past_key_values.{i}.key", f"present.{i}.key")),
                              ("value", (f"past_key_values.{i}.value", f"present.{i}.value"))):
        bits = strategy.kv_bits
        if bits is None:
            out.append(StateTensor(inp, outp, (1, hkv, t, d), KV_DTYPES[strategy.params["dtype"]], i, role))
            continue
        g = strategy.params["group"] or d
        if d % g:
            raise ParamsDoNotFit(f"{strategy.label}: head_dim {d} is not a multiple of group {g}")
        if bits == 8:
            out.append(StateTensor(inp, outp, (1, hkv, t, d), "int8", i, role))
        else:
            per_byte = 8 // bits
            out.append(StateTensor(inp, outp, (1, hkv, t, d // per_byte), "uint8", i, role, packed_bits=bits))
        out.append(StateTensor(inp + ".scale", outp + ".scale", (1, hkv, t, d // g), "float16", i, role + ".scale"))
        if bits < 8:  # asymmetric below 8 bits: a zero point per group as well
            out.append(StateTensor(inp + ".zero", outp + ".zero", (1, hkv, t, d // g), "float16", i, role + ".zero"))
    return out


def _ssm_pair(i: int, m: SSM, dtype: str) -> list[StateTensor]:
    state_shape = (1, m.d_inner, m.d_state) if m.version == 1 else (1, m.n_heads, m.head_dim, m.d_state)
    dt = "int8" if dtype == "int8" else KV_DTYPES[dtype]
    out = [StateTensor(f"past_conv.{i}", f"present_conv.{i}", (1, m.conv_dim, m.d_conv - 1), "float32", i, "conv"),
           StateTensor(f"past_ssm.{i}", f"present_ssm.{i}", state_shape, dt, i, "ssm")]
    if dtype == "int8":  # per (channel|head, dim) scales, as vLLM PR #52962 does for SSM state
        out.append(StateTensor(f"past_ssm.{i}.scale", f"present_ssm.{i}.scale", state_shape[:-1] + (1,), "float32",
                               i, "ssm.scale"))
    return out


def _linear_state(i: int, m: Linear, dtype: str) -> list[StateTensor]:
    """One block's recurrent state. Linear attention: [1, H, Dk, Dv] in the strategy's dtype, after the conv state
    [1, conv_dim, K - 1] fp32 of a layer with a causal conv (Gated DeltaNet).

    RWKV-4 (n_vectors rows of width d, rows: ffn shift, att shift, num, den, max) is fp32 unless dtype is int8 (the
    module has no fp16/bf16 path, so those stay fp32). int8 splits the rows:
      past_recurrent.{i}        [1, 4, d] int8   ffn shift, att shift, num, den (symmetric codes, edgekv.quant)
      past_recurrent.{i}.scale  [1, 4, 1] fp32   one scale per row (fp32 as the int8 SSM state's scales)
      past_recurrent.{i}.max    [1, 1, d] fp32   the WKV exponent offset, kept exact
    The shifts are last-token LayerNorm outputs and num/den are decayed sums with den >= 1: bounded rows that a
    per-row scale covers. max is a log-domain offset: an absolute error e in it scales the whole history's num and
    den by exp(e) against the new token, and its range is that of the keys, not of anything a per-row grid fits;
    it is 1/5 of the state, so it stays fp32 (the edgekv.models.recurrent docstring says more)."""
    if not m.n_vectors:
        dt = "int8" if dtype == "int8" else KV_DTYPES[dtype]
        # a Gated DeltaNet layer (Qwen3.5) also keeps its conv's last K - 1 inputs, fp32 as an SSM's conv state
        conv = [StateTensor(f"past_conv.{i}", f"present_conv.{i}", (1, m.conv_dim, m.d_conv - 1), "float32", i,
                            "conv")] if m.d_conv else []
        return conv + [StateTensor(f"past_recurrent.{i}", f"present_recurrent.{i}", (1, m.n_heads, m.d_k, m.d_v),
                                   dt, i, "recurrent")]
    if dtype != "int8":  # RWKV-4's exp sums in fp32
        return [StateTensor(f"past_recurrent.{i}", f"present_recurrent.{i}", (1, m.n_vectors, m.width), "float32", i,
                            "recurrent")]
    rows = m.n_vectors - 1  # every row but max
    return [StateTensor(f"past_recurrent.{i}", f"present_recurrent.{i}", (1, rows, m.width), "int8", i, "recurrent"),
            StateTensor(f"past_recurrent.{i}.scale", f"present_recurrent.{i}.scale", (1, rows, 1), "float32", i,
                        "recurrent.scale"),
            StateTensor(f"past_recurrent.{i}.max", f"present_recurrent.{i}.max", (1, 1, m.width), "float32", i,
                        "recurrent.max")]


def hybrid_kv(strategy: Strategy) -> Strategy:
    """The cache strategy of a hybrid's attention layers: hybrid:dtype=fp16 -> kv:dtype=fp16; dtype=int8 -> kv-int8
    (one scale per token and head), dtype=int4 -> kv-int4 (groups of 32), edgekv.quant's codes as for a transformer."""
    dt = strategy.params["dtype"]
    if dt in ("int8", "int4"):
        return Strategy(f"kv-{dt}", dict(DEFAULTS[f"kv-{dt}"]))
    return Strategy("kv", {"dtype": dt})


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


def build_layout(arch: Arch, strategy: Strategy, ctx: int) -> StateLayout:
    """The state one sequence keeps at ctx tokens. Raises NotApplicable when the model lacks what the strategy needs."""
    s, kinds = strategy.name, arch.kinds
    tensors: list[StateTensor] = []
    if s == "ring":
        raise NotApplicable("ring splits the KV over several GPUs: use build_ring_layout")
    native_recurrent = kinds & {"ssm", "linear", "conv"}
    if s in ("ssm", "linear") and (kinds != {s}):
        raise NotApplicable(f"needs a pure {s} model")
    if s == "hybrid" and not (native_recurrent and kinds & {"attention", "mla"}):
        raise NotApplicable("needs a hybrid model (attention and recurrent layers)")
    if s in ("kv", "kv-int8", "kv-int4", "kv-int2", "window", "mla") and native_recurrent:
        raise NotApplicable("a model with recurrent layers: plan it with hybrid/ssm/linear")
    if s in ("kv", "kv-int8", "kv-int4", "kv-int2", "window") and "mla" in kinds:
        raise NotApplicable("an MLA model caches a latent: use mla")
    for i, b in enumerate(arch.blocks):
        for m in b.mixers:
            if isinstance(m, Attention):
                if s == "mla":
                    r = mla_rank(arch, strategy)
                    t = ctx if m.window is None else min(ctx, m.window)
                    tensors.append(StateTensor(f"past_latent.{i}", f"present_latent.{i}", (1, t, r),
                                               KV_DTYPES[strategy.params["dtype"]], i, "latent"))
                    continue
                t = ctx if m.window is None else min(ctx, m.window)
                if s == "window":
                    t = min(t, strategy.params["w"] + strategy.params["sinks"])
                kv = strategy if s != "hybrid" else hybrid_kv(strategy)
                if s == "window":
                    kv = Strategy("kv", {"dtype": strategy.params["dtype"]})
                tensors += _kv_pair(i, m.n_kv_heads, t, m.head_dim, kv)
            elif isinstance(m, MLA):
                if s not in ("mla", "hybrid"):
                    raise NotApplicable("an MLA model caches a latent: use mla")
                tensors.append(StateTensor(f"past_latent.{i}", f"present_latent.{i}",
                                           (1, ctx, m.kv_lora_rank + m.qk_rope_head_dim),
                                           KV_DTYPES[strategy.params["dtype"]], i, "latent"))
            elif isinstance(m, SSM):
                tensors += _ssm_pair(i, m, strategy.params.get("state_dtype", strategy.params["dtype"]))
            elif isinstance(m, Linear):
                tensors += _linear_state(i, m, strategy.params.get("state_dtype", strategy.params["dtype"]))
            elif isinstance(m, ShortConv):  # LFM2: the conv's last K - 1 inputs, fp32 as a Mamba conv state
                tensors.append(StateTensor(f"past_conv.{i}", f"present_conv.{i}", (1, m.width, m.d_conv - 1),
                                           "float32", i, "conv"))
    return StateLayout(strategy.label, ctx, tuple(tensors))


def build_ring_layout(arch: Arch, strategy: Strategy, ctx: int) -> StateLayout:
    """What ONE of the n GPUs holds for one sequence: its 1/n share of the tokens' KV (the last rank the remainder)."""
    n = strategy.params["n"]
    share = math.ceil(ctx / n)
    base = build_layout(arch, Strategy("kv", {"dtype": strategy.params["dtype"]}), share)
    return replace(base, strategy=strategy.label, ctx=ctx)


def native_strategy(arch: Arch) -> str:
    """The strategy that keeps a model's own state as designed."""
    return {"transformer": "kv", "mla": "mla", "ssm": "ssm", "linear": "linear", "hybrid": "hybrid"}[arch.family]
