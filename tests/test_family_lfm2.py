"""LFM2 (gated short convolutions + GQA attention) against transformers' Lfm2ForCausalLM as the independent reference.

A tiny random model is built with transformers' own class (fixed seed, odd shapes: 6 query heads on 2 KV heads, GQA
ratio 3, head_dim 8, conv kernel 4, conv and attention layers alternating, conv biases on), saved as safetensors, read by
edgekv's registry, exported by `edgekv export` to ONNX and .pte, and driven by ONNX Runtime / the ExecuTorch runtime
alone: its logits follow transformers' full-sequence forward step by step, over many more tokens than the conv
kernel, with the conv state carried across calls of 8 and 3 tokens and across single-token steps.
"""
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_rows, greedy_with_state, run_cli  # noqa: E402
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import family_of, load_any  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402

HYBRID = parse_strategy("hybrid:dtype=fp32")
KIND = ["conv", "full_attention", "conv", "full_attention"]
TINY = dict(vocab_size=101, hidden_size=48, intermediate_size=96, block_multiple_of=16, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=2, layer_types=KIND, conv_L_cache=4, conv_bias=True,
            max_position_embeddings=256, initializer_range=0.2, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 1e4},
            tie_word_embeddings=False)


def tiny_lfm2(folder, **over):
    """A random Lfm2ForCausalLM saved as an HF folder; norm weights moved off 1 so that every norm matters."""
    cfg = transformers.Lfm2Config(**{**TINY, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    word_tokenizer(folder, cfg.vocab_size)
    return model


def word_tokenizer(folder, vocab: int):
    """A word-level tokenizer.json over the vocabulary (word w{i} is token id i + 3), so that `edgekv run` has text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(Path(folder) / "tokenizer.json"))


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_planner_reads_lfm2_as_a_hybrid_of_conv_state_and_kv(tmp_path):
    ref = tiny_lfm2(tmp_path)
    arch = read_config_json(tmp_path)
    assert arch.family == "hybrid" and arch.n_params == sum(p.numel() for p in ref.parameters())
    layout = build_layout(arch, HYBRID, 64)
    assert [(t.name, t.shape) for t in layout.tensors[:3]] == [
        ("past_conv.0", (1, 48, 3)), ("past_key_values.1.key", (1, 2, 64, 8)), ("past_key_values.1.value", (1, 2, 64, 8))]
    assert sum(t.role == "conv" for t in layout.tensors) == 2
    q = build_layout(arch, parse_strategy("hybrid:dtype=int8"), 64)  # int8 KV on the attention layers, conv fp32
    assert {t.dtype for t in q.tensors if t.role == "key"} == {"int8"}
    assert {t.dtype for t in q.tensors if t.role == "conv"} == {"float32"}
    with pytest.raises(EdgekvError, match="window:.* does not apply to a lfm2-family model"):
        load_any(str(tmp_path), parse_strategy("window:w=8"), 32)
    # kv (analyze's fp32 reference) is the native state with the KV in that dtype
    assert load_any(str(tmp_path), parse_strategy("kv:dtype=fp32"), 32).layout == build_layout(arch, HYBRID, 32)
    assert family_of(tmp_path).name == "lfm2"


@pytest.mark.parametrize("strategy,tol", [("hybrid:dtype=fp32", 2e-5), ("hybrid:dtype=int8", 0.05)])
def test_matches_transformers_over_prefill_and_decode(strategy, tol, tmp_path):
    """fp32: to fp32 rounding. dtype=int8 (the attention layers' KV in int8, the conv state exact): within int8's
    error."""
    ref = tiny_lfm2(tmp_path)
    loaded = load_any(str(tmp_path), parse_strategy(strategy), 64)
    prompt = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9]
    tokens, logits, _ = greedy_with_state(loaded.module, prompt, steps=20, chunk=4)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (logits - want).abs().max().item()
    assert diff <= tol * scale, f"{strategy}: max abs diff {diff:.3g} (logit scale {scale:.3g})"


@pytest.fixture(scope="module", params=[pytest.param("lfm2", marks=pytest.mark.slow)])
def exported(tmp_path_factory):
    from click.testing import CliRunner

    from edgekv.export.cli import cli

    pytest.importorskip("onnxruntime")
    pytest.importorskip("executorch")
    root = tmp_path_factory.mktemp("lfm2")
    ref = tiny_lfm2(root / "hf")
    out = root / "export"
    r = CliRunner().invoke(cli, ["export", "--model", str(root / "hf"), "--strategy", "hybrid:dtype=fp32", "--format",
                                 "onnx,pte", "--max-ctx", "40", "--prefill-chunk", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return ref, out


@pytest.mark.parametrize("fmt", ["onnx", "pte"])
def test_exported_lfm2_matches_transformers_step_by_step_in_the_runtime(exported, fmt):
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper, PteStepper

    ref, out = exported
    manifest = load_export(out)
    names = [t["input"] for t in manifest["state"]["tensors"]]
    assert names[:2] == ["past_conv.0", "past_key_values.1.key"]
    stepper = OrtStepper(manifest, out) if fmt == "onnx" else PteStepper(manifest, out)
    prompt = [5, 9, 33, 12, 40, 7, 21, 3, 18, 50, 11]  # calls of 8 and 3 tokens
    tokens, ours = greedy_rows(stepper, prompt, 40 - len(prompt) - 1)
    want = hf_logits(ref, tokens).numpy()
    assert np.abs(want).max() > 1.0
    diff = np.abs(ours - want).max()
    assert diff <= 1e-3, f"lfm2 {fmt}: max abs diff {diff:.3g}"


def test_run_and_profile_work_on_the_export(exported, tmp_path):
    """edgekv run: the greedy continuation transformers generates; edgekv profile: a report for the export."""

    ref, out = exported
    r = run_cli("run", str(out), "--prompt", "w5 w9 w33", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    gen = ref.generate(torch.tensor([[8, 12, 36]]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, 3:].tolist()
    assert data["text"].split() == [f"w{i - 3}" for i in gen]
    r = run_cli("profile", str(out), "--ctx", "24", "--steps", "4", "--json", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p.json").read_text())


def test_analyze_refuses_a_text_its_tokenizer_reads_as_one_unknown_id(tmp_path):
    """The word-level test vocabulary reads analyze's English text as <unk> throughout: KL 0 and top-1 1.000 there
    would be a measurement of nothing, so it is one line and exit 2."""
    tiny_lfm2(tmp_path)
    r = run_cli("analyze", "--model", tmp_path, "--strategy", "kv-int8", "--ctx", 32, "--weight-bits", 0)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "reads the text as 1 distinct id(s) in 33 tokens" in r.stderr.strip().splitlines()[-1], r.stderr
