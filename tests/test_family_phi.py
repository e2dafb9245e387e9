"""Phi-3 / Phi-4-mini (Phi3ForCausalLM) through the llama module (edgekv.models.phi3 rewrites the checkpoint): what is
particular to it. The tiny models (Phi-4-mini's partial rotary with longrope and tied embeddings; Phi-3-mini's full
rotary with a sliding window shorter than the sequence) are tests/tiny_families.py's; their parity with transformers,
eager and exported, is tests/test_family_conformance.py.
"""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_families import tiny  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import family_of, load_any  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

FP32 = parse_strategy("kv:dtype=fp32")


def test_phi3_checkpoint_is_the_llama_family_with_fused_projections_split(tmp_path):
    tiny("phi4mini", tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "phi3"
    assert family_of(tmp_path).name == "llama"
    loaded = load_any(str(tmp_path), FP32, 32)
    attn = loaded.module.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (96, 96) and attn.k_proj.weight.shape == (32, 96)
    # 12 of 16 channels rotate: 6 frequencies, 2 of the llama module's 8 at zero (the pass-through channels)
    inv = loaded.module.inv_freq
    assert inv.shape == (8,) and (inv[6:] == 0).all() and (inv[:6] > 0).all()


def test_longrope_without_its_original_context_is_one_clear_line(tmp_path):
    tiny("phi4mini", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"]["short_factor"] = [1.0, 2.0]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EdgekvError, match="short_factor must list 6 numbers"):
        load_any(str(tmp_path), FP32, 32)
