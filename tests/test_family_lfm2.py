"""LFM2 (gated short convolutions + GQA attention): what is particular to it (its state layout, analyze on a
vocabulary that reads text as one id).
The tiny model is tests/tiny_families.py's; its parity with transformers, eager and exported, is
tests/test_family_conformance.py.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import run_cli  # noqa: E402
from tiny_families import tiny  # noqa: E402
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import family_of, load_any  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402

HYBRID = parse_strategy("hybrid:dtype=fp32")


def test_planner_reads_lfm2_as_a_hybrid_of_conv_state_and_kv(tmp_path):
    ref = tiny("lfm2", tmp_path)
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


def test_analyze_refuses_a_text_its_tokenizer_reads_as_one_unknown_id(tmp_path):
    """The word-level test vocabulary reads analyze's English text as <unk> throughout: KL 0 and top-1 1.000 there
    would be a measurement of nothing, so it is one line and exit 2."""
    tiny("lfm2", tmp_path)
    r = run_cli("analyze", "--model", tmp_path, "--strategy", "kv-int8", "--ctx", 32, "--weight-bits", 0)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "reads the text as 1 distinct id(s) in 33 tokens" in r.stderr.strip().splitlines()[-1], r.stderr
