"""Runtime attention as per-layer module swaps (edgekv.models.swaps) and the cache classes (edgekv.models.cache).

The reference is the eager module itself (whose agreement with transformers test_models_llama, test_window and
test_families check): a swapped copy must compute the same logits and state, leave the eager module untouched, and
swap exactly the layers the runtime's op can serve, counted here by hand from each layer's cache.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import ROOT  # noqa: E402
from edgekv.models import load_any  # noqa: E402
from edgekv.models.attention import Attention  # noqa: E402
from edgekv.models.swaps import GQAAttention, OnnxRMSNorm, SdpaAttention, for_runtime  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

TINY_LLAMA = ROOT / "fixtures" / "tiny" / "llama"  # 4 layers, 4 KV heads, head_dim 48
PROMPT = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9, 4, 6, 7, 1, 2, 3, 4, 5, 6]


def tiny_gemma3(folder):
    """A random Gemma 3 with 4 layers, layer 2 global, sliding window 8 (tests/tiny_families.py's)."""
    from tiny_families import tiny
    tiny("gemma3", folder)
    return folder


def run(module, state, prompt=PROMPT):
    """Chunks of 7 and 3, then one token a call; -> (logits of every position, the final state)."""
    outs, pos = [], 0
    with torch.no_grad():
        for chunk in [prompt[:7], prompt[7:10]] + [[t] for t in prompt[10:]]:
            out = module(torch.tensor([chunk]), torch.tensor([pos]), *state)
            state, pos = list(out[1:]), pos + len(chunk)
            outs.append(out[0][0])
    return torch.cat(outs), state


def kinds(module):
    return [type(m).__name__ for m in module.modules() if isinstance(m, Attention)]


def test_a_model_with_sliding_layers_gets_the_fused_op_on_its_global_layers_and_rings_in_place_in_the_pte(tmp_path):
    """ExecuTorch: custom_sdpa on the global layer, the sliding ones their eager ring written by an index_put
    (RingSdpaAttention), so every layer is swapped and the .pte writes its state in place. ONNX Runtime:
    GroupQueryAttention on every layer, the sliding ones with the op's window-sized cache (local_window_size = the
    model's window, sliding_window_cache)."""
    pytest.importorskip("executorch")
    loaded = load_any(str(tiny_gemma3(tmp_path)), parse_strategy("kv:dtype=fp32"), 64)
    eager = loaded.module
    assert [c.rolling for c in eager.caches] == [True, True, False, True]
    pte, swapped = for_runtime(eager, "executorch")
    assert swapped == [True] * 4
    assert kinds(pte) == ["RingSdpaAttention", "RingSdpaAttention", "SdpaAttention", "RingSdpaAttention"]
    onnx, swapped = for_runtime(eager, "onnxruntime")
    assert swapped == [True] * 4
    assert kinds(onnx) == ["GQAAttention"] * 4
    windows = [eager.caches[i].size if eager.caches[i].rolling else None for i in range(4)]
    assert [at.window for at in onnx.modules() if type(at).__name__ == "GQAAttention"] == windows
    assert all(type(m) is OnnxRMSNorm for m in onnx.modules() if type(m).__name__.endswith("RMSNorm"))
    # every layer swapped in both: the whole state is written in place
    assert eager.fusable() and eager.pte_in_place()
    # the eager module is left as it was, weights shared with the copies
    assert kinds(eager) == ["Attention"] * 4 and not hasattr(eager.model.layers[2].self_attn, "qkv_proj")
    assert all(type(m).__name__ == "RMSNorm" for m in eager.modules() if type(m).__name__.endswith("RMSNorm"))
    assert pte.model.layers[2].self_attn.q_proj.weight is eager.model.layers[2].self_attn.q_proj.weight
    # custom_sdpa on the global layer and the rings written by index_put compute what the eager graph does (chunks of
    # 7 and 3, then single tokens: the rings of 8 wrap), and the state is the same, slot for slot
    want, want_state = run(eager, eager.empty_state())
    got, got_state = run(pte, eager.empty_state())
    scale = want.abs().max().item()
    assert scale > 1.0 and (got - want).abs().max().item() <= 1e-5 * scale
    for a, b in zip(got_state, want_state):
        assert (a - b).abs().max().item() <= 1e-5 * max(b.abs().max().item(), 1.0)


@pytest.mark.parametrize("spec, want", [
    ("kv:dtype=fp32", {"onnxruntime": [True] * 4, "executorch": [True] * 4}),
    ("kv-int8", {"onnxruntime": [False] * 4, "executorch": [True] * 4}),  # GQA takes no quantized cache
    ("kv-int8c", {"onnxruntime": [True] * 4, "executorch": [True] * 4}),  # both read the static-scale codes
    ("window:w=8,sinks=2,dtype=fp32", {"onnxruntime": [False] * 4, "executorch": [False] * 4}),
])
def test_which_layers_each_runtime_swaps_and_the_copy_computes_the_eager_step(spec, want):
    """The .pte's copy against the eager step: exact for a float cache (custom_sdpa over the written rows is the same
    softmax as the masked graph); for int8 codes read in place by custom_quantized_sdpa, exact against the eager
    module whose query is rounded to int8 as the op's contract says (kernel_reference: torch's own quantized_decomposed
    reference ops, not ExecuTorch's kernel), and kv-int8c's static scales, set here to a spread of values, folded
    around the op the same way the eager graph multiplies them into its dequantized rows."""
    from edgekv.models.swaps import kernel_reference

    loaded = load_any(str(TINY_LLAMA), parse_strategy(spec), 48)
    eager = loaded.module
    if parse_strategy(spec).static_scales:  # per (layer, K/V, head, channel): 0.02 .. 0.06
        for i, at in enumerate(m for m in eager.modules() if hasattr(m, "kv_scale")):
            at.kv_scale.copy_(0.02 + 0.04 * torch.rand(at.kv_scale.shape, generator=torch.Generator().manual_seed(i)))
    for runtime, layers in want.items():
        if runtime == "executorch" and any(layers):
            pytest.importorskip("executorch")
        module, swapped = for_runtime(eager, runtime)
        assert swapped == layers, runtime
        if not any(layers):
            assert module is eager
    pte, _ = for_runtime(eager, "executorch")
    if pte is not eager:
        ref = kernel_reference(eager, "executorch")
        rounds = [at.query_int8 for at in ref.modules() if isinstance(at, Attention)]
        assert rounds == [spec in ("kv-int8", "kv-int8c")] * 4
        assert not any(at.query_int8 for at in eager.modules() if isinstance(at, Attention))  # eager untouched
        want_logits, want_state = run(ref, eager.empty_state())
        got, got_state = run(pte, eager.empty_state())
        assert (got - want_logits).abs().max().item() <= 1e-5 * want_logits.abs().max().item()
        for a, b in zip(got_state, want_state):  # the same codes (and scales) written
            assert (a.float() - b.float()).abs().max().item() <= 1e-5 * max(b.float().abs().max().item(), 1.0)


def test_a_model_without_attention_layers_is_not_swapped():
    loaded = load_any(str(ROOT / "fixtures" / "tiny" / "mamba"), parse_strategy("ssm"), 32)
    assert for_runtime(loaded.module, "executorch") == (loaded.module, [])


@pytest.mark.parametrize("spec", ["kv:dtype=fp32", "kv", "kv-int8", "kv-int4:group=16", "kv-int2:group=48",
                                  "window:w=8,sinks=2", "window:w=8,sinks=2,dtype=fp32"])
def test_each_layer_cache_counts_the_bytes_of_its_layout_tensors(spec):
    loaded = load_any(str(TINY_LLAMA), parse_strategy(spec), 48)
    m, a = loaded.module, loaded.args
    per_layer = [sum(t.nbytes for t in loaded.layout.tensors if t.layer == i) for i in range(a.n_layers)]
    assert [c.nbytes(m.kv, a.n_kv_heads, a.head_dim) for c in m.caches] == per_layer
    assert sum(per_layer) == loaded.layout.nbytes


def test_swapped_attention_classes_are_attention_subclasses_for_the_next_runtime():
    """The extension point (SWAPS): a runtime's attention is an Attention subclass with forward's signature."""
    import inspect
    for cls in (GQAAttention, SdpaAttention):
        assert issubclass(cls, Attention)
        # the call Llama.forward makes of every layer: (x, cos, sin, k_state, v_state, call)
        assert list(inspect.signature(cls.forward).parameters) == ["self", "x", "cos", "sin", "k_state", "v_state",
                                                                  "call"]


@pytest.mark.parametrize("fixture, spec", [("llama", "kv:dtype=fp32"), ("mamba", "ssm"), ("mamba2", "ssm"),
                                           ("rwkv", "linear")])
def test_every_family_module_keeps_the_written_export_interface(fixture, spec):
    """edgekv.models.protocol.ExportModule: layout, args, empty_state() in the layout's shapes and dtypes, and
    forward(tokens, pos, *state, rows) -> logits [1, R, V] and the state in the same shapes and dtypes."""
    from edgekv.models.base import DecoderShell
    from edgekv.models.protocol import ExportModule

    loaded = load_any(str(ROOT / "fixtures" / "tiny" / fixture), parse_strategy(spec), 32)
    m = loaded.module
    assert isinstance(m, ExportModule) and isinstance(m, DecoderShell)
    state = m.empty_state()
    want = [(tuple(t.shape), t.dtype) for t in m.layout.tensors]
    assert [(tuple(s.shape), str(s.dtype).removeprefix("torch.")) for s in state] == want
    with torch.no_grad():
        logits, *new = m(torch.tensor([[1, 2, 3]]), torch.tensor([0]), *state, rows=torch.tensor([2]))
    assert tuple(logits.shape) == (1, 1, loaded.args.vocab) and logits.dtype == torch.float32
    assert [(tuple(s.shape), str(s.dtype).removeprefix("torch.")) for s in new] == want


def test_the_layer_takes_a_plan_its_caller_made_as_well_as_its_own():
    """Families that reuse the llama Attention with their own state order call it with an explicit plan (write,
    keep, mask, k_state, v_state, fmt): the same step as the layer's own cache plan."""
    from edgekv.models.attention import Call
    from edgekv.models.layers import rope_cos_sin

    m = load_any(str(TINY_LLAMA), parse_strategy("kv-int8"), 48).module
    at, a = m.model.layers[0].self_attn, m.args
    x = torch.randn(1, 5, a.hidden)
    pos = torch.tensor([3])
    call = Call(pos, 5, a.n_heads // a.n_kv_heads)
    cos, sin = (t[:, None, :] for t in rope_cos_sin(call.positions, m.inv_freq))
    ks, vs = tuple(m.empty_state()[:2]), tuple(m.empty_state()[2:4])
    with torch.no_grad():
        own = at(x, cos, sin, ks, vs, call)
        plan = at.cache.plan(pos, call.positions, a.n_heads // a.n_kv_heads, torch.float32)
        given = at(x, cos, sin, *plan, ks, vs, m.kv)
    assert torch.equal(own[0], given[0])
    assert all(torch.equal(p, q) for p, q in zip(own[1] + own[2], given[1] + given[2]))
