"""Deployment: everything the planner knows about one (model, strategy, ctx, weights, runtime)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..strategies import StateLayout, Strategy
from .item import Item

WEIGHT_PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")


@dataclass
class Deployment:
    """Everything the planner knows about one (model, strategy, ctx, weights, runtime): the one object export writes
    into the manifest and profile compares against."""
    model: str
    strategy: Strategy
    ctx: int
    weight_precision: str
    runtime: str
    layout: StateLayout
    weights: dict[str, float]
    workspace: Item
    runtime_overhead: float
    load: Item = field(default_factory=lambda: Item(0, "not modelled"))
    explain: dict[str, str] = field(default_factory=dict)
    # stored weight bytes the runtime does not keep resident (memory.paged_table: a .pte's embedding table beside its
    # own output layer); weights["total"] stays the stored bytes, bytes["weights"] is what is resident
    paged: Item = field(default_factory=lambda: Item(0, ""))

    @property
    def bytes(self) -> dict[str, int]:
        w = int(self.weights["total"] - self.paged.value)
        s = self.layout.nbytes
        ws = int(self.workspace.value)
        rt = int(self.runtime_overhead)
        ld = int(self.load.value)
        return {"weights": w, "state": s, "workspace": ws, "load": ld, "runtime": rt, "total": w + s + ws + ld + rt}

    def to_json(self) -> dict:
        return {"model": self.model, "strategy": self.strategy.name, "params": self.strategy.params,
                "ctx": self.ctx, "weights": self.weight_precision, "runtime": self.runtime, "bytes": self.bytes,
                "weight_bytes_by_class": {k: int(v) for k, v in self.weights.items()},
                "state": self.layout.to_json()}
