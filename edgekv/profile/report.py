"""`edgekv report`: plan, measurement, quality and the datacenter baseline of one export on one page
(HTML with embedded PNGs, or markdown)."""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from ..errors import EdgekvError

WEIGHT_PRECISION = {"float32": "fp32", "float16": "fp16", "bfloat16": "fp16", "int8": "int8", "int4": "int4"}
RUNTIME_NAME = {"ort": "onnxruntime", "executorch": "executorch"}


def _packaged_name(manifest: dict) -> str | None:
    """The packaged model name (smollm2-135m) an export's weights came from, else None."""
    from ..models.weights import PACKAGED
    src = Path(manifest["model"]["source"])
    return next((k for k, (pkg, f) in PACKAGED.items() if src.name == f and src.parent.name == pkg), None)


def _arch(manifest: dict):
    """The model to plan: the catalog entry of a packaged model (so the page's plan row is `edgekv plan -m NAME`'s,
    with its stored analyzer measurements), else the export's source re-read."""
    from ..arch import catalog_names, catalog_arch, load_arch
    src = manifest["model"]["source"]
    packaged = _packaged_name(manifest)
    if packaged and packaged in catalog_names():
        return catalog_arch(packaged)
    try:
        return load_arch(src)
    except EdgekvError:
        name = manifest["model"]["name"].lower()
        if name in catalog_names():
            return catalog_arch(name)
        raise EdgekvError(f"cannot re-read the model of this export ({src}) to plan it") from None


def _png(fig) -> str:
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def memory_figure(runs: list[dict], budget: int | None, budget_label: str):
    """Predicted vs measured bytes per context (linear GB axis), the budget as a line when it is on the same scale,
    else said in the title; the legend below the axes, never over the bars."""
    from ..mpl import pyplot
    plt = pyplot()
    import numpy as np

    from ..units import GB, fmt_mem

    fig, ax = plt.subplots(figsize=(6.2, 4.6))
    x = np.arange(len(runs))
    pred = [r["predicted_bytes"] / GB for r in runs]
    meas = [r["measured_bytes"] / GB for r in runs]
    ax.bar(x - 0.2, pred, 0.4, label="predicted (planner: weights + state + workspace)", color="#4c72b0")
    ax.bar(x + 0.2, meas, 0.4, label="measured (peak RSS - runtime baseline)", color="#dd8452")
    top = max(pred + meas)
    title = "memory above the runtime baseline"
    if budget and budget / GB <= 4 * top:
        ax.axhline(budget / GB, color="red", lw=2, ls="--", label=f"{budget_label} {fmt_mem(budget)}")
        top = max(top, budget / GB)
    elif budget:
        title += f"\n({budget_label} {fmt_mem(budget)}: {budget / GB / top:,.0f}x the tallest bar, off this scale)"
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(x, [_ctx_label(r["ctx"]) for r in runs])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("GB (1e9 bytes)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    fig.tight_layout()
    return fig


def speed_figure(runs: list[dict]):
    """Measured decode tokens/s beside the bandwidth roofline, linear axis, legend below the axes."""
    from ..mpl import pyplot
    plt = pyplot()
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.2, 4.6))
    x = np.arange(len(runs))
    ax.bar(x - 0.2, [r.get("tokens_per_s") or 0 for r in runs], 0.4, label="measured decode", color="#55a868")
    ax.bar(x + 0.2, [r.get("roofline_tokens_per_s") or 0 for r in runs], 0.4,
           label="roofline: bandwidth / (weights + state bytes)", color="#8172b3")
    ax.set_xticks(x, [_ctx_label(r["ctx"]) for r in runs])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("decode speed", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    fig.tight_layout()
    return fig


def quality_figure(fit: dict, measured_ctx: int, ctx: int | None, label: str):
    """The analyzer's fitted error law: solid over the measured positions, dashed beyond (extrapolated), the
    requested context marked."""
    from ..mpl import pyplot
    plt = pyplot()
    import numpy as np

    from ..quality import kl_at

    end = max(measured_ctx, ctx or 0) * 2
    t_in = np.geomspace(1, measured_ctx, 100)
    t_out = np.geomspace(measured_ctx, end, 100)
    fig, ax = plt.subplots(figsize=(7, 4.6))
    ax.plot(t_in, [kl_at(fit, float(t)) for t in t_in], lw=2, color="#4c72b0",
            label=f"{fit['law']} law fitted to {label} ({fit['class']})")
    ax.plot(t_out, [kl_at(fit, float(t)) for t in t_out], lw=2, ls="--", color="#4c72b0",
            label="extrapolated beyond the measurement")
    ax.axvline(measured_ctx, color="grey", ls=":", label=f"end of measurement ({_ctx_label(measured_ctx)})")
    if ctx:
        ax.axvline(ctx, color="black", ls="-.", label=f"this report's context ({_ctx_label(ctx)})")
    ax.set_xscale("log", base=2)
    ticks = [2 ** k for k in range(0, int(np.log2(end)) + 1, 2)]
    ax.set_xticks(ticks, [_ctx_label(t) for t in ticks])
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("KL vs fp32 reference (nats/token)")
    ax.set_ylim(bottom=0)
    ax.set_title("quality: error growth measured by edgekv analyze", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    fig.tight_layout()
    return fig


def _ctx_label(n) -> str:
    from ..units import fmt_ctx
    return fmt_ctx(int(n))


def _figures(prof: dict, meas: dict | None, ctx: int | None, budget: int | None, budget_label: str) -> dict:
    figs = {}
    runs = [r for r in prof["runs"] if r.get("measured_bytes")]
    if runs:
        figs["memory"] = _png(memory_figure(runs, budget, budget_label))
        figs["speed"] = _png(speed_figure(runs))
    if meas and meas.get("fit"):
        figs["quality"] = _png(quality_figure(meas["fit"], meas["measured_ctx"], ctx, meas.get("model", "")))
    return figs


QUICK_CTXS = (256, 1024)  # report's own profile: short contexts, seconds each (an export's full 32k took 19 min)


def quick_contexts(max_ctx: int, steps: int) -> list[int]:
    """The contexts `edgekv report` profiles when no --profile is given: 256 and 1k tokens (at most the export's
    max_ctx). The full context is `edgekv profile -c ... --out P` then `report --profile P`."""
    return sorted({min(c, max_ctx) for c in QUICK_CTXS}) if max_ctx > steps + 1 else [max_ctx]


def build_report(folder: Path, out: str | None, device_name: str, gpu_name: str, ctx_text: str | None,
                 profile_json: str | dict | None, progress: bool = True, force: bool = False) -> tuple[Path, dict]:
    """Writes the page; returns its path and what it shows, as data (`edgekv report --json`). profile_json: an
    `edgekv profile --out` JSON, its path or already read; None: profile now."""
    from ..devices import load_device
    from ..export.manifest import load_export
    from ..plan import deployment, plan_one
    from ..serving import serve
    from ..quality import measured
    from ..strategies import parse_strategy
    from ..units import fmt_mem, fmt_sig, parse_ctx

    manifest = load_export(folder)
    arch = _arch(manifest)
    strategy = parse_strategy(manifest["strategy"]["label"])
    ctx = parse_ctx(ctx_text) if ctx_text else int(manifest["max_ctx"])
    weights = WEIGHT_PRECISION.get(manifest["weights"]["dtype"], "fp16")
    phone, gpu = load_device(device_name), load_device(gpu_name)
    fmt = manifest["artifacts"][0]["format"]
    runtime = "onnxruntime" if fmt == "onnx" else "edgekv-pte"  # edgekv's own artifact (edgekv/costs/runtimes.json)
    row = plan_one(arch, strategy, phone, ctx, weights, runtime if runtime in phone.runtime_overhead
                   or runtime == "edgekv-pte" and "executorch" in phone.runtime_overhead else None)
    base = serve(gpu, arch, deployment(arch, strategy, ctx, "fp16", gpu.runtime, gpu.overhead().value))
    if isinstance(profile_json, dict):  # read (once) and validated by the caller: a pipe cannot be read twice
        prof = profile_json
    elif profile_json:
        from ..jsonfile import read_json
        prof = read_json(profile_json, f"--profile {profile_json}")
    else:
        mc = int(manifest["max_ctx"])
        steps = max(1, min(16, mc // 4))
        ctxs = quick_contexts(mc, steps)
        from .cli import profile_with_progress
        prof = profile_with_progress(str(folder), [c for c in ctxs if c > steps], steps, None, None, None, None, 1,
                                     enabled=progress)
    meas = measured(arch.name, strategy, arch.family)
    b = row.deployment.bytes
    if prof.get("budget_bytes"):
        budget, budget_label = prof["budget_bytes"], "the profile's budget"
    else:  # the phone's app budget less its runtime's overhead: the same basis as the bars (above the runtime)
        basis = row.budget_basis  # devices.artifact_budget, as profile --device and plan use it
        budget, budget_label = basis.above_baseline, f"{phone.name} budget - {basis.runtime} overhead ="
    figs = _figures(prof, meas, ctx, budget, budget_label)
    plan_rows = [("model", arch.name), ("strategy", strategy.label), ("context", f"{ctx:,} tokens"),
                 ("weights", f"{weights}: {fmt_mem(b['weights'])}"), ("state", fmt_mem(b["state"])),
                 ("workspace", fmt_mem(b["workspace"])), ("runtime overhead", fmt_mem(b["runtime"])),
                 ("total", fmt_mem(b["total"])), (f"{phone.name} app budget", fmt_mem(row.budget)),
                 ("fits", row.fit), ("decode", f"{fmt_sig(row.decode.value)} tok/s"),
                 ("prefill of the whole context", f"{fmt_sig(row.prefill.value)} s"),
                 ("quality risk", f"{row.quality['risk']} ({row.quality['source']}: {row.quality['evidence']})")]
    gpu_rows = [("per-user state", fmt_mem(base.state_bytes_per_user)), ("users per GPU", str(int(base.users.value))),
                ("decode per user", f"{fmt_sig(base.tok_s_per_user)} tok/s"),
                ("$ per million tokens", "no user fits" if base.usd.value == float("inf")
                 else f"${fmt_sig(base.usd.value)}"),
                ("assumptions", base.assumptions)]
    prof_rows = [(str(r["ctx"]), fmt_sig(r["predicted_bytes"] / 1e9),
                  fmt_sig(r["measured_bytes"] / 1e9) if r.get("measured_bytes") else "-",
                  f"{r['error_pct']:+.1f}%" if r.get("error_pct") is not None else "-",
                  f"{r['tokens_per_s']:.1f}" if r.get("tokens_per_s") else "-",
                  f"{r['roofline_tokens_per_s']:.1f}" if r.get("roofline_tokens_per_s") else "-",
                  "yes" if r["fits"] else "no") for r in prof["runs"]]
    title = f"edgekv report — {arch.name}, {strategy.label}"
    spec = _packaged_name(manifest) or manifest["model"]["source"]
    hint = (f"no edgekv analyze measurement is stored for {arch.name} with {strategy.label}; the plan cites published "
            f"results. To draw the curve here: edgekv analyze --model {spec} --strategy {strategy.label} --save, "
            "then run edgekv report again.")
    target = Path(out) if out else folder / "report.html"
    if target.suffix.lower() == ".md":
        text = _markdown(title, plan_rows, prof, prof_rows, gpu_name, gpu_rows, meas, phone.name, hint)
    else:
        text = _html(title, plan_rows, prof, prof_rows, gpu.name, gpu_rows, meas, figs, phone.name, hint)
    from ..outputs import write_atomic
    write_atomic(target, text, option="--out", force=force)
    data = {"out": str(target), "artifact": str(folder), "model": arch.name, "strategy": strategy.label, "ctx": ctx,
            "plan": {"device": phone.name, **row.to_json()}, "profile": prof, "analyzer": meas,
            "baseline": {"gpu": gpu.name, **base.to_json(), "assumptions": base.assumptions}}
    return target, data


PROFILE_COLS = ("ctx", "predicted GB", "measured GB", "error", "decode tok/s", "roofline tok/s", "fits")
UNITS_NOTE = "GB = 1e9 bytes; tok/s = tokens per second; $ = US dollars."
BASIS_NOTE = ("The phone plan's total and the profile's predicted count different things: the plan's total is weights "
              "+ state + workspace + the phone runtime's overhead (what the app budget must hold); the profile's "
              "predicted is what this artifact adds above this host's runtime baseline (weights + state + workspace), "
              "the same basis as measured. The memory chart's budget line is on that basis too.")


def _markdown(title, plan_rows, prof, prof_rows, gpu_name, gpu_rows, meas, phone_name, hint) -> str:
    from ..outputs import generator
    md = [f"<!-- generator: {generator()} -->", f"# {title}", "", UNITS_NOTE, "", f"## Plan on {phone_name}", "", "| | |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in plan_rows]
    md += ["", f"## Measured on this host ({prof['host']['kind']}, {prof['runtime']})", "", BASIS_NOTE, "",
           "| " + " | ".join(PROFILE_COLS) + " |", "|" + "---|" * len(PROFILE_COLS)]
    md += ["| " + " | ".join(r) + " |" for r in prof_rows]
    md += ["", "## Quality", "", meas["evidence"] if meas else hint, "", f"## Datacenter baseline ({gpu_name})", "",
           "| | |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in gpu_rows]
    return "\n".join(md) + "\n"


def _html(title, plan_rows, prof, prof_rows, gpu_name, gpu_rows, meas, figs, phone_name, hint) -> str:
    e = html.escape

    def kv(rows):
        return "<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows) + "</table>"

    prof_html = ("<table><tr>" + "".join(f"<th>{c}</th>" for c in PROFILE_COLS) + "</tr>"
                 + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in prof_rows) + "</table>")
    img = lambda k: f'<img alt="{k}" src="data:image/png;base64,{figs[k]}">' if k in figs else ""
    quality = e(meas["evidence"]) if meas else e(hint)
    from ..outputs import generator
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta name="generator" content="{e(generator())}">
<title>{e(title)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}} table{{border-collapse:collapse;margin:1em 0}}
th,td{{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}} .cols{{display:flex;gap:2em}}
.cols>div{{flex:1;min-width:0}} img{{max-width:100%}} .note{{background:#f6f6f6;padding:.5em 1em}}</style>
</head><body><h1>{e(title)}</h1><p>{e(UNITS_NOTE)}</p>
<div class="cols"><div><h2>Phone: plan on {e(phone_name)}</h2>{kv(plan_rows)}</div>
<div><h2>Datacenter: {e(gpu_name)}</h2>{kv(gpu_rows)}</div></div>
<h2>Measured on this host ({e(prof['host']['kind'])}, {e(prof['runtime'])})</h2>
<p class="note">{e(BASIS_NOTE)}</p>{prof_html}
<div class="cols"><div>{img('memory')}</div><div>{img('speed')}</div></div>
<h2>Quality</h2><p>{quality}</p>{img('quality')}
</body></html>
"""
