"""Each Llama-family variant declared in edgekv.arch.variants carries its transformers config class's defaults: the
value a config.json that leaves the field out gets (tied head, RMSNorm eps, RoPE bases, activation, score scale,
window). The reference is the config class itself (AutoConfig.for_model), not edgekv's declaration."""
import pytest

transformers = pytest.importorskip("transformers")

from edgekv.arch.variants import VARIANTS  # noqa: E402

DECLARED = sorted(mt for mt, v in VARIANTS.items() if not v.text_model)  # a wrapper's defaults are its text model's


def _theta(rope: dict) -> float:
    return float(rope["rope_theta"])


@pytest.mark.parametrize("mt", DECLARED)
def test_the_declared_defaults_are_the_config_classes(mt):
    v = VARIANTS[mt]
    c = transformers.AutoConfig.for_model(mt)
    assert v.tied == c.tie_word_embeddings
    assert v.rms_eps == c.rms_norm_eps
    assert v.act == getattr(c, v.act_field)
    rope = c.rope_parameters
    if v.local_rope_theta is not None:  # per layer type (transformers >= 5)
        assert (v.rope_theta, v.local_rope_theta) == (_theta(rope["full_attention"]), _theta(rope["sliding_attention"]))
    else:
        assert v.rope_theta == _theta(rope)
    assert v.query_pre_attn_scalar == getattr(c, "query_pre_attn_scalar", None)
    if v.window_default is not None:
        assert v.window_default == c.sliding_window
    assert hasattr(c, "no_rope_layers") == v.nope_layers


def test_wrappers_name_a_declared_text_model():
    for v in VARIANTS.values():
        if v.text_model:
            assert v.text_model in VARIANTS and VARIANTS[v.text_model].exported


# a tiny config of each model type; the ids inside the vocabulary (the classes' defaults name Llama-3's)
TINY = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _norm_offset(norm) -> float:
    """c in y = (c + w) * x / rms(x), read off transformers' own RMSNorm: its output with w = 0 and with w = 1."""
    torch = pytest.importorskip("torch")
    x = torch.arange(1.0, 1.0 + norm.weight.numel()).reshape(1, -1)
    with torch.no_grad():
        norm.weight.fill_(0.0)
        y0 = norm(x)[0, 0].item()
        norm.weight.fill_(1.0)
        y1 = norm(x)[0, 0].item()
    return y0 / (y1 - y0)


@pytest.mark.parametrize("mt", DECLARED)
def test_the_declared_layer_is_the_transformers_modules(mt):
    """Biases, norm layout and offset, qk-norm and the scaled embedding as transformers' own modules have them, for
    the config class's attention_bias and (where the class has the field) for attention_bias=True."""
    pytest.importorskip("torch")
    v = VARIANTS[mt]
    c = transformers.AutoConfig.for_model(mt, **TINY)
    for bias in [c.attention_bias, True] if hasattr(c, "attention_bias") else [False]:
        c = transformers.AutoConfig.for_model(mt, **TINY, **({"attention_bias": bias} if bias else {}))
        m = transformers.AutoModelForCausalLM.from_config(c)
        layer, att = m.model.layers[0], m.model.layers[0].self_attn
        q = getattr(att, "q_proj", None) or att.qkv_proj  # Phi-3's fused projection
        assert (q.bias is not None, att.o_proj.bias is not None) == v.biases(bool(bias)), bias
    norms = {n: ch for n, ch in layer.named_children() if "Norm" in type(ch).__name__}
    assert set(norms) == set(v.norm_names().values())
    assert _norm_offset(next(iter(norms.values()))) == pytest.approx(v.norm_offset, abs=1e-4)
    shape = {"head": (c.head_dim,), "proj": (c.num_attention_heads * c.head_dim,), None: None}[v.qk_norm]
    assert (tuple(att.q_norm.weight.shape) if hasattr(att, "q_norm") else None) == shape
    assert ("Scaled" in type(m.model.embed_tokens).__name__) == v.embed_scale
