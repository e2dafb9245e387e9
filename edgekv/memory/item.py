"""Item: a number together with the formula that produced it, so `--explain` prints exactly what the planner
computed."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Item:
    """A number and how it was computed; parts: the named terms a maximum was taken over, where it is one (the
    workspace: a call's peak `step` and the load-time transients)."""
    value: float
    formula: str
    parts: dict[str, float] = field(default_factory=dict)

    def __int__(self):
        return int(self.value)
