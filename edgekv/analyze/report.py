"""Turn measured curves into the analyze JSON, a plot, and a stored measurement the planner reads.

JSON (other tools parse it; keep the names):
  {"model", "strategy", "ctx", "target_ctx", "text", "chunk",
   "variants": [{"label", "bits", "rounding", "source" (weights|state|both), "positions", "kl", "top1",
                 "nll_diff", "hidden_rel_err", "state_positions", "state_rel_err",
                 "fit": {"law", "params", "stderr", "r2", "class"}, "state_fit": {...} | null,
                 "extrapolated": {"ctx", "kl", "low", "high", "far_beyond_measured", "note"}}],
   "analytic": {...} | null}
Curves are windowed means over log-spaced position windows (positions = window centres).

Stored measurement (edgekv/measurements/<model>__<strategy label with ':'->'_', ','->'_', '='->'-'>.json):
  {"model", "strategy", "measured_ctx", "fit": {"law", "params", "class"}, "kl_at_measured", "source", "evidence"}
The planner (edgekv/quality.py) evaluates the fitted law at the plan's context and maps KL to a risk.
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from ..jsonfile import output_json
from ..outputs import marked, plot_marks, write_atomic
from ..quality import MEASURED_DIR, measurement_path
from .fit import extrapolate, fit_growth, windowed



def _w(pos, vals, n_windows):
    if not vals:
        return [], []
    xs, ys = windowed(pos, vals, n_windows)
    return [round(float(x), 2) for x in xs], [float(y) for y in ys]


def summarise(runner, tokens_text: str, target_ctx: int, n_windows: int = 24, analytic: dict | None = None) -> dict:
    out = {"model": runner.model, "strategy": runner.variants[0].strategy.name if runner.variants else None,
           "ctx": runner.ctx, "target_ctx": target_ctx, "chunk": runner.chunk, "text": tokens_text,
           "interrupted": bool(getattr(runner, "interrupted", False)), "variants": [], "analytic": analytic}
    for v, cv in zip(runner.variants, runner.curves):
        pos, kl = _w(cv.positions, cv.kl, n_windows)
        _, top1 = _w(cv.positions, cv.top1, n_windows)
        _, nll = _w(cv.positions, cv.nll_diff, n_windows)
        _, hid = _w(cv.positions, cv.hidden_rel_err, n_windows)
        spos, serr = _w(cv.state_positions, cv.state_rel_err, n_windows)
        fit = ext = sfit = None
        fpos, fkl, fit_from = pos, kl, None
        if v.strategy.window_tokens is not None:
            # a window keeps the first W + S positions exactly (KL = 0 there) and starts dropping tokens after: a
            # step, not a growth law over the whole range. Fit the law to the positions past the window only.
            fit_from = v.strategy.window_tokens
            # and in tokens past the window (t - W - S), the number of tokens it has dropped
            past = [i for i, t in enumerate(cv.positions) if t > fit_from]
            fpos, fkl = _w([cv.positions[i] - fit_from for i in past], [cv.kl[i] for i in past], n_windows)
        try:
            f = fit_growth(fpos, fkl)
            fit = f.to_json()
            e = extrapolate(f, target_ctx - (fit_from or 0))
            ext = {"ctx": target_ctx, "kl": e["value"], "low": e["low"], "high": e["high"],
                   "far_beyond_measured": e["far_beyond_measured"], "note": e["note"]}
        except ValueError:
            pass
        try:
            sfit = fit_growth(spos, serr).to_json()
        except ValueError:
            pass
        out["variants"].append({
            "label": v.label, "bits": v.bits, "rounding": v.rounding, "source": v.source,
            "strategy": v.strategy.label, "weight_bits": v.weight_bits, **v.extra,
            "positions": pos, "kl": kl, "top1": top1, "nll_diff": nll, "hidden_rel_err": hid,
            "state_positions": spos, "state_rel_err": serr, "fit": fit, "state_fit": sfit, "extrapolated": ext,
            **({"fit_from_position": fit_from} if fit_from is not None else {}),
            "mean_kl": float(np.mean(cv.kl)) if cv.kl else None,
            "mean_top1": float(np.mean(cv.top1)) if cv.top1 else None})
    return out


def store(result: dict, model_name: str, out_dir: Path | None = None, applies_to: str | None = None) -> list[Path]:
    """One file per model x strategy x precision (state variants only, nearest rounding)."""
    out_dir = out_dir or MEASURED_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for v in result["variants"]:
        if v["source"] != "state" or v["rounding"] != "nearest" or not v["fit"]:
            continue
        label = v["strategy"]
        rec = {"model": model_name, "strategy": label, "measured_ctx": result["ctx"], "fit": v["fit"],
               "kl_at_measured": v["kl"][-1] if v["kl"] else None, "mean_top1": v["mean_top1"],
               "applies_to": applies_to or f"model:{model_name}",
               "source": f"edgekv analyze --model {result['model']} (teacher-forced on {result['text']})",
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
               "evidence": (f"edgekv measured KL vs fp32 over {result['ctx']} tokens: {v['fit']['class']} "
                            f"({v['fit']['law']} law), top-1 agreement {v['mean_top1']:.3f}")}
        p = measurement_path(model_name, label, out_dir)
        if p.resolve().parent != out_dir.resolve():  # a model name is one file name part (analyze.cli.save_target)
            raise EdgekvError(f"{model_name!r}: a stored measurement must stay in {out_dir}")
        write_atomic(p, output_json(marked(rec)) + "\n", option="--save", force=True)  # updates its own files
        written.append(p)
    return written


def plot(result: dict, out: str, force: bool = False) -> None:
    from ..mpl import pyplot
    plt = pyplot()

    analytic = result.get("analytic")
    fig, axes = plt.subplots(1, 2 if analytic else 1, figsize=(13 if analytic else 8, 5), squeeze=False)
    ax = axes[0][0]
    for v in result["variants"]:
        if not v["positions"]:
            continue
        line, = ax.plot(v["positions"], np.maximum(v["kl"], 1e-12), marker="o", ms=3, label=f"{v['label']}")
        if v["fit"]:
            t = np.geomspace(1, max(result["target_ctx"], v["positions"][-1]), 100)
            p = v["fit"]["params"]
            y = p["a"] * t ** p["b"] if v["fit"]["law"] == "power" else p["a"] * np.exp(p["k"] * t)
            ax.plot(t, y, "--", color=line.get_color(), alpha=0.6, lw=1,
                    label=f"  fit: {v['fit']['law']}, {v['fit']['class']}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    seen = [k for v in result["variants"] for k in v["kl"] if k > 0]
    if seen:  # the fitted laws may explode when extrapolated: keep the axis on the data
        ax.set_ylim(min(seen) / 10, max(seen) * 1e3)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("KL(reference || variant), nats/token")
    ax.axvline(result["ctx"], color="grey", lw=0.8, ls=":")
    ax.set_title(f"{result['model']}: error vs position")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    if analytic:
        ax2 = axes[0][1]
        for v in result["variants"]:
            if v["state_positions"]:
                ax2.plot(v["state_positions"], v["state_rel_err"], marker="o", ms=3, label=f"measured {v['label']}")
        ax2.plot(analytic["positions"], analytic["predicted_state_rel_err"], "k--",
                 label="analytic prediction (int8, independent errors)")
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        ax2.set_xlabel("position (tokens)")
        ax2.set_ylabel("state relative error")
        ax2.set_title("recurrent state: analytic prediction vs measured")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend(fontsize=7)
    save_png(fig, out, force)


def save_png(fig, out, force: bool = False) -> None:
    """tight_layout, write the figure to a hidden sibling and rename it into place (never a half-written PNG)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        write_atomic(out, b"", writer=lambda tmp: fig.savefig(tmp, dpi=110, **plot_marks(tmp)),  # format: the suffix
                     option="--plot", force=force)
    finally:
        plt.close(fig)
