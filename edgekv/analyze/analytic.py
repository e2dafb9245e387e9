"""The analytic view of a quantized recurrent state (Mamba-1 / Mamba-2), from the real weights and the step sizes
the text produces.

Each step the SSM state is h_t = a_t * h_{t-1} + u_t with a per-element decay a_t = exp(dt_t * A) in (0, 1)
(Mamba-1: per channel and state dim; Mamba-2: per head). Storing h_t in int8 adds a rounding error e_t of at most
half a step Delta_t = amax(row of h_t) / 127. Because the recurrence is linear in h, the error a stored state carries
obeys the same recurrence:  E_t = a_t * E_{t-1} + e_t.
  independent rounding errors (stochastic rounding; nearest on a fast-moving state):
      Var E_t = a_t^2 Var E_{t-1} + Delta_t^2 / 12   -> saturates at Delta^2 / (12 (1 - a^2))
  coherent errors (nearest rounding on a slowly moving state: the same error every step):
      |E_t| <= a_t |E_{t-1}| + Delta_t / 2           -> gain 1 / (1 - a) over one step's error
The time to saturate is about 1 / (1 - a) steps. The prediction ignores what the error does downstream (through
the output projection into later layers), which the measurement includes; the difference is reported.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

BITS_THRESHOLD = 0.01  # relative state error a layer may reach at the target context


def _decays(module, tokens: torch.Tensor):
    """Per layer: (a [T, rows, N] or [T, H], h [T, ...] the reference state after each step), by stepping the fp32
    module one token at a time and recomputing dt from the mixer's own weights."""
    from ..models.layers import causal_conv_step
    from ..models.ssm import Mamba1Mixer

    blocks = module.backbone.layers
    state = module.empty_state()
    per_layer_a = [[] for _ in blocks]
    per_layer_h = [[] for _ in blocks]
    inputs = {}
    hooks = [b.mixer.register_forward_hook(lambda m, i, o, k=j: inputs.__setitem__(k, i[0].detach()))
             for j, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            for t in range(tokens.shape[1]):
                prev = list(state)
                _, *state = module(tokens[:, t:t + 1], torch.tensor([t]), *state)
                for j, b in enumerate(blocks):
                    m, x = b.mixer, inputs[j]
                    if isinstance(m, Mamba1Mixer):
                        xs, _ = m.in_proj(x).transpose(1, 2).chunk(2, dim=1)
                        xs, _ = causal_conv_step(xs, prev[2 * j], m.conv1d.weight[:, 0], m.conv1d.bias)
                        dt = m.x_proj(F.silu(xs).transpose(1, 2))[..., :m.dt_rank]
                        if m.norms:
                            dt = m.dt_layernorm(dt)
                        dt = F.softplus(dt @ m.dt_proj.weight.t() + m.dt_proj.bias)[0, 0]  # [Di]
                        a = torch.exp(dt[:, None] * -torch.exp(m.A_log.float()))  # [Di, N]
                    else:
                        dt_raw = m.in_proj(x)[0, 0, -m.h:]
                        dt = F.softplus(dt_raw + m.dt_bias)
                        a = torch.exp(dt * -torch.exp(m.A_log.float()))  # [H]
                    per_layer_a[j].append(a.numpy().copy())
                    per_layer_h[j].append(state[2 * j + 1][0].float().numpy().copy())
    finally:
        for h in hooks:
            h.remove()
    return [np.stack(a) for a in per_layer_a], [np.stack(h) for h in per_layer_h]


def _predict_layer(a: np.ndarray, h: np.ndarray):
    """a [T, ...decay], h [T, rows..., N] -> (relative error per step, independent; coherent), with rows = all but
    the last axis of h; the decay broadcasts over h's shape (Mamba-2: one decay per head)."""
    T = h.shape[0]
    if a.ndim == 2 and h.ndim == 4:  # Mamba-2: a [T, H], h [T, H, P, N]
        a = a[:, :, None, None]
    step = np.abs(h).max(-1, keepdims=True) / 127.0  # [T, rows..., 1]: the int8 step of each stored row
    var = np.zeros(h.shape[1:])
    coh = np.zeros(h.shape[1:])
    ind, co = np.empty(T), np.empty(T)
    for t in range(T):
        at = np.broadcast_to(a[t], h.shape[1:])
        var = at ** 2 * var + step[t] ** 2 / 12.0
        coh = at * coh + step[t] / 2.0
        n = np.linalg.norm(h[t]) or 1e-30
        ind[t] = np.sqrt(var.sum()) / n
        co[t] = np.sqrt((coh ** 2).sum()) / n
    return ind, co, np.broadcast_to(a, h.shape).mean(0)


def ssm_prediction(runner, tokens: list[int], target: int) -> dict | None:
    """The analytic prediction for the reference model's SSM layers, against the measured int8-nearest curve."""
    module = runner.ref.module
    if not hasattr(module, "backbone"):
        return None
    ids = torch.tensor(tokens[:-1], dtype=torch.int64)[None]
    a_layers, h_layers = _decays(module, ids)
    positions = np.arange(1, ids.shape[1] + 1)
    layers, inds, cohs = [], [], []
    dominant = []
    for j, (a, h) in enumerate(zip(a_layers, h_layers)):
        ind, coh, a_mean = _predict_layer(a, h)
        inds.append(ind)
        cohs.append(coh)
        a_flat = a_mean.reshape(-1)
        gain = 1.0 / np.clip(1.0 - a_flat, 1e-9, None)
        # independent errors saturate at ~ind[-1] (if the slowest channel has saturated by then); extrapolate by the
        # fraction of the stationary variance reached: sqrt((1 - a^(2t)) / (1 - a^2)) per element
        a_max = float(a_flat.max())
        reach = lambda t: np.sqrt((1 - a_max ** (2 * t)) / max(1 - a_max ** 2, 1e-12))
        at_target = float(ind[-1] * reach(target) / reach(len(ind)))
        bits = next((b for b in (4, 6, 8, 10, 12, 16) if at_target * 2.0 ** (8 - b) <= BITS_THRESHOLD), ">16")
        rows = a_mean.reshape(a_mean.shape[0], -1).mean(-1) if a_mean.ndim > 1 else a_mean
        top = np.argsort(-(1.0 / np.clip(1 - rows, 1e-9, None)))[:3]
        dominant.append(f"L{j}:" + ",".join(str(int(i)) for i in top))
        layers.append({"layer": j, "decay_median": float(np.median(a_flat)), "decay_max": a_max,
                       "gain_max": float(gain.max()), "saturation_tokens": float(1.0 / max(1 - a_max, 1e-9)),
                       "predicted_at_target": at_target, "bits_needed": bits,
                       "dominant_rows": [int(i) for i in top]})
    pred = np.mean(inds, axis=0)
    pred_coh = np.mean(cohs, axis=0)
    measured = next((v for v in runner.curves_by_label().items() if "int8 nearest" in v[0]), None)
    compare_at, measured_at, predicted_at, err = int(positions[-1]), float("nan"), float(pred[-1]), float("nan")
    if measured and measured[1].state_rel_err:
        cv = measured[1]
        k = max(1, len(cv.state_rel_err) // 10)  # the last 10 % of the samples, and the prediction at their positions
        at = np.asarray(cv.state_positions[-k:])
        compare_at = int(at[-1])
        measured_at = float(np.mean(cv.state_rel_err[-k:]))
        predicted_at = float(np.mean(pred[at - 1]))  # pred[i] is the error after position i + 1
        err = 100.0 * (predicted_at - measured_at) / measured_at if measured_at else float("nan")
    sel = np.unique(np.geomspace(1, len(pred), 40).astype(int)) - 1
    return {"model": "independent rounding errors through the linear recurrence, Var E_t = a^2 Var E_t-1 + "
                     "step^2/12 (coherent bound: |E_t| <= a|E_t-1| + step/2)",
            "positions": [int(positions[i]) for i in sel], "predicted_state_rel_err": [float(pred[i]) for i in sel],
            "predicted_coherent_bound": [float(pred_coh[i]) for i in sel],
            "compare_at": compare_at, "predicted_at": predicted_at, "measured_at": measured_at, "error_pct": err,
            "dominant": " ".join(dominant), "layers": layers, "threshold_rel_err": BITS_THRESHOLD}
