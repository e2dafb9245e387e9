"""Quality risk per strategy and precision: edgekv's own measurements where they exist (edgekv analyze writes them to
edgekv/measurements/), otherwise published results with their citation (each strategy's `evidence`, which names the paper).
Never blank, never invented: where nothing is published the risk is 'unknown' and the evidence says so.
"""
from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path

from .jsonfile import STABLE_S, parsed
from .strategies import REGISTRY, Strategy

RISK_ORDER = {"none": 0, "low": 1, "medium": 2, "unknown": 3, "high": 4}
MEASURED_DIR = Path(__file__).resolve().parent / "measurements"

# (risk, evidence) and the short citation for tables (the full evidence string goes to --json and --explain), per
# evidence key: each strategy class holds its own (edgekv.strategies, `evidence`; citations as in anchors.md sections
# 3 and 4); these are the tables gathered from the registry.
PUBLISHED = {k: (r, e) for c in REGISTRY.values() for k, (r, e, _) in c.evidence.items()}
CITE = {k: c for cls in REGISTRY.values() for k, (_, _, c) in cls.evidence.items()}


def risk_from_kl(kl: float, cls: str) -> str:
    """KL (nats/token) of the variant against the fp32 reference: < 0.01 low, < 0.1 medium, else high; compounding
    growth is high whatever its level. (For scale: llama.cpp PR #7412 measures q8_0 KV at KLD 0.00155.)"""
    if cls == "compounding" or not math.isfinite(kl):
        return "high"
    return "low" if kl < 0.01 else "medium" if kl < 0.1 else "high"


def kl_at(fit: dict, ctx: int) -> float:
    """The stored growth law evaluated at ctx."""
    p = fit["params"]
    if fit["law"] == "power":
        return p["a"] * ctx ** p["b"]
    x = p["k"] * ctx
    return p["a"] * math.exp(x) if x < 700 else math.inf


def measurement_path(model: str, label: str, folder: Path | None = None) -> Path:
    """Where edgekv analyze stores one model x strategy x precision: <model>__<label, ':'/',' -> '_', '=' -> '-'>.json"""
    return (folder or MEASURED_DIR) / f"{model}__{_safe(label)}.json"


def _safe(label: str) -> str:
    return label.replace(":", "_").replace(",", "_").replace("=", "-")


def _listing(folder: Path) -> tuple[str, ...]:
    """The file names in folder, sorted, hidden ones left out as glob leaves them (none when it is not a folder):
    listed once while the folder's modification time stays the same, as a plan asks for every row. A folder changed
    in the last STABLE_S seconds is listed afresh each time (a file added within the clock tick of a listing does
    not change the folder's time)."""
    try:
        mtime = folder.stat().st_mtime_ns
        if time.time_ns() - mtime < STABLE_S * 1e9:
            return _names.__wrapped__(str(folder), mtime)
        return _names(str(folder), mtime)
    except OSError:
        return ()


@functools.lru_cache(maxsize=16)
def _names(folder: str, mtime_ns: int) -> tuple[str, ...]:
    return tuple(sorted(n for n in os.listdir(folder) if not n.startswith(".")))


def measured(model: str, strategy: Strategy, family: str | None = None) -> dict | None:
    """A stored edgekv analyze result for this model x strategy x precision, else one stored for the model's family
    (e.g. the trained Mamba fixture for every ssm model), else None."""
    p = measurement_path(model, strategy.label)
    names = _listing(MEASURED_DIR)
    candidates = [p] if p.name in names and p.is_file() else []
    if not candidates and family:
        suffix = f"__{_safe(strategy.label)}.json"
        candidates = [MEASURED_DIR / n for n in names if n.endswith(suffix)]
    for c in candidates:
        try:
            rec = parsed(c)  # shared, read-only
        except (OSError, ValueError):
            continue
        if c == p or rec.get("applies_to") == f"family:{family}":
            return rec
    return None


def quality(model: str, strategy: Strategy, ctx: int, native: bool, converted_mla: bool = False,
            family: str | None = None) -> dict:
    """{'risk', 'evidence', 'source', 'cite'} where source is 'measured' (edgekv analyze) or 'published'."""
    m = measured(model, strategy, family)
    if m and m.get("fit"):
        kl = kl_at(m["fit"], ctx)
        far = ctx > 4 * m["measured_ctx"]
        who = "this model" if m.get("applies_to") == f"model:{model}" else f"a trained {family} fixture"
        return {"risk": risk_from_kl(kl, m["fit"]["class"]), "source": "measured", "cite": "edgekv analyze",
                "evidence": f"{m['evidence']}; measured on {who}; extrapolated KL at {ctx} tokens = {kl:.3g}"
                            + (f" ({ctx / m['measured_ctx']:.0f}x beyond the measured {m['measured_ctx']})"
                               if far else "")}
    risk, ev, cite = strategy.evidence[strategy.quality_key(ctx, converted_mla)]
    return {"risk": risk, "evidence": ev, "source": "published", "cite": cite}


def past_trained(q: dict, model: str, strategy: Strategy, ctx: int, trained: tuple[int, str] | None,
                 family: str | None) -> dict:
    """The strategy's risk combined with the context's: past the length the model was trained at the risk is high
    (with that evidence) unless a stored edgekv analyze measurement of this very model reached ctx; where the trained
    length is unknown (a bare recurrent config) the risk is at least 'unknown', never none or low. q is quality()'s
    answer; the worse of the two is kept."""
    if trained is None:
        if RISK_ORDER[q["risk"]] < RISK_ORDER["unknown"]:
            return {**q, "risk": "unknown", "cite": "trained length unknown",
                    "evidence": f"the config names no trained context length, so nothing is known about {ctx:,} "
                                f"tokens; {q['evidence']}"}
        return q
    t, src = trained
    if ctx <= t:
        return q
    m = measured(model, strategy, family)
    if m and m.get("applies_to") == f"model:{model}" and m.get("measured_ctx", 0) >= ctx:
        return q
    return {**q, "risk": "high", "source": "published", "cite": f"past trained {_k(t)}",
            "evidence": f"ctx {ctx:,} is past the {t:,} tokens the model was trained at ({src}); no edgekv analyze "
                        f"measurement of {model} reaches {ctx:,} tokens; the strategy alone: {q['risk']} "
                        f"({q['evidence']})"}


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def weights_path(model: str, precision: str, folder: Path | None = None) -> Path:
    """Where the measured cost of a model's quantized weights is stored: <model>__weights-<precision>.json, one entry
    per artifact format under "formats" (top1, kl_mean, positions, recipe, source): what edgekv export's
    verify-quant measured against the fp32 model."""
    return (folder or MEASURED_DIR) / f"{model}__weights-{precision}.json"


def weights_cost(model: str, precision: str, fmt: str | None, folder: Path | None = None) -> dict | None:
    """The stored verify-quant measurement of this model's weights at this precision: the artifact format's own
    where stored, else another format's (its "format" says which: the nearest evidence there is for the same
    precision, e.g. for llama.cpp, whose planner layout for int4 is edgekv's); None when nothing is stored or
    readable."""
    p = weights_path(model, precision, folder)
    if not p.is_file():
        return None
    try:
        formats = parsed(p).get("formats") or {}
    except (OSError, ValueError, AttributeError):
        return None
    order = ([fmt] if fmt in formats else []) + sorted(k for k in formats if k != fmt)
    for f in order:
        m = formats[f]
        if isinstance(m, dict) and isinstance(m.get("kl_mean"), (int, float)) and isinstance(m.get("top1"),
                                                                                            (int, float)):
            return {**m, "format": f, "own_format": f == fmt, "file": f"edgekv/measurements/{p.name}"}
    return None


VERIFY_QUANT = "edgekv export's verify-quant"  # who measured a stored weights cost that names no measured_by


def with_weights(q: dict, model: str, precision: str, fmt: str | None, folder: Path | None = None) -> dict:
    """q (the state's risk at ctx) with the weights' measured cost beside it: the weights' KL against fp32 on the
    same scale as a cache's (risk_from_kl), the worse of the two kept, and the evidence and short cite saying what
    was measured. Unchanged where no measurement of these weights is stored (fp32/fp16 weights have none)."""
    m = weights_cost(model, precision, fmt, folder)
    if m is None:
        return q
    risk = risk_from_kl(float(m["kl_mean"]), "bounded")
    where = f"edgekv's {m['format']} export" + ("" if m["own_format"] else " (the format measured, not this plan's)")
    verb = "carries" if precision == "gguf" else "quantizes"  # gguf: the file's own blocks, not quantized again
    how = (f"{precision} weights, as {where} {verb} them ({m.get('recipe', '')}): top-1 {m['top1']:.1%}, KL mean "
           f"{m['kl_mean']:.3g} nats against the fp32 model over {m.get('positions')} positions of real text "
           f"({m.get('measured_by', VERIFY_QUANT)}; {m.get('source', m['file'])}) -> {risk}")
    weights = {"precision": precision, "format": m["format"], "top1": m["top1"], "kl_mean": m["kl_mean"],
               "risk": risk, "file": m["file"]}
    if RISK_ORDER[risk] > RISK_ORDER[q["risk"]]:  # the weights set the label: the short cite is theirs, the evidence
        return {**q, "risk": risk, "source": "measured", "weights": weights,  # leads with them, the state after
                "cite": f"{precision} weights: KL {m['kl_mean']:.2g}, top-1 {m['top1']:.0%}, measured",
                "evidence": f"{how}; the state alone: {q['risk']} ({q['cite']}: {q['evidence']})"}
    return {**q, "evidence": f"{q['evidence']}; {how}", "weights": weights}
