"""Falcon-H1 (attention and Mamba-2 side by side in every layer) against transformers' FalconH1ForCausalLM.

A tiny random model is built with transformers' own class (fixed seed, odd shapes: 6 query heads on 2 KV heads, GQA
ratio 3, head_dim 12 that is not hidden / heads; 6 Mamba heads in 3 groups with mamba_d_ssm 72, not expand x hidden;
conv kernel 4; every muP multiplier away from 1 and each of the five ssm_multipliers different, so that a missing or
misplaced one shows), saved as safetensors, read by edgekv's registry, and compared in eager torch (both gate forms
of the Mamba half) and, exported by `edgekv export` to ONNX and .pte, driven by ONNX Runtime / the ExecuTorch runtime
alone: its logits follow transformers' full-sequence forward step by step with the KV and the conv + SSM state of
every layer carried across calls of 8 and 3 tokens and single-token steps.
"""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_rows, greedy_with_state, run_cli  # noqa: E402
from test_family_lfm2 import word_tokenizer  # noqa: E402
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import load_any  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402

TINY = dict(vocab_size=103, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, head_dim=12, mamba_d_ssm=72, mamba_n_heads=6, mamba_d_head=12, mamba_n_groups=3,
            mamba_d_state=8, mamba_d_conv=4, mamba_rms_norm=False, max_position_embeddings=256,
            initializer_range=0.2, embedding_multiplier=3.0, lm_head_multiplier=0.7, attention_in_multiplier=1.3,
            attention_out_multiplier=0.6, key_multiplier=0.4, ssm_in_multiplier=1.25, ssm_out_multiplier=0.8,
            ssm_multipliers=[0.35, 0.25, 0.9, 0.5, 1.6], mlp_multipliers=[0.88, 0.59], tie_word_embeddings=False)


def tiny_falcon(folder, **over):
    """A random FalconH1ForCausalLM saved as an HF folder; norms and the SSM's dt_bias / D moved off their init so
    that every one matters."""
    cfg = transformers.FalconH1Config(**{**TINY, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", ".D")):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    word_tokenizer(folder, cfg.vocab_size)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_planner_reads_every_layer_as_kv_plus_mamba2_state(tmp_path):
    ref = tiny_falcon(tmp_path)
    arch = read_config_json(tmp_path)
    assert arch.family == "hybrid" and arch.n_params == sum(p.numel() for p in ref.parameters())
    layout = build_layout(arch, parse_strategy("hybrid:dtype=fp32"), 64)
    dc = 72 + 2 * 3 * 8
    assert [(t.name, t.shape) for t in layout.tensors] == [
        (name, shape) for i in range(3) for name, shape in (
            (f"past_key_values.{i}.key", (1, 2, 64, 12)), (f"past_key_values.{i}.value", (1, 2, 64, 12)),
            (f"past_conv.{i}", (1, dc, 3)), (f"past_ssm.{i}", (1, 6, 12, 8)))]


def test_unsupported_variant_is_refused_in_one_line(tmp_path):
    tiny_falcon(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text().replace('"hidden_act": "silu"', '"hidden_act": "gelu"'))
    assert read_config_json(tmp_path).n_params > 0  # the planner still reads it
    with pytest.raises(EdgekvError, match="hidden_act 'gelu' is not supported by the falcon-h1 export module"):
        load_any(str(tmp_path), parse_strategy("hybrid"), 32)


@pytest.mark.parametrize("strategy,tol,over", [
    ("hybrid:dtype=fp32", 2e-5, {}),  # Falcon-H1-0.5B's form: y * silu(z), no norm
    ("hybrid:dtype=fp32", 2e-5, {"mamba_rms_norm": True, "mamba_norm_before_gate": False}),  # 1.5B, 7B
    ("hybrid:dtype=fp32", 2e-5, {"mamba_rms_norm": True, "mamba_norm_before_gate": True}),  # the config default
    ("hybrid:dtype=int8", 0.05, {})])
def test_matches_transformers_over_prefill_and_decode(strategy, tol, over, tmp_path):
    ref = tiny_falcon(tmp_path, **over)
    loaded = load_any(str(tmp_path), parse_strategy(strategy), 64)
    prompt = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9]
    tokens, logits, _ = greedy_with_state(loaded.module, prompt, steps=16, chunk=4)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (logits - want).abs().max().item()
    assert diff <= tol * scale, f"{strategy} {over}: max abs diff {diff:.3g} (logit scale {scale:.3g})"


@pytest.fixture(scope="module", params=[pytest.param("falcon-h1", marks=pytest.mark.slow)])
def exported(tmp_path_factory):
    from click.testing import CliRunner

    from edgekv.export.cli import cli

    pytest.importorskip("onnxruntime")
    pytest.importorskip("executorch")
    root = tmp_path_factory.mktemp("falcon_h1")
    ref = tiny_falcon(root / "hf", mamba_rms_norm=True, mamba_norm_before_gate=False)
    out = root / "export"
    r = CliRunner().invoke(cli, ["export", "--model", str(root / "hf"), "--strategy", "hybrid:dtype=fp32", "--format",
                                 "onnx,pte", "--max-ctx", "32", "--prefill-chunk", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return ref, out


@pytest.mark.parametrize("fmt", ["onnx", "pte"])
def test_exported_falcon_h1_matches_transformers_step_by_step_in_the_runtime(exported, fmt):
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper, PteStepper

    ref, out = exported
    manifest = load_export(out)
    stepper = OrtStepper(manifest, out) if fmt == "onnx" else PteStepper(manifest, out)
    prompt = [5, 9, 33, 12, 40, 7, 21, 3, 18, 50, 11]  # calls of 8 and 3 tokens
    tokens, ours = greedy_rows(stepper, prompt, 32 - len(prompt) - 1)
    want = hf_logits(ref, tokens).numpy()
    assert np.abs(want).max() > 1.0
    diff = np.abs(ours - want).max()
    assert diff <= 1e-3, f"falcon-h1 {fmt}: max abs diff {diff:.3g}"


def test_run_and_profile_work_on_the_export(exported, tmp_path):
    """edgekv run: the greedy continuation transformers generates; edgekv profile: a report for the export."""
    ref, out = exported
    r = run_cli("run", str(out), "--prompt", "w5 w9 w33", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    gen = ref.generate(torch.tensor([[8, 12, 36]]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, 3:].tolist()
    assert json.loads(r.stdout)["text"].split() == [f"w{i - 3}" for i in gen]
    r = run_cli("profile", str(out), "--ctx", "24", "--steps", "4", "--json", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p.json").read_text())


@pytest.mark.slow
def test_int4_kv_on_every_layer_exports_and_runs_in_onnx_runtime(tmp_path):
    """hybrid:dtype=int4: every layer's KV as kv-int4 codes (uint8, two per byte) with fp16 scales and zeros, the
    Mamba state fp32; ONNX Runtime's logits follow the eager module's over prefill and decode."""
    from click.testing import CliRunner

    from edgekv.export.cli import cli
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper

    pytest.importorskip("onnxruntime")
    tiny_falcon(tmp_path / "hf", head_dim=32)  # groups of 32
    out = tmp_path / "export"
    r = CliRunner().invoke(cli, ["export", "--model", str(tmp_path / "hf"), "--strategy", "hybrid:dtype=int4",
                                 "--format", "onnx", "--max-ctx", "32", "--prefill-chunk", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    manifest = load_export(out)
    dtypes = {(t["role"], t["dtype"]) for t in manifest["state"]["tensors"]}
    assert dtypes == {("key", "uint8"), ("value", "uint8"), ("key.scale", "float16"), ("value.scale", "float16"),
                      ("key.zero", "float16"), ("value.zero", "float16"), ("conv", "float32"), ("ssm", "float32")}
    prompt = [5, 9, 33, 12, 40, 7, 21, 3, 18, 50, 11]
    tokens, ours = greedy_rows(OrtStepper(manifest, out), prompt, 12)
    loaded = load_any(str(tmp_path / "hf"), parse_strategy("hybrid:dtype=int4"), 32)
    state, pos, rows = loaded.module.empty_state(), 0, []
    for part in (tokens[:8], tokens[8:11], *([t] for t in tokens[11:])):
        with torch.no_grad():
            logits, *state = loaded.module(torch.tensor([part]), torch.tensor([pos]), *state)
        rows.append(logits[0].numpy())
        pos += len(part)
    want = np.concatenate(rows)
    diff = np.abs(ours - want).max()
    assert diff <= 1e-3, f"falcon-h1 int4 onnx vs eager: max abs diff {diff:.3g}"
