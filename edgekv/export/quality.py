"""verify-quant: a weight-quantized artifact against the fp32 model, teacher-forced over real text.

The trap (stack.md): torchao IntxWeightOnlyConfig int8 lowered to XNNPACK gives wrong logits with no error raised.
So a quantized artifact is never trusted: compare_to_fp32 runs it against fp32 teacher-forced over real text, and
check_quality rejects it (stage verify-quant) when top-1 agreement or KL divergence is outside THRESHOLDS.
How the weights are quantized: edgekv.export.wquant.
"""
from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from .wquant import trim

# Quality thresholds vs fp32, teacher-forced over quality_text (compare_to_fp32): a margin on KL over what correct
# recipes measure on SmolLM2-135M (int4 is low: its weights come from a Q4_1 GGUF, so requantizing to symmetric int4
# compounds two roundings), tight enough to reject what broken quantizations measure (the XNNPACK weight-only trap,
# ORT quantize_dynamic's per-tensor activations). The measurements: docs/export.md#weight-quantization.
THRESHOLDS = {
    "fp16": {"min_top1": 0.95, "max_kl_mean": 0.02},
    "int8": {"min_top1": 0.90, "max_kl_mean": 0.10},
    "int4": {"min_top1": 0.60, "max_kl_mean": 0.60},
    "int4-mix": {"min_top1": 0.60, "max_kl_mean": 0.60},  # int4's limits: it is never worse than int4
    # the file's own blocks: only the runtime's rounding (int8 activations per block) is left, far inside these
    # limits (the measured KL: benchmarks/README.md, Weights); a carry that misplaces blocks is off by tens of nats
    "gguf": {"min_top1": 0.90, "max_kl_mean": 0.02},
}


def quality_text() -> str:
    """Real English prose about Python on every machine: the docstrings of the standard library's textwrap and
    argparse modules and their classes, read from the source files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for rel in ("textwrap.py", "argparse.py"):
        tree = ast.parse((stdlib / rel).read_text(errors="replace"))
        docs += [ast.get_docstring(n) for n in [tree] + [c for c in tree.body if isinstance(c, ast.ClassDef)]]
    return "\n\n".join(d for d in docs if d)


def quality_tokens(tokenizer, vocab: int, n: int, bos: list[int] = ()) -> list[int]:
    """The first n tokens of quality_text: bytes for byte-level models (vocab 256), else the model's tokenizer
    (a tokenizers.Tokenizer); after `bos` (tokenizer.bos_prefix: the BOS a model that expects one is run with)."""
    text = quality_text()
    if vocab == 256:
        ids = list(text.encode("utf-8"))
    elif tokenizer is None:
        raise EdgekvError("checking quantized weights needs the model's tokenizer to read real text")
    else:
        ids = tokenizer.encode(text).ids
    ids = list(bos) + ids
    if len(ids) < n:
        raise EdgekvError(f"the quality text has {len(ids)} tokens, {n} wanted")
    return ids[:n]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def compare_to_fp32(fp32_stepper, quant_stepper, tokens: list[int], n_prefill: int | None = None) -> dict:
    """Teacher-forced over `tokens` (real text): both steppers prefill tokens[:n_prefill] (default half) and then
    step one token at a time through the rest, so the artifact's prefill and decode paths are both compared.
    Position i's logits predict tokens[i + 1]; over those len(tokens) - 1 positions:
        top1_agreement  fraction where both argmaxes agree
        kl_mean/kl_max  KL(p_fp32 || p_quant) in nats
        nll_fp32/quant  mean negative log-likelihood of the text (nats/token): the quality cost in absolute terms"""
    ref = teacher_forced(fp32_stepper, tokens, n_prefill, side=0)
    return compare_rows(ref, quant_stepper, tokens, n_prefill)


def _split(tokens: list[int], n_prefill: int | None) -> int:
    if len(tokens) < 3:
        raise EdgekvError("compare_to_fp32 needs at least 3 tokens")
    return max(1, min(len(tokens) - 1, n_prefill or len(tokens) // 2))


def teacher_forced(stepper, tokens: list[int], n_prefill: int | None = None, side: int = 0) -> np.ndarray:
    """The stepper's logits [len(tokens) - 1, V] over `tokens`, prefilling tokens[:n_prefill] (default half) and then
    one token at a time (compare_to_fp32's either side; side 0 / 1: the first / second half of the stage's work).
    The fp32 side computed on its own lets an export free the eager module before the artifact's runtime loads."""
    from ..progress import work
    n_prefill = _split(tokens, n_prefill)
    n_steps = len(tokens) - 1 - n_prefill
    stepper.reset()
    got = [stepper.prefill(tokens[:n_prefill])]
    for p, t in enumerate(tokens[n_prefill:-1], start=n_prefill):
        work(side * n_steps + p - n_prefill, 2 * n_steps)  # the stage's own work: its estimate of the time left
        got.append(stepper.step([t], p))
        trim()
    return np.concatenate(got)


def compare_rows(fp32_rows: np.ndarray, quant_stepper, tokens: list[int], n_prefill: int | None = None) -> dict:
    """compare_to_fp32 with the fp32 side's logits already computed (teacher_forced)."""
    n_prefill = _split(tokens, n_prefill)
    rows = teacher_forced(quant_stepper, tokens, n_prefill, side=1)
    target = np.asarray(tokens[1:])
    # per position, ROWS_PER_SLICE positions at a time: the float64 log-probabilities of a whole [positions, V] pair
    # and their products are several times the rows (3 GB at Gemma-3's 262144-token vocabulary over 255 positions)
    kl, agree, nll_p, nll_q, neg_ent, finite = [], [], [], [], [], True
    for a in range(0, len(rows), ROWS_PER_SLICE):
        b = min(len(rows), a + ROWS_PER_SLICE)
        lp, lq = _log_softmax(fp32_rows[a:b]), _log_softmax(rows[a:b])
        finite &= bool(np.isfinite(lq).all())
        p = np.exp(lp)
        kl.append((p * (lp - lq)).sum(-1))
        neg_ent.append((p * lp).sum(-1))
        agree.append(lp.argmax(-1) == lq.argmax(-1))
        at = np.arange(b - a)
        nll_p.append(-lp[at, target[a:b]])
        nll_q.append(-lq[at, target[a:b]])
        del lp, lq, p
    kl = np.concatenate(kl) if finite else np.full(len(rows), np.inf)
    log_v = np.log(rows.shape[-1])
    return {"top1_agreement": float(np.mean(np.concatenate(agree))),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "nll_fp32": float(np.concatenate(nll_p).mean()), "nll_quant": float(np.concatenate(nll_q).mean()),
            "nll_uniform": float(log_v),
            "kl_fp32_uniform": float(np.mean(log_v + np.concatenate(neg_ent))),
            "positions": int(len(target)), "prefill_tokens": n_prefill}


ROWS_PER_SLICE = 16  # positions compared at a time (compare_rows)


def reference_is_noise(result: dict) -> bool:
    """The fp32 model reads the text no better than a uniform guess over its vocabulary: its NLL is at least
    NOISE_NLL of ln V (result["nll_uniform"]). Random weights at a model's published shapes (scripts/
    make_random_model.py) do: their logits are nearly flat, so which token is largest is decided by noise that any
    rounding moves, and top-1 agreement measures nothing. A trained model is far below (SmolLM2-135M about a quarter
    of ln V; the byte-level test model, trained a few minutes, under three quarters of ln 256)."""
    return "nll_uniform" in result and result["nll_fp32"] >= NOISE_NLL * result["nll_uniform"]


NOISE_NLL = 0.9


def limits(result: dict, weights: str) -> dict:
    """The thresholds this result is held to: THRESHOLDS[weights], or where the fp32 reference is noise
    (reference_is_noise) no top-1 limit and a KL limit of at most the reference's own KL from a uniform guess
    (result["kl_fp32_uniform"]): a faithful quantization stays well inside what fp32 says beyond uniform, while
    logits unrelated to fp32's but as far from uniform (a misplaced block) measure about twice it (the random tiny
    test model: 0.06 and 2.0 times it, tests/test_quality_random.py)."""
    t = THRESHOLDS[weights]
    if not reference_is_noise(result):
        return t
    return {"min_top1": None, "max_kl_mean": min(t["max_kl_mean"], result["kl_fp32_uniform"])}


def check_quality(result: dict, weights: str, fmt: str) -> dict:
    """result (compare_to_fp32) -> the same with thresholds and passed; an EdgekvError naming verify-quant when it
    fails. NaN/inf compare as failures. Where the fp32 reference is noise (random weights) top-1 agreement is
    recorded, not held ("top1": "not measured: ..."), and KL is held to limits()."""
    t = limits(result, weights)
    noise = t["min_top1"] is None
    ok = (noise or result["top1_agreement"] >= t["min_top1"]) and result["kl_mean"] <= t["max_kl_mean"]
    out = {**result, "weights": weights, "thresholds": t, "passed": bool(ok)}
    if noise:
        out["top1"] = (f"not measured: random weights (the fp32 model's NLL of the text, {result['nll_fp32']:.2f} "
                       f"nats, is at least {NOISE_NLL:.0%} of a uniform guess's ln V = {result['nll_uniform']:.2f})")
    if not ok:
        needs = (f"KL mean <= {t['max_kl_mean']:.3g}, fp32's own KL from uniform; top-1 not held: random weights"
                 if noise else f"top-1 >= {t['min_top1']:.0%}, KL mean <= {t['max_kl_mean']}")
        raise EdgekvError(f"{weights} weights ({fmt}) failed verify-quant against fp32 over {result['positions']} "
                          f"positions of real text: {describe_quality(out)} (needs {needs})")
    return out


def verify_quant(fp32_stepper, quant_stepper, tokens: list[int], weights: str, fmt: str) -> dict:
    """compare_to_fp32 + check_quality: the record for manifest["verification"][f"{fmt}-quant"]."""
    return check_quality(compare_to_fp32(fp32_stepper, quant_stepper, tokens), weights, fmt)


def describe_quality(v: dict) -> str:
    return (f"top-1 {v['top1_agreement']:.1%}, KL mean {v['kl_mean']:.3g} max {v['kl_max']:.3g} nats, "
            f"NLL {v['nll_quant']:.3f} vs fp32 {v['nll_fp32']:.3f} nats/token"
            + ("; top-1 not held: the fp32 model reads the text no better than chance (random weights)"
               if v.get("top1", "").startswith("not measured") else ""))
