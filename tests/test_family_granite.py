"""Granite-4.0-H (Mamba-2 + attention, dense) against transformers' GraniteMoeHybridForCausalLM as the reference.

A tiny random model is built with transformers' own class (fixed seed, odd shapes: 6 query heads on 2 KV heads, GQA
ratio 3; 6 Mamba heads in 3 groups; conv kernel 4; Granite's four multipliers all away from 1 so that a missing one
shows), saved as safetensors, read by edgekv's registry, exported by `edgekv export` to ONNX and .pte, and driven by
ONNX Runtime / the ExecuTorch runtime alone: its logits follow transformers' full-sequence forward step by step with
the Mamba conv + SSM state and the attention KV carried across calls of 8 and 3 tokens and single-token steps.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_rows, greedy_with_state  # noqa: E402
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import load_any  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402

TINY = dict(vocab_size=103, hidden_size=48, intermediate_size=40, shared_intermediate_size=80, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "attention"],
            mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=3, mamba_d_state=8, mamba_d_conv=4,
            num_local_experts=0, max_position_embeddings=256, initializer_range=0.2, embedding_multiplier=3.0,
            residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0, tie_word_embeddings=False)


def tiny_granite(folder, **over):
    """A random GraniteMoeHybridForCausalLM saved as an HF folder; norms and the SSM's dt_bias / D moved off their
    init so that every one matters."""
    cfg = transformers.GraniteMoeHybridConfig(**{**TINY, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", ".D")):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_planner_reads_granite_as_mamba2_state_plus_kv(tmp_path):
    ref = tiny_granite(tmp_path)
    arch = read_config_json(tmp_path)
    assert arch.family == "hybrid" and arch.n_params == sum(p.numel() for p in ref.parameters())
    layout = build_layout(arch, parse_strategy("hybrid:dtype=fp32"), 64)
    assert [(t.name, t.shape) for t in layout.tensors] == [
        ("past_conv.0", (1, 96 + 2 * 3 * 8, 3)), ("past_ssm.0", (1, 6, 16, 8)),
        ("past_key_values.1.key", (1, 2, 64, 8)), ("past_key_values.1.value", (1, 2, 64, 8)),
        ("past_conv.2", (1, 144, 3)), ("past_ssm.2", (1, 6, 16, 8)),
        ("past_key_values.3.key", (1, 2, 64, 8)), ("past_key_values.3.value", (1, 2, 64, 8))]


def test_moe_config_is_refused_in_one_line(tmp_path):
    tiny_granite(tmp_path, num_local_experts=4, num_experts_per_tok=2)
    assert read_config_json(tmp_path).n_params > 0  # the planner reads it
    with pytest.raises(EdgekvError, match="num_local_experts 4: the granite export module runs the dense"):
        load_any(str(tmp_path), parse_strategy("hybrid"), 32)


@pytest.mark.parametrize("strategy,tol,over", [("hybrid:dtype=fp32", 2e-5, {}),
                                               ("hybrid:dtype=fp32", 2e-5, {"position_embedding_type": "rope"}),
                                               ("hybrid:dtype=int8", 0.05, {})])
def test_matches_transformers_over_prefill_and_decode(strategy, tol, over, tmp_path):
    ref = tiny_granite(tmp_path, **over)
    loaded = load_any(str(tmp_path), parse_strategy(strategy), 64)
    prompt = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9]
    tokens, logits, _ = greedy_with_state(loaded.module, prompt, steps=16, chunk=4)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (logits - want).abs().max().item()
    assert diff <= tol * scale, f"{strategy} {over}: max abs diff {diff:.3g} (logit scale {scale:.3g})"


@pytest.fixture(scope="module", params=[pytest.param("granite", marks=pytest.mark.slow)])
def exported(tmp_path_factory):
    from click.testing import CliRunner

    from edgekv.export.cli import cli

    pytest.importorskip("onnxruntime")
    pytest.importorskip("executorch")
    root = tmp_path_factory.mktemp("granite")
    ref = tiny_granite(root / "hf")
    out = root / "export"
    r = CliRunner().invoke(cli, ["export", "--model", str(root / "hf"), "--strategy", "hybrid:dtype=fp32", "--format",
                                 "onnx,pte", "--max-ctx", "32", "--prefill-chunk", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return ref, out


@pytest.mark.parametrize("fmt", ["onnx", "pte"])
def test_exported_granite_matches_transformers_step_by_step_in_the_runtime(exported, fmt):
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
    assert diff <= 1e-3, f"granite {fmt}: max abs diff {diff:.3g}"
