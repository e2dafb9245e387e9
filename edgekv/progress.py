"""Progress of long steps on stderr: one renderer for every command (export's stages, profile's and report's runs,
analyze).

- On a terminal: one status line at the bottom (what runs, steps done, elapsed, and time left where the running
  step reports its own work), redrawn in place every second. Messages go through the same renderer (Bar.message):
  the status line is erased first and drawn again after the message, so no old status line is left behind and no
  message is glued onto one. The line is cut to the terminal's width (the description gives way first), so it never
  wraps.
- Piped (stderr not a terminal): a status line whenever EVERY seconds (30) have passed since the last line written
  to stderr, so a log shows the command alive at least every 30 s; a short run prints nothing extra.
- EDGEKV_PROGRESS=1: a status line at every update, also piped (tests see it); EDGEKV_PROGRESS=0 or enabled=False
  (--json): nothing. EDGEKV_PROGRESS_EVERY=S sets the piped interval.

The estimate of the time left is the running step's own: the seconds it has taken for the work it has done, scaled
to the work it has left (work(done, total), called from inside the step, e.g. verification over positions). A step
that reports no work of its own gets no estimate (not an average over other steps, which said "left ~ 0:00:25" for
a 580 s stage). Nothing here writes to stdout, so tables and JSON on stdout stay clean.
"""
from __future__ import annotations

import math

import os
import re
import sys
import threading
import time
from contextlib import contextmanager

_STAGE = re.compile(r"^\[(\d+)/(\d+)\]\s*")
EVERY = 30.0  # seconds: the most a piped run goes without a line on stderr
_ACTIVE: list["Bar"] = []  # the renderer that work() reports to (the innermost one entered)


def wanted(enabled: bool = True) -> bool:
    return enabled and os.environ.get("EDGEKV_PROGRESS") != "0"


def clock(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def work(done: float, total: float) -> None:
    """The running step's own progress (done of total units of its work): the estimate of its time left."""
    if _ACTIVE:
        _ACTIVE[-1].work(done, total)


class Bar:
    """One task: bar.update(completed, description=...) / bar.advance() / bar.message(text); a no-op when off."""

    def __init__(self, description: str, total: float | None, enabled: bool = True, unit: str = "",
                 stream=None, now=time.monotonic):
        self.on = wanted(enabled)
        self.description, self.total, self.unit = description, total, unit
        self.completed = 0.0
        self.stream = stream or sys.stderr
        self.now = now
        env = os.environ.get("EDGEKV_PROGRESS")
        self.tty = self._isatty() and env != "1"
        self.every = 0.0 if env == "1" else _every()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = None
        self._shown = False  # a status line is on the terminal's last line
        self._work = None  # (done, total, seconds into the step when reported)

    def _isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    # -- the state --

    def __enter__(self) -> "Bar":
        if self.on:
            self.t0 = self.step_t0 = self.last_line = self.now()
            _ACTIVE.append(self)
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
            if self.tty:
                self._draw()
        return self

    def __exit__(self, *exc):
        if self.on:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(2)
            with self._lock:
                self._erase()
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        return False

    def update(self, completed: float | None = None, description: str | None = None, total: float | None = None):
        if not self.on:
            return
        with self._lock:
            if description is not None and description != self.description:
                self.step_t0, self._work = self.now(), None  # a new step: its own clock and work
            if completed is not None:
                self.completed = completed
            if description is not None:
                self.description = description
            if total is not None:
                self.total = total
            self._show()

    def advance(self, n: float = 1):
        self.update(completed=self.completed + n)

    def work(self, done: float, total: float):
        if self.on:
            with self._lock:
                self._work = (done, total, self.now() - self.step_t0)
                if self.tty:
                    self._draw()

    def message(self, text: str) -> None:
        """A line of output on stderr; the status line is erased first and drawn again below it."""
        if not self.on:
            self.stream.write(text + "\n")
            self.stream.flush()
            return
        with self._lock:
            self._erase()
            self.stream.write(text + "\n")
            self.last_line = self.now()
            if self.tty:
                self._draw()
            self.stream.flush()

    # -- the line --

    def left(self) -> float | None:
        """Seconds the running step has left, from its own work: its time so far per unit done, times the units
        left (None: the step reported no work yet)."""
        if self._work is None:
            return None
        done, total, at = self._work
        if done <= 0 or total <= 0:
            return None
        return max(at * (total - done) / done - (self.now() - self.step_t0 - at), 0.0)

    def line(self, width: int | None = None) -> str:
        parts = []
        if self.total:
            parts.append(f"{self.completed:g}/{self.total:g}{' ' + self.unit if self.unit else ''}")
        parts.append(f"elapsed {clock(self.now() - self.t0)}")
        if self._work is not None:
            done, total, _ = self._work
            left = self.left()
            parts.append(f"step {100 * done / total:.0f}%" if total else "")
            if left is not None:
                parts.append(f"left ~ {clock(left)}")
        tail = "  ".join(p for p in parts if p)
        desc = " ".join(self.description.split())
        if width is None:
            return f"{desc}  {tail}"
        room = width - 1 - len(tail) - 2  # the last column stays empty: no terminal wraps the line
        if room < 8:
            return (f"{desc}  {tail}")[:width - 1]
        if len(desc) > room:
            desc = desc[:room - 1] + "…"
        return f"{desc}  {tail}"

    def _width(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or 80
        except (AttributeError, OSError, ValueError):
            return 80

    def _show(self):
        if self.tty:
            self._draw()
        elif self.now() - self.last_line >= self.every:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self.last_line = self.now()

    def _draw(self):
        self.stream.write("\r\x1b[2K" + self.line(self._width()))
        self.stream.flush()
        self._shown = True

    def _erase(self):
        if self._shown:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._shown = False

    def _tick(self):
        while not self._stop.wait(1.0 if self.tty else min(max(self.every, 0.05), 1.0)):
            with self._lock:
                if self._stop.is_set():
                    return
                if self.tty:
                    self._draw()
                elif self.every and self.now() - self.last_line >= self.every:
                    self._show()


def _every() -> float:
    v = os.environ.get("EDGEKV_PROGRESS_EVERY", "")
    try:
        s = float(v) if v else EVERY
    except ValueError:
        return EVERY
    return min(max(s, 0.1), 3600.0) if math.isfinite(s) else EVERY  # NaN, 0 or 1e300: a sane interval


def stage_status(description: str, enabled: bool = True):
    """For a pipeline whose stage lines read "[i/N] name: detail" (edgekv export's Stages): a context-manager
    factory, status(line), that shows the stages as one status line (i-1 of N done while stage i runs, with the
    stage's own estimate where it reports its work). Returns (bar, status); enter the bar around the pipeline and
    print the pipeline's lines through bar.message."""
    bar = Bar(description, None, enabled, "stages")

    @contextmanager
    def status(line: str):
        m = _STAGE.match(line)
        name = line.split(":")[0]
        if m:
            i, n = int(m.group(1)), int(m.group(2))
            bar.update(completed=i - 1, total=n, description=name)
        else:
            bar.update(description=name)
        yield
        if m:
            bar.update(completed=i)
    return bar, status
