"""Growth laws for error-vs-position curves: fit, classify, extrapolate. numpy only (no torch).

Two laws are fitted to a windowed curve y(t) > 0 by least squares on log y:
  power        y = a * t^b          (log y = log a + b log t)      accumulating when b > 0, bounded when b ~ 0
  exponential  y = a * exp(k * t)   (log y = log a + k t)          compounding when it wins and grows >= e-fold
The law with the lower residual error (AIC, both have 2 parameters) is kept. Uncertainty: the parameters' standard
errors from the regression; the extrapolation interval is +-1.96 standard errors of the predicted log y (delta method).
Classes:
  bounded       the fitted growth over the measured range is within noise: power b's 95% interval includes 0 or
                b < 0.05 (less than 5% growth per doubling of t... i.e. y(2t)/y(t) < 1.035)
  accumulating  polynomial growth (power law, b > 0.05 and significant): a per-token error that adds up, e.g. sqrt(t)
  compounding   exponential growth that the data prefer and that grows at least e-fold over the measured range
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CLASSES = ("bounded", "accumulating", "compounding")
B_FLAT = 0.05


def windowed(positions, values, n_windows: int = 24, first: int = 1):
    """Mean of values in log-spaced windows of position: (window centre, mean) with empty windows dropped."""
    t = np.asarray(positions, dtype=float)
    y = np.asarray(values, dtype=float)
    lo, hi = max(first, t.min()), t.max()
    edges = np.unique(np.round(np.geomspace(lo, hi + 1, n_windows + 1)))
    xs, ys = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        m = (t >= a) & (t < b)
        if m.any():
            xs.append(float(np.exp(np.log(t[m]).mean())))
            ys.append(float(y[m].mean()))
    return np.array(xs), np.array(ys)


@dataclass
class Fit:
    law: str  # power | exponential
    params: dict  # {"a", "b"} or {"a", "k"}
    stderr: dict
    r2: float
    aic: float
    cls: str
    t_max: float
    _cov: np.ndarray
    _design: str

    def predict(self, t) -> np.ndarray:
        t = np.asarray(t, dtype=float)
        if self.law == "power":
            return self.params["a"] * t ** self.params["b"]
        return self.params["a"] * np.exp(self.params["k"] * t)

    def interval(self, t: float, z: float = 1.96) -> tuple[float, float, float]:
        """(prediction, low, high) at t from the parameter covariance on log y."""
        x = np.array([1.0, np.log(t) if self.law == "power" else t])
        mean = float(self.predict(t))
        sd = float(np.sqrt(max(x @ self._cov @ x, 0.0)))
        return mean, mean * np.exp(-z * sd), mean * np.exp(z * sd)

    def to_json(self) -> dict:
        return {"law": self.law, "params": {k: float(v) for k, v in self.params.items()},
                "stderr": {k: float(v) for k, v in self.stderr.items()}, "r2": float(self.r2), "class": self.cls}


def _ols(x: np.ndarray, ly: np.ndarray):
    X = np.stack([np.ones_like(x), x], 1)
    coef, res, *_ = np.linalg.lstsq(X, ly, rcond=None)
    resid = ly - X @ coef
    n = len(ly)
    s2 = float(resid @ resid) / max(n - 2, 1)
    cov = s2 * np.linalg.inv(X.T @ X)
    ss_tot = float(((ly - ly.mean()) ** 2).sum()) or 1e-300
    r2 = 1 - float(resid @ resid) / ss_tot
    aic = n * np.log(max(float(resid @ resid) / n, 1e-300)) + 4
    return coef, cov, r2, aic


def fit_growth(positions, values) -> Fit:
    """Fit both laws to a positive curve (already windowed, or raw) and classify it."""
    t = np.asarray(positions, dtype=float)
    y = np.asarray(values, dtype=float)
    keep = (t > 0) & (y > 0) & np.isfinite(y)
    t, y = t[keep], y[keep]
    if len(t) < 4:
        raise ValueError("need at least 4 positive points to fit a growth law")
    ly = np.log(y)
    cp, covp, r2p, aicp = _ols(np.log(t), ly)
    ce, cove, r2e, aice = _ols(t, ly)
    b, sb = cp[1], float(np.sqrt(covp[1, 1]))
    k = ce[1]
    span = t.max() - t.min()
    exp_wins = aice < aicp - 2 and k > 0 and k * span >= 1.0
    if exp_wins:
        return Fit("exponential", {"a": float(np.exp(ce[0])), "k": float(k)},
                   {"log_a": float(np.sqrt(cove[0, 0])), "k": float(np.sqrt(cove[1, 1]))}, r2e, aice, "compounding",
                   t.max(), cove, "exp")
    flat = b < B_FLAT or (b - 1.96 * sb) <= 0
    return Fit("power", {"a": float(np.exp(cp[0])), "b": float(b)}, {"log_a": float(np.sqrt(covp[0, 0])), "b": sb},
               r2p, aicp, "bounded" if flat else "accumulating", t.max(), covp, "power")


def extrapolate(fit: Fit, target: int) -> dict:
    mean, lo, hi = fit.interval(target)
    far = bool(target > 4 * fit.t_max)
    return {"ctx": int(target), "value": float(mean), "low": float(lo), "high": float(hi), "far_beyond_measured": far,
            "note": (f"{target / fit.t_max:.0f}x beyond the last measured position ({fit.t_max:.0f}): "
                     f"treat as an order of magnitude" if far else "within 4x of the measured range")}
