"""Item: a number together with the formula that produced it, so `--explain` prints exactly what the planner
computed."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Item:
    """A number and how it was computed."""
    value: float
    formula: str

    def __int__(self):
        return int(self.value)
