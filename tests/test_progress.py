"""edgekv.progress, the one renderer of long steps (issue 42, point 6): on a terminal the status line never leaves
old copies or gets a message glued onto it, and fits 80 columns (a pty of that size, read through a small terminal
model: carriage return, erase-line, newline, wrap at the last column); piped, a line at least every EVERY seconds
with nothing else added; the time left is the running step's own (hand arithmetic on a fake clock), not an
average over steps."""
import os
import subprocess
import sys
from pathlib import Path

from conftest import pty_run
from edgekv.progress import Bar

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import time
from edgekv.progress import stage_status, work
bar, status = stage_status("export")
names = ["load", "tokenizer", "verify-quant-onnx-with-a-very-long-stage-name-that-does-not-fit-80-columns"]
with bar:
    for i, name in enumerate(names, 1):
        line = f"[{i}/3] {name}: " + "detail " * 12
        bar.message(line + "...")
        with status(line):
            for k in range(4):
                time.sleep(0.3)
                work(k + 1, 4)
        bar.message(f"      {name} done in 1.2 s")
print("stdout")
"""


def screen(data: str, cols: int) -> list[str]:
    """The lines a terminal `cols` wide shows after `data`: \\r to column 0, ESC[2K erases the line, \\n (the pty
    turns it into \\r\\n) to the next line, a character past the last column wraps."""
    import re
    lines, row, col = [""], 0, 0
    for tok in re.findall(r"\x1b\[[0-9;]*[A-Za-z]|\r|\n|[^\x1b\r\n]", data):
        if tok == "\r":
            col = 0
        elif tok == "\n":
            row += 1
            if row == len(lines):
                lines.append("")
        elif tok == "\x1b[2K":
            lines[row] = ""
        elif tok.startswith("\x1b"):
            continue
        else:
            if col >= cols:  # wraps
                row, col = row + 1, 0
                if row == len(lines):
                    lines.append("")
            cur = lines[row].ljust(col)
            lines[row] = cur[:col] + tok + cur[col + 1:]
            col += 1
    return lines


def test_on_an_80_column_terminal_the_status_line_leaves_nothing_behind():
    buf = pty_run(["-c", SCRIPT], 80, 24, winsize_fd=2, env={"EDGEKV_PROGRESS": None})
    data = buf.decode()
    assert "elapsed" in data and "left ~" in data  # the status line was drawn, with the step's own estimate
    shown = [ln.rstrip() for ln in screen(data, 80)]
    assert all(len(ln) <= 80 for ln in shown)  # (a long message wraps, as on any terminal; the text check below
    # finds any part of a wrapped status line left behind)
    want = []
    for i, name in enumerate(["load", "tokenizer",
                              "verify-quant-onnx-with-a-very-long-stage-name-that-does-not-fit-80-columns"], 1):
        want += [f"[{i}/3] {name}: " + "detail " * 12 + "...", f"      {name} done in 1.2 s"]
    text = "\n".join(shown).strip("\n")
    # every message whole, in order, on its own lines; no status line left (no 'elapsed' on the final screen)
    assert "elapsed" not in text and "left ~" not in text, text
    assert "".join(text.split()) == "".join("".join(want + ["stdout"]).split()), text  # (wraps split words)


def test_piped_a_line_at_least_every_interval_and_nothing_glued():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGEKV_PROGRESS_EVERY": "0.5"}
    env.pop("EDGEKV_PROGRESS", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "stdout\n"
    lines = p.stderr.splitlines()
    assert "\r" not in p.stderr and "\x1b" not in p.stderr
    status = [ln for ln in lines if "elapsed" in ln]
    assert len(status) >= 3  # each 1.2 s stage printed after 0.5 s of silence
    import re
    status_re = re.compile(r"\[\d/3\] [\w-]+  \d/3 stages  elapsed \d:\d\d:\d\d(  step \d+%)?(  left ~ \d:\d\d:\d\d)?")
    for ln in lines:  # a line is a whole message or a whole status line, never both
        assert status_re.fullmatch(ln) or ("elapsed" not in ln and (ln.endswith("...") or ln.endswith("1.2 s"))), ln
    # with the default 30 s, a run this short adds nothing to the messages
    env.pop("EDGEKV_PROGRESS_EVERY")
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert "elapsed" not in p.stderr and len(p.stderr.splitlines()) == 6


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_the_time_left_is_the_running_steps_own():
    """A first step ran 100 s; the second has done 1 of 4 units in 10 s: 30 s left (10 s per unit x 3), whatever the
    first step took; 5 s later with no new report, 25 s."""
    c = Clock()
    bar = Bar("export", 3, unit="stages", now=c, stream=open(os.devnull, "w"))
    bar.on, bar.tty, bar.every = True, False, 1e9
    bar.t0 = bar.step_t0 = bar.last_line = 0.0
    bar.update(completed=0, description="[1/3] load")
    c.t = 100.0
    bar.update(completed=1, description="[2/3] verify")
    assert bar.left() is None and "left" not in bar.line()  # no work reported yet: no estimate, not '-:--:--'
    c.t = 110.0
    bar.work(1, 4)
    assert bar.left() == 30.0
    c.t = 115.0
    assert bar.left() == 25.0
    assert bar.line().endswith("elapsed 0:01:55  step 25%  left ~ 0:00:25")
    # at 80 columns the description gives way; the numbers stay whole
    bar.description = "verify-quant-onnx: int4 artifact vs fp32 eager, 256 tokens of real text (top-1, KL)"
    ln = bar.line(80)
    assert len(ln) == 79 and ln.endswith("1/3 stages  elapsed 0:01:55  step 25%  left ~ 0:00:25") and "…" in ln


def test_report_profiles_short_contexts_not_the_exports_full_one():
    from edgekv.profile.report import quick_contexts
    assert quick_contexts(32768, 16) == [256, 1024]
    assert quick_contexts(512, 16) == [256, 512]
    assert quick_contexts(8, 2) == [8]


def test_a_wrong_piped_interval_falls_back_to_a_sane_one(monkeypatch):
    """EDGEKV_PROGRESS_EVERY: NaN would compare false with every elapsed time (no line ever), 0 a line per tick."""
    from edgekv import progress
    for v, want in (("nan", progress.EVERY), ("abc", progress.EVERY), ("inf", progress.EVERY), ("0", 0.1),
                    ("1e300", 3600.0), ("5", 5.0)):
        monkeypatch.setenv("EDGEKV_PROGRESS_EVERY", v)
        assert progress._every() == want, v
