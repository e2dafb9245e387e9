"""edgekv analyze on a small Mamba built by transformers: curves, fits, the analytic prediction, and the plan reading
the stored result."""
import json
import math

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from conftest import run_cli
from edgekv import quality
from edgekv.analyze import report
from edgekv.analyze.analytic import ssm_prediction
from edgekv.analyze.run import Runner, default_text, make_variants, tokenize
from edgekv.strategies import parse_strategy

CTX = 192


@pytest.fixture(scope="module")
def mamba_dir(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("mamba")
    MambaForCausalLM(MambaConfig(vocab_size=256, hidden_size=48, num_hidden_layers=2, state_size=16)).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def result(mamba_dir):
    torch.set_num_threads(1)
    base = parse_strategy("ssm")
    variants = make_variants(base, [8], ["nearest", "stochastic"], 4)
    r = Runner(str(mamba_dir), base, variants, CTX, chunk=1)
    tokens = tokenize(r.ref, default_text(), CTX)
    r.run(tokens)
    an = ssm_prediction(r, tokens, 32768)
    return r, report.summarise(r, "stdlib", 32768, n_windows=12, analytic=an)


def test_every_variant_has_windowed_curves_and_a_classified_fit(result):
    _, res = result
    assert [v["source"] for v in res["variants"]] == ["state", "state", "weights"]
    for v in res["variants"]:
        assert len(v["positions"]) == len(v["kl"]) == len(v["top1"]) > 5
        assert v["fit"]["class"] in ("bounded", "accumulating", "compounding")
        assert v["extrapolated"]["ctx"] == 32768 and v["extrapolated"]["far_beyond_measured"]
    state = res["variants"][0]
    assert 0 < state["mean_kl"] < 1e-2 and state["mean_top1"] > 0.95
    assert len(state["state_rel_err"]) > 5 and all(e > 0 for e in state["state_rel_err"])


def test_weight_quantization_changes_the_output_but_not_the_state_precision(result):
    runner, res = result
    w = res["variants"][2]
    assert w["mean_kl"] > res["variants"][0]["mean_kl"]
    assert runner.loaded[2].layout.tensors[1].dtype == "float32"  # fp32 SSM state in the weights-only variant
    # the reference keeps its fp32 weights (loaders may share tensors: fake quantization must not write through)
    ref_w = runner.ref.module.backbone.layers[0].mixer.x_proj.weight
    var_w = runner.loaded[2].module.backbone.layers[0].mixer.x_proj.weight
    assert type(ref_w) is torch.nn.Parameter and ref_w.dtype == torch.float32
    assert not torch.equal(ref_w, var_w.dequantize())


def test_analytic_prediction_tracks_the_measured_state_error(result):
    _, res = result
    an = res["analytic"]
    # an independent estimate (linear recurrence + rounding noise) against the measured error of the int8 state:
    # measured -19.6 % on this fixture (2026-12-02), held to 30 %; a recurrence or noise term off by 2x is outside
    assert an["measured_at"] > 0 and abs(an["error_pct"]) < 30
    for layer in an["layers"]:
        assert 0 < layer["decay_median"] < 1 and layer["saturation_tokens"] >= 1
        assert layer["bits_needed"] in (4, 6, 8, 10, 12, 16, ">16")


def test_stored_result_becomes_the_plans_evidence(result, tmp_path, monkeypatch):
    _, res = result
    written = report.store(res, "tiny-mamba", tmp_path)
    assert [p.name for p in written] == ["tiny-mamba__ssm_dtype-int8.json"]
    monkeypatch.setattr(quality, "MEASURED_DIR", tmp_path)
    q = quality.quality("tiny-mamba", parse_strategy("ssm:dtype=int8"), 4096, native=False)
    assert q["source"] == "measured" and "edgekv measured" in q["evidence"]
    fit = json.loads(written[0].read_text())["fit"]
    p = fit["params"]  # the stored law at the plan's context, by hand, against the documented thresholds
    kl = p["a"] * 4096 ** p["b"] if fit["law"] == "power" else p["a"] * math.exp(p["k"] * 4096)
    want = "high" if fit["class"] == "compounding" else "low" if kl < 0.01 else "medium" if kl < 0.1 else "high"
    assert q["risk"] == want and f"{kl:.3g}" in q["evidence"]
    # no measurement for another strategy: the published evidence with its citation
    assert quality.quality("tiny-mamba", parse_strategy("ssm"), 4096, native=True)["source"] == "published"


def test_plot_and_json_from_the_command(mamba_dir, tmp_path):
    png = tmp_path / "a.png"
    p = run_cli("analyze", "--model", mamba_dir, "--strategy", "ssm", "--ctx", "64", "--weight-bits", "0",
                "--json", "--plot", png, "--threads", "1", check=True)
    out = json.loads(p.stdout)
    assert {"model", "strategy", "ctx", "variants"} <= set(out)
    v = out["variants"][0]
    assert {"bits", "rounding", "source", "positions", "kl", "top1", "state_rel_err", "fit", "extrapolated"} <= set(v)
    assert {"law", "params", "class"} <= set(v["fit"]) and {"ctx", "kl", "low", "high"} <= set(v["extrapolated"])
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_bits_is_one_line(mamba_dir):
    p = run_cli("analyze", "--model", mamba_dir, "--strategy", "ssm", "--bits", "3", "--ctx", "32")
    assert p.returncode == 2 and "--bits 3" in p.stderr and "Traceback" not in p.stderr


def test_weight_bits_other_than_an_exports_are_one_line(mamba_dir):
    p = run_cli("analyze", "--model", mamba_dir, "--strategy", "ssm", "--weight-bits", "3", "--ctx", "32")
    assert p.returncode == 2 and "--weight-bits" in p.stderr and "Traceback" not in p.stderr


def test_the_weights_line_quantizes_as_the_export_does_even_where_the_weights_are_already_int4(gguf_path):
    """SmolLM2's GGUF is Q4_1: its linears already lie on an asymmetric int4 grid in groups of 32, so rounding them
    to that grid again changes none of them (what the weights line once did: KL 0 on this model). The export's
    recipe is symmetric, quantizes the tied output matrix too and rounds activations to int8: the logits move."""
    from edgekv.analyze.run import fake_quantize_weights
    from edgekv.models import load_any
    from edgekv.quant import roundtrip

    ref = load_any(str(gguf_path), parse_strategy("kv:dtype=fp32"), 64)
    var = load_any(str(gguf_path), parse_strategy("kv:dtype=fp32"), 64)
    w = ref.module.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(roundtrip(w, 4, 32), w)  # the trap: asymmetric int4 in groups of 32 is this model's grid
    fake_quantize_weights(var.module, 4)
    q = var.module.model.layers[0].self_attn.q_proj.weight.dequantize()
    assert (q != w).float().mean() > 0.5
    assert ref.module.lm_head is None and var.module.lm_head is not None  # the output matrix untied and quantized
    tokens = torch.tensor([list(range(100, 132))])
    with torch.no_grad():
        a = ref.module(tokens, torch.tensor([0]), *ref.module.empty_state())[0].log_softmax(-1)
        b = var.module(tokens, torch.tensor([0]), *var.module.empty_state())[0].log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1).mean().item()
    # measured 0.64 nats over these 32 token ids (real text: 0.35, README); the old weights line gave 0, a wrong
    # scale or code several nats
    assert 0.2 < kl < 1.5


def _by_role(layout, state):
    return {(t.layer, t.role): x for t, x in zip(layout.tensors, state)}


def test_state_error_is_the_relative_error_of_the_dequantized_state(result, mamba_dir):
    """The runner's state error at position 20 against the two modules stepped here, dequantized by hand."""
    from edgekv.models import load_any
    from edgekv.quant import dequantize
    runner, _ = result
    tokens = tokenize(runner.ref, default_text(), CTX)[:20]
    ref = load_any(str(mamba_dir), parse_strategy("ssm:dtype=fp32"), CTX)
    var = load_any(str(mamba_dir), parse_strategy("ssm:dtype=int8"), CTX)  # nearest rounding, as variant 0
    states = []
    for lv in (ref, var):
        s = lv.module.empty_state()
        with torch.no_grad():
            for t, tok in enumerate(tokens):
                _, *s = lv.module(torch.tensor([[tok]]), torch.tensor([t]), *s)
        states.append(_by_role(lv.layout, s))
    r, v = states
    errs = [float((dequantize(v[(i, "ssm")], v[(i, "ssm.scale")], None, 8) - r[(i, "ssm")]).norm()
                  / r[(i, "ssm")].norm()) for i in range(2)]
    cv = runner.curves[0]
    assert cv.state_rel_err[cv.state_positions.index(20)] == pytest.approx(sum(errs) / 2, rel=1e-5)


def test_cache_state_error_compares_only_the_slots_a_call_wrote():
    """kv-int4 with group 16 (the tiny llama's head_dim is 48): the error of the second 64-token call, by hand."""
    from edgekv.models import load_any
    from edgekv.quant import dequantize
    base = parse_strategy("kv-int4:group=16")
    variants = make_variants(base, [4], ["nearest"], None)
    assert [v.strategy.label for v in variants] == ["kv-int4:group=16"]  # the group asked for, not the default 32
    r = Runner("fixtures/tiny/llama", base, variants, 128, chunk=64)
    tokens = tokenize(r.ref, default_text(), 128)
    r.run(tokens)
    states = []
    for strategy in (parse_strategy("kv:dtype=fp32"), base):
        fresh = load_any("fixtures/tiny/llama", strategy, 128)
        s = fresh.module.empty_state()
        with torch.no_grad():
            for start in (0, 64):
                _, *s = fresh.module(torch.tensor([tokens[start:start + 64]]), torch.tensor([start]), *s)
        states.append(_by_role(fresh.layout, s))
    ref, var = states
    errs = []
    for i in range(4):
        for role in ("key", "value"):
            cut = slice(64, 128)
            got = dequantize(var[(i, role)][:, :, cut], var[(i, role + ".scale")][:, :, cut],
                             var[(i, role + ".zero")][:, :, cut], 4, 16)
            want = ref[(i, role)][:, :, cut]
            errs.append(float((got - want).norm() / want.norm()))
    cv = r.curves[0]
    assert cv.state_positions == [64, 128]
    assert cv.state_rel_err[1] == pytest.approx(sum(errs) / len(errs), rel=1e-5)
