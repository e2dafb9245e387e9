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


def test_extrapolation_interval_has_the_width_least_squares_gives_by_hand():
    """Four points of y = 1e-3 t^0.7 at log t = 0, 1, 2, 3, with log-residuals (+d, -d, -d, +d), which are orthogonal
    to [1, log t]: least squares recovers the law exactly, RSS = 4 d^2, s^2 = RSS / (n - 2) = 2 d^2, mean log t 1.5,
    Sxx = 5. The predicted log y at x* = log t* has variance s^2 (1/n + (x* - 1.5)^2 / Sxx); the interval is the
    prediction times exp(+-1.96 sd). Not wider, not narrower."""
    d = 0.1
    x = np.arange(4.0)
    y = 1e-3 * np.exp(0.7 * x + d * np.array([1, -1, -1, 1]))
    f = fit_growth(np.exp(x), y)
    assert f.law == "power" and f.params["b"] == pytest.approx(0.7, rel=1e-9)
    assert f.params["a"] == pytest.approx(1e-3, rel=1e-9)
    target = 98304
    xs = np.log(target)
    sd = np.sqrt(2 * d**2 * (1 / 4 + (xs - 1.5) ** 2 / 5))
    e = extrapolate(f, target)
    assert e["value"] == pytest.approx(1e-3 * target**0.7, rel=1e-9)
    assert e["high"] / e["value"] == pytest.approx(np.exp(1.96 * sd), rel=1e-9)
    assert e["value"] / e["low"] == pytest.approx(np.exp(1.96 * sd), rel=1e-9)
    assert f.stderr["b"] == pytest.approx(np.sqrt(2 * d**2 / 5), rel=1e-9)
    assert e["far_beyond_measured"]


def test_an_exponential_that_grows_less_than_e_fold_is_not_compounding():
    """y = 1e-3 exp(k t) with k x span = 0.5: the exponential law fits it exactly, but it grows less than e-fold
    over the measured range, so the curve is not called compounding (the power law is kept)."""
    k = 0.5 / (T.max() - T.min())
    f = fit_growth(*windowed(T, 1e-3 * np.exp(k * T)))
    assert f.law == "power" and f.cls != "compounding"
    g = fit_growth(*windowed(T, 1e-3 * np.exp(3 * k * T)))  # 1.5-fold in the exponent: e^1.5 growth
    assert g.law == "exponential" and g.cls == "compounding" and g.params["k"] == pytest.approx(3 * k, rel=0.02)


def test_fit_statistics_against_numpy_polyfit_and_by_hand():
    """r2, both laws' standard errors: the four hand points above (power law; stderr of log a by hand,
    s^2 (1/n + mean^2 / Sxx)), and an exponential curve against numpy.polyfit's own covariance."""
    d = 0.1
    x = np.arange(4.0)
    ly = np.log(1e-3) + 0.7 * x + d * np.array([1, -1, -1, 1])
    f = fit_growth(np.exp(x), np.exp(ly))
    assert f.r2 == pytest.approx(1 - 4 * d**2 / ((ly - ly.mean()) ** 2).sum(), rel=1e-9)
    assert f.stderr["log_a"] == pytest.approx(np.sqrt(2 * d**2 * (1 / 4 + 1.5**2 / 5)), rel=1e-9)
    t = T[::64].astype(float)
    y = 1e-4 * np.exp(t / 1000) * np.exp(np.random.default_rng(1).normal(0, 0.05, t.shape))
    g = fit_growth(t, y)
    coef, cov = np.polyfit(t, np.log(y), 1, cov=True)
    assert g.law == "exponential" and g.params["k"] == pytest.approx(coef[0], rel=1e-9)
    assert g.stderr["k"] == pytest.approx(np.sqrt(cov[0, 0]), rel=1e-6)
    assert g.stderr["log_a"] == pytest.approx(np.sqrt(cov[1, 1]), rel=1e-6)


def test_growth_within_its_own_noise_is_bounded():
    """b = 0.1 (above the 0.05 flat line) with a standard error of 0.1 / 1.5: the 95 % interval of b includes 0, so
    the curve is bounded; with a tenth of the noise it is accumulating. Four hand points as above."""
    x = np.arange(4.0)
    r = np.array([1, -1, -1, 1])
    sb = 0.1 / 1.5
    d = sb * np.sqrt(5 / 2)  # stderr of b = sqrt(2 d^2 / 5)
    noisy = fit_growth(np.exp(x), np.exp(0.1 * x + d * r))
    assert noisy.law == "power" and noisy.stderr["b"] == pytest.approx(sb, rel=1e-9) and noisy.cls == "bounded"
    quiet = fit_growth(np.exp(x), np.exp(0.1 * x + d / 10 * r))
    assert quiet.cls == "accumulating"


def test_positions_at_zero_are_left_out():
    x = np.arange(4.0)
    y = 1e-3 * np.exp(0.7 * x)
    a, b = fit_growth(np.exp(x), y), fit_growth(np.r_[0.0, np.exp(x)], np.r_[5.0, y])
    assert a.params == pytest.approx(b.params) and a.law == b.law
