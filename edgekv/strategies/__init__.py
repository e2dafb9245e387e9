"""Strategy -> StateLayout: which bytes a decoding step keeps per sequence.

One class per strategy (edgekv/strategies/kv.py: kv, kv-int8/int4/int2, window; mla.py; recurrent.py: ssm, linear,
hybrid; ring.py), each registered by name in REGISTRY (base.py). A StateLayout (layout.py) drives the planner's
arithmetic, the exported program's extra inputs/outputs, the manifest, the profiler's expectation and the analyzer's
quantizers. Adding a strategy: a class with @register in one of these modules (or a new one imported below), and its
tests; `parse_strategy`, `edgekv plan`'s default list, export's exportable list and the CLI's list read REGISTRY.
How a KV cache stores its rows is its storage (storage.py: one class per kind, Strategy.kv_storage); a new kind of KV
storage is a class there and a strategy that names it (kv-fp8 is the example: Fp8GroupStorage and KvFp8).
"""
from . import kv, mla, recurrent, ring  # noqa: F401  (registers the classes, in this order)
from .base import (REGISTRY, NotApplicable, ParamsDoNotFit, Strategy, build_layout, defaults_for, native_strategy,
                   parse_strategy, register)
from .kv import Kv, KvInt2, KvInt4, KvInt8, KvInt8Channel, Window
from .layout import (DTYPE_BYTES, KV_DTYPES, StateLayout, StateTensor, _kv_pair, _linear_state, _ssm_pair,
                     per_token_int8)
from .mla import Mla, mla_rank
from .recurrent import Hybrid, LinearState, Ssm, hybrid_kv
from .ring import Ring, build_ring_layout
from .storage import FloatStorage, GroupQuantStorage, KvStorage, StaticInt8Storage

NAMES = tuple(REGISTRY)


def kv_storage_of(layout: StateLayout) -> KvStorage | None:
    """The KV storage of the strategy that built the layout (its label parses back to it)."""
    return parse_strategy(layout.strategy).kv_storage
DEFAULTS = {n: dict(c.defaults) for n, c in REGISTRY.items()}

__all__ = ["REGISTRY", "NotApplicable", "ParamsDoNotFit", "Strategy", "build_layout", "defaults_for",
           "native_strategy", "parse_strategy", "register", "Kv", "KvInt2", "KvInt4", "KvInt8", "KvInt8Channel", "Window",
           "DTYPE_BYTES", "KV_DTYPES", "StateLayout", "StateTensor", "_kv_pair", "_linear_state", "_ssm_pair",
           "per_token_int8", "Mla", "mla_rank", "Hybrid", "LinearState", "Ssm", "hybrid_kv", "Ring", "build_ring_layout", "NAMES",
           "FloatStorage", "GroupQuantStorage", "KvStorage", "StaticInt8Storage", "kv_storage_of",
           "DEFAULTS"]
