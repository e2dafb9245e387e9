"""Tables, JSON and plots. No arithmetic here: everything shown was computed in memory.py / plan.py.

Every table goes through `fit_table`: columns declare whether they may give way. The columns a user types or reads
to tell rows apart (model, strategy, device id) are never cut; the others first take their short header, then drop
out, most dispensable first, and the table says which it left out. Memory is shown in GB (1e9 bytes) only, with
three significant digits (units.fmt_gb); each time column has one unit (units.time_unit).
"""
from __future__ import annotations

import io
import math
import os
import sys
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .units import GB, fmt_ctx, fmt_gb, fmt_mem, fmt_sig, time_unit

RISK_STYLE = {"none": "green", "low": "green", "medium": "yellow", "unknown": "magenta", "high": "red"}
GB_NOTE = "GB = 1e9 bytes"
PIPED_WIDTH = 200  # piped without COLUMNS: wide enough that no table drops a column


def width() -> int:
    """Columns to render for: $COLUMNS when set (also when piped), else the terminal's, else PIPED_WIDTH."""
    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    if sys.stdout.isatty():
        return Console().width
    return PIPED_WIDTH


def console(stderr: bool = False) -> Console:
    return Console(width=width(), stderr=stderr, soft_wrap=False)


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


def _cell_width(cell) -> int:
    text = cell if isinstance(cell, Text) else Text.from_markup(str(cell))
    return max((Text(line).cell_len for line in text.plain.split("\n")), default=0)


def _table(cols: list[Col], idx: list[int], rows: list[list], use_short: bool, title: str | None = None) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True,
              title=title, title_justify="left")
    for i in idx:
        c = cols[i]
        head = c.short if (use_short and c.short) else c.header
        natural = max([_cell_width(head)] + [_cell_width(r[i]) for r in rows])
        t.add_column(head, justify=c.justify, no_wrap=True,
                     min_width=natural if c.keep else None, overflow="fold" if c.keep else "ellipsis")
    for r in rows:
        t.add_row(*(r[i] for i in idx))
    return t


def table_width(t: Table) -> int:
    buf = Console(width=10_000, file=io.StringIO(), color_system=None)
    buf.print(t)
    return max((Text(line.rstrip()).cell_len for line in buf.file.getvalue().splitlines()), default=0)


def fit_table(cols: list[Col], rows: list[list], max_width: int) -> tuple[Table, list[str]]:
    """-> (the table, the headers left out). Short headers first, then the columns with the largest `give` drop
    out until the table fits max_width; kept columns are never cut."""
    idx = list(range(len(cols)))
    use_short = False
    t = _table(cols, idx, rows, use_short)
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
        t = _table(cols, idx, rows, use_short)
    for i in sorted(out, key=lambda i: (cols[i].give, i)):  # a narrow column dropped early may fit again
        trial = sorted(idx + [i])
        if table_width(_table(cols, trial, rows, use_short)) <= max_width:
            idx = trial
            out.remove(i)
    if use_short and table_width(_table(cols, idx, rows, False)) <= max_width:
        use_short = False  # the full headers fit now that columns dropped out
    t = _table(cols, idx, rows, use_short)
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


# ---- plan ----


def plan_columns(dc: bool, time_head: str) -> list[Col]:
    cols = [Col("model", keep=True), Col("strategy", keep=True), Col("weights", give=7, short="wts"),
            Col("state\nGB", "right", give=4), Col("total\nGB", "right", give=1), Col("fits", give=1),
            Col("head-\nroom GB", "right", give=6), Col("decode\ntok/s", "right", give=2),
            Col(time_head, "right", give=5, short=time_head.replace("prefill", "pf")),
            Col("trained\nctx", "right", give=3), Col("risk", give=3), Col("evidence", give=9)]
    if dc:
        cols += [Col("users\n/GPU", "right", give=6), Col("$/M tok", "right", give=6)]
    return cols


def plan_table(plan, limit: int | None = 30, explain: bool = False) -> None:
    c = console()
    d = plan.device
    rows = plan.ranked()
    n_fit = sum(r.fits for r in rows)
    shown = rows if limit is None else rows[:limit]
    head, pre = time_column("prefill", [r.prefill.value for r in shown])
    dc = d.is_datacenter
    cells = []
    for r, p in zip(shown, pre):
        b = r.deployment.bytes
        risk = r.quality["risk"]
        tc = r.trained_ctx[0] if r.trained_ctx else None
        cells.append([r.model + ("" if r.exportable[0] else " †"), r.strategy.short + ("" if r.native else " *"),
                      r.deployment.weight_precision, fmt_gb(b["state"]), fmt_gb(b["total"]),
                      "[green]yes[/]" if r.fits else "[red]no[/]", ("" if r.fits else "-") + fmt_gb(abs(r.headroom)),
                      fmt_sig(r.decode.value), p,
                      "?" if tc is None else ("[red]" + fmt_ctx(tc) + " ![/]" if plan.ctx > tc else fmt_ctx(tc)),
                      f"[{RISK_STYLE[risk]}]{risk}[/]", r.quality["cite"],
                      *((str(int(r.serving.users.value)), "-" if math.isinf(r.serving.usd.value)
                         else f"{r.serving.usd.value:.2f}") if dc else ())])
    from .memory import PLAN_RUNTIMES
    rt = PLAN_RUNTIMES[plan.runtime]
    title = (f"edgekv plan: {d.name} ({d.id}), ctx {fmt_ctx(plan.ctx)} = {plan.ctx:,} tokens, budget "
             f"{fmt_mem(plan.budget)}, runtime {rt['label']} (overhead {fmt_mem(d.overhead(rt['overhead']).value)})")
    footer = (f"{n_fit} of {len(rows)} options fit. {GB_NOTE}. total = weights + state + workspace + runtime; "
              "headroom = budget - total ('-' = over by); "
              f"decode = tokens/s at ctx; prefill = time to read a {plan.ctx:,}-token prompt. "
              "'*' = state changed from what the model was trained with (quantized, windowed or converted). "
              "'†' = edgekv export cannot build this row today (another tool may; --json: exportable_reason). "
              "trained = the context the model was trained at ('!' = ctx is past it: risk high unless edgekv analyze "
              "measured this model that far; '?' = unknown: risk at least 'unknown'). risk 'unknown' = no published "
              "or measured result covers this option. "
              "A catalog model is a shape (its published config); the weights come from you: "
              f"`edgekv export -m ./hf-folder-or.gguf --strategy S --from-plan {d.id} -c {fmt_ctx(plan.ctx)} -o OUT` "
              "exports a row as planned.")
    print_table(c, title, plan_columns(dc, head), cells, footer)
    if limit is not None and len(rows) > limit:
        c.print(f"{len(rows) - limit} more options: --all shows them, --json gives every number.")
    fams = {}
    for e in plan.not_applicable:
        if "needs_family" in e:
            fams.setdefault(e["needs_family"], set()).update(e.get("alternatives", []))
    for fam, alts in sorted(fams.items()):
        models = ", ".join(sorted(alts)) if alts else "none in the catalog could run on this device"
        c.print(f"[dim]{fam}: needs a model built that way ({fam} family) — catalog models: {models}[/]")
    for e in plan.not_applicable:  # a strategy of the right family whose parameters do not fit the model
        if "needs_family" not in e:
            from rich.markup import escape
            c.print(f"[dim]{escape(e['model'])} / {escape(e['strategy'])}: not applicable — {escape(e['reason'])}[/]")
    if explain:
        explain_rows(c, plan, shown)


def _first_sentence(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1].rsplit(" ", 1)[0] + " …"


def recall_point(p: dict, run: int | None = None) -> str:
    """'8,064* 0.75 (4, 412 s)': a stored recall point: distance ('*' = its trial runs past the trained context),
    exact recall, trials and the point's own CPU seconds where its run recorded them; run: the [n] of the run that
    measured it."""
    cpu = p.get("cpu_seconds")
    t = (f", {cpu:,.0f} s" if cpu >= 10 else f", {cpu:.1f} s") if isinstance(cpu, (int, float)) else ""
    return (f"{p['distance']:,}{'*' if p.get('beyond_trained') else ''} {p['value']:.2f} ({p.get('trials')}{t})"
            + (f"[{run}]" if run else ""))


def recall_lines(c: Console, rec: dict, runs: dict) -> None:
    """The stored recall-vs-distance curve of a row's strategy and the fp32 cache's (edgekv.measured.curves), each
    point with the [n] of the run that measured it; runs: {"files": {file: (trained_ctx, source)}, "commands":
    {command: (n, point)}}, filled here, printed once after every row (recall_runs)."""
    from rich.markup import escape
    runs.setdefault("files", {})[rec["file"]] = (rec.get("trained_ctx"), rec.get("trained_from"))
    commands = runs.setdefault("commands", {})
    curves = [(rec["label"], rec["points"])]
    if rec.get("reference"):
        ref = rec["reference"]["label"]
        curves.append((ref if "reference" in ref else f"{ref} (reference)", rec["reference"]["points"]))
    for i, (label, pts) in enumerate(curves):
        cells = []
        for p in pts:
            key = p.get("command")
            if key and key not in commands:
                commands[key] = (len(commands) + 1, p)
            cells.append(recall_point(p, commands[key][0] if key else None))
        c.print(("  recall   " if i == 0 else "           ") + f"{escape(label)}: " + " · ".join(cells))
    if rec.get("note"):
        c.print(f"           note: {escape(rec['note'])}")


def recall_runs(c: Console, runs: dict) -> None:
    """Once, after the rows: what a recall point shows, the files, and the runs the points cite ([n] date, wall
    seconds of the whole run: every variant and distance it measured, load average, command)."""
    from rich.markup import escape
    files = runs.get("files", {})
    if not files:
        return
    c.print("\n[bold]Recall[/] (edgekv analyze --probe recall, stored): per row, needle distance, exact recall (the "
            "fraction of trials with every value token right), (trials, CPU s of the point) and \\[run]; * = the trial "
            "runs past the trained context:")
    for f, (tc, src) in files.items():
        c.print(f"  {escape(f)}" + (f" (trained at {tc:,}, {escape(str(src))})" if tc else ""))
    for cmd, (n, p) in runs.get("commands", {}).items():
        wall = f"{p['seconds']:,.0f} s wall" if isinstance(p.get("seconds"), (int, float)) else "time not recorded"
        load = f", load average {p['load_average']:g}" if isinstance(p.get("load_average"), (int, float)) else ""
        c.print(f"  [{n}] {p.get('date')}, {wall}{load}: {escape(cmd)}")


def explain_rows(c: Console, plan, rows) -> None:
    """A short derivation per row; the facts every row shares once, first. --json --explain has every formula."""
    d = plan.device
    f = d.facts
    budget_fact = f["app_budget_bytes"] if plan.budget == d.budget_bytes else f.get("app_budget_entitled_bytes")
    where = os.path.relpath(d.path) if d.path and not os.path.relpath(d.path).startswith("..") else d.path
    c.print(f"\n[bold]Shared by every row[/] ({d.id}, {where or 'device_profiles/'}):")
    shared = [("app budget", fmt_mem(plan.budget), budget_fact),
              ("memory bandwidth", f"{d.bandwidth / 1e9:.1f} GB/s", f["mem_bandwidth_bytes_per_s"]),
              ("decode efficiency", f"{d.decode_efficiency:g}", f["decode_efficiency"]),
              ("compute", f"{d.flops / 1e9:,.0f} GFLOP/s", f["compute_flops"]),
              ("prefill efficiency", f"{d.prefill_efficiency:g}", f["prefill_efficiency"])]
    from .memory import PLAN_RUNTIMES
    rt = PLAN_RUNTIMES[plan.runtime]
    shared.append((f"{rt['label']} runtime overhead", fmt_mem(d.overhead(rt["overhead"]).value),
                   d.overhead(rt["overhead"])))
    for name, value, fact in shared:
        c.print(f"  {name} {value} — " + (_first_sentence(fact.cite) if fact is not None else ""))
    runs: dict = {}
    for r in rows:
        b = r.deployment.bytes
        parts = [("weights", b["weights"]), ("state", b["state"]), ("workspace", b["workspace"])]
        if b.get("load"):
            parts.append(("load", b["load"]))
        parts.append(("runtime", b["runtime"]))
        mem = " + ".join(f"{fmt_gb(v)} {k}" for k, v in parts)
        head = plan.budget - b["total"]
        verdict = (f"fits, {fmt_gb(head)} GB to spare" if r.fits else f"does not fit, {fmt_gb(-head)} GB over")
        read = r.deployment.weights.get("read_per_token", b["weights"]) + b["state"]
        c.print(f"\n[bold]{r.model} / {r.strategy.short}[/] ({r.deployment.weight_precision} weights)")
        c.print(f"  memory   {mem} = {fmt_gb(b['total'])} GB vs budget {fmt_gb(plan.budget)} GB: {verdict}")
        bound = "bandwidth-bound" if "bandwidth-bound" in r.decode.formula else (
            "compute-bound" if "compute-bound" in r.decode.formula else "")
        c.print(f"  decode   ~{fmt_gb(read)} GB read per token / ({d.bandwidth / 1e9:.1f} GB/s x "
                f"{d.decode_efficiency:g}) -> {fmt_sig(r.decode.value)} tok/s" + (f" ({bound})" if bound else ""))
        unit, div = time_unit([r.prefill.value])
        c.print(f"  prefill  {plan.ctx:,} tokens at {d.flops / 1e9:,.0f} GFLOP/s x {d.prefill_efficiency:g} -> "
                f"{fmt_sig(r.prefill.value / div)} {unit}")
        q = r.quality
        c.print(f"  risk     {q['risk']}: {_first_sentence(q['evidence'], 200)} ({q['cite']})")
        if r.recall:
            recall_lines(c, r.recall, runs)
        for n in r.notes:
            c.print(f"  note     {n}")
    recall_runs(c, runs)
    c.print(f"\n{GB_NOTE}. Every formula with its inputs in bytes: --json --explain (options[].explain).")


# ---- baseline ----


def baseline_table(rows, title: str, explain: bool = False) -> None:
    c = console()
    cols = [Col("strategy", keep=True), Col("ctx", "right", keep=True), Col("state\n/user GB", "right", give=2),
            Col("GPUs", "right", give=3), Col("users", "right", give=1), Col("tok/s\n/user", "right", give=4),
            Col("$ / M\ntokens", "right", give=1)]
    cells = [[r.strategy.short, f"{r.ctx:,}", fmt_gb(r.state_bytes_per_user), str(r.n_gpus), str(int(r.users.value)),
              f"{r.tok_s_per_user:.1f}", "∞ (no user fits)" if math.isinf(r.usd.value) else f"{r.usd.value:.2f}"]
             for r in rows]
    print_table(c, title, cols, cells, f"{GB_NOTE}; $ = US dollars per million generated tokens.")
    if explain:
        for r in rows:
            c.print(f"\n[bold]{r.strategy.short} @ {r.ctx:,}[/]\n  users: {r.users.formula}\n  cost: {r.usd.formula}"
                    f"\n  assumptions: {r.assumptions}")


# ---- devices and models ----


def devices_table(ds) -> None:
    cols = [Col("id", keep=True), Col("name", give=2), Col("class", give=5), Col("RAM\nGB", "right", give=4),
            Col("app budget\nGB", "right"), Col("entitled\nGB", "right", give=3),
            Col("bandwidth\nGB/s", "right", give=1), Col("compute\nTFLOP/s", "right", give=1),
            Col("$/h", "right", give=6)]
    cells = [[d.id, d.name, d.device_class, fmt_gb(d.ram_bytes), fmt_gb(d.budget_bytes),
              fmt_gb(d.entitled_budget_bytes) if d.entitled_budget_bytes else "",
              fmt_sig(d.bandwidth / 1e9), fmt_sig(d.flops / 1e12), f"{d.usd_per_hour:.2f}" if d.usd_per_hour else ""]
             for d in ds]
    print_table(console(), "device profiles (device_profiles/*.toml)", cols, cells,
                f"{GB_NOTE}. entitled = iOS increased-memory-limit budget (plan --entitled). Use the id with "
                "--device, or pass your own .toml.")


def models_table(out: list[dict]) -> None:
    cols = [Col("name", keep=True), Col("type", give=3), Col("family", give=2),
            Col("params\nmillions", "right", give=1), Col("layers", "right", give=4), Col("hf repo", give=5)]
    cells = [[m["name"], m["model_type"], m["family"], f"{m['params'] / 1e6:,.0f}", str(m["layers"]),
              m["hf_repo"] or ""] for m in out]
    print_table(console(), "model catalog (edgekv/catalog/*.json)", cols, cells,
                "A catalog entry is a model's shape (its published config.json), enough to plan; to export or run, "
                "give the weights: an HF folder or a .gguf (smollm2-135m is also packaged).")


# ---- plots ----


def ctx_label(tokens: float) -> str:
    """Axis labels: 4096 -> '4k', 131072 -> '128k', 1048576 -> '1m', 4000 -> '4000'."""
    return fmt_ctx(int(tokens))


def plot_plan(curves: dict, budget: int, title: str, out: str, ctx: int | None = None,
              fits: dict | None = None) -> None:
    """Memory against context per option (linear GB axis, x labelled 1k/4k/32k), the device budget as a line, the
    requested context marked. fits: label -> whether the option fits at ctx; those that do not are drawn faint and
    dotted and say so in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(10, 6))
    markers = "os^vD<>pPX*h"
    cmap = plt.get_cmap("tab10")
    xs_all = sorted({x for xs, _ in curves.values() for x in xs})
    for i, (label, (ctxs, totals)) in enumerate(curves.items()):
        ok = True if fits is None else fits.get(label, True)
        ax.plot(ctxs, [t / GB for t in totals], "-" if ok else ":", marker=markers[i % len(markers)], ms=5,
                lw=2 if ok else 1, alpha=1.0 if ok else 0.45, color=cmap(i % 10),
                label=label + ("" if ok else " (does not fit)"))
    ax.axhline(budget / GB, color="red", lw=2, ls="--", label=f"app budget {fmt_mem(budget)}")
    if ctx:
        ax.axvline(ctx, color="black", lw=1.2, ls="-.", label=f"requested ctx {fmt_ctx(ctx)}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(xs_all))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: ctx_label(v)))
    top = max([budget / GB] + [t / GB for _, ts in curves.values() for t in ts])
    top = min(top, 2.5 * budget / GB)  # far above the budget only says "does not fit"; the legend says which
    ax.set_ylim(0, top * 1.08)
    ax.set_xlabel("context (tokens; k = 1024)")
    ax.set_ylabel("total memory, GB (1e9 bytes)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    from .jsonfile import plot_marks
    fig.savefig(out, dpi=120, bbox_inches="tight", **plot_marks(out))
    plt.close(fig)
