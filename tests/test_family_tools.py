"""Every exported family through the user's commands: a tiny random model of each family (the builders of its own
test module, transformers' classes) with a character-level tokenizer, so that text means something to it, is
exported to ONNX with `edgekv export --strategy kv-int8` (a hybrid's kv-int8 is its native state with int8 attention
caches), then `edgekv run` generates from a text prompt, `edgekv profile` measures it at a filled context, and
`edgekv analyze` measures the int8 cache's error against fp32 on real text. Slow: ~1 min per family on 2 cores.
"""
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from conftest import run_cli  # noqa: E402

CHARS = (" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:'\"!?-()\n")


def char_tokenizer(folder: Path, vocab: int) -> None:
    """A tokenizer.json reading each character as one token (ids 3.. in CHARS order, <unk> 0 for the rest)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + list(CHARS)
    assert len(words) <= vocab, (len(words), vocab)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))


def _builders():
    from test_families import tiny_hf
    from test_family_falcon_h1 import tiny_falcon
    from test_family_granite import tiny_granite
    from test_family_lfm2 import tiny_lfm2
    from test_family_phi import tiny_phi
    from test_family_qwen3_5 import tiny_qwen3_5
    from test_family_zamba2 import tiny_zamba2
    return {"qwen3": lambda f: tiny_hf("qwen3", f), "gemma3": lambda f: tiny_hf("gemma3", f),
            "smollm3": lambda f: tiny_hf("smollm3", f), "phi4mini": lambda f: tiny_phi("phi4mini", f),
            "lfm2": tiny_lfm2, "granite": tiny_granite, "falcon_h1": tiny_falcon, "zamba2": tiny_zamba2,
            "qwen3_5": tiny_qwen3_5}


FAMILIES = ["qwen3", "gemma3", "smollm3", "phi4mini", "lfm2", "granite", "falcon_h1", "zamba2", "qwen3_5"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_export_run_profile_and_analyze_work_on_every_family(family, tmp_path):
    hf = tmp_path / "hf"
    model = _builders()[family](hf)
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
