"""What an export carries for its user (issue 42, point 9): a Gemma export writes the NOTICE the Gemma Terms of Use
require of a distributor (the sentence quoted in README.md, the independent source here), listed in the manifest; an
int4 ONNX export records its verification in the manifest and prints a `verified onnx:` line (README: every artifact
is verified), held to verify-quant's thresholds (edgekv.export.quality.THRESHOLDS) against fp32."""
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def readme_notice_sentence() -> str:
    text = " ".join((ROOT / "README.md").read_text().split())
    return re.search(r'ship a `NOTICE` text file saying "([^"]+)"', text).group(1)


def export(args):
    from click.testing import CliRunner

    from edgekv.export.cli import cli
    r = CliRunner().invoke(cli, ["export", *map(str, args), "--threads", "1"])
    assert r.exit_code == 0, r.output
    return r.output


def test_a_gemma_export_ships_the_notice_its_terms_require(tmp_path):
    pytest.importorskip("onnxruntime")
    from tiny_families import tiny

    from edgekv.export.manifest import load_export
    tiny("gemma3", tmp_path / "hf")
    out = tmp_path / "export"
    export(["--model", tmp_path / "hf", "--strategy", "kv:dtype=fp32", "--format", "onnx", "--max-ctx", "64",
            "--out", out])
    m = load_export(out)  # every file's sha256 checked
    notice = (out / "NOTICE").read_text()
    assert notice.splitlines()[0] == readme_notice_sentence() + "."
    assert "modified by edgekv export" in notice
    assert "NOTICE" in m["files"]


def test_a_llama_export_writes_no_gemma_notice():
    from edgekv.export.licenses import license_files
    assert license_files("llama", "smollm2-135m", "x") == {}
    assert set(license_files("gemma3_text", "gemma-3-270m", "x")) >= {"NOTICE"}


def test_an_int4_onnx_export_is_verified_and_says_so(tiny_int4_onnx_export):
    pytest.importorskip("onnxruntime")
    import jsonschema

    from edgekv.export import manifest as mf
    from edgekv.export.quality import THRESHOLDS
    # `edgekv export --model fixtures/tiny/llama --weights int4 --format onnx --max-ctx 320 --verify-steps 4` (conftest)
    out, text = tiny_int4_onnx_export
    m = json.loads((out / "manifest.json").read_text())
    jsonschema.validate(m, json.loads(mf.SCHEMA_PATH.read_text()))
    v = m["verification"]["onnx-quant"]
    t = THRESHOLDS["int4"]
    assert v["passed"] and v["top1_agreement"] >= t["min_top1"] and v["kl_mean"] <= t["max_kl_mean"]
    assert v["top1_agreement"] == m["weight_quality"]["onnx"]["top1_agreement"]
    line = next(ln for ln in text.splitlines() if ln.startswith("verified onnx: "))
    assert f"top-1 {v['top1_agreement']:.1%}" in line and "int4 weights vs fp32" in line
    # which app API loads the file, in words (was `loaded by: model.onnx: edgekv`)
    assert "loaded by" not in text
    assert "model.onnx runs in: edgekv run / edgekv profile, and an app through android_demo/" in text


def test_the_app_route_is_linked_from_the_readmes_top_and_the_runner_needs_custom_ops_said():
    text = (ROOT / "README.md").read_text()
    top = text[:text.index("\n## ")]
    assert "(android_demo/README.md)" in top
    flat = " ".join(text.split())
    at = flat.index("`TextLLMRunner`, `LlmModule` on Android")
    assert "import executorch.extension.llm.custom_ops" in flat[at:at + 400]
