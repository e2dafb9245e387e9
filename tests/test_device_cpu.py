"""A host profile's speeds are its CPU's: host (the AMD EPYC VM) and host-xeon (the Intel Xeon VM) each hold the rates
measured on their own CPU (device_profiles/*.toml `cpu`, edgekv/costs/attention_rates.json devices.<id>), and
`edgekv plan` says so in one line when it runs on a CPU that is not its profile's (devices.cpu_note)."""
import io
import json
from contextlib import redirect_stdout

import pytest

from conftest import ROOT, cli
from edgekv import devices

ALL = json.loads((ROOT / "edgekv" / "costs" / "attention_rates.json").read_text())
XEON_CPU = "Intel(R) Xeon(R) Processor"


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """Set the model name this machine's /proc/cpuinfo reports (None: no such file)."""
    def use(model: str | None):
        f = tmp_path / "cpuinfo"
        if model is None:
            monkeypatch.setattr(devices, "CPUINFO", str(tmp_path / "absent"))
        else:
            f.write_text(f"processor\t: 0\nvendor_id\t: X\nmodel name\t: {model}\nflags\t\t: fpu\n")
            monkeypatch.setattr(devices, "CPUINFO", str(f))
        devices.this_cpu.cache_clear()
    yield use
    devices.this_cpu.cache_clear()


def test_host_profiles_name_their_cpu_and_host_xeon_loads():
    host, xeon = devices.load_device("host"), devices.load_device("host-xeon")
    assert host.cpu == "AMD EPYC" and xeon.cpu == XEON_CPU
    assert xeon.device_class == "host" and xeon.to_json()["cpu"] == XEON_CPU
    for name, f in xeon.facts.items():  # every fact with its source or estimate
        assert (f.source is None) != (f.estimate is None), name
    assert devices.load_device("pixel8").cpu == "" and "cpu" not in devices.load_device("pixel8").to_json()


@pytest.mark.parametrize("here,want", [
    (XEON_CPU, "--device host-xeon"),  # the profile whose cpu is this machine's
    ("AMD EPYC", None),  # the profile's own CPU: no note
    ("Some Other CPU 9000", "benchmarks/attention_rates.py"),  # none: the speeds are another CPU's, how to measure
    (None, None),  # no /proc/cpuinfo: unknown, no note
])
def test_cpu_note_names_the_profile_of_this_cpu(cpuinfo, here, want):
    from edgekv.arch import catalog_arch
    from edgekv.plan import make_plan
    from edgekv.render import plan_table
    from edgekv.strategies import parse_strategy

    cpuinfo(here)
    p = make_plan(devices.load_device("host"), 8192, [catalog_arch("smollm2-135m")], [parse_strategy("kv")],
                  "int4", "onnxruntime")
    assert p.to_json()["cpu_note"] == p.cpu_note
    buf = io.StringIO()
    with redirect_stdout(buf):
        plan_table(p, None)
    text = " ".join(buf.getvalue().split())
    if want is None:
        assert p.cpu_note is None and "speeds were measured on" not in text
    else:
        assert want in p.cpu_note and "AMD EPYC" in p.cpu_note and here in p.cpu_note
        assert " ".join(p.cpu_note.split()) in text  # printed under the table, one line
    cpuinfo(XEON_CPU)  # on the Xeon the Xeon's profile gets no note
    assert devices.cpu_note(devices.load_device("host-xeon")) is None


def _plan(*args) -> dict:
    code, out, err = cli("plan", *args, "--json")
    assert code == 0, err
    (row,) = json.loads(out)["options"]
    return row


def _calls(name: str, kind: str, head_dim: int) -> dict[int, float]:
    rows = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]
    return {r["ctx"]: r["median_us"] * 1e-6 for r in rows if r["kind"] == kind and r["head_dim"] == head_dim}


@pytest.mark.parametrize("runtime,strategy,name,kind,extra", [
    ("onnxruntime", "kv:dtype=fp32", "attention_rates_xeon.json", "fp32", ()),
    ("onnxruntime", "kv-int8c", "attention_rates_xeon.json", "int8c", ()),
    ("executorch", "kv:dtype=fp32", "attention_rates_executorch_fp16_default_xeon.json", "fp32", ()),
    ("executorch", "kv", "attention_rates_executorch_fp16_edgekv.json", "fp16", ("--pte-kernel", "edgekv")),
])
def test_host_xeon_decode_step_is_its_measured_calls(runtime, strategy, name, kind, extra):
    """`edgekv plan --device host-xeon`: from a filled 2k to 8k SmolLM2's 30 layers each keep 6144 more keys, so the
    step grows by 30 x (one call at 8192 keys - one at 2048) as the kernel benchmark measured them on the Xeon
    (the stored per-head-size curve is those calls over their keys x H x D): the Xeon's own calls, not the EPYC's
    (the host profile's step grows by another amount)."""
    calls = _calls(name, kind, 64)
    args = ("-m", "smollm2-135m", "--runtime", runtime, "--strategy", strategy, "--weights", "int4", *extra)
    step = {(dev, c): 1 / _plan("--device", dev, *args, "--ctx", str(c))["decode_tokens_per_s"]
            for dev in ("host-xeon", "host") for c in (2048, 8192)}
    xeon = step["host-xeon", 8192] - step["host-xeon", 2048]
    assert xeon == pytest.approx(30 * (calls[8192] - calls[2048]), rel=0.02)
    epyc = step["host", 8192] - step["host", 2048]
    assert abs(epyc / xeon - 1) > 0.05  # another CPU's rate


@pytest.mark.parametrize("strategy,kind", [("kv", "f16"), ("kv-int8", "q8_0")])
def test_host_xeon_llamacpp_step_is_its_measured_steps(strategy, kind):
    """`edgekv plan --device host-xeon --runtime llama.cpp`: from a filled 2k to 8k SmolLM2's 30 layers each keep 6144
    more keys, so the step grows by 30 x 6144 x 9 x 64 x the per-key cost fitted on the Xeon's 1-layer llama.cpp steps
    (benchmarks/results/attention_rates_llamacpp_<kind>_xeon.json, the step's own overhead left out as on the host),
    i.e. by 30 x what its measured step grew by from 2051 to 8195 keys (to 10 %: the fit's line against the two
    steps), and not by the EPYC's amount (llama.cpp's flash attention is another speed on this CPU)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attention_rates as ar

    name = f"attention_rates_llamacpp_{kind}_xeon.json"
    rows = [r for r in json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]
            if r["kind"] == kind and r["head_dim"] == 64]
    slope = ar.fit_head_dim(rows)["compute_s_per_head_dim_position"]
    calls = _calls(name, kind, 64)
    args = ("-m", "smollm2-135m", "--runtime", "llama.cpp", "--strategy", strategy, "--weights", "int4")
    step = {(dev, c): 1 / _plan("--device", dev, *args, "--ctx", str(c))["decode_tokens_per_s"]
            for dev in ("host-xeon", "host") for c in (2048, 8192)}
    xeon = step["host-xeon", 8192] - step["host-xeon", 2048]
    assert xeon == pytest.approx(30 * 6144 * 9 * 64 * slope, rel=0.02)
    assert xeon == pytest.approx(30 * (calls[8195] - calls[2051]), rel=0.1)
    epyc = step["host", 8192] - step["host", 2048]
    assert abs(epyc / xeon - 1) > 0.1  # another CPU's rate (f16: 4x; q8_0: 19 %)


@pytest.mark.parametrize("strategy,kind", [("kv", "f16"), ("kv-int8", "q8_0")])
def test_host_xeon_llamacpp_1b_step_at_its_kv_heads_cost(strategy, kind):
    """Llama-3.2-1B (config.json: 16 layers, 32 heads, 8 KV heads, head_dim 64) on host-xeon's llama.cpp: from a
    filled 2k to 8k its step grows by 16 x 6144 x 32 x 64 x the stored per-key cost at head size 64 (SmolLM2's 3 KV
    heads) x the ratio of the 1B shape's per-key slope to SmolLM2's, both timed in one run
    (benchmarks/results/attention_rates_llamacpp_kv_heads_xeon.json; here by hand from its rows: what the step grew
    by from 2051 to 8195 keys, per key x H x D; the stored factor is the fit through all three contexts, hence 15 %):
    f16 about 1.3x, q8_0 about 2x, so charging SmolLM2's cost fails both."""
    d = json.loads((ROOT / "benchmarks" / "results" / "attention_rates_llamacpp_kv_heads_xeon.json").read_text())

    def slope(shape):
        t = {r["ctx"]: (r["median_us"] * 1e-6, r["heads"] * r["head_dim"]) for r in d["rows"]
             if r["kind"] == kind and r["shape"] == shape}
        return (t[8195][0] - t[2051][0]) / (6144 * t[8195][1])

    ratio = slope("llama-3.2-1b") / slope("smollm2-135m")
    assert ratio > 1.15
    c = ALL["llama.cpp"]["devices"]["host-xeon"]["kinds"][kind]["by_head_dim"]["64"]["compute_s_per_head_dim_position"]
    args = ("--device", "host-xeon", "-m", "llama-3.2-1b", "--runtime", "llama.cpp", "--strategy", strategy,
            "--weights", "int4")
    grow = 1 / _plan(*args, "--ctx", "8192")["decode_tokens_per_s"] - 1 / _plan(*args, "--ctx", "2048")[
        "decode_tokens_per_s"]
    assert grow == pytest.approx(16 * 6144 * 32 * 64 * c * ratio, rel=0.15)


def test_host_xeon_llamacpp_1b_prefill_at_its_kv_heads_rate_by_hand():
    """Llama-3.2-1B's 8192-token prefill on host-xeon's llama.cpp, q8_0 cache against f16: the same matmuls, so the
    prefills differ by the causal attention, 16 layers x 4 x 32 x 64 x 8192 x 8193 / 2 FLOP, over each type's fill
    rate stored at head size 64 divided by its factor at 8 KV heads (attention_flop_per_s_kv_heads_scale: the 1B
    shape's fills against SmolLM2's in one run)."""
    pre = ALL["llama.cpp"]["devices"]["host-xeon"]["prefill"]
    rate, scale = pre["attention_flop_per_s_by_head_dim"], pre["attention_flop_per_s_kv_heads_scale"]
    attn = 16 * 4 * 32 * 64 * 8192 * 8193 / 2
    want = attn * (scale["q8_0"]["64"]["8"] / rate["q8_0"]["64"] - scale["f16"]["64"]["8"] / rate["f16"]["64"])
    args = ("--device", "host-xeon", "-m", "llama-3.2-1b", "--runtime", "llama.cpp", "--weights", "int4", "--ctx",
            "8192", "--strategy")
    got = _plan(*args, "kv-int8")["prefill_seconds"] - _plan(*args, "kv")["prefill_seconds"]
    assert got == pytest.approx(want, rel=0.01)
    assert scale["q8_0"]["64"]["8"] > 1.2  # the 1B's q8_0 fills measured a third slower than SmolLM2's


def test_host_xeon_rates_are_stored_from_their_sources():
    """edgekv/costs/attention_rates.json devices.host-xeon is what benchmarks/device_rates.py builds from the Xeon's
    results JSONs and plan_vs_filled.json (nothing edited by hand), and differs from host's where both measured."""
    from conftest import load_benchmark

    dr = load_benchmark("device_rates")
    assert dr.main(["--device", "host-xeon", "--check"]) == 0
    for rt in ("onnxruntime", "executorch"):
        x, h = ALL[rt]["devices"]["host-xeon"], ALL[rt]["devices"]["host"]
        assert x["kinds"]["fp32"]["by_head_dim"]["64"] != h["kinds"]["fp32"].get("by_head_dim", {}).get("64")
        assert x["weights"]["int4"]["read_bytes_per_s"] != h["weights"]["int4"]["read_bytes_per_s"]
    # llama.cpp: its three cache types, its weights fitted on the Xeon's SmolLM2 rows and its GGUF weight types
    # measured on the Xeon (the host's schema), each another number than the EPYC's
    x, h = ALL["llama.cpp"]["devices"]["host-xeon"], ALL["llama.cpp"]["devices"]["host"]
    assert set(x["kinds"]) == set(h["kinds"]) == {"f16", "q8_0", "q4_0"}
    for k in x["kinds"]:
        assert x["kinds"][k]["overhead_s"] == 0.0 and x["kinds"][k]["by_head_dim"]["64"]["overhead_s"] == 0.0
        assert x["kinds"][k]["by_head_dim"]["64"]["compute_s_per_head_dim_position"] != \
            h["kinds"][k]["by_head_dim"]["64"]["compute_s_per_head_dim_position"]
        assert "_xeon.json" in x["kinds"][k]["source"]
    assert x["weights"]["int4"]["read_bytes_per_s"] != h["weights"]["int4"]["read_bytes_per_s"]
    assert set(x["gguf_types"]) == set(h["gguf_types"]) and {"Q4_0", "Q6_K", "Q4_1"} <= set(x["gguf_type_rates"])
    for t, g in x["gguf_type_rates"].items():
        assert g["read_bytes_per_s"] != h["gguf_type_rates"][t]["read_bytes_per_s"]
        assert "llamacpp_gguf_types_xeon.json" in g["source"]
    assert set(x["prefill"]["attention_flop_per_s_by_head_dim"]) == {"f16", "q8_0", "q4_0"}
    # ONNX Runtime: GenAI's int4 form ('4-bit/32') and the --weights gguf forms timed on the Xeon, and GenAI's cost
    # per 4 KiB page of cache, measured on the Xeon (the host entry holds it too, by machine_cpu)
    o, oh = ALL["onnxruntime"]["devices"]["host-xeon"], ALL["onnxruntime"]["devices"]["host"]
    forms = o["weights"]["gguf"]["by_form"]
    assert "4-bit/32" in forms["forms"] and "matmul_nbits_forms_xeon.json" in forms["source"]
    assert forms["forms"]["4-bit/32"]["rows"] != oh["weights"]["gguf"]["by_form"]["forms"]["4-bit/32"]["rows"]
    assert o["cache_pages"]["s_per_page"] == oh["cache_pages"]["s_per_page"]
    assert oh["cache_pages"]["machine_cpu"] == XEON_CPU


# none left (benchmarks/README.md, "On the Intel Xeon VM": the last three mended by the prefill matmul priced by
# matrix shape, the kernels' calls at their own keys' rate and custom_quantized_sdpa's int8 rate measured per head size)
PREFILL_MISSES: set = set()


def test_xeon_rows_are_priced_at_host_xeons_rates():
    """benchmarks/results/plan_vs_filled.json: every run whose JSON names the Xeon is set against host-xeon (its rows
    carry device), priced at host-xeon's stored rates (the plan's own number equals the prediction), its weights fitted
    on the Xeon's SmolLM2 rows only (Gemma's and the 1B's held out); decode within 25 % but for the miss named in
    benchmarks/README.md (the ONNX fp16 cache at a filled 8k, a fit row), and every modelled prefill; the 1B's
    llama.cpp rows at the per-key cost of its 8 KV heads (kv_heads_scale). llama.cpp's rows are priced as
    `edgekv plan -m <the row's GGUF> --device host-xeon` prices them (plan_gguf_tok_s: the file's own weight types at
    the rates measured on the Xeon), their fit rows (SmolLM2's at 2k) and the 1B's held-out row among them."""
    res = json.loads((ROOT / "benchmarks" / "results" / "plan_vs_filled.json").read_text())
    xeon = [r for r in res["rows"] if r.get("device") == "host-xeon"]
    assert len(xeon) >= 30
    assert {r["set"] for r in xeon if r["model"] != "smollm2-135m"} == {"held-out"}
    modelled = [r for r in xeon if r["modelled"]]
    assert len(modelled) >= 28
    for r in modelled:
        if r["row"].startswith("genai:"):  # GenAI's own graph, priced at its forms: no runtime edgekv plans
            assert r["plan_tok_s"] is None and r["set"] == "held-out"
            continue
        plan = r["plan_gguf_tok_s"] if r["runtime"] == "llama.cpp" else r["plan_tok_s"]
        assert plan == pytest.approx(r["predicted_tok_s"], rel=0.01), r
    lc = {(r["set"], r["row"], r["ctx"], r["file"]) for r in modelled if r["runtime"] == "llama.cpp"}
    assert {("fit", "llamacpp:f16", 2048, "filled_context_2048_llamacpp_xeon.json"),
            ("fit", "llamacpp:q8_0", 2048, "filled_context_2048_llamacpp_xeon.json"),
            ("held-out", "llamacpp:f16", 8192, "filled_context_8192_llama32_1b_pte_int8c.json")} <= lc, lc
    # the decode miss, named in benchmarks/README.md: the ONNX fp16 cache at 8k in one of its two runs (a fit row)
    misses = {(r["row"], r["ctx"], r["file"]) for r in modelled if not r["within_25"]}
    assert misses == {("edgekv-ort:kv/int4", 8192, "filled_context_8192_pte_fp16_kernel.json")}, misses
    # issue 41's two commands on this CPU: SmolLM2 at a filled 8k and Gemma-3-270M at 32k, each runtime and cache
    # the filled-context benchmark ran there, within 25 % (Gemma's held out)
    at = {(m, c): {r["row"] for r in modelled if m in r["model"] and r["ctx"] == c}
          for m, c in (("smollm2-135m", 8192), ("gemma-3-270m", 32768))}
    # every row of the benchmark's full list at 8k but the mla rows (its int4 export refused: runtimes.json
    # cannot_build) and the --weights gguf rows
    assert {"edgekv-ort:kv:dtype=fp32/int4", "edgekv-ort:kv/int4", "edgekv-ort:kv-int8c/int4", "edgekv-ort:kv-int8/int4",
            "edgekv-ort:kv-int4/int4", "edgekv-ort:window/int4", "edgekv-pte:kv:dtype=fp32/int4", "edgekv-pte:kv/int4",
            "edgekv-pte:kv-int8/int4", "edgekv-pte:kv-int8c/int4", "edgekv-pte:kv-int4/int4", "edgekv-pte:window/int4",
            "llamacpp:f16", "llamacpp:q8_0", "llamacpp:q4_0", "genai:int4", "et-llama:kv-fp32/8da4w"} \
        <= at["smollm2-135m", 8192]
    assert {"edgekv-ort:kv:dtype=fp32/int4", "edgekv-ort:kv/int4", "edgekv-ort:kv-int8c/int4", "edgekv-ort:window/int4",
            "edgekv-ort:kv-int4/int4", "edgekv-pte:kv:dtype=fp32/int4", "edgekv-pte:kv/int4",
            "edgekv-pte:kv-int8c/int4", "llamacpp:f16", "llamacpp:q8_0", "llamacpp:q4_0",
            "genai:int4"} <= at["gemma-3-270m", 32768]
    assert all(r["set"] == "held-out" and r["within_25"] for r in modelled
               if "gemma-3-270m" in r["model"] and r["ctx"] == 32768)
    # the 1B's llama.cpp rows at a filled 8k (issue 41, target 3): f16 +33 % and q8_0 +57 % at SmolLM2's per-key cost,
    # within 10 % at its own KV heads'
    t3 = [r for r in modelled if r["file"] == "filled_context_8192_llama32_1b_target3_xeon.json"
          and r["runtime"] == "llama.cpp"]
    assert {r["row"] for r in t3} == {"llamacpp:f16", "llamacpp:q8_0"} and all(abs(r["error"]) < 0.1 for r in t3)
    # the same 1B GGUF's decode timed alone per context on the Xeon (llamacpp_decode_by_ctx): the plan within 5 % at
    # 64 keys (its weights term, the file's types at the Xeon's per-type rates) and within 25 % at every context (the
    # per-key cost at its KV heads is the kernel's slope over 2k-8k; its q8_0 steps slow faster than linearly, so the
    # plan is slow at 1k-4k); at 8k the plan is the filled row's prediction
    by = {(r["cache"], r["ctx"]): r for r in res["llamacpp_decode_by_ctx"] if r["device"] == "host-xeon"}
    assert {("f16", 64), ("q8_0", 64), ("f16", 1024), ("f16", 8192), ("q8_0", 8192)} <= set(by)
    assert all(abs(r["error"]) < 0.05 for (_, n), r in by.items() if n == 64), by
    assert all(abs(r["error"]) < 0.25 for r in by.values()), by
    row = next(r for r in modelled if r["row"] == "llamacpp:f16" and r["ctx"] == 8192
               and r["model"].startswith("llama-3.2-1b"))
    assert by["f16", 8192]["plan_gguf_tok_s"] == pytest.approx(row["predicted_tok_s"], rel=0.01)
    # the prefill miss, named in benchmarks/README.md (PREFILL_MISSES)
    pre_miss = {(r["row"], r["ctx"], r["file"]) for r in xeon if "prefill_error" in r and not r["prefill_within_25"]}
    assert pre_miss == PREFILL_MISSES, pre_miss
    fits = res["devices"]["host-xeon"]
    for cost, rate in fits["weights_rates_bytes_per_s"].items():
        stored = ALL[cost]["devices"]["host-xeon"]["weights"]["int4"]["read_bytes_per_s"]
        assert stored == pytest.approx(rate, rel=0.001) and rate != pytest.approx(res["weights_rates_bytes_per_s"][cost])


def test_readme_xeon_table_is_plan_vs_filled_table():
    """benchmarks/README.md's table of the Xeon's rows is what `plan_vs_filled.py --table host-xeon` makes of
    results/plan_vs_filled.json, row for row (a row added, dropped, doubled or edited by hand fails); --into refuses a
    file with no table of that header."""
    from conftest import load_benchmark

    pvf = load_benchmark("plan_vs_filled")
    res = json.loads((ROOT / "benchmarks" / "results" / "plan_vs_filled.json").read_text())
    table = pvf.markdown_table(res["rows"], "host-xeon")
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    assert table in readme
    assert pvf.replace_table(readme, table) == readme
    n = sum(r.get("device") == "host-xeon" for r in res["rows"])
    assert table.count("\n") == n + 2 and len(set(table.splitlines())) == n + 2  # no row twice
    with pytest.raises(ValueError, match="0 tables"):
        pvf.replace_table("# nothing here\n", table)
