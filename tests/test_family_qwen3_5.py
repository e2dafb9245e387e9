"""Qwen3.5 (Gated DeltaNet + gated full attention: edgekv.models.qwen3_5) against transformers' Qwen3_5ForCausalLM.

Tiny random models built with transformers' Qwen3_5TextConfig in odd shapes: 6 query heads on 2 KV heads (GQA 3),
head_dim 16 with a quarter of it rotated (Qwen3.5's partial_rotary_factor 0.25), linear layers with 3 value heads per
key head (Dk 8, Dv 12) and a conv kernel of 4; sequences longer than the kernel, so the conv state carries real
inputs across calls. Saved as safetensors, exported by `edgekv export` to ONNX and .pte, and driven by ONNX Runtime /
the ExecuTorch runtime alone; logits follow transformers' full-sequence forward (its chunked delta rule) step by step.
"""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_rows, greedy_with_state  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import family_of, load_any  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402

HYBRID = parse_strategy("hybrid:dtype=fp32,state_dtype=fp32")
TINY = dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, linear_num_key_heads=2,
            linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25},
            tie_word_embeddings=False, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_qwen3_5(folder, **over):
    """A random Qwen3_5ForCausalLM saved as an HF folder; norm weights moved off their init (the (1 + w) norms start
    at 0) and dt_bias / A_log spread, so that every norm and each head's decay matters."""
    cfg = transformers.Qwen3_5TextConfig(**{**TINY, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_state_layout_is_conv_and_recurrent_per_linear_layer_and_kv_per_full_layer(tmp_path):
    tiny_qwen3_5(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_text"
    assert family_of(tmp_path).name == "qwen3_5"
    loaded = load_any(str(tmp_path), HYBRID, 64)
    assert loaded.layout == build_layout(loaded.arch, HYBRID, 64)  # the planner's layout, tensor for tensor
    got = [(t.name, t.shape) for t in loaded.layout.tensors]
    assert got == [("past_conv.0", (1, 2 * 2 * 8 + 6 * 12, 3)), ("past_recurrent.0", (1, 6, 8, 12)),
                   ("past_key_values.1.key", (1, 2, 64, 16)), ("past_key_values.1.value", (1, 2, 64, 16)),
                   ("past_conv.2", (1, 104, 3)), ("past_recurrent.2", (1, 6, 8, 12)),
                   ("past_key_values.3.key", (1, 2, 64, 16)), ("past_key_values.3.value", (1, 2, 64, 16))]
    assert loaded.arch.n_params == sum(p.numel() for p in loaded.module.parameters())


@pytest.mark.parametrize("chunk", [1, 5])
def test_matches_transformers_over_prefill_and_decode(chunk, tmp_path):
    ref = tiny_qwen3_5(tmp_path)
    loaded = load_any(str(tmp_path), HYBRID, 64)
    prompt = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9]
    tokens, logits, _ = greedy_with_state(loaded.module, prompt, steps=12, chunk=chunk)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (logits - want).abs().max().item()
    assert diff <= 2e-5 * scale, f"chunk {chunk}: max abs diff {diff:.3g} (logit scale {scale:.3g})"


def test_the_image_text_wrapper_loads_its_text_model(tmp_path):
    """Qwen3_5ForConditionalGeneration's checkpoints (the published Qwen3.5-0.8B / 2B): model_type qwen3_5, the text
    config under text_config and the text weights under model.language_model; vision weights are left out."""
    from safetensors.torch import load_file, save_file

    ref = tiny_qwen3_5(tmp_path / "text")
    sd = load_file(tmp_path / "text" / "model.safetensors")
    wrapped = {k.replace("model.", "model.language_model.", 1): v for k, v in sd.items()}
    wrapped["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    (tmp_path / "vl").mkdir()
    save_file(wrapped, tmp_path / "vl" / "model.safetensors")
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    (tmp_path / "vl" / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text,
                                                             "tie_word_embeddings": False}))
    loaded = load_any(str(tmp_path / "vl"), HYBRID, 32)
    tokens, logits, _ = greedy_with_state(loaded.module, [3, 17, 42, 5, 8], steps=3)
    assert torch.allclose(logits, hf_logits(ref, tokens), atol=1e-4)


def test_a_strategy_the_hybrid_does_not_keep_is_one_clear_line(tmp_path):
    tiny_qwen3_5(tmp_path)
    with pytest.raises(EdgekvError, match="ssm:dtype=fp32 does not apply to a qwen3_5-family model"):
        load_any(str(tmp_path), parse_strategy("ssm"), 32)
    # kv / kv-int8 name the hybrid's own form (edgekv.models.hybrid_alias): its attention caches in that format
    loaded = load_any(str(tmp_path), parse_strategy("kv-int8"), 32)
    assert loaded.layout.strategy.startswith("hybrid:dtype=int8")


# ---- exported, run by the runtimes alone ----


@pytest.fixture(scope="module", params=[pytest.param("qwen3_5", marks=pytest.mark.slow)])  # minutes: make test-all
def exported(request, tmp_path_factory):
    from click.testing import CliRunner

    from edgekv.export.cli import cli

    pytest.importorskip("onnxruntime")
    pytest.importorskip("executorch")
    root = tmp_path_factory.mktemp("qwen3_5")
    ref = tiny_qwen3_5(root / "hf")
    out = root / "export"
    r = CliRunner().invoke(cli, ["export", "--model", str(root / "hf"), "--strategy", HYBRID.label, "--format",
                                 "onnx,pte", "--max-ctx", "32", "--prefill-chunk", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return ref, out


@pytest.mark.parametrize("fmt", ["onnx", "pte"])
def test_exported_qwen3_5_matches_transformers_step_by_step_in_the_runtime(exported, fmt):
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper, PteStepper

    ref, out = exported
    manifest = load_export(out)
    names = {t["input"] for t in manifest["state"]["tensors"]}
    assert {"past_conv.0", "past_recurrent.0", "past_key_values.1.key"} <= names
    stepper = OrtStepper(manifest, out) if fmt == "onnx" else PteStepper(manifest, out)
    prompt = [5, 9, 33, 12, 40, 7, 21, 3, 18, 50, 11]  # 11 tokens: a prefill of 8, then 3 through decode
    tokens, ours = greedy_rows(stepper, prompt, 10)
    want = hf_logits(ref, tokens).numpy()
    assert np.abs(want).max() > 1.0
    diff = np.abs(ours - want).max()
    assert diff <= 1e-3, f"{fmt}: max abs diff {diff:.3g}"


def test_int8_kv_on_the_full_attention_layers_only(tmp_path):
    """hybrid:dtype=int8 quantizes the full attention layers' caches (edgekv.quant codes + a scale per token and head,
    as kv-int8) and leaves the DeltaNet state fp32; logits stay near transformers' fp32 ones."""
    ref = tiny_qwen3_5(tmp_path)
    s = parse_strategy("hybrid:dtype=int8,state_dtype=fp32")
    loaded = load_any(str(tmp_path), s, 64)
    roles = {(t.layer, t.role): t.dtype for t in loaded.layout.tensors}
    assert roles[(1, "key")] == "int8" and roles[(1, "key.scale")] == "float16"
    assert roles[(0, "recurrent")] == "float32" and (0, "key") not in roles
    prompt = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9]
    tokens, logits, state = greedy_with_state(loaded.module, prompt, steps=6, chunk=4)
    assert state[2].dtype == torch.int8 and state[2].abs().max() > 0
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    diff = (logits - want).abs().max().item()
    assert 0 < diff <= 2e-2 * scale, f"max abs diff {diff:.3g} (logit scale {scale:.3g})"
