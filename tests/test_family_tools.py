"""Every exported family through the user's commands: a tiny random model of each family (the builders of its own
tests/tiny_families.py, transformers' classes) with a character-level tokenizer, so that text means something to it, is
exported to ONNX with `edgekv export --strategy kv-int8` (a hybrid's kv-int8 is its native state with int8 attention
caches), then `edgekv run` generates from a text prompt, `edgekv profile` measures it at a filled context, and
`edgekv analyze` measures the int8 cache's error against fp32 on real text. Slow: ~1 min per family on 2 cores.
"""
import json
import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from conftest import run_cli  # noqa: E402
from tiny_families import char_tokenizer, tiny  # noqa: E402

FAMILIES = ["qwen3", "gemma3", "smollm3", "phi4mini", "lfm2", "granite", "falcon_h1", "zamba2", "qwen3_5"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_export_run_profile_and_analyze_work_on_every_family(family, tmp_path):
    hf = tmp_path / "hf"
    model = tiny(family, hf)
    char_tokenizer(hf, model.config.vocab_size)
    out = tmp_path / "export"
    r = run_cli("export", "--model", hf, "--strategy", "kv-int8", "--format", "onnx", "--max-ctx", 64,
                "--verify-steps", 4, "--threads", 1, "--out", out)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    v = manifest["verification"]["onnx"]
    assert v["passed"] and v["logit_scale"] > 0.5, v  # a comparison of real logits, not of zeros

    r = run_cli("run", out, "--prompt", "The capital of France is", "--max-new-tokens", 6, "--json", "--threads", 1)
    assert r.returncode == 0, r.stderr
    ran = json.loads(r.stdout)
    assert ran["prompt_tokens"] == len("The capital of France is")  # one token per character
    assert ran["new_tokens"] == 6 or (0 < ran["new_tokens"] < 6 and ran["stopped"] != "max_new_tokens"), ran

    r = run_cli("profile", out, "--ctx", 48, "--steps", 2, "--threads", 1, "--out", tmp_path / "p.json")
    assert r.returncode == 0, r.stderr
    prof = json.loads((tmp_path / "p.json").read_text())
    assert all(run.get("status", "ok") == "ok" for run in prof["runs"]), prof["runs"]

    r = run_cli("analyze", "--model", hf, "--strategy", "kv-int8", "--ctx", 40, "--weight-bits", 0, "--json")
    assert r.returncode == 0, r.stderr
    kls = [k for row in json.loads(r.stdout)["variants"] for k in row["kl"]]  # int8 cache vs fp32, per position
    assert kls and all(math.isfinite(k) and k >= 0 for k in kls) and max(kls) > 0, kls
