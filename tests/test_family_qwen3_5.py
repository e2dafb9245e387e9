"""Qwen3.5 (Gated DeltaNet + gated full attention: edgekv.models.qwen3_5): what is particular to it (its state
layout, the image-text wrapper, refused strategies, int8 KV on the full-attention layers only).
The tiny model is tests/tiny_families.py's; its parity with transformers, eager and exported, is
tests/test_family_conformance.py.
"""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_with_state  # noqa: E402
from tiny_families import hf_logits, tiny  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import family_of, load_any  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402

HYBRID = parse_strategy("hybrid:dtype=fp32,state_dtype=fp32")


def test_state_layout_is_conv_and_recurrent_per_linear_layer_and_kv_per_full_layer(tmp_path):
    tiny("qwen3_5", tmp_path)
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


def test_the_image_text_wrapper_loads_its_text_model(tmp_path):
    """Qwen3_5ForConditionalGeneration's checkpoints (the published Qwen3.5-0.8B / 2B): model_type qwen3_5, the text
    config under text_config and the text weights under model.language_model; vision weights are left out."""
    from safetensors.torch import load_file, save_file

    ref = tiny("qwen3_5", tmp_path / "text")
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
    tiny("qwen3_5", tmp_path)
    with pytest.raises(EdgekvError, match="ssm:dtype=fp32 does not apply to a qwen3_5-family model"):
        load_any(str(tmp_path), parse_strategy("ssm"), 32)
    # kv / kv-int8 name the hybrid's own form (edgekv.models.hybrid_alias): its attention caches in that format
    loaded = load_any(str(tmp_path), parse_strategy("kv-int8"), 32)
    assert loaded.layout.strategy.startswith("hybrid:dtype=int8")


def test_int8_kv_on_the_full_attention_layers_only(tmp_path):
    """hybrid:dtype=int8 quantizes the full attention layers' caches (edgekv.quant codes + a scale per token and head,
    as kv-int8) and leaves the DeltaNet state fp32; logits stay near transformers' fp32 ones."""
    ref = tiny("qwen3_5", tmp_path)
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
