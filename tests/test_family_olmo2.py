"""OLMo-2 (Olmo2ForCausalLM), a Llama variant declared in edgekv.arch.variants (norms after each sublayer only, qk-norm
over the whole q / k projection), against transformers as the reference.

A tiny random model built with transformers' Olmo2Config (6 query heads on 2 KV heads: GQA 3, head_dim 16), its norm
weights moved off 1 so that every norm counts; saved as safetensors and read by edgekv's llama module."""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import cli, greedy_with_state  # noqa: E402
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.models import family_of, load_any  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

FP32 = parse_strategy("kv:dtype=fp32")
TINY = dict(vocab_size=101, hidden_size=96, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_olmo2(folder, **over):
    cfg = transformers.Olmo2Config(**{**TINY, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Olmo2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


def test_the_planner_counts_the_weights_transformers_builds(tmp_path):
    """edgekv's reader lists Olmo2's tensors (no input norm, a q_norm of H*D and a k_norm of Hkv*D channels): the
    same names and shapes as the checkpoint transformers writes."""
    ref = tiny_olmo2(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "olmo2"
    arch = read_config_json(tmp_path)
    assert {w.name: w.shape for w in arch.weights} == {n: tuple(p.shape) for n, p in ref.state_dict().items()}
    assert arch.family == "transformer" and family_of(tmp_path).name == "llama"


@pytest.mark.parametrize("chunk", [None, 4])
def test_matches_transformers_over_prefill_and_decode(tmp_path, chunk):
    ref = tiny_olmo2(tmp_path)
    loaded = load_any(str(tmp_path), FP32, 48)
    prompt = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9]
    tokens, logits, _ = greedy_with_state(loaded.module, prompt, steps=20, chunk=chunk)
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0]
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (logits - want).abs().max().item()
    assert diff <= 2e-5 * scale, f"chunk {chunk}: max abs diff {diff:.3g} (logit scale {scale:.3g})"


def test_the_catalog_entry_plans():
    code, out, err = cli("plan", "-m", "olmo-2-1b", "--device", "pixel8", "--ctx", "4k", "--json")
    assert code == 0, err
    rows = json.loads(out)["options"]
    kv = next(o for o in rows if o["strategy"] == "kv")
    # fp16 K and V: 16 layers x 16 KV heads x 128 channels x 2 (K, V) x 2 bytes per token
    assert kv["bytes"]["state"] == 16 * 16 * 128 * 2 * 2 * 4096


# ---- exported, run by the runtimes alone (minutes on 2 shared cores: `make test-all` runs it) ----


@pytest.fixture(scope="module", params=[pytest.param("olmo2", marks=pytest.mark.slow)])
def exported(request, tmp_path_factory):
    from click.testing import CliRunner

    from edgekv.export.cli import cli as export_cli

    pytest.importorskip("onnxruntime")
    pytest.importorskip("executorch")
    root = tmp_path_factory.mktemp("olmo2")
    ref = tiny_olmo2(root / "hf")
    out = root / "export"
    r = CliRunner().invoke(export_cli, ["export", "--model", str(root / "hf"), "--strategy", "kv:dtype=fp32",
                                        "--format", "onnx,pte", "--max-ctx", "32", "--prefill-chunk", "8",
                                        "--out", str(out)])
    assert r.exit_code == 0, r.output
    return ref, out


@pytest.mark.parametrize("fmt", ["onnx", "pte"])
def test_exported_olmo2_matches_transformers_step_by_step_in_the_runtime(exported, fmt):
    """The runtimes' fused attention (GroupQueryAttention, custom_sdpa) with the whole-projection qk-norm before it."""
    import numpy as np

    from conftest import greedy_rows
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper, PteStepper

    ref, out = exported
    manifest = load_export(out)
    art = next(a for a in manifest["artifacts"] if a["format"] == fmt)
    assert art.get("state_in_place"), art
    stepper = OrtStepper(manifest, out) if fmt == "onnx" else PteStepper(manifest, out)
    prompt = [5, 9, 33, 12, 40, 7, 21, 3, 18, 50, 11]
    tokens, ours = greedy_rows(stepper, prompt, 32 - len(prompt) - 1)
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0].numpy()
    assert np.abs(want).max() > 1.0
    diff = np.abs(ours - want).max()
    assert diff <= 1e-3, f"{fmt}: max abs diff {diff:.3g}"
