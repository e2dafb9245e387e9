"""Quality risk per strategy and precision: edgekv's own measurements where they exist (edgekv analyze writes them to
edgekv/measurements/), otherwise published results with their citation (../shared/research/anchors.md, section 4).
Never blank, never invented: where nothing is published the risk is 'unknown' and the evidence says so.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .strategies import Strategy

RISK_ORDER = {"none": 0, "low": 1, "medium": 2, "unknown": 3, "high": 4}
MEASURED_DIR = Path(__file__).resolve().parent / "measurements"

# (risk, evidence). Citations as in anchors.md section 4 / section 3.
PUBLISHED = {
    "kv:fp32": ("none", "reference precision"),
    "kv:fp16": ("none", "the precision models are trained and served in"),
    "kv:bf16": ("none", "the precision models are trained and served in"),
    "kv:fp8": ("low", "8-bit KV: llama.cpp PR #7412, q8_0 K/V dPPL 0.0049, KLD 0.00155 (f16 KLD 0.00019)"),
    "kv-int8": ("low", "8-bit KV: llama.cpp PR #7412, q8_0 K/V dPPL 0.0049, KLD 0.00155 (f16 KLD 0.00019)"),
    "kv-int4": ("medium", "4-bit KV: KVQuant (arXiv 2401.18079) <0.1 PPL at 3-bit needs per-channel pre-RoPE keys; "
                          "plain q4_0 KV 'destroys output quality' (lmstudio-bug-tracker #1740)"),
    "kv-int4:long": ("high", "int4 KV tool-call failures past ~40k tokens (minimal-ai #18); KV quantization errors "
                             "matter more with context length (ik_llama.cpp PR #1547)"),
    "kv-int2": ("high", "2-bit KV only works with KIVI's scheme (ICML'24: per-channel keys, per-token values, recent "
                        "tokens in full precision); uniform per-token 2-bit has no published support"),
    "window:short": ("none", "the whole context fits in the window: nothing is dropped"),
    "window": ("high", "tokens older than the window are dropped: exact recall of them is impossible by construction "
                       "(ExecuTorch keeps sink tokens for stability, export_llama --use_attention_sink)"),
    "mla:native": ("low", "the model was trained with its latent cache (DeepSeek-V2: -93.3% KV vs DeepSeek 67B)"),
    "mla:converted": ("unknown", "no published result for post-hoc low-rank conversion of a GQA cache without "
                                 "fine-tuning; run edgekv analyze --strategy mla to measure it"),
    "ssm:fp32": ("low", "native state precision; keep A/dt/state in fp32 (state-spaces/mamba #133, llama.cpp PR #5328)"),
    "ssm:fp16": ("medium", "SSM state error compounds through the recurrence (S4D edge study arXiv 2506.12480; "
                           "openai/parameter-golf #1355)"),
    "ssm:int8": ("high", "uniform INT8 SSM state halved GSM8K 81%->41% without error feedback (vLLM #55196); "
                         "per-(head,dim) fp32 scales recover it (vLLM PR #52962: 85.94% vs 85.35% fp32)"),
    "linear:fp32": ("low", "native state precision"),
    "linear:fp16": ("medium", "recurrent state error compounds through the recurrence (S4D edge study arXiv "
                              "2506.12480)"),
    "linear:int8": ("high", "INT8 uniform GDN state GSM8K 81%->41% without error feedback (vLLM #55196)"),
    "hybrid": ("low", "native model: attention KV in fp16, recurrent state in fp32"),
    "ring": ("none", "exact attention: the same numbers, split over devices"),
}


# short citations for tables (the full evidence string goes to --json and --explain)
CITE = {
    "kv:fp32": "reference", "kv:fp16": "reference", "kv:bf16": "reference", "kv:fp8": "llama.cpp #7412",
    "kv-int8": "llama.cpp #7412", "kv-int4": "KVQuant; lmstudio #1740", "kv-int4:long": "minimal-ai #18",
    "kv-int2": "KIVI", "window:short": "fits the window", "window": "drops old tokens",
    "mla:native": "DeepSeek-V2", "mla:converted": "no published result", "ssm:fp32": "mamba #133",
    "ssm:fp16": "S4D arXiv 2506.12480", "ssm:int8": "vLLM #55196, #52962", "linear:fp32": "native",
    "linear:fp16": "S4D arXiv 2506.12480", "linear:int8": "vLLM #55196", "hybrid": "native", "ring": "exact",
}


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


def measured(model: str, strategy: Strategy, family: str | None = None) -> dict | None:
    """A stored edgekv analyze result for this model x strategy x precision, else one stored for the model's family
    (e.g. the trained Mamba fixture for every ssm model), else None."""
    p = measurement_path(model, strategy.label)
    candidates = [p] if p.is_file() else []
    if not candidates and family and MEASURED_DIR.is_dir():
        candidates = sorted(MEASURED_DIR.glob(f"*__{_safe(strategy.label)}.json"))
    for c in candidates:
        try:
            rec = json.loads(c.read_text())
        except (OSError, json.JSONDecodeError):
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
    s, p = strategy.name, strategy.params
    if s == "kv":
        key = f"kv:{p['dtype']}"
    elif s == "kv-int4":
        key = "kv-int4:long" if ctx > 32768 else "kv-int4"
    elif s == "window":
        key = "window:short" if ctx <= p["w"] + p["sinks"] else "window"
    elif s == "mla":
        key = "mla:converted" if converted_mla else "mla:native"
    elif s in ("ssm", "linear"):
        key = f"{s}:{p['dtype']}" if f"{s}:{p['dtype']}" in PUBLISHED else f"{s}:fp16"  # bf16/fp8 as fp16
    else:
        key = s
    risk, ev = PUBLISHED[key]
    return {"risk": risk, "evidence": ev, "source": "published", "cite": CITE[key]}


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
