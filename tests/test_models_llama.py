"""The export-first llama module (edgekv.models.llama) against transformers as the independent reference.

Every test runs our module the way an exported program runs: a prefill, then one-token decode steps with the state
tensors fed back, and compares its logits with transformers' full-sequence forward over the same tokens.
"""
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_with_state  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import load_model  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

FP32 = parse_strategy("kv:dtype=fp32")
FP16 = parse_strategy("kv:dtype=fp16")
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.strategies import build_layout  # noqa: E402
from tiny_families import hf_logits  # noqa: E402



TINY = {
    "llama": dict(cls="LlamaConfig", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": dict(cls="Qwen2Config", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True, initializer_range=0.2, rope_theta=1e6),
    "mistral": dict(cls="MistralConfig", vocab_size=89, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=8, head_dim=8, max_position_embeddings=256,
                    sliding_window=4096, initializer_range=0.2),
}


def tiny_hf(kind: str, folder):
    """A random transformers model of that family, saved as an HF folder (config.json + model.safetensors)."""
    spec = dict(TINY[kind])
    cfg = getattr(transformers, spec.pop("cls"))(**spec)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", sorted(TINY))
def test_tiny_random_model_matches_transformers_over_prefill_and_32_decode_steps(kind, tmp_path):
    ref = tiny_hf(kind, tmp_path)
    ours = load_model(str(tmp_path), FP32, max_ctx=64).module
    prompt = [3, 17, 42, 5, 8, 60, 11]
    tokens, logits, _ = greedy_with_state(ours, prompt, steps=32)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    assert scale > 1.0  # random weights with a large init: attention and RoPE really matter
    diff = (logits - want).abs().max().item()
    assert diff <= 2e-5 * scale, f"{kind}: max abs diff {diff:.3g} (logit scale {scale:.3g})"
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_fp16_cache_stays_close_to_the_fp32_reference(tmp_path):
    ref = tiny_hf("llama", tmp_path)
    ours = load_model(str(tmp_path), FP16, max_ctx=64).module
    assert all(s.dtype == torch.float16 for s in ours.empty_state())
    tokens, logits, _ = greedy_with_state(ours, [3, 17, 42, 5], steps=32)
    want = hf_logits(ref, tokens)
    diff = (logits - want).abs().max().item()
    assert diff <= 5e-3 * want.abs().max().item()  # fp16 rounds K/V to ~5e-4 relative


def test_chunked_prefill_equals_one_shot_prefill(tmp_path):
    tiny_hf("qwen2", tmp_path)
    ours = load_model(str(tmp_path), FP32, max_ctx=32).module
    prompt = [4, 9, 33, 2, 71, 15, 60, 8, 1, 99, 23]
    _, one, _ = greedy_with_state(ours, prompt, steps=8)
    _, chunked, _ = greedy_with_state(ours, prompt, steps=8, chunk=4)
    assert (one - chunked).abs().max().item() < 1e-5


def test_state_is_exactly_the_strategy_layout(tmp_path):
    from edgekv.arch import read_config_json
    from edgekv.strategies import build_layout

    tiny_hf("llama", tmp_path)
    loaded = load_model(str(tmp_path), FP16, max_ctx=48)
    layout = build_layout(read_config_json(tmp_path), FP16, 48)
    assert loaded.layout == layout
    out = loaded.module(torch.tensor([[1, 2]]), torch.tensor([0]), *loaded.module.empty_state())
    assert out[0].shape == (1, 2, 97)
    assert [tuple(t.shape) for t in out[1:]] == [t.shape for t in layout.tensors] == [(1, 2, 48, 16)] * 6
    assert [t.name for t in layout.tensors][:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    # by hand: 3 layers x (K, V) x 2 KV heads x 48 slots x head_dim 16 x 2 B (fp16)
    assert layout.nbytes == sum(t.numel() * t.element_size() for t in out[1:]) == 3 * 2 * 2 * 48 * 16 * 2


@pytest.mark.parametrize("spec,bits,group", [("kv-int8", 8, 0), ("kv-int4:group=8", 4, 8), ("kv-int2:group=8", 2, 8)])
def test_quantized_cache_holds_transformers_keys_rounded_by_the_quantizer(tmp_path, spec, bits, group):
    """The codes a kv-int* module stores, dequantized, are transformers' own keys and values after one trip through
    edgekv.quant (itself checked against llama.cpp's q8_0/q4_1), and the state is exactly the planner's layout."""
    from edgekv.quant import dequantize, roundtrip

    ref = tiny_hf("llama", tmp_path)
    strategy = parse_strategy(spec)
    loaded = load_model(str(tmp_path), strategy, max_ctx=32)
    layout = build_layout(read_config_json(tmp_path), strategy, 32)
    ids = torch.tensor([[3, 17, 5, 42, 8, 1, 77, 9, 12, 30, 2, 64]])
    out = loaded.module(ids, torch.tensor([0]), *loaded.module.empty_state())
    state = out[1:]
    assert [(tuple(t.shape), str(t.dtype)) for t in state] == [(t.shape, f"torch.{t.dtype}") for t in layout.tensors]
    with torch.no_grad():
        hf = ref(ids, use_cache=True).past_key_values
    n = 2 if bits == 8 else 3
    for layer in range(1):  # layer 0 only: later layers see the quantized cache's effect on their input
        for j, hf_t in enumerate((hf.layers[layer].keys, hf.layers[layer].values)):
            parts = state[2 * n * layer + n * j: 2 * n * layer + n * (j + 1)]
            ours = dequantize(parts[0], parts[1], parts[2] if bits < 8 else None, bits, group)[:, :, :12]
            want = roundtrip(hf_t, bits, group)
            step = (hf_t.abs().max() / 127) if bits == 8 else (hf_t.max() - hf_t.min()) / (2 ** bits - 1)
            close = (ours - want).abs() <= 1e-4 * hf_t.abs().max()
            assert close.float().mean() > 0.98 and ((ours - want).abs() <= step * 1.01).all()
    # the logits still follow transformers' closely (more loosely for fewer bits)
    want_logits = ref(ids).logits
    tol = {8: 0.05, 4: 0.5, 2: 2.0}[bits] * want_logits.abs().max()
    assert 0 < (out[0] - want_logits).abs().max() < tol


def test_unsupported_cache_dtypes_are_refused_in_one_line(tmp_path):
    tiny_hf("llama", tmp_path)
    with pytest.raises(EdgekvError, match="fp32, fp16"):
        load_model(str(tmp_path), parse_strategy("kv:dtype=bf16"), max_ctx=16)


def test_unknown_model_name_is_a_user_error():
    with pytest.raises(EdgekvError, match="smollm2-135m"):
        load_model("no-such-model", FP32, max_ctx=16)


# ---- real weights: SmolLM2-135M (GGUF Q4_1) against transformers' own GGUF loader ----


@pytest.fixture(scope="module")
def smollm2(gguf_path):
    t0 = time.perf_counter()
    ours = load_model("smollm2-135m", FP32, max_ctx=128)
    t1 = time.perf_counter()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                            dtype=torch.float32, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    print(f"\nload: edgekv {t1 - t0:.1f} s, transformers {time.perf_counter() - t1:.1f} s")
    return ours, ref, tok


def test_smollm2_gguf_resolves_from_the_pip_package(gguf_path):
    from edgekv.models.weights import resolve_model
    assert resolve_model("smollm2-135m") == gguf_path


def test_smollm2_matches_transformers_on_a_real_sentence_and_32_decode_steps(smollm2):
    ours, ref, tok = smollm2
    prompt = tok("The Python standard library contains modules for reading files, parsing")["input_ids"]
    assert len(prompt) >= 8
    tokens, logits, _ = greedy_with_state(ours.module, prompt, steps=32)
    want = hf_logits(ref, tokens)
    diff = (logits - want).abs().max().item()
    scale = want.abs().max().item()
    print(f"SmolLM2 fp32: {len(tokens)} positions, max abs diff {diff:.2e}, logit scale {scale:.1f}")
    assert diff <= 1e-3 * scale
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_smollm2_layout_is_the_planners_layout(smollm2, gguf_path):
    from edgekv.arch import read_gguf
    from edgekv.strategies import build_layout
    ours = smollm2[0]
    assert ours.layout == build_layout(read_gguf(gguf_path), FP32, 128)
    assert ours.args.n_layers == 30 and ours.args.n_kv_heads == 3 and ours.args.tied
    # by hand from SmolLM2-135M's published config: 30 layers x (K, V) x 3 KV heads x 128 slots x head_dim 64 x 4 B
    assert ours.layout.nbytes == 30 * 2 * 3 * 128 * 64 * 4 == 5_898_240
    assert {t.shape for t in ours.layout.tensors} == {(1, 3, 128, 64)}


def test_sharded_safetensors_folder_loads_like_a_single_file(tmp_path):
    ref = tiny_hf("llama", tmp_path / "one")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one = load_model(str(tmp_path / "one"), FP32, max_ctx=16).module
    sharded = load_model(str(tmp_path / "sharded"), FP32, max_ctx=16).module
    for (n, a), (_, b) in zip(one.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), n


def test_llama3_rope_matches_transformers_and_gguf_rope_freqs_factors():
    """Llama-3.1 rope scaling two ways: the config formula, and llama.cpp's rope_freqs.weight factors (a GGUF stores
    llama3 scaling as per-frequency divisors of the default inverse frequencies)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from edgekv.models.layers import rope_inv_freq
    from edgekv.models.llama import LlamaArgs

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_theta=500000.0,
                                   rope_scaling=scaling, max_position_embeddings=131072)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    base = dict(vocab=8, hidden=2048, n_layers=1, n_heads=32, n_kv_heads=8, head_dim=64, intermediate=8,
                rope_theta=500000.0, max_position=131072)
    ours = rope_inv_freq(LlamaArgs(**base, rope_scaling=scaling))
    assert torch.allclose(ours, want, rtol=1e-6)
    default = rope_inv_freq(LlamaArgs(**base))
    factors = (default / want).tolist()  # what convert_hf_to_gguf writes as rope_freqs.weight
    assert max(factors) == pytest.approx(8.0) and min(factors) == pytest.approx(1.0)
    via_gguf = rope_inv_freq(LlamaArgs(**base, rope_freq_factors=factors))
    assert torch.allclose(via_gguf, want, rtol=1e-6)
