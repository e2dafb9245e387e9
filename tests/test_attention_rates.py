"""The plan's attention term on ONNX Runtime (GroupQueryAttention at its measured kernel rate): re-derived by hand
arithmetic from the stored rates (edgekv/costs/attention_rates.json) and the models' published configs, the phone
range from the stored scale, and the fit of benchmarks/attention_rates.py on rows of a known law."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, cli

RATES = json.loads((ROOT / "edgekv" / "costs" / "attention_rates.json").read_text())["onnxruntime"]
HOST = RATES["devices"]["host"]["kinds"]


def per_key_s(kind: str, h: int, hkv: int, d: int, nbytes: int) -> float:
    r = HOST[kind]
    read = 2 * hkv * d * nbytes / r["read_bytes_per_s"] if r["read_bytes_per_s"] else 0.0
    return read + h * d * r["compute_s_per_head_dim_position"]


def plan(*args) -> dict:
    code, out, err = cli("plan", *args, "--json")
    assert code == 0, err
    out = json.loads(out)
    (row,) = out["options"]
    return row


def test_gemma3_decode_slows_by_its_three_global_layers_by_hand():
    """Gemma-3-270M (config.json: 18 layers, 4 heads, 1 KV head, head_dim 256, sliding_window 512 on all but every
    6th layer): from a filled 16k to 32k only its 3 global layers read more keys, so the decode seconds per token
    grow by 3 x 16384 x (2 x 1 x 256 x 1 B / read rate + 4 x 256 x compute) with kv-int8c; the weights term and the
    512-key sliding layers cancel."""
    args = ("--device", "host", "-m", "gemma-3-270m", "--runtime", "onnxruntime", "--strategy", "kv-int8c",
            "--weights", "int4")
    t16 = 1 / plan(*args, "--ctx", "16384")["decode_tokens_per_s"]
    t32 = 1 / plan(*args, "--ctx", "32768")["decode_tokens_per_s"]
    want = 3 * 16384 * per_key_s("int8c", 4, 1, 256, 1)
    assert t32 - t16 == pytest.approx(want, rel=0.01)


def test_smollm2_fp32_cache_attention_by_hand():
    """SmolLM2-135M (30 layers, 9 heads, 3 KV heads, head_dim 64), fp32 cache: 2k -> 8k adds 30 x 6144 keys at
    overhead-free per-key cost 2 x 3 x 64 x 4 B / read rate + 9 x 64 x compute."""
    args = ("--device", "host", "-m", "smollm2-135m", "--runtime", "onnxruntime", "--strategy", "kv:dtype=fp32",
            "--weights", "int4")
    t2 = 1 / plan(*args, "--ctx", "2048")["decode_tokens_per_s"]
    t8 = 1 / plan(*args, "--ctx", "8192")["decode_tokens_per_s"]
    assert t8 - t2 == pytest.approx(30 * 6144 * per_key_s("fp32", 9, 3, 64, 4), rel=0.01)
    # and the whole step at 8k: int4 weights over the stored weights rate + 30 layers' attention
    w_rate = RATES["devices"]["host"]["weights"]["int4"]["read_bytes_per_s"]
    attn8 = 30 * (HOST["fp32"]["overhead_s"] + 8192 * per_key_s("fp32", 9, 3, 64, 4))
    w_seconds = t8 - attn8
    assert 0 < w_seconds * w_rate < 0.2e9  # SmolLM2's int4 weights read per token: tens of MB, not the state


def test_phone_shows_the_range_of_its_guessed_scale():
    """pixel8 has no measured GroupQueryAttention rate: the host's divided by the stored scale (low, high); the
    two ends differ by attention x (1/low - 1/high), attention by hand from SmolLM2's config; the table prints
    'low-high'."""
    lo_s, hi_s = RATES["classes"]["phone"]["scale"]
    args = ("--device", "pixel8", "-m", "smollm2-135m", "--runtime", "onnxruntime", "--strategy", "kv-int8c",
            "--ctx", "32k", "--weights", "int4")
    row = plan(*args)
    slow, fast = row["decode_tokens_per_s_range"]
    attn = 30 * (HOST["int8c"]["overhead_s"] + 32768 * per_key_s("int8c", 9, 3, 64, 1))
    assert 1 / slow - 1 / fast == pytest.approx(attn * (1 / lo_s - 1 / hi_s), rel=0.01)
    assert row["decode_tokens_per_s"] == pytest.approx(slow, abs=1e-3)
    code, text, err = cli("plan", *args)
    assert code == 0, err
    assert f"{slow:.3g}-{fast:.3g}" in text
    # the device's own runtime (edgekv's .pte) has no kernel rate here: one number, no range
    assert "decode_tokens_per_s_range" not in plan("--device", "pixel8", "-m", "smollm2-135m", "--ctx", "32k",
                                                   "--strategy", "kv")


def test_plan_imports_no_onnxruntime():
    code = ("import sys; from click.testing import CliRunner; from edgekv.cli import main; "
            "r = CliRunner().invoke(main, ['plan', '--device', 'host', '--ctx', '8k', '-m', 'smollm2-135m']); "
            "assert r.exit_code == 0, r.output; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('onnxruntime', 'torch', 'onnx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_the_benchmark_fit_recovers_a_known_law():
    """Rows made from time = 20 us + cache bytes / 3 GB/s + ctx x H x D x 50 ps over two head shapes: the fit
    returns those three numbers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention_rates import fit

    rows = []
    for h, hkv, d in ((9, 3, 64), (4, 1, 256)):
        for ctx in (1024, 4096, 16384):
            cb = 2 * hkv * ctx * d * 2
            rows.append({"ctx": ctx, "heads": h, "kv_heads": hkv, "head_dim": d, "cache_bytes": cb,
                         "median_us": (20e-6 + cb / 3e9 + ctx * h * d * 50e-12) * 1e6})
    f = fit(rows)
    assert f["overhead_s"] == pytest.approx(20e-6, rel=1e-3)
    assert f["read_bytes_per_s"] == pytest.approx(3e9, rel=1e-3)
    assert f["compute_s_per_head_dim_position"] == pytest.approx(50e-12, rel=1e-3)


def test_held_out_gemma3_rows_within_25_percent(tmp_path):
    """benchmarks/plan_vs_filled.py: the weights rate fitted on SmolLM2-135M's filled rows (and stored as the host's),
    Gemma-3-270M's measured edgekv ONNX rows at a filled 16k and 32k (benchmarks/results/, not fitted) predicted
    within 25 % by the plan itself."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_vs_filled

    out = tmp_path / "pvf.json"
    assert plan_vs_filled.main(["--out", str(out)]) == 0
    res = json.loads(out.read_text())
    stored = RATES["devices"]["host"]["weights"]["int4"]["read_bytes_per_s"]
    assert res["weights_rate_bytes_per_s"] == pytest.approx(stored, rel=0.005)
    held = [r for r in res["rows"] if r["set"] == "held-out" and r["row"].startswith("edgekv-ort:")]
    assert len(held) == 4 and all(r["modelled"] for r in held)
    for r in held:
        assert abs(r["plan_tok_s"] / r["measured_tok_s"] - 1) <= 0.25, r
