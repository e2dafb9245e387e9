"""The tiny trained fixtures in fixtures/tiny/ (made by scripts/train_tiny.py) are real trained models.

Each folder must load offline with transformers' from_pretrained, be byte-level, and score a fixed held-out slice of
the Python standard library far better than a freshly initialised model of the same config scores it (trained
dynamics, not random init); the training log must exist and agree with what is measured here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import sysconfig
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"
EXPECTED = {
    "mamba": ("mamba", "MambaForCausalLM"),
    "mamba2": ("mamba2", "Mamba2ForCausalLM"),
    "rwkv": ("rwkv", "RwkvForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
}
TRAINED_MAX_BPB = 4.0  # trained fixtures score ~2-3 bits/byte on the slice
RANDOM_MIN_BPB = 7.0  # a fresh init scores ~8 (uniform over 256 bytes) or worse
SLICE_TOL = 0.02  # this test vs the number the training script logged for the same slice and code
VAL_TOL = 0.75  # 2 KB slice vs the script's 32 held-out windows (different text, same model)


pytestmark = pytest.mark.usefixtures("one_thread")


def load_log(name: str) -> dict:
    p = FIXTURES / name / "train_log.json"
    assert p.is_file(), f"{p} is missing: run python scripts/train_tiny.py --model {name}"
    return json.loads(p.read_text())


def held_out_slice(log: dict) -> tuple[bytes, str]:
    """The logged held-out slice, read from this machine's stdlib when it has the same bytes, else the logged copy."""
    spec = log["eval_slice"]
    stored = base64.b64decode(spec["bytes_b64"])
    assert hashlib.sha256(stored).hexdigest() == spec["sha256"] and len(stored) == spec["length"]
    p = Path(sysconfig.get_paths()["stdlib"]) / spec["file"]
    if p.is_file():
        b = p.read_bytes()[spec["offset"] : spec["offset"] + spec["length"]]
        if hashlib.sha256(b).hexdigest() == spec["sha256"]:
            return b, "stdlib"
    return stored, "logged copy (this Python's stdlib differs)"


def bits_per_byte(model, data: bytes, row: int) -> float:
    rows = torch.tensor(list(data), dtype=torch.long).view(-1, row)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    return float(nll) / math.log(2)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_is_a_trained_byte_level_model(name):
    d = FIXTURES / name
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert sum(f.stat().st_size for f in d.iterdir()) < 12e6
    log = load_log(name)
    model_type, cls_name = EXPECTED[name]

    model = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
    assert type(model).__name__ == cls_name and model.config.model_type == model_type
    assert model.config.vocab_size == 256
    assert next(model.parameters()).dtype == torch.float32
    n = sum(p.numel() for p in model.parameters())
    assert n == log["params"] and 1_000_000 <= n <= 3_000_000
    if name == "llama":
        assert model.config.max_position_embeddings >= 8192

    data, _ = held_out_slice(log)
    row = log["training"]["seq_len"]
    trained = bits_per_byte(model, data, row)

    torch.manual_seed(0)
    fresh = type(model)(model.config)
    random_init = bits_per_byte(fresh, data, row)

    assert trained < TRAINED_MAX_BPB, (name, trained)
    assert random_init > RANDOM_MIN_BPB, (name, random_init)
    assert random_init - trained > 3.0, (name, trained, random_init)

    # the log agrees with this measurement
    assert abs(trained - log["eval_slice"]["bits_per_byte"]) < SLICE_TOL, (trained, log["eval_slice"])
    val = log["val_curve"]["bits_per_byte"]
    assert val[-1] == log["final"]["val_bits_per_byte"]
    assert abs(trained - val[-1]) < VAL_TOL, (trained, val[-1])
    assert val[0] > RANDOM_MIN_BPB and val[-1] < TRAINED_MAX_BPB  # the curve starts at random init and ends trained
    assert log["val_curve"]["step"][-1] == log["training"]["steps"]
    assert len(log["train_curve"]["step"]) >= 10


def test_fixtures_share_a_parameter_budget():
    counts = {n: load_log(n)["params"] for n in EXPECTED}
    assert max(counts.values()) <= 1.1 * min(counts.values()), counts
