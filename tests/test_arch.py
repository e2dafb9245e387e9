"""Reading architectures: parameter counts from shapes vs published counts, GGUF headers, and bad input."""
import json

import pytest

from edgekv.arch import SUPPORTED, arch_from_config, catalog_arch, catalog_entry, catalog_names, load_arch, read_gguf
from edgekv.errors import EdgekvError

REQUIRED_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mamba", "mamba2", "jamba",
                  "deepseek_v2", "deepseek_v3", "falcon_h1", "zamba2"}


def test_every_required_model_type_has_a_reader():
    assert REQUIRED_TYPES <= set(SUPPORTED)


@pytest.mark.parametrize("name", catalog_names())
def test_parameter_count_from_shapes_matches_the_published_count(name):
    e = catalog_entry(name)
    published = e["params"]["published"]
    counted = catalog_arch(name).n_params
    # exact counts must match to the parameter (up to a non-weight buffer); rounded ones (e.g. "1.24B") to 1%
    tol = 0.001 if e["params"]["precision"] == "exact" else 0.01
    assert abs(counted - published) / published <= tol, f"{name}: counted {counted:,} vs published {published:,}"


def test_catalog_covers_the_phone_and_reference_models():
    need = {"llama-3.2-1b", "llama-3.2-3b", "qwen2.5-0.5b", "qwen2.5-1.5b", "smollm2-135m", "smollm2-360m",
            "smollm2-1.7b", "gemma-3-1b", "phi-3-mini", "mamba-130m", "mamba-370m", "mamba-1.4b", "mamba-2.8b",
            "mamba2-1.3b", "mamba2-2.7b", "deepseek-v2-lite", "llama-3-70b"}
    names = set(catalog_names())
    assert need <= names
    assert {"zamba2-1.2b", "falcon-h1-0.5b", "falcon-h1-1.5b"} & names
    for n in names:
        assert catalog_entry(n)["config_source"], n


def test_smollm2_gguf_header_gives_exact_shapes_and_bytes(gguf_path):
    a = read_gguf(gguf_path)
    # stack.md: 30 layers, d_model 576, 9 query / 3 KV heads, 134,515,008 parameters, 272 tensors
    assert (a.n_layers, a.hidden, a.vocab) == (30, 576, 49152)
    assert a.blocks[0].mixers[0].n_heads == 9 and a.blocks[0].mixers[0].n_kv_heads == 3
    assert a.n_params == 134_515_008 and len(a.weights) == 272
    # the stored bytes are the file minus its header and alignment padding
    stored = sum(w.gguf_bytes for w in a.weights)
    assert 0.97 * gguf_path.stat().st_size < stored < gguf_path.stat().st_size
    # and the same architecture read from the catalog's config.json has the same parameter count
    assert catalog_arch("smollm2-135m").n_params == a.n_params


def test_truncated_gguf_is_a_clear_error(gguf_path, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    with pytest.raises(EdgekvError, match="truncated|corrupt"):
        read_gguf(bad)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(EdgekvError):
        read_gguf(tmp_path / "junk.gguf")


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(EdgekvError, match="supported: .*llama"):
        arch_from_config({"model_type": "gpt_bigcode"}, "x", "x.json")


def test_missing_field_is_named_not_guessed():
    cfg = dict(catalog_entry("llama-3.2-1b")["config"])
    del cfg["num_attention_heads"]
    with pytest.raises(EdgekvError, match="num_attention_heads"):
        arch_from_config(cfg, "x", "x.json")


def test_legacy_field_names_are_accepted():
    # Mamba configs in the wild use d_model / n_layer (state-spaces original) instead of hidden_size / num_hidden_layers
    cfg = dict(catalog_entry("mamba-130m")["config"])
    legacy = {"model_type": "mamba", "d_model": cfg["hidden_size"], "n_layer": cfg["num_hidden_layers"],
              "vocab_size": cfg["vocab_size"]}
    assert arch_from_config(legacy, "x", "x").n_params == catalog_arch("mamba-130m").n_params


def test_config_json_file_and_folder(tmp_path):
    cfg = catalog_entry("qwen2.5-0.5b")["config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_arch(str(tmp_path)).n_params == load_arch(str(tmp_path / "config.json")).n_params
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(EdgekvError, match="not valid JSON"):
        load_arch(str(tmp_path / "broken.json"))


def test_unknown_catalog_name_points_to_the_catalog_in_one_short_line():
    # not the whole catalog (a 760-character list, issue 42): `edgekv models` lists it; a close name is suggested
    with pytest.raises(EdgekvError, match="`edgekv models` lists the catalog") as e:
        load_arch("gpt-5")
    assert len(str(e.value)) < 200 and "smollm2-135m" not in str(e.value)
    with pytest.raises(EdgekvError, match="did you mean smollm2-135m"):
        load_arch("smollm2_135M")


def test_gguf_read_arch_equals_the_catalog_config_of_the_same_model(gguf_path):
    """SmolLM2-135M read from its GGUF and from the catalog's config.json (HuggingFaceTB/SmolLM2-135M-Instruct) are the
    same model: same blocks, widths and, where the planner uses it, the same MLP width (config intermediate_size 1536,
    which GGUF stores as blk.N.ffn_up.weight [576 -> 1536]; not the 4 x hidden = 2304 fallback)."""
    from edgekv.memory import workspace_bytes
    from edgekv.strategies import build_layout, parse_strategy

    g, c = read_gguf(gguf_path), catalog_arch("smollm2-135m")
    assert (g.model_type, g.family, g.hidden, g.vocab, g.n_layers) == (c.model_type, c.family, c.hidden, c.vocab, c.n_layers)
    assert g.blocks == c.blocks
    assert g.mlp_width == c.mlp_width == catalog_entry("smollm2-135m")["config"]["intermediate_size"] == 1536
    s = parse_strategy("kv")
    for rt in ("onnxruntime", "executorch"):
        wg = workspace_bytes(g, build_layout(g, s, 2048), s, rt, 512).value
        wc = workspace_bytes(c, build_layout(c, s, 2048), s, rt, 512).value
        assert wg == wc, rt


def test_one_gguf_metadata_reader_gives_the_published_config(gguf_path):
    """The one GGUF metadata reader (edgekv.arch.gguf.gguf_config), which both the planner's read_gguf and the export's
    weight loader use, reads SmolLM2-135M's header into the values of its published config.json (the catalog's copy of
    HuggingFaceTB/SmolLM2-135M-Instruct): widths, heads, norm epsilon, RoPE base, tied head, context."""
    import gguf

    from edgekv.arch.gguf import gguf_config
    from edgekv.models.weights import gguf_config as export_config

    reader = gguf.GGUFReader(str(gguf_path))
    cfg, published = gguf_config(reader, str(gguf_path)), catalog_entry("smollm2-135m")["config"]
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "rope_theta", "max_position_embeddings",
            "tie_word_embeddings", "attention_bias", "hidden_act")
    assert {k: cfg[k] for k in keys} == {k: published[k] for k in keys}
    assert cfg["rms_norm_eps"] == pytest.approx(published["rms_norm_eps"], rel=1e-6)  # stored as a float32
    assert cfg["head_dim"] == published["hidden_size"] // published["num_attention_heads"] == 64
    assert "rope_scaling" not in cfg and "partial_rotary_factor" not in cfg
    assert export_config(reader, str(gguf_path)) == cfg  # the export adds refusals, not a second parse
