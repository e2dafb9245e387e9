"""Granite-4.0-H (Mamba-2 + attention, dense): what is particular to it (its state layout, the MoE refusal).
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


def test_planner_reads_granite_as_mamba2_state_plus_kv(tmp_path):
    ref = tiny("granite", tmp_path)
    arch = read_config_json(tmp_path)
    assert arch.family == "hybrid" and arch.n_params == sum(p.numel() for p in ref.parameters())
    layout = build_layout(arch, parse_strategy("hybrid:dtype=fp32"), 64)
    assert [(t.name, t.shape) for t in layout.tensors] == [
        ("past_conv.0", (1, 96 + 2 * 3 * 8, 3)), ("past_ssm.0", (1, 6, 16, 8)),
        ("past_key_values.1.key", (1, 2, 64, 8)), ("past_key_values.1.value", (1, 2, 64, 8)),
        ("past_conv.2", (1, 144, 3)), ("past_ssm.2", (1, 6, 16, 8)),
        ("past_key_values.3.key", (1, 2, 64, 8)), ("past_key_values.3.value", (1, 2, 64, 8))]


def test_moe_config_is_refused_in_one_line(tmp_path):
    tiny("granite", tmp_path, num_local_experts=4, num_experts_per_tok=2)
    assert read_config_json(tmp_path).n_params > 0  # the planner reads it
    with pytest.raises(EdgekvError, match="num_local_experts 4: the granite export module runs the dense"):
        load_any(str(tmp_path), parse_strategy("hybrid"), 32)
