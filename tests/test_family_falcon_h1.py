"""Falcon-H1 (attention and Mamba-2 side by side in every layer): what is particular to it (its state layout, the
refused variants, int4 KV on every layer in ONNX Runtime).
The tiny model is tests/tiny_families.py's; its parity with transformers, eager and exported, is
tests/test_family_conformance.py.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_rows  # noqa: E402
from tiny_families import tiny  # noqa: E402
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models import load_any  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402


def test_planner_reads_every_layer_as_kv_plus_mamba2_state(tmp_path):
    ref = tiny("falcon_h1", tmp_path)
    arch = read_config_json(tmp_path)
    assert arch.family == "hybrid" and arch.n_params == sum(p.numel() for p in ref.parameters())
    layout = build_layout(arch, parse_strategy("hybrid:dtype=fp32"), 64)
    dc = 72 + 2 * 3 * 8
    assert [(t.name, t.shape) for t in layout.tensors] == [
        (name, shape) for i in range(3) for name, shape in (
            (f"past_key_values.{i}.key", (1, 2, 64, 12)), (f"past_key_values.{i}.value", (1, 2, 64, 12)),
            (f"past_conv.{i}", (1, dc, 3)), (f"past_ssm.{i}", (1, 6, 12, 8)))]


def test_unsupported_variant_is_refused_in_one_line(tmp_path):
    tiny("falcon_h1", tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text().replace('"hidden_act": "silu"', '"hidden_act": "gelu"'))
    assert read_config_json(tmp_path).n_params > 0  # the planner still reads it
    with pytest.raises(EdgekvError, match="hidden_act 'gelu' is not supported by the falcon-h1 export module"):
        load_any(str(tmp_path), parse_strategy("hybrid"), 32)


@pytest.mark.slow
def test_int4_kv_on_every_layer_exports_and_runs_in_onnx_runtime(tmp_path):
    """hybrid:dtype=int4: every layer's KV as kv-int4 codes (uint8, two per byte) with fp16 scales and zeros, the
    Mamba state fp32; ONNX Runtime's logits follow the eager module's over prefill and decode."""
    from click.testing import CliRunner

    from edgekv.export.cli import cli
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper

    pytest.importorskip("onnxruntime")
    tiny("falcon_h1", tmp_path / "hf", head_dim=32)  # groups of 32
    out = tmp_path / "export"
    r = CliRunner().invoke(cli, ["export", "--model", str(tmp_path / "hf"), "--strategy", "hybrid:dtype=int4",
                                 "--format", "onnx", "--max-ctx", "32", "--prefill-chunk", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    manifest = load_export(out)
    dtypes = {(t["role"], t["dtype"]) for t in manifest["state"]["tensors"]}
    assert dtypes == {("key", "uint8"), ("value", "uint8"), ("key.scale", "float16"), ("value.scale", "float16"),
                      ("key.zero", "float16"), ("value.zero", "float16"), ("conv", "float32"), ("ssm", "float32")}
    prompt = [5, 9, 33, 12, 40, 7, 21, 3, 18, 50, 11]
    tokens, ours = greedy_rows(OrtStepper(manifest, out), prompt, 12)
    loaded = load_any(str(tmp_path / "hf"), parse_strategy("hybrid:dtype=int4"), 32)
    state, pos, rows = loaded.module.empty_state(), 0, []
    for part in (tokens[:8], tokens[8:11], *([t] for t in tokens[11:])):
        with torch.no_grad():
            logits, *state = loaded.module(torch.tensor([part]), torch.tensor([pos]), *state)
        rows.append(logits[0].numpy())
        pos += len(part)
    want = np.concatenate(rows)
    diff = np.abs(ours - want).max()
    assert diff <= 1e-3, f"falcon-h1 int4 onnx vs eager: max abs diff {diff:.3g}"
