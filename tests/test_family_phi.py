"""Phi-3 / Phi-4-mini (Phi3ForCausalLM) through the llama module (edgekv.models.phi3 rewrites the checkpoint) against
transformers as the reference.

Tiny random models built with transformers' Phi3Config (6 query heads on 2 KV heads: GQA 3, head_dim 16), in the
shapes the published checkpoints use: Phi-4-mini's partial rotary (0.75: 12 of 16 channels rotate) with longrope
(short and long factors, an attention factor from max_position_embeddings / original_max_position_embeddings) and tied
embeddings; Phi-3-mini's full rotary with a sliding window shorter than the sequence, so its ring rolls. Saved as
safetensors, exported by `edgekv export` to ONNX and .pte and driven by ONNX Runtime / the ExecuTorch runtime alone.
"""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_rows, greedy_with_state  # noqa: E402
from edgekv.models import family_of, load_any  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

FP32 = parse_strategy("kv:dtype=fp32")
ORIGINAL = 40  # the tiny longrope's original_max_position_embeddings

TINY = {
    # Phi-4-mini's shape: partial rotary 0.75, longrope, tied embeddings (its config.json; edgekv/catalog/phi-4-mini)
    "phi4mini": dict(vocab_size=101, hidden_size=96, intermediate_size=80, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=160,
                     original_max_position_embeddings=ORIGINAL, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 1000.0, "partial_rotary_factor": 0.75,
                                      "short_factor": [1.0, 1.3, 1.9, 2.6, 3.1, 4.0],
                                      "long_factor": [1.0, 2.2, 4.1, 7.0, 9.5, 12.0]},
                     initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Phi-3-mini-4k's shape: full rotary, no scaling, a sliding window on every layer (2047 there, 8 here)
    "phi3mini": dict(vocab_size=97, hidden_size=96, intermediate_size=80, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8,
                     initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


def tiny_phi(kind: str, folder, **over):
    cfg = transformers.Phi3Config(**{**TINY[kind], **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_phi3_checkpoint_is_the_llama_family_with_fused_projections_split(tmp_path):
    tiny_phi("phi4mini", tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "phi3"
    assert family_of(tmp_path).name == "llama"
    loaded = load_any(str(tmp_path), FP32, 32)
    attn = loaded.module.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (96, 96) and attn.k_proj.weight.shape == (32, 96)
    # 12 of 16 channels rotate: 6 frequencies, 2 of the llama module's 8 at zero (the pass-through channels)
    inv = loaded.module.inv_freq
    assert inv.shape == (8,) and (inv[6:] == 0).all() and (inv[:6] > 0).all()


@pytest.mark.parametrize("kind,ctx,n", [("phi4mini", 32, 30),  # short factors: the whole run within the original 40
                                        ("phi4mini", 96, 70),  # long factors: the run passes 40, as transformers'
                                        ("phi3mini", 32, 30)])  # the window of 8 rolls
def test_matches_transformers_over_prefill_and_decode(kind, ctx, n, tmp_path):
    ref = tiny_phi(kind, tmp_path)
    loaded = load_any(str(tmp_path), FP32, ctx)
    prompt = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9]
    tokens, logits, _ = greedy_with_state(loaded.module, prompt, steps=n - len(prompt), chunk=4)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (logits - want).abs().max().item()
    assert diff <= 2e-5 * scale, f"{kind} ctx {ctx}: max abs diff {diff:.3g} (logit scale {scale:.3g})"


def test_longrope_without_its_original_context_is_one_clear_line(tmp_path):
    from edgekv.errors import EdgekvError
    tiny_phi("phi4mini", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"]["short_factor"] = [1.0, 2.0]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EdgekvError, match="short_factor must list 6 numbers"):
        load_any(str(tmp_path), FP32, 32)


# ---- exported, run by the runtimes alone ----


CASES = {"phi4mini": ("phi4mini", 32), "phi3mini": ("phi3mini", 32)}


# each export traces and lowers both formats: minutes on 2 shared cores (`make test-all` runs them)
@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) for k in sorted(CASES)])
def exported(request, tmp_path_factory):
    from click.testing import CliRunner

    from edgekv.export.cli import cli

    pytest.importorskip("onnxruntime")
    pytest.importorskip("executorch")
    kind, ctx = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    ref = tiny_phi(kind, root / "hf")
    out = root / "export"
    r = CliRunner().invoke(cli, ["export", "--model", str(root / "hf"), "--strategy", "kv:dtype=fp32", "--format",
                                 "onnx,pte", "--max-ctx", str(ctx), "--prefill-chunk", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return request.param, ref, out, ctx


@pytest.mark.parametrize("fmt", ["onnx", "pte"])
def test_exported_phi_matches_transformers_step_by_step_in_the_runtime(exported, fmt):
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper, PteStepper

    name, ref, out, ctx = exported
    manifest = load_export(out)
    if name == "phi4mini":  # no rolling layer: the fused ops (GroupQueryAttention's own rotary, custom_sdpa) ran
        art = next(a for a in manifest["artifacts"] if a["format"] == fmt)
        assert art.get("state_in_place"), art
    stepper = OrtStepper(manifest, out) if fmt == "onnx" else PteStepper(manifest, out)
    prompt = [5, 9, 33, 12, 40, 7, 21, 3, 18, 50, 11]
    tokens, ours = greedy_rows(stepper, prompt, ctx - len(prompt) - 1)
    want = hf_logits(ref, tokens).numpy()
    assert np.abs(want).max() > 1.0
    diff = np.abs(ours - want).max()
    assert diff <= 1e-3, f"{name} {fmt}: max abs diff {diff:.3g}"
