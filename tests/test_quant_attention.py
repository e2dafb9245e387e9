"""experiments/ort_quant_cache.py and experiments/pte_quant_attention.py: each kernel they time computes attention over
the cache it is given (checked against numpy / torch attention over the dequantized cache), so the README's table of
what each runtime can read compares kernels that do the same work; the int4 layout ONNX Runtime's GQA reads (two
codes per byte, low nibble first, value + 8) is pinned here."""
import argparse

import pytest

from conftest import load_benchmark as load



ARGS = argparse.Namespace(heads=9, kv_heads=3, head_dim=64, threads=1, runs=1)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_ort_gqa_reads_a_quantized_cache_as_its_dequantized_values(bits):
    oqc = load("ort_quant_cache")
    r = oqc.measure(96, bits, ARGS)
    assert r["max_abs_err"] < 1e-5, r
    assert r["cache_bytes"] == 2 * 3 * 96 * {None: 64 * 4, 8: 64, 4: 32}[bits]


@pytest.mark.slow
def test_pte_attention_paths_match_fp32_attention_but_the_quantized_query():
    pqa = load("pte_quant_attention")
    rows = {r["path"]: r for r in pqa.measure(96, ARGS)}
    assert rows["fp32 custom_sdpa"]["rel_err_vs_fp32_attention"] < 1e-5
    assert rows["int8 -> fp32 + custom_sdpa"]["rel_err_vs_fp32_attention"] < 1e-5
    # the int8 query moves the output, by less than an int8 step's worth of its scale
    assert 1e-4 < rows["custom_quantized_sdpa"]["rel_err_vs_fp32_attention"] < 2e-2
