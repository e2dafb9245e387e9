"""The plan of --weights gguf on ONNX Runtime: the bytes edgekv's ONNX holds when it carries a GGUF's blocks
(edgekv.memory.weights CARRIED_FORM), and the carried weights' measured quality in the plan's risk.

Independent references: hand arithmetic on small shapes (every number below is worked out in its comment, from
MatMulNBits' layout: codes at `bits` per element, one fp32 scale per block, uint4 zero points two to a byte per row,
an fp32 remainder per block); the measured size of SmolLM2's real export (benchmarks/results/
gguf_carried_bytes_smollm2-135m.json, model.onnx.data); the KL and top-1 benchmarks/filled_context.py measured
(benchmarks/results/filled_context_1024_gguf_*_n129.json), read here from the results, not from edgekv's copy."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgekv.arch import Arch, Weight, read_gguf
from edgekv.cli import main
from edgekv.memory import GGUF_CARRIED, carried_matrix_bytes, weight_bytes
from edgekv.plan import deployment
from edgekv.strategies import parse_strategy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@pytest.mark.parametrize("type_name,n,k,want", [
    # [4, 256]: 8 blocks of 32 per row (Q6_K: 16 of 16); fp32 scales 4 rows x 8 x 4 B = 128
    ("Q4_0", 4, 256, 512 + 128),  # codes 4 x 256 / 2; default zero point
    ("Q8_0", 4, 256, 1024 + 128),  # 8-bit codes 4 x 256
    ("Q5_0", 4, 256, 1024 + 128),  # 5-bit codes stored at 8 bits
    ("Q6_K", 4, 256, 1024 + 256),  # 8-bit codes, scales per 16: 4 x 16 x 4
    ("Q4_1", 4, 256, 512 + 128 + 16 + 128),  # zero points 4 rows x 8 / 2; remainders 4 x 8 x 4
    ("Q4_K", 4, 256, 512 + 128 + 16 + 128),
    ("Q5_1", 4, 256, 1024 + 128 + 32 + 128),  # 8-bit zero points: 4 x 8
    ("Q5_K", 4, 256, 1024 + 128 + 32 + 128),
    # [3, 96]: 3 blocks per row; a row's odd last uint4 zero point padded to a byte: 3 rows x 2 B
    ("Q4_1", 3, 96, 144 + 36 + 6 + 36),
    ("Q5_1", 3, 96, 288 + 36 + 9 + 36),
])
def test_each_carried_type_costs_its_codes_scales_zero_points_and_remainders(type_name, n, k, want):
    assert carried_matrix_bytes(type_name, n, k) == want


def tiny(*weights: Weight) -> Arch:
    return Arch("tiny", "llama", "transformer", 64, 40, (), weights)


def gw(name, shape, cls, type_name):
    n = math.prod(shape)
    file = {"Q8_0": n // 32 * 34, "Q4_1": n // 32 * 20, "F32": 4 * n}[type_name]
    return Weight(name, shape, cls, gguf_type=type_name, gguf_bytes=file)


def test_a_tied_q8_0_table_is_one_copy_of_codes_with_the_head_and_the_gathers_scales_each():
    # table [40, 64] Q8_0, tied: codes 40 x 64 = 2,560 read by both ops; MatMulNBits' scales 40 x 2 x 4 = 320,
    # GatherBlockQuantized's own 320; a norm [64] fp32 256. Read per token: the head 2,560 + 320, one gathered row
    # (2,560 + 320) / 40 = 72, the norm 256
    a = tiny(gw("token_embd.weight", (40, 64), "embedding", "Q8_0"), gw("output_norm.weight", (64,), "small", "F32"))
    wb = weight_bytes(a, "gguf", GGUF_CARRIED)
    assert wb["embedding"] == 2560 + 320 + 320
    assert wb["total"] == 3200 + 256
    assert wb["read_per_token"] == 2880 + 72 + 256
    assert weight_bytes(a, "gguf")["total"] == 40 * 2 * 34 + 256  # without the scheme: the file's own bytes


def test_a_tied_table_with_a_minimum_stays_fp32_beside_the_heads_4_bit_form():
    # Q4_1 [40, 64]: the Gather keeps the fp32 table 40 x 64 x 4 = 10,240; the head: codes 1,280, scales 320,
    # zero points 40 x 1 B (2 blocks, two to a byte), remainders 320
    a = tiny(gw("token_embd.weight", (40, 64), "embedding", "Q4_1"))
    wb = weight_bytes(a, "gguf", GGUF_CARRIED)
    assert wb["embedding"] == 10240 + 1280 + 320 + 40 + 320
    assert wb["read_per_token"] == 1960 + 256  # the head, and one fp32 row of 64


def test_an_untied_head_and_a_float_matrix():
    # lm_head Q8_0 [40, 64]: 2,560 + 320; its own Q8_0 table gathered: 2,560 + 320; an F32 linear [8, 64] stays fp32
    a = tiny(gw("token_embd.weight", (40, 64), "embedding", "Q8_0"), gw("output.weight", (40, 64), "lm_head", "Q8_0"),
             gw("blk.0.ffn_up.weight", (8, 64), "linear", "F32"))
    wb = weight_bytes(a, "gguf", GGUF_CARRIED)
    assert (wb["embedding"], wb["lm_head"], wb["linear"]) == (2880, 2880, 2048)
    assert wb["read_per_token"] == 72 + 2880 + 2048


@pytest.fixture(scope="module")
def smollm2(gguf_path):
    return read_gguf(gguf_path)  # the header and tensor table; no weights are dequantized


def test_smollm2s_carried_bytes_are_its_measured_export(smollm2):
    m = json.loads((RESULTS / "gguf_carried_bytes_smollm2-135m.json").read_text())
    wb = weight_bytes(smollm2, "gguf", GGUF_CARRIED)
    assert wb["total"] == m["model_onnx_data_bytes"]
    assert {k: wb[k] for k in m["external_initializers_bytes"]} == m["external_initializers_bytes"]


def test_the_onnx_runtime_plan_prices_the_carried_form_and_llama_cpp_the_file(smollm2):
    m = json.loads((RESULTS / "gguf_carried_bytes_smollm2-135m.json").read_text())
    kv = parse_strategy("kv:dtype=fp32")
    # what plan, the export's `planned` and `edgekv profile`'s prediction call: deployment under the cost model
    ort = deployment(smollm2, kv, 512, "gguf", "onnxruntime", 0)
    assert ort.weights["total"] == m["model_onnx_data_bytes"]
    assert "carries" in ort.explain["weights"]
    file = sum(w.gguf_bytes for w in smollm2.weights)
    assert deployment(smollm2, kv, 512, "gguf", "llama.cpp", 0).weights["total"] == file
    assert m["model_onnx_data_bytes"] > 1.2 * file  # the reason for all this: the carried form is larger


def plan_json(*args) -> dict:
    r = CliRunner().invoke(main, ["plan", *args, "--json"], env={"COLUMNS": "2000"})
    assert r.exit_code in (0, 3), r.stderr
    return json.loads(r.stdout)


def measured_kl(short: str) -> tuple[float, float]:
    d = json.loads((RESULTS / f"filled_context_1024_gguf_{short}_n129.json").read_text())
    q = next(r for r in d["rows"] if r["name"] == "edgekv-ort:kv:dtype=fp32/gguf")["quality"]
    return q["kl_mean"], q["top1_agree"]


def test_a_gguf_plan_row_cites_the_carried_weights_measured_kl_and_int4_its_own(gguf_path):
    kl, top1 = measured_kl("smollm2")
    for model in ("smollm2-135m", str(gguf_path)):  # a known model's name reads its GGUF for --weights gguf
        d = plan_json("-m", model, "--weights", "gguf", "--device", "pixel8", "--ctx", "2k", "--runtime", "ort",
                      "--strategy", "kv:dtype=fp16")
        (row,) = d["options"]
        w = row["quality"]["weights"]
        assert (w["precision"], w["risk"], row["quality"]["risk"]) == ("gguf", "low", "low")
        assert w["kl_mean"] == pytest.approx(kl, rel=1e-3) and w["top1"] == pytest.approx(top1, abs=1e-4)
        assert "filled_context_1024_gguf_smollm2_n129.json" in row["quality"]["evidence"]
        assert row["bytes"]["weights"] == 116815104  # the carried form (the measured export), not the file's bytes
    (row,) = plan_json("-m", "smollm2-135m", "--weights", "int4", "--device", "pixel8", "--ctx", "2k", "--runtime",
                       "ort", "--strategy", "kv:dtype=fp16")["options"]
    assert row["quality"]["weights"]["risk"] == "high" and row["quality"]["risk"] == "high"
    # the plan stays free of torch with a GGUF read for its tensor types
    code = ("import sys; from click.testing import CliRunner; from edgekv.cli import main; "
            "r = CliRunner().invoke(main, ['plan', '-m', 'smollm2-135m', '--weights', 'gguf', '-d', 'pixel8', '-c', "
            "'2k', '--runtime', 'ort']); assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    # a catalog name without known weights has no GGUF to read: one line, exit 2
    r = CliRunner().invoke(main, ["plan", "-m", "llama-3.2-1b", "--weights", "gguf", "--device", "pixel8", "--ctx",
                                  "2k"])
    assert r.exit_code == 2 and "--weights gguf needs a GGUF model" in r.stderr


def test_gemmas_carried_weights_have_their_measured_kl():
    from edgekv.quality import weights_cost
    kl, top1 = measured_kl("gemma3")
    m = weights_cost("gemma-3-270m", "gguf", "onnx")
    assert m["kl_mean"] == pytest.approx(kl, rel=1e-3) and m["top1"] == pytest.approx(top1, abs=1e-4)
    assert "filled_context_1024_gguf_gemma3_n129.json" in m["source"]
    assert weights_cost("gemma-3-270m", "int4", "onnx")["kl_mean"] > 10 * m["kl_mean"]

