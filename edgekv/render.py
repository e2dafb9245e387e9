"""Tables, JSON and plots. No arithmetic here: everything shown was computed in memory.py / plan.py."""
from __future__ import annotations

import json
import math
import sys

from rich import box
from rich.console import Console
from rich.table import Table

from .units import fmt_auto, fmt_bytes, fmt_ctx

RISK_STYLE = {"none": "green", "low": "green", "medium": "yellow", "unknown": "magenta", "high": "red"}


def console() -> Console:
    return Console(width=max(Console().width, 150) if not sys.stdout.isatty() else None)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=_default) + "\n")


def _default(o):
    if isinstance(o, float) and math.isinf(o):
        return None
    raise TypeError(type(o))


def _secs(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def plan_table(plan, limit: int | None = 30, explain: bool = False) -> None:
    c = console()
    d = plan.device
    rows = plan.ranked()
    n_fit = sum(r.fits for r in rows)
    from .memory import PLAN_RUNTIMES
    t = Table(box=box.SIMPLE_HEAD, title=f"edgekv plan — {d.name} ({d.id}), ctx {fmt_ctx(plan.ctx)} = {plan.ctx:,} tokens, "
                    f"app budget {fmt_bytes(plan.budget)}, runtime {PLAN_RUNTIMES[plan.runtime]['label']} "
                    f"(overhead {fmt_bytes(d.overhead(PLAN_RUNTIMES[plan.runtime]['overhead']).value)})",
              title_justify="left", show_lines=False)
    for col, kw in (("model", {}), ("strategy", {}), ("weights", {}), ("state", {"justify": "right"}),
                    ("total", {"justify": "right"}), ("fits", {}), ("headroom", {"justify": "right"}),
                    ("decode", {"justify": "right"}), ("prefill", {"justify": "right"}),
                    ("trained", {"justify": "right"}), ("risk", {}), ("evidence", {"no_wrap": True})):
        t.add_column(col, **kw)
    dc = d.is_datacenter
    if dc:
        t.add_column("users/GPU", justify="right")
        t.add_column("$/M tok", justify="right")
    shown = rows if limit is None else rows[:limit]
    for r in shown:
        b = r.deployment.bytes
        risk = r.quality["risk"]
        tc = r.trained_ctx[0] if r.trained_ctx else None
        t.add_row(r.model + ("" if r.exportable[0] else " †"), r.strategy.short + ("" if r.native else " *"),
                  r.deployment.weight_precision, fmt_auto(b["state"]), fmt_auto(b["total"]),
                  "[green]yes[/]" if r.fits else "[red]no[/]",
                  ("" if r.fits else "-") + fmt_auto(abs(r.headroom)), f"{r.decode.value:.1f} tok/s",
                  _secs(r.prefill.value),
                  "?" if tc is None else ("[red]" + fmt_ctx(tc) + " ![/]" if plan.ctx > tc else fmt_ctx(tc)),
                  f"[{RISK_STYLE[risk]}]{risk}[/]",
                  r.quality["cite"],
                  *((str(int(r.serving.users.value)), "-" if math.isinf(r.serving.usd.value)
                     else f"${r.serving.usd.value:.2f}") if dc else ()))
    c.print(t)
    c.print(f"{n_fit} of {len(rows)} options fit; GB = 1e9 bytes. '*' = state changed from what the model was trained "
            f"with (quantized, windowed or converted). '†' = edgekv export cannot build this row today (another tool "
            f"may; --json: exportable_reason). headroom = app budget - total ('-' = over by). decode = tokens/s at "
            f"ctx; prefill = time to read a {plan.ctx:,}-token prompt. trained = the context the model was trained "
            f"at ('!' = ctx is past it: risk high unless edgekv analyze measured this model that far; '?' = unknown: "
            f"risk at least 'unknown'). risk 'unknown' = no published or measured result covers this option.")
    if limit is not None and len(rows) > limit:
        c.print(f"{len(rows) - limit} more options: --all shows them, --json gives every number.")
    fams = {}
    for e in plan.not_applicable:
        if "needs_family" in e:
            fams.setdefault(e["needs_family"], set()).update(e.get("alternatives", []))
    for fam, alts in sorted(fams.items()):
        models = ", ".join(sorted(alts)) if alts else "none in the catalog could run on this device"
        c.print(f"[dim]{fam}: needs a model built that way ({fam} family) — catalog models: {models}[/]")
    if explain:
        for r in shown:
            c.print(f"\n[bold]{r.model} / {r.strategy.label}[/]")
            for k, v in r.to_json(explain=True)["explain"].items():
                c.print(f"  {k}: {v}")


def baseline_table(rows, title: str, explain: bool = False) -> None:
    c = console()
    t = Table(title=title, title_justify="left")
    for col in ("strategy", "ctx", "state / user", "GPUs", "users", "tok/s / user", "$ / M tokens"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        usd = "∞ (no user fits)" if math.isinf(r.usd.value) else f"${r.usd.value:.2f}"
        t.add_row(r.strategy.short, f"{r.ctx:,}", fmt_bytes(r.state_bytes_per_user), str(r.n_gpus), str(int(r.users.value)),
                  f"{r.tok_s_per_user:.1f}", usd)
    c.print(t)
    c.print("GB = 1e9 bytes.")
    if explain:
        for r in rows:
            c.print(f"\n[bold]{r.strategy.short} @ {r.ctx:,}[/]\n  users: {r.users.formula}\n  cost: {r.usd.formula}"
                    f"\n  assumptions: {r.assumptions}")


def plot_plan(curves: dict, budget: int, title: str, out: str) -> None:
    """Memory against context (log x) per option, with the device budget as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, (ctxs, totals) in curves.items():
        style = "-" if "*" not in label else "--"
        ax.plot(ctxs, [t / 1e9 for t in totals], style, marker="o", ms=3, label=label)
    ax.axhline(budget / 1e9, color="red", ls="--", label=f"app budget {budget / 1e9:.2f} GB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("total memory (GB = 1e9 B)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
