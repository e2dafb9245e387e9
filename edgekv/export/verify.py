"""Stage 4, verify: the artifact in its runtime against the eager torch module, over a prefill and N decode steps
with the state fed back on both sides, making the same calls (same chunks, same padding).

Decode is teacher-forced by the reference (both sides get the reference's greedy token), so one near-tie cannot make
the two sequences diverge and hide or invent differences after it. Reported: max |logit difference| over every
compared position, the logit scale (max |reference logit|), top-1 agreement, and the max difference of the final
state. The parity check is what catches silent miscompilation (stack.md: a torchao int8 lowering gave errors of 1e3
with no error raised).
"""
from __future__ import annotations

import statistics
import time

import numpy as np

# relative to the logit scale; fp16 caches round K/V to fp16 on both sides, and a 1-ulp flip between two runtimes'
# fp32 arithmetic moves a value by ~5e-4 relative, which is why they get more room than fp32.
# quantized caches (int8 codes; uint8 = packed int4/int2): artifact and eager quantize the same values, but a
# last-bit difference in a runtime kernel can move a value across a rounding boundary: one quantization step
# int8 codes: on a 30-layer real model a last-bit difference upstream moves K/V codes by a few steps by the last
# layers, which is why int8 gets 2e-2, not one step's 1e-2
# packed int4/int2 codes: one step is 1/15 (1/3) of a group's range, and on a real model a group's range is set by
# an outlier channel, so a flipped code is a large move that the later layers carry on. A wrong unpack or scale gives
# errors of the order of the logit scale, far outside 1e-1. (The measurements behind each limit: docs/export.md#verification-limits.)
# An fp32-weights ONNX export with a quantized cache is also held to the eager module's own noise floor (one ulp
# away, measured in the same export: `nudged` below, limits below): on SmolLM2 kv-int4 that floor alone
# reaches past 1e-1 (benchmarks/results/arm64_vs_x86_smollm2_kv_int4_floor.json).
REL_TOL = {"float32": 1e-4, "float16": 2e-3, "int8": 2e-2, "uint8": 1e-1,
           # a .pte with torchao-quantized weights against the same quantized eager module: both quantize the
           # activations dynamically per token, and a one-step difference in a rounded activation moves a logit
           # by about one weight step, which every later layer carries on. How far
           # a model's own rounding noise reaches depends on the model and the host's kernels, so the .pte is also
           # held to a noise floor measured in the same export (noise_floor, FLOOR_FACTOR). A lowering bug moves logits
           # by the order of their scale; how far the quantized model is from fp32 is verify-quant's job (wquant:
           # top-1 and KL over real text)
           "quantized-weights": 1.5e-1,
           # an ONNX kv graph with a fp16 cache attends through ORT's GroupQueryAttention, which takes q, k, v in
           # the cache dtype and returns its output in it too: q and the attention output are rounded to fp16 as
           # well as K/V (eager keeps them fp32)
           "float16-attention": 5e-3}
MIN_TOP1 = {"uint8": 0.9, "quantized-weights": 0.9}  # by tolerance dtype; 0.95 for the others (near-tie flips)


def min_top1(cache_dtype: str) -> float:
    return MIN_TOP1.get(cache_dtype, 0.95)


# A quantized-weights .pte is compared with the quantized eager module, and both quantize their activations per
# token at run time: a last-bit difference upstream moves a rounded activation by a step, and a chaotic model carries
# that on. How far is measured in the same export: the eager module against a copy of itself one ulp away
# (nudge_one_ulp), over the same prompt and steps. Where that noise reaches further than the fixed limits, the
# artifact may differ by up to FLOOR_FACTOR x the floor's max difference, and disagree on top-1 up to FLOOR_FACTOR x
# as often as the floor does, plus one position (a count of a few near-ties over some 34-50 positions is itself
# noisy). A layer's weight rows laid out in reverse is still refused (tests/test_wquant.py); the measurements: docs/export.md#verification-limits.
FLOOR_FACTOR = 2.0


def near_ties(art, ref, floor_diff) -> np.ndarray:
    """Per row: the artifact's top-1 differs from the reference's, and the reference's own margin between its top-1
    and the artifact's pick is smaller than what the floor (the reference one ulp away) moves a logit at that row
    (floor_diff: max |noise - ref| per row). Such a flip is a near tie that the module's own last-bit noise can
    already make, not a wrong lowering; the margin is taken to the artifact's pick, so a flip to a token further down
    the reference's ranking than its top-2 needs a larger noise to count as a tie."""
    art, ref = np.atleast_2d(art), np.atleast_2d(ref)
    a, t = art.argmax(-1), ref.argmax(-1)
    rows = np.arange(len(ref))
    margin = ref[rows, t] - ref[rows, a]
    return (a != t) & (margin < np.broadcast_to(np.asarray(floor_diff, dtype=np.float64), margin.shape))


def nudge_one_ulp(module, up: bool = True) -> None:
    """Move every plain floating-point parameter of module one ulp up (or down), in place (norms, the embedding table; not a
    quantized linear's weight, a tensor subclass whose codes stay as they are): what another kernel's last bit does
    upstream of the dynamically quantized activations. Nudging the fp32 weights before quantizing instead moves
    codes that sit on a rounding boundary (SmolLM2's come from a Q4_1 GGUF) by a whole step: a different model
    rather than noise."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            if type(p.data) is torch.Tensor and p.is_floating_point():
                p.copy_(torch.nextafter(p, torch.full_like(p, torch.inf if up else -torch.inf)))


def tolerance_dtype(layout, fused_attention: bool = False) -> str:
    """The REL_TOL key that sets the tolerance: the coarsest one the layout stores (a KV cache's is its storage's
    tolerance, edgekv.strategies.storage; any other state its dtype's: a hybrid's fp16 KV next to its fp32 SSM
    state, an int8 SSM state next to its fp32 conv state and scales), since its rounding bounds the agreement of the
    whole step; a fp16 cache read by a fused attention op that computes in fp16 (the ONNX graph's
    GroupQueryAttention) is "float16-attention"."""
    from ..strategies import kv_storage_of

    st = kv_storage_of(layout)  # a KV cache's tensors take its storage's tolerance, the others their dtype's
    keys = [st.tolerance if st and t.role.split(".")[0] in ("key", "value") else t.dtype for t in layout.tensors]
    dtype = max(keys, key=lambda d: REL_TOL[d])
    return "float16-attention" if fused_attention and dtype == "float16" else dtype


def limits(cache_dtype: str, floor: dict | None, positions: int) -> tuple[float, float]:
    """(max |diff| over the logit scale, min top-1 agreement): the fixed ones, widened to a noise floor where it
    reaches further (FLOOR_FACTOR; positions: how many the artifact is compared over)."""
    rel, need = REL_TOL[cache_dtype], min_top1(cache_dtype)
    if floor:
        rel = max(rel, FLOOR_FACTOR * floor["max_abs_diff"] / max(floor["logit_scale"], 1.0))
        need = min(need, 1.0 - FLOOR_FACTOR * (1.0 - floor["top1_agreement"]) - 1.0 / positions)
    return rel, need


def verify(artifact, reference, prompt: list[int], steps: int, cache_dtype: str, runtime: str,
           noise=None, last_rows: bool = False) -> dict:
    """noise: a stepper of the reference one ulp away (nudge_one_ulp), compared with the reference in the same pass
    (the reference runs once); where its noise reaches further than the fixed limits, they widen to it (limits).
    last_rows: the artifact returns one row of logits a call (GenAI, the ExecuTorch runner .pte: the last; edgekv's .pte
    forward: the one asked for), so its prefill
    above ran one token per call to give every row; the prompt is then prefilled again from a fresh state in the
    calls its runtime makes (chunks), and that last row is compared too."""
    t0 = time.perf_counter()
    sides = [artifact] + ([noise] if noise is not None else [])
    diffs, agree = [[] for _ in sides], [[] for _ in sides]
    ties = []  # per compared position: the artifact's top-1 flip is a near tie (near_ties; only with a floor)

    def compare(outs, r):
        for i, a in enumerate(outs):
            diffs[i].append(float(np.abs(a - r).max()))
            agree[i] += list(a.argmax(-1) == r.argmax(-1))
        if len(outs) > 1:
            ties.extend(near_ties(outs[0], r, np.abs(np.atleast_2d(outs[1]) - np.atleast_2d(r)).max(-1)))

    outs, r = [s.prefill(prompt) for s in sides], reference.prefill(prompt)
    compare(outs, r)
    scale = float(np.abs(r).max())
    pos, times = len(prompt), []
    from ..progress import work
    for k in range(steps):
        work(k, steps)  # the stage's own work, for its estimate of the time left
        nxt = int(r[-1].argmax())
        t = time.perf_counter()
        a = artifact.step([nxt], pos)
        times.append(time.perf_counter() - t)
        outs = [a] + [s.step([nxt], pos) for s in sides[1:]]
        r = reference.step([nxt], pos)
        compare(outs, r)
        scale = max(scale, float(np.abs(r).max()))
        pos += 1
    from .runtime import state_as_numpy
    # a runtime that keeps the state to itself (GenAI's Generator, the ExecuTorch runner .pte's buffers): not compared
    # a graph whose sliding layers keep GroupQueryAttention's window order (manifest sliding_window_cache) holds
    # those rows elsewhere than the eager ring: only the state tensors of a full context are compared there
    pairs = [] if getattr(artifact, "state", None) is None else \
        list(zip(state_as_numpy(artifact), state_as_numpy(reference)))
    if getattr(artifact, "window_order", False):
        pairs = [p for p, t in zip(pairs, artifact.state_specs)
                 if t["role"] not in ("key", "value") or t["shape"][2] == artifact.max_ctx]
    sdiff = max((float(np.abs(x.astype(np.float32) - y.astype(np.float32)).max()) for x, y in pairs), default=None)
    if last_rows:
        for s in [*sides, reference]:
            s.reset()
        outs = [s.prefill(prompt, last=True) for s in sides]
        compare(outs, reference.prefill(prompt, last=True))
    floor = ({"max_abs_diff": max(diffs[1]), "logit_scale": scale, "top1_agreement": float(np.mean(agree[1]))}
             if noise is not None else None)
    rel, need = limits(cache_dtype, floor, len(agree[0]))
    top1 = float(np.mean(agree[0]))
    # the top-1 limit counts clear disagreements only: a flip inside the floor's own movement at that position is a
    # near tie (near_ties), which over a short prompt (34 positions at --verify-steps 0) decided the limit by chance
    n_ties = int(np.sum(ties))
    clear = (int(np.sum(agree[0])) + n_ties) / len(agree[0])
    out = {"runtime": runtime, "prompt_tokens": len(prompt), "decode_steps": steps,
           "positions_compared": len(agree[0]), "max_abs_diff": max(diffs[0]), "logit_scale": scale,
           "top1_agreement": top1, **({"state_max_abs_diff": sdiff} if sdiff is not None else {}),
           **({"top1_near_ties": n_ties, "top1_agreement_clear": clear} if floor else {}),
           "tolerance": {"max_abs_diff_over_logit_scale": rel, "min_top1_agreement": need},
           # logits all zero on both sides compare nothing (an embedding row of zeros fed throughout): not a pass
           "passed": bool(max(diffs[0]) <= rel * max(scale, 1.0) and clear >= need and scale > 0),
           "seconds": round(time.perf_counter() - t0, 3)}
    if floor:
        out["noise_floor"] = floor
    if times:
        out["decode_ms_median"] = round(1e3 * statistics.median(times), 3)
    return out


class Replay:
    """A reference stepper's outputs, computed ahead by record() and given back in the order verify() asks for them
    (prefill, the decode steps, the state, and with last_rows a reset and the last-row prefill): the eager module can
    be freed before the artifact's runtime loads. The reference is teacher-forced by its own greedy token, so its
    calls do not depend on the artifact's answers, and the logits are those of the same calls made interleaved."""

    def __init__(self, outputs: list, state: list | None):
        self._outputs, self.state = list(outputs), state

    def _next(self):
        return self._outputs.pop(0)

    def prefill(self, tokens, pos: int = 0, last: bool = False):
        return self._next()

    def step(self, tokens, pos: int, last: bool = False):
        return self._next()

    def reset(self):
        pass


def record(reference, prompt: list[int], steps: int, noise=None, last_rows: bool = False) -> tuple:
    """The calls verify() makes of the reference (and of the noise floor's stepper, fed the reference's tokens), run
    now -> (Replay of the reference with its final state, Replay of the noise side or None)."""
    from .runtime import state_as_numpy
    sides = [reference] + ([noise] if noise is not None else [])
    outs = [[s.prefill(prompt)] for s in sides]
    pos = len(prompt)
    for _ in range(steps):
        nxt = int(outs[0][-1][-1].argmax())
        for s, o in zip(sides, outs):
            o.append(s.step([nxt], pos))
        pos += 1
    state = None
    if getattr(reference, "state", None) is not None:  # copied where a reset follows (the steppers' own arrays)
        state = [np.array(a) for a in state_as_numpy(reference)] if last_rows else state_as_numpy(reference)
    if last_rows:
        for s, o in zip(sides, outs):
            s.reset()
            o.append(s.prefill(prompt, last=True))
    return Replay(outs[0], state), (Replay(outs[1], None) if noise is not None else None)


def describe(v: dict) -> str:
    return (f"{v['runtime']}: max |diff| {v['max_abs_diff']:.2e} (logit scale {v['logit_scale']:.1f}), "
            f"top-1 {v['top1_agreement']:.1%} over {v['positions_compared']} positions"
            + (f", state |diff| {v['state_max_abs_diff']:.2e}" if "state_max_abs_diff" in v else "")
            + (f" ({v['top1_near_ties']} of the flips near ties inside the floor's own movement, not counted)"
               if v.get("top1_near_ties") else "")
            + (f"; limits {v['tolerance']['max_abs_diff_over_logit_scale']:.2e} of the scale, top-1 "
               f"{v['tolerance']['min_top1_agreement']:.0%} (eager against itself one ulp away: max |diff| "
               f"{v['noise_floor']['max_abs_diff']:.2e}, top-1 {v['noise_floor']['top1_agreement']:.1%})"
               if "noise_floor" in v else ""))


def nudged(module):
    """A copy of the eager module with its float parameters moved one ulp (nudge_one_ulp): another kernel's
    last bits, for the noise floor of a quantized cache, whose codes flip where a value sits on a rounding boundary."""
    import copy

    m = copy.deepcopy(module)
    nudge_one_ulp(m)
    return m


def nudged_copy(qmodule):
    """nudged_quantized of a module already quantized (the same codes: the recipe is deterministic), without the fp32
    module: a copy sharing its quantized weights (tensor subclasses and integer tensors, which nudge_one_ulp leaves
    as they are) and copying its plain floating-point tensors, nudged."""
    import copy

    import torch
    memo = {id(t): t for t in (*qmodule.parameters(), *qmodule.buffers())
            if not (type(t.data) is torch.Tensor and t.is_floating_point())}
    m = copy.deepcopy(qmodule, memo)
    nudge_one_ulp(m)
    return m


def nudged_quantized(module, weights: str):
    """A copy of the fp32 eager module quantized as the .pte's module is, then its float parameters moved one ulp
    (nudge_one_ulp): the same codes, last bits upstream of the quantized activations different."""
    import copy

    from .wquant import quantize_module
    m = copy.deepcopy(module)
    quantize_module(m, weights)
    nudge_one_ulp(m)
    return m
