"""Terminal text: the plain-text printer (`Console`) that reads the few rich markup tags edgekv writes ([bold],
[dim], [green]...[/]) and wraps at the terminal's width, tables laid out as rich's SIMPLE_HEAD box would lay them out
(`fit_table`: columns declare whether they may give way), and JSON on stdout. rich itself is imported only for what
only rich draws (progress bars, another caller's rich Table): importing and laying out rich tables was half the CPU
time of `edgekv plan`. Every text that came from a file is printed through safetext.printable.

The columns a user types or reads to tell rows apart (model, strategy, device id) are never cut; the others first
take their short header, then drop out, most dispensable first, and the table says which it left out.
"""
from __future__ import annotations

import math
import os
import re
import sys
import unicodedata
from dataclasses import dataclass

from .clibase import MAX_WIDTH, MIN_WIDTH
from .safetext import printable
from .units import time_unit, fmt_sig

PIPED_WIDTH = 200  # piped without COLUMNS: wide enough that no table drops a column


def width() -> int:
    """Columns to render for: $COLUMNS when set (also when piped), else the terminal's, else PIPED_WIDTH; held
    within MIN_WIDTH..MAX_WIDTH. A COLUMNS that is not a number of ASCII digits ('²', '-1', '') is ignored."""
    cols = os.environ.get("COLUMNS", "").strip()
    if cols.isascii() and cols.isdigit() and len(cols) <= 6 and int(cols) > 0:
        n = int(cols)
    elif sys.stdout.isatty():
        try:
            n = os.get_terminal_size(sys.stdout.fileno()).columns or 80
        except (OSError, ValueError):
            n = 80
    else:
        n = PIPED_WIDTH
    return min(max(n, MIN_WIDTH), MAX_WIDTH)


# ---- plain-text printing with rich's markup ----

# a markup tag as rich reads one: '[' then a letter, '#', '/' or '@', up to the next ']' (rich.markup.RE_TAGS); an
# odd number of backslashes before it escapes it
_TAG = re.compile(r"((?:\\\\)*)(\\?)\[([a-z#/@][^[]*?)]")
_SGR = {"bold": "1", "dim": "2", "italic": "3", "underline": "4", "red": "31", "green": "32", "yellow": "33",
        "blue": "34", "magenta": "35", "cyan": "36"}


def escape(text: str) -> str:
    """text with every '[' that would open a markup tag escaped, as rich.markup.escape does."""
    return re.sub(r"(\\*)(\[[a-z#/@][^[]*?])", lambda m: m.group(1) * 2 + "\\" + m.group(2), str(text))


def parse_markup(text: str) -> tuple[str, list[tuple[int, int, str]]]:
    """(the plain text, [(start, end, style)]) of a markup string: [style]...[/] or [/style]; '\\[' is a '['."""
    out: list[str] = []
    spans: list[tuple[int, int, str]] = []
    stack: list[tuple[str, int]] = []
    pos = n = 0
    for m in _TAG.finditer(text):
        out.append(text[pos:m.start()])
        n += m.start() - pos
        pos = m.end()
        slashes = m.group(1)[: len(m.group(1)) // 2]
        out.append(slashes)
        n += len(slashes)
        if m.group(2):  # escaped: the tag is text
            lit = "[" + m.group(3) + "]"
            out.append(lit)
            n += len(lit)
            continue
        tag = m.group(3)
        if tag.startswith("/"):
            name = tag[1:].strip()
            i = len(stack) - 1
            if name:
                while i >= 0 and stack[i][0] != name:
                    i -= 1
            if i >= 0:
                style, start = stack.pop(i)
                spans.append((start, n, style))
        else:
            stack.append((tag, n))
    out.append(text[pos:])
    n += len(text) - pos
    spans += [(start, n, style) for style, start in stack]
    return "".join(out), spans


def cell_len(text: str) -> int:
    """Terminal columns of text: East Asian wide and full-width characters take two."""
    if text.isascii():
        return len(text)
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _wrap(plain: str, cols: int) -> list[tuple[int, int]]:
    """(start, end) of each line of plain wrapped at cols, words kept whole where they fit (rich's wrapping: words
    with their trailing spaces, a word wider than a line folded)."""
    lines: list[tuple[int, int]] = []
    base = 0
    for para in plain.split("\n"):
        words = list(re.finditer(r"\s*\S+\s*", para))
        if not words:
            lines.append((base, base + len(para)))
        start, used = base, 0
        for w in words:
            a, word = base + w.start(), w.group()
            core = cell_len(word.rstrip())
            if used and used + core > cols:
                lines.append((start, a))
                start, used = a, 0
            while core > cols > 0 and used == 0:  # fold a word wider than the line
                cut = a + cols
                lines.append((start, cut))
                start, a, word = cut, cut, plain[cut:base + w.end()]
                core = cell_len(word.rstrip())
            used += cell_len(word)
        if words:
            lines.append((start, base + len(para)))
        base += len(para) + 1
    return lines


def _styled(plain: str, spans: list[tuple[int, int, str]], a: int, b: int) -> str:
    """plain[a:b] with ANSI styles for the spans that cover it."""
    cuts = sorted({a, b} | {x for s, e, _ in spans for x in (s, e) if a < x < b})
    parts = []
    for x, y in zip(cuts, cuts[1:]):
        codes = [c for s, e, st in spans if s <= x and y <= e for w in st.split() for c in [_SGR.get(w)] if c]
        parts.append(f"\x1b[{';'.join(codes)}m{plain[x:y]}\x1b[0m" if codes else plain[x:y])
    return "".join(parts)


class Console:
    """Prints markup text and TextTables to stdout (or stderr), wrapped at `width` columns; ANSI styles only on a
    terminal that takes them (not piped, NO_COLOR unset, TERM not dumb). Anything else (a rich renderable) goes to a
    rich Console of the same width."""

    def __init__(self, width: int, stderr: bool = False):
        self.width = width
        self.stderr = stderr
        f = self.file
        self.color = (f.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb")

    @property
    def file(self):
        return sys.stderr if self.stderr else sys.stdout

    def print(self, obj="", end: str = "\n") -> None:
        if isinstance(obj, TextTable):
            text = "\n".join(obj.lines(self.color))
        elif isinstance(obj, str):
            plain, spans = parse_markup(printable(obj))
            lines = [(a, a + len(plain[a:b].rstrip())) for a, b in _wrap(plain, self.width)]  # no trailing spaces
            text = "\n".join(_styled(plain, spans, a, b) if self.color and spans else plain[a:b] for a, b in lines)
        else:
            _safe_rich_console(self.width, self.stderr).print(obj)
            return
        self.file.write(text + end)


def _safe_rich_console(cols: int, stderr: bool):
    """A rich Console (for what is not markup text or a TextTable) that prints the text it was given with control
    characters escaped; the styles rich adds itself are kept. It overrides rich's Console._render_buffer (rich 15,
    requirements.lock), where the text of each segment meets its style. rich is imported only here."""
    from rich.console import Console as RichConsole
    from rich.segment import Segment

    class SafeConsole(RichConsole):
        def _render_buffer(self, buffer) -> str:
            return super()._render_buffer(seg if seg.control else Segment(printable(seg.text), seg.style, seg.control)
                                          for seg in buffer)
    return SafeConsole(width=cols, stderr=stderr, soft_wrap=False)


def console(stderr: bool = False) -> Console:
    return Console(width(), stderr)


def print_json(obj) -> None:
    from .jsonfile import output_json
    sys.stdout.write(output_json(obj, default=_default) + "\n")  # NaN / infinity as null: never non-JSON


def _default(o):
    if isinstance(o, float) and math.isinf(o):
        return None
    raise TypeError(type(o))


# ---- tables that fit the terminal ----


@dataclass
class Col:
    """One table column. keep: never cut nor dropped (what tells rows apart: model, strategy, an id). give: the
    larger, the earlier the column drops out when the table is too wide (0: only after every other one). short: a
    narrower header tried first. A header may hold a second line for its unit ("state\\nGB")."""
    header: str
    justify: str = "left"
    keep: bool = False
    give: int = 0
    short: str | None = None


@dataclass
class TextTable:
    """A table laid out as rich's box.SIMPLE_HEAD without edges: header lines (bold, bottom-aligned), a rule of '─' as
    wide as the table, then one line per row; columns as wide as their widest cell, two spaces apart."""
    heads: list[tuple[str, list[tuple[str, list]]]]  # per column: justify, [(plain, spans)] for its header lines
    cells: list[list[tuple[str, list]]]  # per row, per column: (plain, spans)
    widths: list[int]

    @property
    def width(self) -> int:
        return sum(self.widths) + 2 * max(len(self.widths) - 1, 0)

    def _line(self, row: list[tuple[str, list]], color: bool, bold: bool = False) -> str:
        parts = []
        for (just, _), (plain, spans), w in zip(self.heads, row, self.widths):
            pad = " " * (w - cell_len(plain))
            text = _styled(plain, spans + ([(0, len(plain), "bold")] if bold else []), 0, len(plain)) \
                if color and (spans or bold) and plain else plain
            parts.append(pad + text if just == "right" else text + pad)
        return "  ".join(parts).rstrip()

    def lines(self, color: bool = False) -> list[str]:
        n_head = max((len(h) for _, h in self.heads), default=0)
        heads = [[("", [])] * (n_head - len(h)) + h for _, h in self.heads]  # headers sit on the rule, as rich's do
        out = [self._line([h[i] for h in heads], color, bold=True) for i in range(n_head)]
        out.append("─" * self.width)
        out += [self._line(r, color) for r in self.cells]
        return out


def _cell(text) -> tuple[str, list]:
    return parse_markup(printable(text))


def _cell_width(parsed: tuple[str, list]) -> int:
    return max((cell_len(line) for line in parsed[0].split("\n")), default=0)


def _table(cols: list[Col], idx: list[int], rows: list[list], use_short: bool, parsed=None) -> TextTable:
    parsed = parsed or [[_cell(c) for c in r] for r in rows]
    heads, widths = [], []
    for i in idx:
        c = cols[i]
        head = [_cell(line) for line in (c.short if (use_short and c.short) else c.header).split("\n")]
        heads.append((c.justify, head))
        widths.append(max([_cell_width(h) for h in head] + [_cell_width(r[i]) for r in parsed]))
    return TextTable(heads, [[r[i] for i in idx] for r in parsed], widths)


def table_width(t: TextTable) -> int:
    return t.width


def fit_table(cols: list[Col], rows: list[list], max_width: int) -> tuple[TextTable, list[str]]:
    """-> (the table, the headers left out). Short headers first, then the columns with the largest `give` drop
    out until the table fits max_width; kept columns are never cut."""
    parsed = [[_cell(c) for c in r] for r in rows]
    idx = list(range(len(cols)))
    use_short = False
    t = _table(cols, idx, rows, use_short, parsed)
    out: list[int] = []
    while table_width(t) > max_width:
        if not use_short and any(c.short for c in cols):
            use_short = True
        else:
            cand = [i for i in idx if not cols[i].keep]
            if not cand:
                break
            worst = max(cand, key=lambda i: (cols[i].give, i))
            idx.remove(worst)
            out.append(worst)
        t = _table(cols, idx, rows, use_short, parsed)
    for i in sorted(out, key=lambda i: (cols[i].give, i)):  # a narrow column dropped early may fit again
        trial = sorted(idx + [i])
        if table_width(_table(cols, trial, rows, use_short, parsed)) <= max_width:
            idx = trial
            out.remove(i)
    if use_short and table_width(_table(cols, idx, rows, False, parsed)) <= max_width:
        use_short = False  # the full headers fit now that columns dropped out
    t = _table(cols, idx, rows, use_short, parsed)
    return t, [cols[i].header.replace("\n", " ") for i in sorted(out)]


def print_table(c: Console, title: str, cols: list[Col], rows: list[list], footer: str) -> None:
    """Title, the table fitted to the console, then the footer (which names the units) and what was left out."""
    t, dropped = fit_table(cols, rows, c.width)
    c.print(f"[bold]{title}[/]")
    c.print(t)
    if dropped:
        footer += (f" Not shown at {c.width} columns: {', '.join(dropped)} (a wider terminal, "
                   f"COLUMNS={PIPED_WIDTH}, or --json shows them).")
    c.print(footer.strip())


def time_column(name: str, seconds: list[float | None]) -> tuple[str, list[str]]:
    """A column of durations in one unit: -> (header with the unit, cells)."""
    unit, div = time_unit([s for s in seconds if s is not None])
    return f"{name}\n{unit}", ["-" if s is None else fmt_sig(s / div) for s in seconds]
