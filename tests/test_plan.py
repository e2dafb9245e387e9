"""The planner end to end: the published quadratic-tax numbers, JSON field names, ranking, devices."""
import json

import pytest

from conftest import run_cli
from edgekv.arch import catalog_arch
from edgekv.devices import all_devices, load_device
from edgekv.errors import EdgekvError
from edgekv.plan import make_plan
from edgekv.serving import quadratic_tax
from edgekv.strategies import parse_strategy

OPTION_KEYS = {"model", "strategy", "params", "native", "bytes", "budget_bytes", "fits", "decode_tokens_per_s",
               "prefill_seconds", "quality"}


def test_quadratic_tax_reproduces_the_published_numbers():
    rows = {(r.strategy.name, r.ctx): r for r in quadratic_tax()}
    kv4 = rows[("kv", 4000)]
    assert round(kv4.state_bytes_per_user / 1e9, 2) == 0.66 and kv4.users.value == 59
    assert round(kv4.usd.value, 2) == 0.34
    kv128 = rows[("kv", 128000)]
    assert round(kv128.state_bytes_per_user / 1e9, 2) == 20.97 and kv128.users.value == 1
    assert round(kv128.usd.value, 2) == 19.84
    mla = rows[("mla", 128000)]
    assert mla.users.value == 27 and round(mla.usd.value, 2) == 0.73
    hyb = rows[("hybrid", 128000)]
    assert hyb.users.value == 14 and round(hyb.usd.value, 2) == 1.42
    assert {"ssm", "linear", "ring"} <= {s for s, _ in rows}
    # cost inflation 4K -> 128K: the article's "58x" is the ratio of its rounded prices, 19.84 / 0.34
    assert round(round(kv128.usd.value, 2) / round(kv4.usd.value, 2)) == 58


def test_baseline_preset_json_and_explain():
    p = run_cli("baseline", "--preset", "quadratic-tax", "--json", "--explain", check=True)
    out = json.loads(p.stdout)
    for r in out["rows"]:
        assert {"strategy", "ctx", "state_bytes_per_user", "users", "usd_per_m_tokens"} <= set(r)
        assert isinstance(r["state_bytes_per_user"], int)
        assert "39 GB" in r["explain"]["assumptions"]


def test_plan_json_has_the_documented_fields():
    p = run_cli("plan", "--device", "pixel8", "--ctx", "32k", "--json", check=True)
    out = json.loads(p.stdout)
    assert out["ctx"] == 32768 and out["device"]["id"] == "pixel8"
    assert len(out["options"]) > 20
    for o in out["options"]:
        assert OPTION_KEYS <= set(o)
        assert set(o["bytes"]) == {"weights", "state", "workspace", "load", "runtime", "total"}
        assert all(isinstance(v, int) for v in o["bytes"].values())
        assert o["bytes"]["total"] == sum(v for k, v in o["bytes"].items() if k != "total")
        assert o["quality"]["risk"] and o["quality"]["evidence"]
    # ranked: every option that fits comes before every one that does not
    fits = [o["fits"] for o in out["options"]]
    assert fits == sorted(fits, reverse=True)
    # a transformer's ssm row is not silently dropped: it names catalog models of that family
    na = [e for e in out["not_applicable"] if e["strategy"] == "ssm" and e["model"] == "llama-3.2-1b"]
    assert na and all(a.startswith("mamba") for a in na[0]["alternatives"])


def test_70b_does_not_fit_a_phone_and_is_not_planned_by_default():
    names = {o["model"] for o in make_plan(load_device("pixel8"), 32768, [catalog_arch("llama-3.2-1b")]).to_json()["options"]}
    assert names == {"llama-3.2-1b"}
    p = make_plan(load_device("pixel8"), 4096, [catalog_arch("llama-3-70b")], [parse_strategy("kv")])
    assert not p.rows[0].fits


def test_phone_prefill_of_32k_takes_minutes_not_milliseconds():
    p = make_plan(load_device("pixel8"), 32768, [catalog_arch("llama-3.2-1b")], [parse_strategy("kv")])
    assert p.rows[0].prefill.value > 60


def test_ssm_decode_speed_does_not_fall_with_context_but_kv_does():
    dev = load_device("pixel8")
    def speed(model, spec, ctx):
        return make_plan(dev, ctx, [catalog_arch(model)], [parse_strategy(spec)]).rows[0].decode.value
    assert speed("mamba-1.4b", "ssm", 1024) == pytest.approx(speed("mamba-1.4b", "ssm", 131072))
    assert speed("llama-3.2-1b", "kv", 131072) < 0.8 * speed("llama-3.2-1b", "kv", 1024)


def test_every_device_profile_loads_with_sources():
    ids = {d.id for d in all_devices()}
    assert {"pixel8", "pixel8-pro", "pixel9", "galaxy-s24", "galaxy-a15", "midrange-6gb", "iphone15",
            "iphone15-pro", "iphone16-pro", "h100", "h200", "a100"} <= ids
    for d in all_devices():
        for name, f in d.facts.items():
            assert (f.source is None) != (f.estimate is None), (d.id, name)
    assert load_device("iphone15-pro").entitled_budget_bytes > load_device("iphone15-pro").budget_bytes
    h100 = load_device("h100")
    assert h100.usd_per_hour and "nvlink" in h100.interconnect


def test_device_toml_missing_a_field_is_one_clear_error(tmp_path):
    bad = tmp_path / "phone.toml"
    bad.write_text('id = "x"\nname = "X"\nclass = "phone"\n[ram_bytes]\nvalue = 1\nsource = "s"\n')
    with pytest.raises(EdgekvError, match="missing field 'app_budget_bytes'"):
        load_device(str(bad))
    p = run_cli("plan", "--device", bad, "--ctx", "4k")
    assert p.returncode == 2 and "missing field" in p.stderr and "Traceback" not in p.stderr


def test_a_users_own_device_file_works(tmp_path):
    src = load_device("pixel8").path
    mine = tmp_path / "myphone.toml"
    mine.write_text(open(src).read().replace('id = "pixel8"', 'id = "myphone"'))
    p = run_cli("plan", "--device", mine, "--ctx", "8k", "--model", "qwen2.5-0.5b", "--json", check=True)
    assert json.loads(p.stdout)["device"]["id"] == "myphone"


def test_gemma_int4_pte_weights_are_priced_with_its_int8_decoder_layers():
    """edgekv's int4 .pte keeps eight of Gemma-3-270M's decoder layers (3, 4, 5, 10, 11, 12, 13, 17: the layers
    measured one by one, edgekv.arch.variants.pte_int8_kept, as wquant.quantize_module applies it) int8 per output
    channel, the other 10 at 8da4w (int4 in groups of 32, fp16 scales), the untied output layer int4 in groups of 64
    (it holds more weights than the decoder layers together: wquant.pte_head_group), and gathers the embedding table
    from the output layer's codes as its own int4 copy with its scales as fp16, one per group of 64
    (wquant.gather_head_codes, embedding_4bit, FP16_TABLE_SCALES). By hand from Gemma-3-270M's published config
    (hidden 640, 4 heads of 256 on 1 KV head, intermediate 2048, 18 layers, vocabulary 262,144): per layer q
    1024x640, k and v 256x640, o 640x1024, gate and up 2048x640, down 640x2048 = 5,570,560 weights on 6,912 rows; an
    int8 layer at 1 B each + 2 B per row, an int4 one at 0.5 B + 2 B per 32; the head 167,772,160 weights at 0.5 B
    + 2 B per 64; the table the same; 18 x 3,072 + 640 norm weights at 4 B. The plan's weights are what is resident:
    the stored bytes less the table, which only the gather reads from the file's pages (workspace.json
    fields.table_paged; measured: the .pte's delegates hold 165,511,168 B of weights,
    benchmarks/results/pte_load_steps_gemma3.json)."""
    code, out, err = run_cli_json("plan", "-m", "gemma-3-270m", "--device", "pixel8", "--ctx", "32k",
                                  "--weights", "int4", "--runtime", "executorch", "--json")
    layers = 8 * (5_570_560 + 2 * 6_912) + 10 * (5_570_560 // 2 + 5_570_560 // 32 * 2)
    head = 167_772_160 // 2 + 167_772_160 // 64 * 2
    table = 167_772_160 // 2 + 167_772_160 // 64 * 2
    norms = 4 * (18 * 3_072 + 640)
    assert {o["bytes"]["weights"] for o in out["options"]} == {layers + head + norms} == {165_362_176}
    from edgekv.arch import catalog_arch
    from edgekv.devices import load_device
    from edgekv.plan import device_deployment
    from edgekv.strategies import parse_strategy
    d = device_deployment(catalog_arch("gemma-3-270m"), parse_strategy("kv"), load_device("pixel8"), 32768, "int4",
                          "edgekv-pte")
    assert d.weights["total"] == layers + head + table + norms == 254_491_136  # stored: the table's copy too
    assert d.paged.value == table
    # SmolLM2 (a llama: 8da4w everywhere) keeps 4-bit layers
    code, out, err = run_cli_json("plan", "-m", "smollm2-135m", "--device", "pixel8", "--ctx", "8k",
                                  "--weights", "int4", "--runtime", "executorch", "--json")
    assert max(o["bytes"]["weights"] for o in out["options"]) < 0.2e9


def run_cli_json(*args):
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    return r.returncode, json.loads(r.stdout), r.stderr
