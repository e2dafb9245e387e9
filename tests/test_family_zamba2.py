"""Zamba2 (Mamba-2 layers, shared attention blocks with per-layer LoRA at the hybrid layers): what is particular to
it (its state layout, the refused variants, kv strategies as the hybrid form, the trained context).
The tiny model is tests/tiny_families.py's; its parity with transformers, eager and exported, is
tests/test_family_conformance.py.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_families import tiny  # noqa: E402
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import load_any  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402


def test_planner_reads_hybrid_layers_as_kv_plus_mamba2_state(tmp_path):
    ref = tiny("zamba2", tmp_path)
    arch = read_config_json(tmp_path)  # transformers 5 writes the Mamba layers as "linear_attention"
    assert arch.family == "hybrid" and arch.n_params == sum(p.numel() for p in ref.parameters())
    layout = build_layout(arch, parse_strategy("hybrid:dtype=fp32"), 64)
    ssm = [("conv", (1, 48 + 2 * 2 * 8, 3)), ("ssm", (1, 4, 12, 8))]
    kv = [("key", (1, 6, 64, 8)), ("value", (1, 6, 64, 8))]
    assert [(t.layer, t.role, t.shape) for t in layout.tensors] == [
        (i, r, s) for i in range(5) for r, s in ((kv if i in (1, 3, 4) else []) + ssm)]


def test_unsupported_variant_is_refused_in_one_line(tmp_path):
    tiny("zamba2", tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text().replace('"use_long_context": false', '"use_long_context": true'))
    with pytest.raises(EdgekvError, match="use_long_context is not supported by the zamba2 export module"):
        load_any(str(tmp_path), parse_strategy("hybrid"), 32)


def test_export_takes_kv_strategies_as_the_hybrid_form(tmp_path):
    """`edgekv export --strategy kv-int8` (or kv, kv-int4) on a hybrid is its native state with that attention
    cache, as analyze reads it (edgekv.models.hybrid_alias), not a refusal naming hybrid."""
    from edgekv.export.options import check_applies, family_form
    from edgekv.strategies import parse_strategy

    tiny("zamba2", tmp_path)
    for spec, want in [("kv-int8", "hybrid:dtype=int8,state_dtype=fp32"), ("kv", "hybrid:dtype=fp16,state_dtype=fp32")]:
        s = family_form(str(tmp_path), parse_strategy(spec))
        assert s.label == want
        layout = check_applies(str(tmp_path), s, 32)
        assert {"key", "value", "conv", "ssm"} <= set(layout.bytes_by_role())


def test_a_context_past_the_trained_one_is_refused_before_weights_are_built(tmp_path):
    """edgekv.models.base.read_source (the hybrids' one reader): max_ctx above max_position_embeddings is one line."""
    from edgekv.models.zamba2 import read_zamba2

    tiny("zamba2", tmp_path, max_position_embeddings=48)
    assert read_zamba2(str(tmp_path), 48).args.max_position == 48
    with pytest.raises(EdgekvError, match="max_ctx 49 exceeds the model's trained context 48"):
        read_zamba2(str(tmp_path), 49)
