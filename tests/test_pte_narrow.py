"""A .pte-only int4 export of a bf16 checkpoint loads it narrow and quantizes the .pte's module one linear at a time
from the narrow weights (edgekv.export.narrow_route.quantize_narrow): the fp32 module is never built whole.

Reference: the same weights stored as fp32 (widened from the bf16 file, so the same values), exported the way every
.pte was before (the fp32 module loaded, deep-copied and quantized whole): the two model.pte files are the same bytes.
A weight the narrow route read as a placeholder's zeros, from the wrong layer or rounded another way would change
them."""
import hashlib
import json

import pytest
from conftest import random_llama

# over conftest.RANDOM_LLAMA: one decoder layer, so the two exports take seconds; its 512 x 2048 matrices and the
# 2048 x 512 table are above lazy_weights.MIN_ELEMS, so the bf16 load keeps them narrow
CFG = {"num_hidden_layers": 1}


def _fp32_copy(src, dst):
    """src (a bf16 HF folder) with model.safetensors widened to fp32 and config.json saying so."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    save_file({k: v.to(torch.float32) for k, v in load_file(src / "model.safetensors").items()},
              dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg))


def _export(src, out):
    from edgekv.export.options import ExportOptions
    from edgekv.export.pipeline import export_model
    lines = []
    m = export_model(ExportOptions(model=str(src), formats=("pte",), weights="int4", max_ctx=512, out=out,
                                   threads=1, verify_steps=2), echo=lines.append)
    return m, lines


@pytest.mark.slow  # two .pte exports: 54 s each at a load of 12 on the 2-core host
@pytest.mark.usefixtures("one_thread")
def test_a_bf16_checkpoints_int4_pte_is_the_fp32_routes_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_PTE_CACHE", "off")  # each export lowers its own program
    random_llama(tmp_path, **CFG)
    _fp32_copy(tmp_path / "m", tmp_path / "m32")
    narrow, lines = _export(tmp_path / "m", tmp_path / "narrow")
    assert any("one linear at a time" in s for s in lines), lines  # the narrow route ran
    wide, wide_lines = _export(tmp_path / "m32", tmp_path / "wide")
    assert not any("one linear at a time" in s for s in wide_lines)

    def sha(d):
        return hashlib.sha256((d / "model.pte").read_bytes()).hexdigest()
    assert sha(tmp_path / "narrow") == sha(tmp_path / "wide")
    assert narrow["weights"]["quantization"]["pte"] == wide["weights"]["quantization"]["pte"]
    # verify-quant's fp32 side: the same logits up to fp32 rounding (the narrow route reads the text in prefill calls:
    # narrow_route.fp32_reference), so the same top-1 and KL against them
    q, r = narrow["weight_quality"]["pte"], wide["weight_quality"]["pte"]
    assert q["top1_agreement"] == r["top1_agreement"]
    assert q["kl_mean"] == pytest.approx(r["kl_mean"], rel=1e-5)
    assert narrow["verification"]["pte"]["passed"] and wide["verification"]["pte"]["passed"]
    # verify-pte: the narrow route runs the quantized eager module's calls first and frees it before the .pte loads
    # (verify.record, narrow_route.release_quantized); the wide route interleaves them with the .pte's. The same .pte
    # against the same module: the same comparison, to the bit
    a, b = narrow["verification"]["pte"], wide["verification"]["pte"]
    for key in ("max_abs_diff", "logit_scale", "top1_agreement", "state_max_abs_diff", "noise_floor",
                "positions_compared"):
        assert a[key] == b[key], key
