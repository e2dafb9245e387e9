"""What each command shows: the plan, baseline, device and model tables, `--explain`, and the plan's plot. No
arithmetic here: everything shown was computed in memory/ / plan.py; the terminal text itself (wrapping, markup,
tables that fit) is termtext's. Memory is shown in GB (1e9 bytes) only, with three significant digits (units.fmt_gb);
each time column has one unit (units.time_unit).
"""
from __future__ import annotations

import math
import os
import sys

from .termtext import (Col, Console, console, escape, print_table,
                       time_column)
from .units import GB, fmt_ctx, fmt_gb, fmt_mem, fmt_sig, time_unit

FIT_CELL = {"yes": "[green]yes[/]", "tight": "[yellow]tight[/]", "no": "[red]no[/]"}
RISK_STYLE = {"none": "green", "low": "green", "medium": "yellow", "unknown": "magenta", "high": "red"}
GB_NOTE = "GB = 1e9 bytes"


# ---- plan ----


def plan_columns(dc: bool, time_head: str) -> list[Col]:
    # what the ranking is by (fits, headroom, risk) stays longest at 80 columns; then decode, total, weights
    cols = [Col("model", keep=True), Col("strategy", keep=True), Col("weights", give=4, short="wts"),
            Col("state\nGB", "right", give=7), Col("total\nGB", "right", give=3), Col("fits", give=1),
            Col("head-\nroom GB", "right", give=1), Col("decode\ntok/s", "right", give=2),
            Col(time_head, "right", give=6, short=time_head.replace("prefill", "pf")),
            Col("trained\nctx", "right", give=5), Col("risk", give=1), Col("evidence", give=9)]
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
    _, div = time_unit([r.prefill.value for r in shown])
    pre = [prefill_cell(r, p, div) for r, p in zip(shown, pre)]
    dc = d.is_datacenter
    cells = []
    for r, p in zip(shown, pre):
        b = r.deployment.bytes
        risk = r.quality["risk"]
        tc = r.trained_ctx[0] if r.trained_ctx else None
        cells.append([r.model + ("" if r.exportable[0] else " †"), r.strategy.short + ("" if r.native else " *"),
                      r.deployment.weight_precision, fmt_gb(b["state"]), fmt_gb(b["total"]),
                      FIT_CELL[r.fit], ("" if r.fits else "-") + fmt_gb(abs(r.headroom)),
                      decode_cell(r), p,
                      "?" if tc is None else ("[red]" + fmt_ctx(tc) + " ![/]" if plan.ctx > tc else fmt_ctx(tc)),
                      f"[{RISK_STYLE[risk]}]{risk}[/]", r.quality["cite"],
                      *((str(int(r.serving.users.value)), "-" if math.isinf(r.serving.usd.value)
                         else f"{r.serving.usd.value:.2f}") if dc else ())])
    from .memory import PLAN_RUNTIMES
    rt = PLAN_RUNTIMES[plan.runtime]
    title = (f"edgekv plan: {escape(d.name)} ({escape(d.id)}), ctx {fmt_ctx(plan.ctx)} = {plan.ctx:,} tokens, budget "
             f"{fmt_mem(plan.budget)}, runtime {rt['label']} (overhead {fmt_mem(d.overhead(rt['overhead']).value)})")
    n_tight = sum(r.fit == "tight" for r in rows)
    unc = d.budget_uncertainty_bytes
    footer = (f"{n_fit} of {len(rows)} options fit" + (f", {n_tight} of them tight" if n_tight else "") + f". {GB_NOTE}. "
              "total = weights + state + workspace + runtime; headroom = budget - total ('-' = over by); "
              + (f"tight = fits with no more headroom than the budget's own uncertainty ({fmt_mem(unc)}, "
                 f"{d.id}'s app_budget_uncertainty_bytes). " if unc else "")
              + "decode = tokens/s at ctx" + ("; low-high where the attention rate of this runtime and cache on this "
                                              "device is a guess, not a measurement (--explain)"
                                              if any(getattr(r, "decode_range", None) for r in shown) else "")
              + f"; prefill = time to read a {plan.ctx:,}-token prompt"
              + ("; fast-slow where this device has no prefill rate for the row's cache (--explain)"
                 if any(getattr(r, "prefill_range", None) for r in shown) else "") + ". "
              "'*' = state changed from what the model was trained with (quantized, windowed or converted). "
              "'†' = edgekv export cannot build this row today (another tool may; --json: exportable_reason). "
              "trained = the context the model was trained at ('!' = ctx is past it: risk high unless edgekv analyze "
              "measured this model that far; '?' = unknown: risk at least 'unknown'). risk 'unknown' = no published "
              "or measured result covers this option. "
              "A catalog model is a shape (its published config); the weights come from you: "
              + export_sentence(plan))
    print_table(c, title, plan_columns(dc, head), cells, footer)
    if getattr(plan, "cpu_note", None):  # the profile's speeds are another CPU's (devices.cpu_note)
        c.print(escape(plan.cpu_note))
    suggestions_lines(c, plan)
    if limit is not None and len(rows) > limit:
        c.print(f"{len(rows) - limit} more options: --all shows them, --json gives every number.")
    not_applicable_lines(c, plan, each=limit is None or explain)
    if explain:
        explain_rows(c, plan, shown)


def export_sentence(plan) -> str:
    """The footer's way from a row to an artifact: `export --from-plan` where edgekv builds this runtime's artifact
    (it builds the .pte and ONNX the default runtime plans), else which --runtime plans what it builds."""
    from .clibase import plan_flag
    from .plan import EDGEKV_BUILDS, OTHERS_BUILD, default_runtime
    d, ctx = plan.device, fmt_ctx(plan.ctx)
    if plan.runtime in EDGEKV_BUILDS:
        fmt = " --format onnx" if plan.runtime == "onnxruntime" and default_runtime(d) != "onnxruntime" else ""
        if plan.runtime == "edgekv-pte" and getattr(plan, "int8_kernel", "executorch") != "executorch":
            fmt += f" --pte-kernel {plan.int8_kernel}"  # the kernel the int8 caches were priced at
        return (f"`edgekv export -m ./hf-folder-or.gguf --strategy S --from-plan {escape(d.id)} -c {ctx}{fmt} -o OUT` "
                "builds a row as planned.")
    from .memory import PLAN_RUNTIMES
    ours = [k for k in EDGEKV_BUILDS if PLAN_RUNTIMES[k]["overhead"] in d.runtime_overhead]
    other = (f" `edgekv plan -d {escape(d.id)} -c {ctx} --runtime {plan_flag(ours[0])}` plans the "
             f"{'.pte' if ours[0] == 'edgekv-pte' else 'ONNX'} edgekv export builds." if ours else "")
    if plan.runtime in OTHERS_BUILD:
        return (f"edgekv export does not build --runtime {plan_flag(plan.runtime)}'s artifact ('†' on every row; "
                "ExecuTorch's examples/models/llama does)." + other)
    return f"{PLAN_RUNTIMES[plan.runtime]['label']} runs the model's own weights: nothing to export." + other


def screen_lines() -> int | None:
    """The terminal's height in lines: $LINES when set, else the terminal's when stdout is one; None when piped."""
    v = os.environ.get("LINES", "").strip()
    if v.isascii() and v.isdigit() and 0 < len(v) <= 6 and int(v) > 0:
        return int(v)
    if sys.stdout.isatty():
        try:
            return os.get_terminal_size(sys.stdout.fileno()).lines or None
        except (OSError, ValueError):
            return None
    return None


def plan_screen(plan, limit: int | None = 30, explain: bool = False) -> None:
    """plan_table, with the default top-N cut so that the title, the table and its footer fit one screen of the
    terminal (a 40-line terminal shows them whole; 5 rows at least); --all, --explain and a pipe print all of it."""
    lines = screen_lines()
    if limit is None or explain or lines is None:
        plan_table(plan, limit, explain)
        return
    import io
    from contextlib import redirect_stdout
    while True:
        buf = io.StringIO()
        buf.isatty, buf.fileno = sys.stdout.isatty, sys.stdout.fileno  # the same width and colours as printed
        with redirect_stdout(buf):
            plan_table(plan, limit, explain)
        text = buf.getvalue()
        over = text.count("\n") - lines + 1  # the shell's prompt takes the last line
        if over <= 0 or limit <= 5:
            break
        limit = max(5, limit - over)
    sys.stdout.write(text)


def not_applicable_lines(c: Console, plan, each: bool) -> None:
    """What the plan left out. A strategy that needs another family of model: the catalog models of that family
    that could run here and are not rows of this plan already. Options that do not apply to a model (kv on a Mamba):
    one summary line, or one line each with `each` (--all, --explain)."""
    planned = {r.model for r in plan.rows}
    fams: dict[str, set] = {}
    for e in plan.not_applicable:
        if "needs_family" in e:
            fams.setdefault(e["needs_family"], set()).update(e.get("alternatives", []))
    for fam, alts in sorted(fams.items()):
        if alts and alts <= planned:
            continue  # every such model is a row already
        models = ", ".join(sorted(alts - planned)) if alts else "none in the catalog could run on this device"
        c.print(f"[dim]{fam}: needs a model built that way ({fam} family) — catalog models: {models}[/]")
    rest = [e for e in plan.not_applicable if "needs_family" not in e]
    if each:
        for e in rest:  # e.g. a kv cache on a model with recurrent layers, a window that covers the whole context
            c.print(f"[dim]{escape(e['model'])} / {escape(e['strategy'])}: not applicable — {escape(e['reason'])}[/]")
    elif rest:
        by_reason: dict[str, list[dict]] = {}
        for e in rest:
            by_reason.setdefault(e["reason"], []).append(e)
        top = sorted(by_reason.items(), key=lambda kv: -len(kv[1]))
        reason, es = top[0]
        others = len(rest) - len(es)
        c.print(f"[dim]{len(rest)} option{'s do' if len(rest) > 1 else ' does'} not apply — " + (f"{len(es)} of them: " if others else "")
                + f"{escape(reason)} (e.g. {escape(es[0]['model'])} / {escape(es[0]['strategy'])})"
                + (f"; {others} for {len(top) - 1} other reason{'s' if len(top) > 2 else ''}" if others else "")
                + "; --all or --explain lists each.[/]")


def suggestions_lines(c: Console, plan) -> None:
    """When no option fits well (plan_search.what_would_fit ran and found none here): what would, from the planner's own
    rows under one changed flag."""
    sug = plan.suggestions
    if sug is None:
        return
    head = "No option fits well here (fits with headroom beyond the budget's uncertainty, risk none or low)."
    if not sug:
        c.print(f"{head} Nothing the planner knows does: not another strategy, runtime or a larger device of this "
                "class.")
        return
    c.print(f"{head} What would, by the planner's own rows:")
    for s in sug:
        where = {"strategy": "another strategy", "runtime": f"runtime {s['what']}",
                 "weights": f"{s['weights']} weights", "runtime and weights": f"runtime {s['what']} weights",
                 "device": f"a larger device: {s['what']}"}[s["kind"]]
        c.print(f"  {escape(where)}: {escape(s['model'])} {escape(s['short'])} ({s['weights']} weights), fits with "
                f"{fmt_gb(s['headroom_bytes'])} GB headroom, risk {s['risk']}, {fmt_sig(s['decode_tokens_per_s'])} "
                f"tok/s — `{escape(s['command'])}`")


def max_ctx_table(mp, limit: int | None = 30, explain: bool = False) -> None:
    """`plan --ctx max`: per option the longest context within the budget, what bounds it, and the option planned
    there."""
    from .memory import PLAN_RUNTIMES
    c = console()
    d = mp.device
    opts = mp.ranked()
    shown = opts if limit is None else opts[:limit]
    cols = [Col("model", keep=True), Col("strategy", keep=True), Col("weights", give=4, short="wts"),
            Col("longest\nctx", "right", keep=True), Col("with head-\nroom", "right", give=2),
            Col("bound", give=1), Col("total\nGB", "right", give=3), Col("fits", give=5),
            Col("decode\ntok/s", "right", give=3), Col("risk", give=1), Col("evidence", give=9)]
    cells = []
    for o in shown:
        r = o.row
        cells.append([o.model + ("" if r is None or r.exportable[0] else " †"), o.strategy.short,
                      r.deployment.weight_precision if r else "", f"{o.ctx:,}" if o.ctx else "none",
                      f"{o.ctx_yes:,}" if o.ctx_yes else "-", o.bound, fmt_gb(r.deployment.bytes["total"]) if r else "",
                      FIT_CELL[r.fit] if r else FIT_CELL["no"], decode_cell(r) if r else "",
                      f"[{RISK_STYLE[r.quality['risk']]}]{r.quality['risk']}[/]" if r else "",
                      escape(r.quality["cite"]) if r else ""])
    rt = PLAN_RUNTIMES[mp.runtime]
    title = (f"edgekv plan: {d.name} ({d.id}), the longest context per option, budget {fmt_mem(mp.budget)}, "
             f"runtime {rt['label']} (overhead {fmt_mem(d.overhead(rt['overhead']).value)})")
    unc = d.budget_uncertainty_bytes
    footer = (f"{sum(o.ctx > 0 for o in opts)} of {len(opts)} options fit at some context. {GB_NOTE}. longest ctx = "
              "the most tokens whose total stays within the budget (bisection over the plan's memory model), "
              "capped at the model's trained context; with headroom = the most tokens that leave more headroom than "
              f"the budget's uncertainty ({fmt_mem(unc)}); bound = what stops it: memory (the budget), trained (the "
              "model's trained context: past it the risk is high) or search (no trained length known, searched to "
              "1m). total, fits, decode and risk are the option planned at its longest ctx. --explain says why per "
              "row.")
    print_table(c, title, cols, cells, footer)
    from .devices import cpu_note
    note = cpu_note(mp.device)  # the profile's speeds are another CPU's
    if note:
        c.print(escape(note))
    if limit is not None and len(opts) > limit:
        c.print(f"{len(opts) - limit} more options: --all shows them, --json gives every number.")
    if explain:
        for o in shown:
            c.print(f"  {escape(o.model)} / {escape(o.strategy.short)}: {o.ctx:,} tokens, {o.bound}: {escape(o.why)}")


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


def decode_cell(r) -> str:
    """The decode tok/s cell: a range "low-high" (two significant digits) where the attention rate is a guessed
    range (a phone whose runtime's kernel rate is the host's scaled: edgekv/costs/attention_rates.json; a cache no
    kernel rate is stored for on this device, between the runtime's measured kinds: memory.speed.attention_bracket),
    else the one number."""
    rng = getattr(r, "decode_range", None)  # a guessed range: two significant digits say as much as it knows
    return f"{fmt_sig(rng[0], 2)}-{fmt_sig(rng[1], 2)}" if rng else fmt_sig(r.decode.value)


def prefill_cell(r, cell: str, div: float) -> str:
    """The prefill cell: "fast-slow" in the column's unit (div seconds) where no prefill rate is stored for the row's
    cache on this device (memory.prefill.prefill_bracket: the slow end is the row's value), else the cell
    time_column made."""
    rng = getattr(r, "prefill_range", None)
    if not rng:
        return cell
    return f"{fmt_sig(rng[0] / div, 2)}-{fmt_sig(rng[1] / div, 2)}"


def decode_line(r, d) -> str:
    """The decode derivation whose arithmetic gives the printed tok/s: bytes read per token over the effective
    bandwidth when bandwidth-bound (with the fp32 copy a runtime writes and reads when it dequantizes the whole
    cache), FLOP per token over the effective compute when compute-bound; where the attention is charged at its
    kernel rate (edgekv/costs/attention_rates.json), the weights term plus the attention term."""
    a = getattr(r, "attention_terms", None)
    if a:
        lo, hi = a["scale"]
        scale = f" / device scale {lo:g}-{hi:g}" if (lo, hi) != (1.0, 1.0) else ""
        fast = f"{fmt_sig(a['attention_fast_s'] * 1e3)}-" if "attention_fast_s" in a else ""
        how = (", no rate stored for this cache here, between the runtime's measured kinds" if fast
               else " at its kernel rate")
        return escape(f"{a['weights']} = {fmt_sig(a['weights_s'] * 1e3)} ms + attention "
                      f"{fast}{fmt_sig(a['attention_s'] * 1e3)} ms{scale} -> {'-'.join(fmt_sig(v) for v in sorted(set(a['tok_s'])))} "
                      f"tok/s ({a.get('kernel', 'attention')}"
                      f"{how}: {a['formula']})")
    if "compute-bound" in r.decode.formula and r.decode_flops is not None:
        return (f"~{fmt_sig(r.decode_flops.value / 1e9)} GFLOP per token / ({d.flops / 1e9:,.0f} GFLOP/s x "
                f"{d.prefill_efficiency:g}) -> {fmt_sig(r.decode.value)} tok/s (compute-bound)")
    b = r.deployment.bytes
    weights = r.deployment.weights.get("read_per_token", b["weights"])
    read = r.read.value if r.read is not None else weights + b["state"]
    extra = read - weights - b["state"]
    parts = (f" (weights {fmt_gb(weights)} + state {fmt_gb(b['state'])} + the fp32 copy of the dequantized cache, "
             f"written and read, {fmt_gb(extra)})" if extra > 0 else "")
    return (f"~{fmt_gb(read)} GB read per token{parts} / ({d.bandwidth / 1e9:.1f} GB/s x {d.decode_efficiency:g}) -> "
            f"{fmt_sig(r.decode.value)} tok/s (bandwidth-bound)")


def prefill_line(r, d, ctx: int) -> str:
    """The prefill derivation whose arithmetic gives the printed time: FLOP over the effective compute, or, where
    reading the weights once per chunk takes longer, chunks x weights over the effective bandwidth; on a device
    with fitted prefill rates, matmul and attention FLOP over those."""
    unit, div = time_unit([r.prefill.value])
    t = f"{fmt_sig(r.prefill.value / div)} {unit}"
    if getattr(r, "prefill_measured", None):  # at the device's fitted prefill rates
        return escape(f"{ctx:,} tokens: {r.prefill_measured}")
    if r.prefill_flops is None:
        return f"{ctx:,} tokens at {d.flops / 1e9:,.0f} GFLOP/s x {d.prefill_efficiency:g} -> {t}"
    fl = r.prefill_flops.value
    if fl / (d.flops * d.prefill_efficiency) >= r.prefill.value * (1 - 1e-9):
        return (f"{ctx:,} tokens: ~{fmt_sig(fl / 1e12)} TFLOP / ({d.flops / 1e9:,.0f} GFLOP/s x "
                f"{d.prefill_efficiency:g}) -> {t} (compute-bound)")
    chunks = math.ceil(ctx / r.chunk)
    return (f"{ctx:,} tokens in {chunks:,} chunks, each reading the weights: {chunks:,} x "
            f"{fmt_gb(r.deployment.bytes['weights'])} GB / ({d.bandwidth / 1e9:.1f} GB/s x {d.decode_efficiency:g}) "
            f"-> {t} (bandwidth-bound)")


def explain_rows(c: Console, plan, rows) -> None:
    """A short derivation per row; the facts every row shares once, first. --json --explain has every formula."""
    d = plan.device
    f = d.facts
    budget_fact = f["app_budget_bytes"] if plan.budget == d.budget_bytes else f.get("app_budget_entitled_bytes")
    where = os.path.relpath(d.path) if d.path and not os.path.relpath(d.path).startswith("..") else d.path
    c.print(f"\n[bold]Shared by every row[/] ({escape(d.id)}, {escape(where or 'device_profiles/')}):")
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
        c.print(f"  {name} {value} — " + (escape(_first_sentence(fact.cite)) if fact is not None else ""))
    runs: dict = {}
    for r in rows:
        b = r.deployment.bytes
        parts = [("weights", b["weights"]), ("state", b["state"]), ("workspace", b["workspace"])]
        if b.get("load"):
            parts.append(("load", b["load"]))
        parts.append(("runtime", b["runtime"]))
        mem = " + ".join(f"{fmt_gb(v)} {k}" for k, v in parts)
        head = plan.budget - b["total"]
        verdict = (f"does not fit, {fmt_gb(-head)} GB over" if not r.fits else
                   f"fits, {fmt_gb(head)} GB to spare" if r.fit == "yes" else
                   f"tight: {fmt_gb(head)} GB to spare, within the budget's uncertainty {fmt_gb(r.uncertainty)} GB")
        c.print(f"\n[bold]{r.model} / {r.strategy.short}[/] ({r.deployment.weight_precision} weights)")
        c.print(f"  memory   {mem} = {fmt_gb(b['total'])} GB vs budget {fmt_gb(plan.budget)} GB: {verdict}")
        c.print(f"  decode   {decode_line(r, d)}")
        c.print(f"  prefill  {prefill_line(r, d, plan.ctx)}")
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
    cells = [[escape(d.id), escape(d.name), d.device_class, fmt_gb(d.ram_bytes), fmt_gb(d.budget_bytes),
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
    from .mpl import pyplot
    plt = pyplot()
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
    from .outputs import plot_marks
    fig.savefig(out, dpi=120, bbox_inches="tight", **plot_marks(out))
    plt.close(fig)
