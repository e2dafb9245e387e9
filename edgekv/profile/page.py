"""`edgekv report`: plan, measurement, quality and the datacenter baseline of one export on one page
(HTML with embedded PNGs, or markdown)."""
from __future__ import annotations

import base64
import html
import io
import json
import os
from pathlib import Path

from ..errors import EdgekvError

WEIGHT_PRECISION = {"float32": "fp32", "float16": "fp16", "bfloat16": "fp16", "int8": "int8", "int4": "int4"}
RUNTIME_NAME = {"ort": "onnxruntime", "executorch": "executorch"}


def _arch(manifest: dict):
    from ..arch import catalog_names, catalog_arch, load_arch
    src = manifest["model"]["source"]
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
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _figures(prof: dict, fit: dict | None, measured_ctx: int | None) -> dict[str, str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figs = {}
    runs = [r for r in prof["runs"] if r.get("measured_bytes")]
    if runs:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        x = np.arange(len(runs))
        a.bar(x - 0.2, [r["predicted_bytes"] / 1e6 for r in runs], 0.4, label="predicted (planner)")
        a.bar(x + 0.2, [r["measured_bytes"] / 1e6 for r in runs], 0.4, label="measured (peak - runtime baseline)")
        a.set_xticks(x, [str(r["ctx"]) for r in runs])
        a.set_xlabel("ctx")
        a.set_ylabel("MB (1e6 B)")
        a.legend(fontsize=8)
        a.set_title("memory")
        b.bar(x - 0.2, [r.get("tokens_per_s") or 0 for r in runs], 0.4, label="measured decode tok/s")
        b.bar(x + 0.2, [r.get("roofline_tokens_per_s") or 0 for r in runs], 0.4, label="bandwidth roofline")
        b.set_xticks(x, [str(r["ctx"]) for r in runs])
        b.set_xlabel("ctx")
        b.set_yscale("log")
        b.legend(fontsize=8)
        b.set_title("decode speed")
        fig.tight_layout()
        figs["profile"] = _png(fig)
    if fit:
        p = fit["params"]
        t = np.geomspace(1, max(measured_ctx or 1, 1) * 16, 200)
        y = p["a"] * t ** p["b"] if fit["law"] == "power" else p["a"] * np.exp(np.minimum(p["k"] * t, 700))
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(t, y, label=f"{fit['law']} law ({fit['class']})")
        if measured_ctx:
            ax.axvline(measured_ctx, color="grey", ls=":", label="end of measurement")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("position")
        ax.set_ylabel("KL vs fp32 (nats/token)")
        ax.legend(fontsize=8)
        ax.set_title("quality: fitted error growth (edgekv analyze)")
        fig.tight_layout()
        figs["quality"] = _png(fig)
    return figs


def build_report(folder: Path, out: str | None, device_name: str, gpu_name: str, ctx_text: str | None,
                 profile_json: str | None) -> tuple[Path, dict]:
    """Writes the page; returns its path and what it shows, as data (`edgekv report --json`)."""
    from ..devices import load_device
    from ..export.manifest import load_export
    from ..plan import deployment, plan_one, serve
    from ..quality import measured
    from ..strategies import parse_strategy
    from ..units import fmt_bytes, parse_ctx
    from .run import profile as run_profile

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
    if profile_json:
        prof = json.loads(Path(profile_json).read_text())
    else:
        mc = int(manifest["max_ctx"])
        steps = max(1, min(16, mc // 4))
        ctxs = sorted({min(256, mc), mc}) if mc > steps + 1 else [mc]
        prof = run_profile(str(folder), [c for c in ctxs if c > steps], steps, None, None, None)
    meas = measured(arch.name, strategy, arch.family)
    figs = _figures(prof, meas["fit"] if meas else None, meas["measured_ctx"] if meas else None)
    b = row.deployment.bytes
    plan_rows = [("model", arch.name), ("strategy", strategy.label), ("context", f"{ctx:,} tokens"),
                 ("weights", f"{weights}: {fmt_bytes(b['weights'])}"), ("state", fmt_bytes(b["state"])),
                 ("workspace", fmt_bytes(b["workspace"])), ("runtime overhead", fmt_bytes(b["runtime"])),
                 ("total", fmt_bytes(b["total"])), (f"{phone.name} app budget", fmt_bytes(row.budget)),
                 ("fits", "yes" if row.fits else "no"), ("decode", f"{row.decode.value:.1f} tok/s"),
                 ("prefill of the whole context", f"{row.prefill.value:.1f} s"),
                 ("quality risk", f"{row.quality['risk']} ({row.quality['source']}: {row.quality['evidence']})")]
    gpu_rows = [("per-user state", fmt_bytes(base.state_bytes_per_user)), ("users per GPU", str(int(base.users.value))),
                ("decode per user", f"{base.tok_s_per_user:.1f} tok/s"),
                ("$ per million tokens", "no user fits" if base.usd.value == float("inf") else f"${base.usd.value:.2f}"),
                ("assumptions", base.assumptions)]
    prof_rows = [(str(r["ctx"]), fmt_bytes(r["predicted_bytes"], "MB", 1),
                  fmt_bytes(r["measured_bytes"], "MB", 1) if r.get("measured_bytes") else "-",
                  f"{r['error_pct']:+.1f}%" if r.get("error_pct") is not None else "-",
                  f"{r['tokens_per_s']:.1f}" if r.get("tokens_per_s") else "-",
                  f"{r['roofline_tokens_per_s']:.1f}" if r.get("roofline_tokens_per_s") else "-",
                  "yes" if r["fits"] else "no") for r in prof["runs"]]
    title = f"edgekv report — {arch.name}, {strategy.label}"
    target = Path(out) if out else folder / "report.html"
    if target.suffix.lower() == ".md":
        text = _markdown(title, plan_rows, prof, prof_rows, gpu_name, gpu_rows, meas, phone.name)
    else:
        text = _html(title, plan_rows, prof, prof_rows, gpu.name, gpu_rows, meas, figs, phone.name)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
    data = {"out": str(target), "artifact": str(folder), "model": arch.name, "strategy": strategy.label, "ctx": ctx,
            "plan": {"device": phone.name, **row.to_json()}, "profile": prof, "analyzer": meas,
            "baseline": {"gpu": gpu.name, **base.to_json(), "assumptions": base.assumptions}}
    return target, data


PROFILE_COLS = ("ctx", "predicted", "measured", "error", "tok/s", "roofline tok/s", "fits")


def _markdown(title, plan_rows, prof, prof_rows, gpu_name, gpu_rows, meas, phone_name) -> str:
    md = [f"# {title}", "", f"## Plan on {phone_name}", "", "| | |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in plan_rows]
    md += ["", f"## Measured on this host ({prof['host']['kind']}, {prof['runtime']})", "",
           "| " + " | ".join(PROFILE_COLS) + " |", "|" + "---|" * len(PROFILE_COLS)]
    md += ["| " + " | ".join(r) + " |" for r in prof_rows]
    md += ["", "## Quality", "", meas["evidence"] if meas else "no edgekv analyze measurement stored for this model "
           "and strategy; the plan cites published results", "", f"## Datacenter baseline ({gpu_name})", "",
           "| | |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in gpu_rows]
    return "\n".join(md) + "\n"


def _html(title, plan_rows, prof, prof_rows, gpu_name, gpu_rows, meas, figs, phone_name) -> str:
    e = html.escape

    def kv(rows):
        return "<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows) + "</table>"

    prof_html = ("<table><tr>" + "".join(f"<th>{c}</th>" for c in PROFILE_COLS) + "</tr>"
                 + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in prof_rows) + "</table>")
    img = lambda k: f'<img src="data:image/png;base64,{figs[k]}">' if k in figs else ""
    quality = e(meas["evidence"]) if meas else ("no edgekv analyze measurement stored for this model and strategy; "
                                                "the plan cites published results")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{e(title)}</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}} table{{border-collapse:collapse;margin:1em 0}}
th,td{{border:1px solid #ccc;padding:4px 8px;text-align:left}} .cols{{display:flex;gap:2em}} .cols>div{{flex:1}}</style>
</head><body><h1>{e(title)}</h1><p>GB = 1e9 bytes, MB = 1e6 bytes.</p>
<div class="cols"><div><h2>Phone: plan on {e(phone_name)}</h2>{kv(plan_rows)}</div>
<div><h2>Datacenter: {e(gpu_name)}</h2>{kv(gpu_rows)}</div></div>
<h2>Measured on this host ({e(prof['host']['kind'])}, {e(prof['runtime'])})</h2>{prof_html}{img('profile')}
<h2>Quality</h2><p>{quality}</p>{img('quality')}
</body></html>
"""
