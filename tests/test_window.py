"""Rolling (ring-buffer) KV caches: the `window:w=W,sinks=S` strategy and native sliding-window layers.

The reference is always transformers: MistralForCausalLM's own sliding-window attention (S = 0), or a full-sequence
LlamaForCausalLM / MistralForCausalLM forward given an explicit 4-D additive attention mask that encodes the rule
written out here independently of edgekv: query q sees key k iff k <= q and (q - k < W or k < S) [and q - k < Wn for a
native window Wn]. transformers 5.24 takes a 4-D mask as-is (masking_utils._preprocess_mask_arguments). Our module runs
as an exported program runs: chunked prefill, then one-token decode steps with the state fed back.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import ROOT, greedy_with_state  # noqa: E402
from edgekv.models import load_model  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

TINY_LLAMA = ROOT / "fixtures" / "tiny" / "llama"  # trained: 4 layers, 4 KV heads, head_dim 48


def rule(w=None, sinks=0, native=None):
    """The attention rule as a function of int64 position tensors (q, k) -> bool."""
    def sees(q, k):
        ok = k <= q
        if w is not None:
            ok = ok & ((q - k < w) | (k < sinks))
        if native is not None:
            ok = ok & (q - k < native)
        return ok
    return sees


def masked_logits(model, tokens, sees) -> torch.Tensor:
    """transformers' full-sequence forward with a 4-D additive mask [1, 1, N, N] built from `sees`."""
    n = len(tokens)
    allowed = sees(torch.arange(n)[:, None], torch.arange(n)[None, :])
    mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        return model(torch.tensor([tokens]), attention_mask=mask).logits[0]


def tiny_hf(folder, kind="mistral", sliding_window=None):
    """A random GQA model (large init, so attention and RoPE matter) saved as an HF folder; eager attention."""
    common = dict(vocab_size=89, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=8, max_position_embeddings=256, initializer_range=0.2)
    if kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=sliding_window)
    elif kind == "qwen2":  # layers >= max_window_layers slide: here layer 0 is global, layer 1 slides
        cfg = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=sliding_window,
                                       max_window_layers=1)
    else:
        cfg = transformers.LlamaConfig(**common)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(folder)
    return model


def assert_close(logits, want, rel, what):
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (logits - want).abs().max().item()
    assert diff <= rel * scale, f"{what}: max abs diff {diff:.3g} (logit scale {scale:.3g})"
    return diff


PROMPT = [3, 17, 42, 5, 8, 60, 11, 29, 71, 2, 50, 33, 14, 88, 7, 21, 40, 9, 66, 19]  # 20 tokens


@pytest.mark.parametrize("kind,chunk", [("mistral", 5), ("mistral", 13), ("qwen2", 13)])  # chunks < and > W
def test_native_sliding_window_matches_transformers_far_past_the_window(tmp_path, kind, chunk):
    """Mistral (every layer slides) and Qwen2 (a global layer 0 with a full cache, a sliding layer 1 with a ring)."""
    w = 8
    ref = tiny_hf(tmp_path, kind, sliding_window=w)
    loaded = load_model(str(tmp_path), parse_strategy("kv:dtype=fp32"), max_ctx=96)
    slots = [w, w] if kind == "mistral" else [96, w]  # T = the window, not max_ctx 96, on sliding layers
    assert [tuple(t.shape) for t in loaded.module.empty_state()] == [(1, 4, t, 8) for t in slots for _ in "kv"]
    tokens, logits, _ = greedy_with_state(loaded.module, PROMPT, steps=40, chunk=chunk)  # 60 positions = 7.5 W
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0]  # transformers' own sliding-window mask
    assert_close(logits, want, 2e-5, f"{kind} chunk {chunk}")
    assert torch.equal(logits.argmax(-1), want.argmax(-1))
    # the test can fail: the same weights without the window give clearly different logits
    full = masked_logits(ref, tokens, rule())
    assert (full - want).abs().max() > 0.1 * want.abs().max()


@pytest.mark.parametrize("kind,native,spec,chunk", [
    ("llama", None, "window:w=8,sinks=3,dtype=fp32", 5),
    ("llama", None, "window:w=8,sinks=3,dtype=fp32", 13),
    ("llama", None, "window:w=8,sinks=3,dtype=fp32", 20),  # the whole prompt in one call: C = 20 > W + S
    ("llama", None, "window:w=8,sinks=0,dtype=fp32", 13),
    ("mistral", 12, "window:w=6,sinks=2,dtype=fp32", 5),  # W + S < Wn: sinks + a ring of W, sinks age out at Wn
    ("mistral", 12, "window:w=8,sinks=6,dtype=fp32", 13),  # W + S > Wn: a ring of Wn, the strategy's rule on top
])
def test_window_with_sinks_matches_transformers_with_the_explicit_mask(tmp_path, kind, native, spec, chunk):
    ref = tiny_hf(tmp_path, kind, sliding_window=native)
    strategy = parse_strategy(spec)
    w, s = strategy.params["w"], strategy.params["sinks"]
    loaded = load_model(str(tmp_path), strategy, max_ctx=96)
    t = min(w + s, native or 96)
    assert [tuple(x.shape) for x in loaded.module.empty_state()] == [(1, 4, t, 8)] * 4
    tokens, logits, _ = greedy_with_state(loaded.module, PROMPT, steps=40, chunk=chunk)
    want = masked_logits(ref, tokens, rule(w, s, native))
    assert_close(logits, want, 2e-5, spec)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))
    # the sinks matter: the same window without them is another computation
    if s:
        nosinks = masked_logits(ref, tokens, rule(w, 0, native))
        assert (nosinks - want).abs().max() > 0.05 * want.abs().max()


def test_int8_cache_on_native_sliding_layers_stays_close_to_transformers(tmp_path):
    ref = tiny_hf(tmp_path, "mistral", sliding_window=8)
    loaded = load_model(str(tmp_path), parse_strategy("kv-int8"), max_ctx=96)
    state = loaded.module.empty_state()
    assert [(tuple(x.shape), x.dtype) for x in state[:2]] == [((1, 4, 8, 8), torch.int8), ((1, 4, 8, 1), torch.float16)]
    tokens, logits, _ = greedy_with_state(loaded.module, PROMPT, steps=40, chunk=13)
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0]
    assert_close(logits, want, 0.05, "kv-int8 sliding")  # the bound test_models_llama uses for kv-int8


def test_window_memory_is_w_plus_s_at_any_max_ctx_and_generation_runs_to_max_ctx():
    """The trained tiny llama, window 16 + 4 sinks, fp16 (the strategy's default): the state is [1, Hkv, 20, D] at
    max_ctx 64 and 4096 alike; generating to position 63 (2.75 ring wraps) follows transformers with the mask, and
    each ring slot holds transformers' own (RoPE'd) key of the position the slot rule says it holds."""
    strategy = parse_strategy("window:w=16,sinks=4")
    small, big = (load_model(str(TINY_LLAMA), strategy, max_ctx=n) for n in (64, 4096))
    for loaded in (small, big):
        assert [tuple(t.shape) for t in loaded.module.empty_state()] == [(1, 4, 20, 48)] * 8
        assert all(t.dtype == torch.float16 for t in loaded.module.empty_state())
    assert small.layout.nbytes == big.layout.nbytes == 8 * 4 * 20 * 48 * 2

    prompt = list(b"The ring keeps four sinks and sixteen")[:24]
    tokens, logits, state = greedy_with_state(small.module, prompt, steps=64 - len(prompt), chunk=10)
    assert len(tokens) == 64
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(TINY_LLAMA), attn_implementation="eager").eval()
    want = masked_logits(ref, tokens, rule(16, 4))
    assert_close(logits, want, 5e-3, "fp16 window")  # fp16 rounds K/V to ~5e-4 relative
    assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= 0.98

    # which position each slot holds after 64 positions, simulated by writing them one by one
    held = {}
    for p in range(64):
        held[p if p < 4 else 4 + (p - 4) % 16] = p
    with torch.no_grad():
        hf_keys = ref(torch.tensor([tokens]), use_cache=True).past_key_values.layers[0].keys[0]  # [Hkv, 64, D]
    ours = state[0][0].float()  # layer 0 key: its input does not depend on attention
    for slot, p in held.items():
        assert torch.allclose(ours[:, slot], hf_keys[:, p], atol=2e-3 * hf_keys.abs().max().item()), (slot, p)


def test_exported_window_onnx_matches_eager_and_transformers_well_past_the_window(tmp_path):
    """The default suite's version of the two-runtime test below: the ONNX artifact only (the .pte's lowering is the
    slow part), the same window, prompt and 40 decode steps, against the eager module and transformers with the
    mask."""
    from edgekv.export.manifest import load_export
    from edgekv.export.pipeline import export_model
    from edgekv.export.options import ExportOptions
    from edgekv.export.runtime import EagerStepper, OrtStepper

    out = tmp_path / "win"
    manifest = export_model(ExportOptions(model=str(TINY_LLAMA), strategy="window:w=16,sinks=4", formats=("onnx",),
                                          max_ctx=128, out=out, prefill_chunk=16, threads=1), echo=lambda s: None)
    assert manifest["verification"]["onnx"]["passed"]
    # by hand: 4 layers x (K, V) of [1, 4 KV heads, 16 + 4 slots, head_dim 48], fp16
    assert [t["shape"] for t in manifest["state"]["tensors"]] == [[1, 4, 20, 48]] * 8
    assert manifest["state"]["bytes"] == 8 * 4 * 20 * 48 * 2
    manifest = load_export(out)
    module = load_model(str(TINY_LLAMA), parse_strategy("window:w=16,sinks=4"), 128).module
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(TINY_LLAMA), attn_implementation="eager").eval()
    prompt = list(b"A rolling cache keeps the sinks and the last window of keys.")[:48]
    art = OrtStepper(manifest, out, threads=1, spin=False)
    eager = EagerStepper(manifest, module)
    rows, erows = [art.prefill(prompt)], [eager.prefill(prompt)]
    tokens = list(prompt)
    for _ in range(40):
        tokens.append(int(erows[-1][-1].argmax()))
        rows.append(art.step([tokens[-1]], len(tokens) - 1))
        erows.append(eager.step([tokens[-1]], len(tokens) - 1))
    ours, mine = np.concatenate(rows), np.concatenate(erows)
    assert np.abs(ours - mine).max() <= 2e-3 * np.abs(mine).max()  # verify.py's fp16 tolerance
    want = masked_logits(ref, tokens, rule(16, 4)).numpy()
    assert np.abs(ours - want).max() <= 5e-3 * np.abs(want).max()
    assert (ours.argmax(-1) == want.argmax(-1)).mean() >= 0.98


@pytest.mark.slow
def test_exported_window_artifact_matches_eager_and_transformers_in_ort_and_executorch(tmp_path):
    """edgekv export of the tiny llama with window 16 + 4: the pipeline's own verification passes, and then, well
    past the window (48 prompt tokens in three .pte prefill calls of 16, no padding, + 40 decode steps = 88
    positions), both runtimes follow the eager module and transformers with the mask."""
    from edgekv.export.manifest import load_export
    from edgekv.export.pipeline import export_model
    from edgekv.export.options import ExportOptions
    from edgekv.export.runtime import EagerStepper, OrtStepper
    from edgekv.export.pte_stepper import PteStepper

    out = tmp_path / "win"
    manifest = export_model(ExportOptions(model=str(TINY_LLAMA), strategy="window:w=16,sinks=4",
                                          formats=("onnx", "pte"), max_ctx=128, out=out, prefill_chunk=16,
                                          threads=1), echo=lambda s: None)
    assert all(manifest["verification"][f]["passed"] for f in ("onnx", "pte"))
    assert [t["shape"] for t in manifest["state"]["tensors"]] == [[1, 4, 20, 48]] * 8
    manifest = load_export(out)
    module = load_model(str(TINY_LLAMA), parse_strategy("window:w=16,sinks=4"), 128).module
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(TINY_LLAMA), attn_implementation="eager").eval()
    prompt = list(b"A rolling cache keeps the sinks and the last window of keys.")[:48]
    for art in (OrtStepper(manifest, out, threads=1, spin=False), PteStepper(manifest, out, threads=1)):
        eager = EagerStepper(manifest, module, chunk=art.chunk)
        rows, erows = [art.prefill(prompt)], [eager.prefill(prompt)]
        tokens = list(prompt)
        for _ in range(40):
            tokens.append(int(erows[-1][-1].argmax()))
            rows.append(art.step([tokens[-1]], len(tokens) - 1))
            erows.append(eager.step([tokens[-1]], len(tokens) - 1))
        ours, mine = np.concatenate(rows), np.concatenate(erows)
        scale = np.abs(mine).max()
        assert np.abs(ours - mine).max() <= 2e-3 * scale, type(art).__name__  # verify.py's fp16 tolerance
        want = masked_logits(ref, tokens, rule(16, 4)).numpy()
        assert np.abs(ours - want).max() <= 5e-3 * np.abs(want).max(), type(art).__name__
        assert (ours.argmax(-1) == want.argmax(-1)).mean() >= 0.98


@pytest.mark.slow
def test_smollm2_window_64_plus_4_follows_transformers_with_the_mask_over_200_tokens(gguf_path):
    """Real weights: SmolLM2-135M (GGUF Q4_1) with window:w=64,sinks=4 (fp16 cache) against transformers' own GGUF
    loader given the window mask, over ~200 positions of real text (prefill in calls of 32, then decode)."""
    import sysconfig
    from pathlib import Path

    loaded = load_model("smollm2-135m", parse_strategy("window:w=64,sinks=4"), max_ctx=256)
    assert [tuple(t.shape) for t in loaded.module.empty_state()][:2] == [(1, 3, 68, 64)] * 2
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                            dtype=torch.float32, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    prompt = tok(text)["input_ids"][:160]
    tokens, logits, _ = greedy_with_state(loaded.module, prompt, steps=40, chunk=32)
    want = masked_logits(ref, tokens, rule(64, 4))
    diff = assert_close(logits, want, 1e-2, "SmolLM2 window")
    top1 = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"SmolLM2 window 64+4 fp16: {len(tokens)} positions, max abs diff {diff:.3g}, top-1 {top1:.1%}")
    assert top1 >= 0.97
    full = masked_logits(ref, tokens, rule())
    assert (full - want)[100:].abs().max() > 10 * diff  # past W + S the window is another computation


@pytest.mark.parametrize("kind,sliding_window,strategy,want,want_rolling_pte", [
    ("llama", None, "kv", True, None),  # every layer one slot per position, float cache
    ("llama", None, "kv:dtype=fp32", True, None),
    ("llama", None, "kv-int8", False, None),  # per-token scales: GroupQueryAttention cannot read them (the .pte can)
    ("llama", None, "kv-int4:group=4", False, None),
    ("llama", None, "kv-int8c", True, None),  # static scales: GroupQueryAttention and custom_quantized_sdpa read the codes
    ("llama", None, "window:w=16,sinks=4", False, None),  # rolling layers under the window strategy
    ("llama", None, "window:w=64,sinks=4", True, None),  # W + S covers max_ctx 64: a slot per position
    # native sliding windows of 16 slots: ONNX Runtime's window-sized GroupQueryAttention cache takes them (layer 1
    # of qwen2 slides, layer 0 does not; every mistral layer slides); the .pte keeps them as rings written in place
    ("qwen2", 16, "kv", True, True),
    ("mistral", 16, "kv", True, True),
    ("mistral", 16, "kv-int8c", True, True),
    ("mistral", 16, "kv-int8", False, True),
    ("mistral", 16, "window:w=8,sinks=2", False, False),  # the strategy's window over the model's: eager
])
def test_the_export_module_and_the_planner_agree_on_which_caches_run_through_gqa(tmp_path, kind, sliding_window,
                                                                                strategy, want, want_rolling_pte):
    """Llama.fusable() decides the ONNX graph (and the manifest's state_in_place); memory.fused_gqa decides what the
    planner predicts for it. The cases are written out by hand from the rule: a float cache (or static-scale int8
    codes) with one slot per position, or exactly the layer's native sliding window, in every layer."""
    from edgekv.memory import fused_gqa

    tiny_hf(tmp_path, kind, sliding_window=sliding_window)
    loaded = load_model(str(tmp_path), parse_strategy(strategy), 64)
    assert loaded.module.fusable() == want
    assert fused_gqa(loaded.arch, loaded.layout, parse_strategy(strategy), "onnxruntime") == want
    # the .pte's rule (Llama.pte_in_place): also a quantized cache, its written rows read back dequantized
    want_pte = (want or strategy.startswith("kv-int")) if want_rolling_pte is None else want_rolling_pte
    assert loaded.module.pte_in_place() == want_pte
    assert fused_gqa(loaded.arch, loaded.layout, parse_strategy(strategy), "executorch") == want_pte
