"""Ring attention: the KV cache split over n datacenter GPUs by token (each holds ceil(ctx / n) tokens' KV)."""
from __future__ import annotations

import math
from dataclasses import replace

from ..arch import Arch
from ..errors import EdgekvError
from .base import NotApplicable, Strategy, register
from .kv import Kv
from .storage import FloatStorage
from .layout import StateLayout


@register
class Ring(Strategy):
    name = "ring"
    defaults = {"n": 8, "dtype": "fp16"}
    integer_params = frozenset({"n"})
    help = "ring[:n=8]"
    # published evidence of its quality risk: key (quality_key) -> (risk, evidence, short citation for tables)
    evidence = {
        'ring': ('none', 'exact attention: the same numbers, split over devices', 'exact'),
    }
    splits_over_gpus = True
    exportable = False
    planned_on = "datacenter"
    native_families = None  # the model's own KV, split: native whatever the family

    @classmethod
    def check_params(cls, spec: str, params: dict) -> None:
        if params["n"] < 1:
            raise EdgekvError(f"strategy {spec!r}: ring n must be at least 1")

    @property
    def short(self) -> str:
        return f"ring x{self.params['n']}"

    @property
    def n_gpus(self) -> int:
        return self.params["n"]

    @property
    def kv_storage(self) -> FloatStorage:
        return FloatStorage(self.params["dtype"])

    def check_device(self, datacenter: bool) -> None:
        if not datacenter:
            raise NotApplicable("ring attention splits the KV over several datacenter GPUs")

    def build(self, arch: Arch, ctx: int) -> StateLayout:
        raise NotApplicable("ring splits the KV over several GPUs: use build_ring_layout")

    def layout(self, arch: Arch, ctx: int) -> StateLayout:
        """What ONE of the n GPUs holds for one sequence: its 1/n share of the tokens' KV (the last rank the
        remainder)."""
        share = math.ceil(ctx / self.params["n"])
        base = Kv({"dtype": self.params["dtype"]}).build(arch, share)
        return replace(base, strategy=self.label, ctx=ctx)


def build_ring_layout(arch: Arch, strategy: Strategy, ctx: int) -> StateLayout:
    """What ONE of the n GPUs holds for one sequence (Ring.layout)."""
    return Ring.layout(strategy, arch, ctx)
