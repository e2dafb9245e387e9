"""Growth-law fitting on synthetic curves with known laws."""
import numpy as np
import pytest

from edgekv.analyze.fit import extrapolate, fit_growth, windowed

T = np.arange(1, 4097)
RNG = np.random.default_rng(0)


def noisy(y, sigma=0.15):
    return y * np.exp(RNG.normal(0, sigma, size=y.shape))


def test_flat_curve_is_bounded():
    f = fit_growth(*windowed(T, noisy(np.full(T.shape, 0.02))))
    assert f.cls == "bounded" and abs(f.params["b"]) < 0.05


def test_sqrt_growth_is_accumulating_with_the_right_exponent():
    f = fit_growth(*windowed(T, noisy(1e-3 * np.sqrt(T))))
    assert f.cls == "accumulating" and f.law == "power"
    assert f.params["b"] == pytest.approx(0.5, abs=0.05)


def test_exponential_growth_is_compounding_with_the_right_rate():
    k = 1.0 / 1000
    f = fit_growth(*windowed(T, noisy(1e-4 * np.exp(k * T))))
    assert f.cls == "compounding" and f.law == "exponential"
    assert f.params["k"] == pytest.approx(k, rel=0.15)


def test_extrapolation_interval_contains_the_truth_and_flags_distance():
    f = fit_growth(*windowed(T, noisy(1e-3 * T ** 0.7, 0.05)))
    e = extrapolate(f, 32768)
    truth = 1e-3 * 32768 ** 0.7
    assert e["low"] <= truth <= e["high"] and e["far_beyond_measured"]
    assert not extrapolate(f, 8192)["far_beyond_measured"]


def test_windowed_means_are_log_spaced():
    xs, ys = windowed(T, np.ones_like(T, dtype=float), 10)
    assert np.all(np.diff(np.log(xs)) > 0) and np.allclose(ys, 1)
