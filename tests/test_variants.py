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
