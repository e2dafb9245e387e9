"""Progress of long steps on stderr: a rich bar with the elapsed time and an estimate of the time left.

On when stderr is a terminal (or EDGEKV_PROGRESS=1, which tests use to see it through a pipe); off under --json
(callers pass enabled=False) and when EDGEKV_PROGRESS=0. Nothing here writes to stdout, so tables and JSON on
stdout stay clean. The estimate is rich's: the rate of the steps done so far applied to the steps left.
"""
from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager

_STAGE = re.compile(r"^\[(\d+)/(\d+)\]\s*")


def wanted(enabled: bool = True) -> bool:
    env = os.environ.get("EDGEKV_PROGRESS")
    if not enabled or env == "0":
        return False
    return env == "1" or sys.stderr.isatty()


class Bar:
    """One task: bar.update(completed, description=...) / bar.advance(); a no-op when progress is off."""

    def __init__(self, description: str, total: float | None, enabled: bool = True, unit: str = ""):
        self.on = wanted(enabled)
        self._p = None
        self.description, self.total, self.unit = description, total, unit

    def __enter__(self) -> "Bar":
        if self.on:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            force = os.environ.get("EDGEKV_PROGRESS") == "1"
            con = Console(stderr=True, force_terminal=force or None, width=100 if force else None)
            self._p = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                               MofNCompleteColumn(), TextColumn(self.unit), TextColumn("elapsed"),
                               TimeElapsedColumn(), TextColumn("left ~"), TimeRemainingColumn(), console=con,
                               transient=not force)
            self._p.__enter__()
            self._task = self._p.add_task(self.description, total=self.total)
        return self

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)
        return False

    def update(self, completed: float | None = None, description: str | None = None, total: float | None = None):
        if self._p is not None:
            kw = {k: v for k, v in (("completed", completed), ("description", description), ("total", total))
                  if v is not None}
            self._p.update(self._task, **kw)
            if os.environ.get("EDGEKV_PROGRESS") == "1":
                self._p.refresh()

    def advance(self, n: float = 1):
        if self._p is not None:
            self._p.advance(self._task, n)


def stage_status(description: str, enabled: bool = True):
    """For a pipeline whose stage lines read "[i/N] name: detail" (edgekv export's Stages): a context-manager
    factory, status(line), that shows the stages as one bar (i-1 of N done while stage i runs) with the estimate of
    the time the remaining stages take. Returns (bar, status); enter the bar around the pipeline."""
    bar = Bar(description, None, enabled, "stages")

    @contextmanager
    def status(line: str):
        m = _STAGE.match(line)
        if m:
            i, n = int(m.group(1)), int(m.group(2))
            bar.update(completed=i - 1, total=n, description=line[:60])
        else:
            bar.update(description=line[:60])
        yield
        if m:
            bar.update(completed=i)
    return bar, status
