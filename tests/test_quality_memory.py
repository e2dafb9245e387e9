"""verify-quant's comparison (edgekv.export.quality.compare_rows) at a large vocabulary: the same numbers as scipy's
log_softmax / rel_entr over the whole [positions, V] rows, computed a few positions at a time, so a 262144-token
vocabulary (Gemma-3) does not hold several float64 copies of every position's logits at once."""
import tracemalloc

import numpy as np
import pytest

scipy_special = pytest.importorskip("scipy.special")

from edgekv.export import quality  # noqa: E402


class Rows:
    """A stepper that returns fixed logits: rows[p] after token p (prefill: the first n rows)."""

    def __init__(self, rows):
        self.rows = rows

    def reset(self):
        pass

    def prefill(self, tokens):
        return self.rows[:len(tokens)].copy()

    def step(self, tokens, p):
        return self.rows[p:p + 1].copy()


def test_compare_rows_matches_scipy_and_holds_a_few_positions_of_float64_at_a_time():
    rng = np.random.default_rng(0)
    n, v = 97, 30011
    p32 = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    q32 = (p32 + rng.standard_normal((n, v)).astype(np.float32) * 0.3).astype(np.float32)
    tokens = rng.integers(0, v, n + 1).tolist()
    tracemalloc.start()
    got = quality.compare_rows(p32, Rows(q32), tokens)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    lp = scipy_special.log_softmax(p32.astype(np.float64), axis=-1)
    lq = scipy_special.log_softmax(q32.astype(np.float64), axis=-1)
    kl = scipy_special.rel_entr(np.exp(lp), np.exp(lq)).sum(-1)
    at, tgt = np.arange(n), np.asarray(tokens[1:])
    assert got["positions"] == n and got["prefill_tokens"] == (n + 1) // 2
    assert np.isclose(got["kl_mean"], kl.mean(), rtol=1e-9) and np.isclose(got["kl_max"], kl.max(), rtol=1e-9)
    assert got["top1_agreement"] == np.mean(p32.argmax(-1) == q32.argmax(-1))
    assert np.isclose(got["nll_fp32"], -lp[at, tgt].mean()) and np.isclose(got["nll_quant"], -lq[at, tgt].mean())
    assert np.isclose(got["kl_fp32_uniform"], np.mean(np.log(v) + (np.exp(lp) * lp).sum(-1)))
    # the artifact's rows (one fp32 copy, and its concatenation) plus float64 temporaries of a few positions: well
    # under one float64 copy of the whole rows, which the comparison over every position at once makes several of
    assert peak < 2.5 * p32.nbytes, peak / p32.nbytes
