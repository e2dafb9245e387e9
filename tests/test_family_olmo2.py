"""OLMo-2 (Olmo2ForCausalLM), a Llama variant declared in edgekv.arch.variants (norms after each sublayer only, qk-norm
over the whole q / k projection): what is particular to it (its weights as the planner reads them, its catalog entry).
The tiny model is tests/tiny_families.py's; its parity with transformers, eager and exported, is
tests/test_family_conformance.py."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import cli  # noqa: E402
from tiny_families import tiny  # noqa: E402
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.models import family_of  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

FP32 = parse_strategy("kv:dtype=fp32")

def test_the_planner_counts_the_weights_transformers_builds(tmp_path):
    """edgekv's reader lists Olmo2's tensors (no input norm, a q_norm of H*D and a k_norm of Hkv*D channels): the
    same names and shapes as the checkpoint transformers writes."""
    ref = tiny("olmo2", tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "olmo2"
    arch = read_config_json(tmp_path)
    assert {w.name: w.shape for w in arch.weights} == {n: tuple(p.shape) for n, p in ref.state_dict().items()}
    assert arch.family == "transformer" and family_of(tmp_path).name == "llama"


def test_the_catalog_entry_plans():
    code, out, err = cli("plan", "-m", "olmo-2-1b", "--device", "pixel8", "--ctx", "4k", "--json")
    assert code == 0, err
    rows = json.loads(out)["options"]
    kv = next(o for o in rows if o["strategy"] == "kv")
    # fp16 K and V: 16 layers x 16 KV heads x 128 channels x 2 (K, V) x 2 bytes per token
    assert kv["bytes"]["state"] == 16 * 16 * 128 * 2 * 2 * 4096
