"""Zamba2 (Mamba-2 layers, shared attention blocks with per-layer LoRA at the hybrid layers) against transformers'
Zamba2ForCausalLM.

A tiny random model is built with transformers' own class (fixed seed, odd shapes: 6 attention heads over the
2 x 24-wide concatenation of stream and embeddings, head dim 8; 4 Mamba heads in 2 groups; two shared blocks over
three hybrid layers, so that block 0 serves two layers with different adapters and its weights are stored once;
RoPE on), saved as safetensors, read by edgekv's registry and compared in eager torch; exported by `edgekv export` to
ONNX and .pte and driven by ONNX Runtime / the ExecuTorch runtime alone: its logits follow transformers'
full-sequence forward step by step with each hybrid layer's KV and every layer's conv + SSM state carried across
calls of 8 and 3 tokens and single-token steps.
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

TINY = dict(vocab_size=103, hidden_size=24, num_hidden_layers=5,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], num_attention_heads=6,
            num_key_value_heads=6, mamba_d_state=8, mamba_d_conv=4, n_mamba_heads=4, mamba_ngroups=2,
            intermediate_size=40, num_mem_blocks=2, adapter_rank=5, use_shared_attention_adapter=True,
            use_mem_rope=True, max_position_embeddings=256, initializer_range=0.1)
# initializer_range 0.1, not the 0.2 of the other families' tiny models: at 0.2 this model amplifies a change in its
# input some thousand times (transformers' own fp32 forward is 1e-4 from its fp64 forward), too chaotic a reference


def tiny_zamba2(folder, **over):
    """A random Zamba2ForCausalLM saved as an HF folder; norms and the SSM's dt_bias / D moved off their init, and
    the adapters' second matrices (which a real init leaves small) made as large as the first, so that every one
    matters."""
    cfg = transformers.Zamba2Config(**{**TINY, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", ".D")) or "adapter" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    word_tokenizer(folder, cfg.vocab_size)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_planner_reads_hybrid_layers_as_kv_plus_mamba2_state(tmp_path):
    ref = tiny_zamba2(tmp_path)
    arch = read_config_json(tmp_path)  # transformers 5 writes the Mamba layers as "linear_attention"
    assert arch.family == "hybrid" and arch.n_params == sum(p.numel() for p in ref.parameters())
    layout = build_layout(arch, parse_strategy("hybrid:dtype=fp32"), 64)
    ssm = [("conv", (1, 48 + 2 * 2 * 8, 3)), ("ssm", (1, 4, 12, 8))]
    kv = [("key", (1, 6, 64, 8)), ("value", (1, 6, 64, 8))]
    assert [(t.layer, t.role, t.shape) for t in layout.tensors] == [
        (i, r, s) for i in range(5) for r, s in ((kv if i in (1, 3, 4) else []) + ssm)]


def test_unsupported_variant_is_refused_in_one_line(tmp_path):
    tiny_zamba2(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text().replace('"use_long_context": false', '"use_long_context": true'))
    with pytest.raises(EdgekvError, match="use_long_context is not supported by the zamba2 export module"):
        load_any(str(tmp_path), parse_strategy("hybrid"), 32)


@pytest.mark.parametrize("strategy,tol,over", [
    ("hybrid:dtype=fp32", 2e-5, {}),
    ("hybrid:dtype=fp32", 2e-5, {"use_mem_rope": False, "use_shared_attention_adapter": False, "num_mem_blocks": 1,
                                 "num_key_value_heads": 2, "hidden_act": "silu"}),  # NoPE, GQA 3, no q/k/v LoRA
    ("hybrid:dtype=int8", 0.05, {})])
def test_matches_transformers_over_prefill_and_decode(strategy, tol, over, tmp_path):
    ref = tiny_zamba2(tmp_path, **over)
    loaded = load_any(str(tmp_path), parse_strategy(strategy), 64)
    prompt = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9]
    tokens, logits, _ = greedy_with_state(loaded.module, prompt, steps=16, chunk=4)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (logits - want).abs().max().item()
    assert diff <= tol * scale, f"{strategy} {over}: max abs diff {diff:.3g} (logit scale {scale:.3g})"


@pytest.fixture(scope="module", params=[pytest.param("zamba2", marks=pytest.mark.slow)])
def exported(tmp_path_factory):
    from click.testing import CliRunner

    from edgekv.export.cli import cli

    pytest.importorskip("onnxruntime")
    pytest.importorskip("executorch")
    root = tmp_path_factory.mktemp("zamba2")
    ref = tiny_zamba2(root / "hf")
    out = root / "export"
    r = CliRunner().invoke(cli, ["export", "--model", str(root / "hf"), "--strategy", "hybrid:dtype=fp32", "--format",
                                 "onnx,pte", "--max-ctx", "32", "--prefill-chunk", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return ref, out


@pytest.mark.parametrize("fmt", ["onnx", "pte"])
def test_exported_zamba2_matches_transformers_step_by_step_in_the_runtime(exported, fmt):
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
    assert diff <= 1e-3, f"zamba2 {fmt}: max abs diff {diff:.3g}"


def test_run_works_on_the_export(exported):
    """edgekv run: the greedy continuation transformers generates."""
    ref, out = exported
    r = run_cli("run", str(out), "--prompt", "w5 w9 w33", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    gen = ref.generate(torch.tensor([[8, 12, 36]]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, 3:].tolist()
    assert json.loads(r.stdout)["text"].split() == [f"w{i - 3}" for i in gen]


def test_export_takes_kv_strategies_as_the_hybrid_form(tmp_path):
    """`edgekv export --strategy kv-int8` (or kv, kv-int4) on a hybrid is its native state with that attention
    cache, as analyze reads it (edgekv.models.hybrid_alias), not a refusal naming hybrid."""
    from edgekv.export.options import check_applies, family_form
    from edgekv.strategies import parse_strategy

    tiny_zamba2(tmp_path)
    for spec, want in [("kv-int8", "hybrid:dtype=int8,state_dtype=fp32"), ("kv", "hybrid:dtype=fp16,state_dtype=fp32")]:
        s = family_form(str(tmp_path), parse_strategy(spec))
        assert s.label == want
        layout = check_applies(str(tmp_path), s, 32)
        assert {"key", "value", "conv", "ssm"} <= set(layout.bytes_by_role())


def test_a_context_past_the_trained_one_is_refused_before_weights_are_built(tmp_path):
    """edgekv.models.base.read_source (the hybrids' one reader): max_ctx above max_position_embeddings is one line."""
    from edgekv.models.zamba2 import read_zamba2

    tiny_zamba2(tmp_path, max_position_embeddings=48)
    assert read_zamba2(str(tmp_path), 48).args.max_position == 48
    with pytest.raises(EdgekvError, match="max_ctx 49 exceeds the model's trained context 48"):
        read_zamba2(str(tmp_path), 49)
