"""The plan's attention term on ONNX Runtime (GroupQueryAttention at its measured kernel rate): re-derived by hand
arithmetic from the stored rates (edgekv/costs/attention_rates.json) and the models' published configs, the phone
range from the stored scale, and the fit of benchmarks/attention_rates.py on rows of a known law."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, cli

ALL = json.loads((ROOT / "edgekv" / "costs" / "attention_rates.json").read_text())
RATES = ALL["onnxruntime"]
HOST = RATES["devices"]["host"]["kinds"]
# SmolLM2-135M's published config.json: 30 layers, 9 heads, 3 KV heads, head_dim 64 (hidden 576)
L, H, HKV, D = 30, 9, 3, 64


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
    assert f"{slow:.2g}-{fast:.2g}" in text
    # the device's own runtime (edgekv's .pte): custom_sdpa's host rate scaled by its own stored range
    lo_e, hi_e = ALL["executorch"]["classes"]["phone"]["scale"]
    et = ALL["executorch"]["devices"]["host"]["kinds"]["fp16"]
    slow, fast = plan("--device", "pixel8", "-m", "smollm2-135m", "--ctx", "32k", "--strategy", "kv")[
        "decode_tokens_per_s_range"]
    attn = L * layer_s(et, 32768, H, HKV, D, 2)
    assert 1 / slow - 1 / fast == pytest.approx(attn * (1 / lo_e - 1 / hi_e), rel=0.01)


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


def per_key(r: dict, h: int, hkv: int, d: int, nbytes: float) -> float:
    """One stored kind's seconds per kept key of one layer: 2 x Hkv x D x bytes / read rate + H x D x compute (the
    kind's own fit at head size d where one is stored: by_head_dim)."""
    r = r.get("by_head_dim", {}).get(str(d), r)
    read = 2 * hkv * d * nbytes / r["read_bytes_per_s"] if r["read_bytes_per_s"] else 0.0
    return read + h * d * r["compute_s_per_head_dim_position"]


def layer_s(r: dict, keys: int, h: int, hkv: int, d: int, nbytes: float) -> float:
    """One layer's attention seconds: overhead + keys x per_key."""
    return r.get("by_head_dim", {}).get(str(d), r)["overhead_s"] + keys * per_key(r, h, hkv, d, nbytes)


def slope(runtime: str, strategy: str) -> float:
    """Decode seconds per token at a filled 8k less at 2k, SmolLM2-135M on the host, from plan --json."""
    args = ("--device", "host", "-m", "smollm2-135m", "--runtime", runtime, "--strategy", strategy, "--weights", "int4")
    return (1 / plan(*args, "--ctx", "8192")["decode_tokens_per_s"]
            - 1 / plan(*args, "--ctx", "2048")["decode_tokens_per_s"])


@pytest.mark.parametrize("runtime,cost,strategy,kind,nbytes", [
    ("executorch", "executorch", "kv:dtype=fp32", "fp32", 4),  # edgekv's .pte: custom_sdpa on the cache itself
    ("executorch", "executorch", "kv", "fp16", 2),  # the fp16 rows read back as fp32 first
    ("executorch", "executorch", "kv-int8", "int8", 1),  # custom_quantized_sdpa on the codes in place
    ("executorch", "executorch", "kv-int8c", "int8c", 1),  # the same, static scales folded around it
    ("llama.cpp", "llama.cpp", "kv", "f16", 2),  # llama.cpp's flash attention over an f16 cache
    ("llama.cpp", "llama.cpp", "kv-int8", "q8_0", 34 / 32),
    ("onnxruntime", "onnxruntime", "kv-int8", "eager int8", 1),  # no GroupQueryAttention: the eager graph's rate
])
def test_runtime_attention_rate_by_hand(runtime, cost, strategy, kind, nbytes):
    """From a filled 2k to 8k SmolLM2's 30 layers each keep 6144 more keys: the decode step grows by 30 x 6144 x
    the stored per-key cost of that runtime's kernel and cache kind (edgekv/costs/attention_rates.json), the
    weights term cancelling. A runtime whose rates plan ignored would grow by the roofline's bytes instead."""
    r = ALL[cost]["devices"]["host"]["kinds"][kind]
    assert slope(runtime, strategy) == pytest.approx(L * 6144 * per_key(r, H, HKV, D, nbytes), rel=0.01)


def test_plan_host_8k_executorch_rows_use_the_pte_rates():
    """`edgekv plan --device host -m smollm2-135m -c 8k --runtime executorch`: every row whose .pte attends through
    custom_sdpa (fp32, fp16) or custom_quantized_sdpa (per-token int8 codes) is charged at the stored .pte rate (its
    --explain names the kernel), the whole step = int4 weights / the stored .pte weights rate + 30 layers' attention
    by hand."""
    host = ALL["executorch"]["devices"]["host"]
    p = json.loads(cli("plan", "--device", "host", "-m", "smollm2-135m", "-c", "8k", "--runtime", "executorch",
                       "--strategy", "kv", "--strategy", "kv:dtype=fp32", "--strategy", "kv-int8", "--json",
                       "--explain")[1])
    rows = {r["params"].get("dtype", "int8"): r for r in p["options"]}
    assert set(rows) == {"fp16", "fp32", "int8"}
    for dtype, (kind, nbytes) in {"fp16": ("fp16", 2), "fp32": ("fp32", 4), "int8": ("int8", 1)}.items():
        r = rows[dtype]
        # the per-token int8 cache is read in place by custom_quantized_sdpa, the float caches by custom_sdpa
        assert ("custom_quantized_sdpa" if dtype == "int8" else "custom_sdpa") in r["explain"]["decode_tokens_per_s"]
        k = host["kinds"][kind]
        attn = L * layer_s(k, 8192, H, HKV, D, nbytes)
        w_s = 1 / r["decode_tokens_per_s"] - attn
        # SmolLM2's int4 weights read per token over the stored rate: tens of MB at GB/s, milliseconds
        assert 0.02e9 < w_s * host["weights"]["int4"]["read_bytes_per_s"] < 0.2e9, r


def test_prefill_at_the_fitted_rates_by_hand():
    """The host's prefill of 8192 tokens, SmolLM2-135M, fp32 cache on ONNX Runtime: 2 x 106,168,320 matmul
    parameters (30 layers x (2 x 576 x 576 + 2 x 576 x 192 + 3 x 576 x 1536), config.json) x 8192 + the logits of
    the last token of each 128-token chunk (2 x 49152 x 576 x 64) over the stored matmul rate, + causal attention
    30 x 4 x 9 x 64 x 8192 x 8193 / 2 FLOP over the stored fp32 attention rate."""
    pre = RATES["devices"]["host"]["prefill"]
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    mm = 2 * L * per_layer * 8192 + 2 * 49152 * 576 * 64
    attn = L * 4 * H * D * 8192 * 8193 / 2
    want = mm / pre["matmul_flop_per_s"] + attn / pre["attention_flop_per_s"]["fp32"]
    row = plan("--device", "host", "-m", "smollm2-135m", "--runtime", "onnxruntime", "--strategy", "kv:dtype=fp32",
               "--weights", "int4", "--ctx", "8192")
    assert row["prefill_seconds"] == pytest.approx(want, rel=0.01)


def test_filled_rows_against_the_plan(tmp_path):
    """benchmarks/plan_vs_filled.py: the rates it fits on SmolLM2-135M's filled rows are the ones stored; Gemma-3-
    270M's measured edgekv ONNX rows at a filled 16k and 32k with a fp32 or kv-int8c cache (fitted to nothing) come
    within 25 % of the plan itself, and so do its explicit-graph kv-int8 / kv-int4 rows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_vs_filled

    out = tmp_path / "pvf.json"
    assert plan_vs_filled.main(["--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for cost in ("onnxruntime", "executorch", "llama.cpp"):
        stored = ALL[cost]["devices"]["host"]["weights"]["int4"]["read_bytes_per_s"]
        assert res["weights_rates_bytes_per_s"][cost] == pytest.approx(stored, rel=0.005), cost
    lc = ALL["llama.cpp"]["devices"]["host"]["kinds"]
    for kind, c in res["llamacpp_per_key_s"].items():
        assert lc[kind]["compute_s_per_head_dim_position"] == pytest.approx(c, rel=0.005), kind
    for cost, kinds in res["fitted_per_key_s"].items():
        for kind, c in kinds.items():
            stored = ALL[cost]["devices"]["host"]["kinds"][kind]["compute_s_per_head_dim_position"]
            assert stored == pytest.approx(c, rel=0.005), (cost, kind)
    held = [r for r in res["rows"] if r["set"] == "held-out" and r["modelled"] and r["row"].startswith("edgekv-ort:")
            and r["row"].split(":", 1)[1].split("/")[0] in ("kv:dtype=fp32", "kv-int8c", "kv-int8", "kv-int4")
            and r["ctx"] >= 16384]
    assert len(held) >= 6
    for r in held:
        assert abs(r["plan_tok_s"] / r["measured_tok_per_cpu_s"] - 1) <= 0.25, r
