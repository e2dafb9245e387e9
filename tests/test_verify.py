"""Export verification and manifest checking on hand-made inputs with known answers (fast: numpy, no export).

verify() compares an artifact's stepper with the reference's; here both are tables of logits with a known logit
scale, and the artifact is made wrong by known amounts: every logit x (1 + e) (max |diff| = e x the scale, exactly,
and no top-1 change), or near-tied top-2 logits swapped at k of N positions (top-1 agreement (N - k) / N, exactly,
with a max |diff| of 1e-6). The limits the artifact must meet come from what the runtimes' rounding was measured to
move (edgekv/export/verify.py: REL_TOL's comments), not from the constants themselves: a float or an 8-bit cache
moves logits by at most 1.2e-2 of the scale, a packed int4 cache by 6.4e-2, a wrong lowering by the order of the
scale. load_export() refuses a folder whose files differ from the manifest's sha256 and sizes.
"""
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgekv.errors import EdgekvError
from edgekv.export.manifest import load_export
from edgekv.export.verify import describe, limits, tolerance_dtype, verify

V, CTX = 50, 64
RNG = np.random.default_rng(3)
TABLE = RNG.normal(0, 4, size=(CTX, V)).astype(np.float32)
TOP2 = np.argsort(TABLE, axis=1)[:, -2:]  # second, first
TABLE[np.arange(CTX), TOP2[:, 0]] = TABLE[np.arange(CTX), TOP2[:, 1]] - 1e-6 * 4  # a near-tie at every position
PROMPT = list(range(3, 13))  # 10 prompt tokens + 10 decode steps = 20 positions compared
STEPS = 10


class Table:
    """A stepper whose logits at position p are TABLE[p] (times `factor`; top-2 swapped at the positions in `swap`),
    and whose state is `state`."""

    def __init__(self, factor=1.0, swap=(), state=0.0):
        self.factor, self.swap = factor, set(swap)
        self.state = [np.full((2, 3), state, dtype=np.float32), np.zeros(4, dtype=np.int8)]

    def rows(self, start, n):
        out = TABLE[start:start + n] * np.float32(self.factor)
        for p in range(start, start + n):
            if p in self.swap:
                a, b = TOP2[p]
                out[p - start, [a, b]] = out[p - start, [b, a]]
        return out

    def prefill(self, tokens):
        return self.rows(0, len(tokens))

    def step(self, tokens, pos):
        return self.rows(pos, 1)


def check(art, dtype, noise=None):
    return verify(art, Table(), PROMPT, STEPS, dtype, "test", noise)


SCALE = float(np.abs(TABLE[:20]).max())
FLOAT_AND_8BIT = ["float32", "float16", "float16-attention", "int8"]


@pytest.mark.parametrize("dtype", FLOAT_AND_8BIT + ["uint8", "quantized-weights"])
def test_the_same_logits_pass_with_the_scale_and_positions_counted(dtype):
    v = check(Table(), dtype)
    assert v["passed"] and v["max_abs_diff"] == 0 and v["top1_agreement"] == 1.0
    assert v["logit_scale"] == pytest.approx(SCALE) and v["positions_compared"] == 20
    assert v["prompt_tokens"] == 10 and v["decode_steps"] == 10 and v["state_max_abs_diff"] == 0


@pytest.mark.parametrize("dtype", FLOAT_AND_8BIT)
def test_float_and_8bit_caches_pass_rounding_noise_and_refuse_3_percent_of_the_scale(dtype):
    ok = check(Table(1 + 1e-5), dtype)  # far under any cache's rounding
    assert ok["passed"] and ok["max_abs_diff"] == pytest.approx(1e-5 * SCALE, rel=1e-2)
    bad = check(Table(1.03), dtype)
    assert bad["top1_agreement"] == 1.0 and bad["max_abs_diff"] == pytest.approx(0.03 * SCALE, rel=1e-4)
    assert not bad["passed"]
    assert bad["tolerance"]["max_abs_diff_over_logit_scale"] < 0.03


def test_a_float32_cache_refuses_what_a_fp16_rounding_moves():
    # fp16 rounds a value by up to 2^-11 ~ 4.9e-4 relative: a fp32 cache moved that far is not a fp32 cache
    assert not check(Table(1 + 4.9e-4), "float32")["passed"]
    assert check(Table(1 + 4.9e-4), "float16")["passed"]


def test_packed_int4_caches_pass_their_measured_noise_and_refuse_a_wrong_unpack():
    assert check(Table(1.064), "uint8")["passed"]  # SmolLM2 kv-int4 g32, ORT vs eager: 6.4e-2 of the scale
    for dtype in FLOAT_AND_8BIT + ["uint8", "quantized-weights"]:
        assert not check(Table(1.5), dtype)["passed"], dtype  # a wrong scale: half the logit scale off


@pytest.mark.parametrize("dtype,k,passes", [("float32", 1, True), ("float32", 2, False), ("int8", 2, False),
                                            ("uint8", 2, True), ("uint8", 3, False)])
def test_top1_agreement_counts_each_flipped_position(dtype, k, passes):
    """k of 20 positions with the top two swapped: agreement (20 - k) / 20; float and int8 caches need 95 % (one
    near-tie flip in 20), a packed int4 cache 90 %."""
    v = check(Table(swap=range(5, 5 + k)), dtype)
    assert v["top1_agreement"] == pytest.approx((20 - k) / 20)
    assert v["max_abs_diff"] < 1e-4 * SCALE
    assert v["passed"] is passes


def test_the_state_difference_is_reported():
    v = check(Table(state=0.25), "float32")
    assert v["state_max_abs_diff"] == pytest.approx(0.25)


def test_a_noise_floor_widens_the_limits_to_twice_what_the_reference_moves_against_itself():
    """A quantized-weights .pte whose own eager twin one ulp away moves the logits by 10 % of the scale and flips 1 of
    20 top-1s: the artifact may differ by up to 2 x 10 % and agree on 1 - 2 x 5 % - 1/20 = 85 %; without the floor
    the fixed 15 % applies."""
    noise = Table(1.10, swap=[7])
    v = check(Table(1.18), "quantized-weights", noise)
    assert v["noise_floor"]["max_abs_diff"] == pytest.approx(0.10 * SCALE, rel=1e-4)
    assert v["noise_floor"]["top1_agreement"] == pytest.approx(0.95)
    assert v["tolerance"]["max_abs_diff_over_logit_scale"] == pytest.approx(0.20, rel=1e-4)
    assert v["tolerance"]["min_top1_agreement"] == pytest.approx(0.85)
    assert v["passed"]
    assert not check(Table(1.18), "quantized-weights")["passed"]
    assert not check(Table(1.25), "quantized-weights", Table(1.10, swap=[7]))["passed"]
    # a floor quieter than the fixed limits does not narrow them
    assert limits("int8", {"max_abs_diff": 0.0, "logit_scale": 10.0, "top1_agreement": 1.0}, 20) == limits(
        "int8", None, 20)


THIRD = np.argsort(TABLE, axis=1)[:, -3]
FAR = TABLE.copy()
FAR[np.arange(CTX), THIRD] = TABLE[np.arange(CTX), TOP2[:, 1]] - 0.5  # the third 0.5 under the top-1 everywhere


class Far(Table):
    """TABLE with each row's third logit 0.5 under its top-1; the top-1 and the third are swapped at the positions in
    `far` (a clear disagreement: a 0.5 margin, yet a max |diff| of 0.5, inside the 15 % limit), the top-2 at the
    positions in `swap` (a near tie, margin 4e-6)."""

    def __init__(self, factor=1.0, swap=(), far=()):
        super().__init__(factor, swap)
        self.far = set(far)

    def rows(self, start, n):
        out = FAR[start:start + n] * np.float32(self.factor)
        for p in range(start, start + n):
            for a, b in [TOP2[p]] * (p in self.swap) + [(TOP2[p][1], THIRD[p])] * (p in self.far):
                out[p - start, [a, b]] = out[p - start, [b, a]]
        return out


def test_near_ties_are_flips_inside_the_floors_own_movement_at_that_row():
    """By hand: the reference's top-1 leads its second by 0.01 and its third by 4.0. A flip to the second is a near
    tie where the floor moved a logit by 0.05 at that row, not where it moved one by 0.005; a flip to the third is
    never one under a floor of 0.05."""
    from edgekv.export.verify import near_ties

    ref = np.array([[5.0, 4.99, 1.0]] * 3, dtype=np.float32)
    art = np.array([[4.9, 5.0, 1.0], [4.9, 5.0, 1.0], [4.9, 1.0, 5.0]], dtype=np.float32)
    assert list(near_ties(art, ref, [0.05, 0.005, 0.05])) == [True, False, False]
    assert list(near_ties(ref, ref, [1.0, 1.0, 1.0])) == [False] * 3  # agreement is no tie


def test_a_near_tie_flip_inside_the_floor_is_not_counted_and_a_clear_one_is():
    """A quantized-weights .pte against a floor one ulp away that moves each row's logits by 1e-3 of the row's largest
    (some 1e-2, far above the 4e-6 top-2 margin of TABLE) and flips no top-1: limits 15 % of the scale and top-1
    1 - 0 - 1/20 = 90 % (18 of 20). 3 near-tie flips leave 17 of 20 (85 %) by the raw count but no clear
    disagreement: it passes. 2 clear flips (the reference's top-1 against its third, 0.5 under it) plus the 3 near ties: 18 of
    20 clear, passes; 3 clear flips: 17 of 20, refused, ties or not. Without a floor every flip counts."""
    noise = Far(1 + 1e-3)

    def check(art, noise=noise):
        return verify(art, Far(), PROMPT, STEPS, "quantized-weights", "test", noise)

    v = check(Far(swap=[3, 8, 14]))
    assert v["noise_floor"]["top1_agreement"] == 1.0 and v["tolerance"]["min_top1_agreement"] == pytest.approx(0.9)
    assert v["top1_agreement"] == pytest.approx(17 / 20)
    assert v["top1_near_ties"] == 3 and v["top1_agreement_clear"] == pytest.approx(1.0)
    assert v["passed"]
    assert "3 of the flips near ties" in describe(v)
    v = check(Far(swap=[3, 8, 14], far=[5, 11]))
    assert v["top1_agreement"] == pytest.approx(15 / 20) and v["top1_near_ties"] == 3 and v["passed"]
    v = check(Far(swap=[3, 8, 14], far=[5, 11, 17]))
    assert v["top1_agreement_clear"] == pytest.approx(17 / 20) and not v["passed"]
    assert v["max_abs_diff"] == pytest.approx(0.5, rel=1e-4) and v["max_abs_diff"] < 0.15 * v["logit_scale"]
    assert not check(Far(far=[5, 11, 17]))["passed"]
    # no floor measured (a float cache's export): the fixed limit counts every flip
    v = check(Far(swap=[3, 8, 14]), None)
    assert "top1_near_ties" not in v and not v["passed"]


def test_the_tolerance_is_set_by_the_coarsest_state_tensor():
    """A KV cache's tensors take its storage's tolerance (codes and their fp16 scales alike), any other state its
    dtype's; the coarsest wins."""
    from edgekv.arch import catalog_arch
    from edgekv.strategies import build_layout, parse_strategy

    def tol(model, spec, fused=False):
        return tolerance_dtype(build_layout(catalog_arch(model), parse_strategy(spec), 64), fused_attention=fused)

    assert tol("smollm2-135m", "kv:dtype=fp32") == "float32"
    assert tol("smollm2-135m", "kv:dtype=fp16") == "float16"
    assert tol("smollm2-135m", "kv-int8") == "int8"  # int8 codes beside fp16 scales
    assert tol("smollm2-135m", "kv-int4") == "uint8"
    assert tol("smollm2-135m", "kv:dtype=fp16", fused=True) == "float16-attention"
    assert tol("smollm2-135m", "kv-int8", fused=True) == "int8"
    assert tol("jamba-v0.1", "hybrid:dtype=fp16,state_dtype=fp32") == "float16"  # fp16 KV beside an fp32 SSM state
    assert tol("mamba-130m", "ssm:dtype=int8") == "int8"  # int8 state beside fp32 conv state and scales


# ---- manifest checking: a real manifest (the Android tests' tiny Llama) over files written here ----

ANDROID_MANIFEST = Path(__file__).resolve().parent.parent / "android_demo/core/src/test/resources/tiny-llama-kv-rows"


@pytest.fixture
def export_folder(tmp_path):
    m = json.loads((ANDROID_MANIFEST / "manifest.json").read_text())
    files = {}
    for i, name in enumerate(sorted(m["files"])):
        data = bytes(range(256)) * (i + 3)
        if name.endswith(".onnx"):  # load_export also parses the graph (its external data must be listed)
            from onnx import TensorProto, helper
            x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
            y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
            data = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]))
            data = data.SerializeToString()
        (tmp_path / name).write_bytes(data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    m["files"] = files
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    return tmp_path, m


def test_a_folder_whose_files_match_the_manifest_loads(export_folder):
    d, m = export_folder
    assert load_export(d) == m


def test_a_changed_byte_a_changed_size_or_a_missing_file_is_refused(export_folder, tmp_path):
    d, m = export_folder
    name = "model.pte"
    data = bytearray((d / name).read_bytes())
    data[100] ^= 1  # same size, one bit
    (d / name).write_bytes(bytes(data))
    with pytest.raises(EdgekvError, match=f"{name}: sha256 does not match"):
        load_export(d)
    assert load_export(d, check_hashes=False)["files"] == m["files"]
    (d / name).write_bytes(bytes(data) + b"\0")  # a byte more
    with pytest.raises(EdgekvError, match="sha256 does not match"):
        load_export(d)
    (d / name).unlink()
    with pytest.raises(EdgekvError, match="missing"):
        load_export(d)


def test_a_manifest_off_its_schema_or_absent_is_one_error(export_folder, tmp_path):
    d, m = export_folder
    bad = dict(m)
    bad["max_ctx"] = "long"
    (d / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(EdgekvError, match="manifest.schema.json at max_ctx"):
        load_export(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EdgekvError, match="no manifest.json"):
        load_export(empty)
    shutil.rmtree(empty)


def test_logits_under_one_are_held_to_an_absolute_floor_of_one():
    """The limit is rel x max(logit scale, 1): logits all under 1 in size (a model that barely commits) may differ by
    rel in absolute terms, not by rel x their own small scale. Here the scale is ~0.14 and the artifact is off by 5e-5
    everywhere: inside float32's 1e-4 x 1, outside 1e-4 x 0.14."""
    small = TABLE[:20] / 100
    scale = float(np.abs(small).max())
    assert scale < 0.5

    class Small(Table):
        def __init__(self, off=0.0):
            super().__init__()
            self.off = off

        def rows(self, start, n):
            return TABLE[start:start + n] / 100 + np.float32(self.off)

    v = verify(Small(5e-5), Small(), PROMPT, STEPS, "float32", "test")
    assert v["logit_scale"] == pytest.approx(scale) and v["max_abs_diff"] == pytest.approx(5e-5, rel=1e-2)
    assert v["passed"]
    assert not verify(Small(2e-4), Small(), PROMPT, STEPS, "float32", "test")["passed"]


def test_logits_all_zero_compare_nothing_and_do_not_pass():
    """A model fed one token whose embedding row is zero (a word-level test tokenizer reading the verification text
    as unknown words, tied embeddings) gives zero logits on both sides: max |diff| 0 at scale 0 checked nothing."""

    class Zero(Table):
        def rows(self, start, n):
            return np.zeros((n, V), dtype=np.float32)

    v = verify(Zero(), Zero(), PROMPT, STEPS, "float32", "test")
    assert v["max_abs_diff"] == 0 and v["logit_scale"] == 0 and not v["passed"]


def test_a_tokenizer_that_reads_the_text_as_one_id_is_replaced_by_spread_ids():
    """verify_prompt: the text tokenized to a few distinct ids (all 'unknown') is not a prompt worth comparing on;
    fixed pseudo-random ids over the vocabulary are used instead, as for a model without a tokenizer."""
    from types import SimpleNamespace

    from edgekv.export.options import VERIFY_TEXT, verify_prompt

    class Unknown:
        def encode(self, text):
            return SimpleNamespace(ids=[0] * len(text.split()))

    class Bytes:
        def encode(self, text):
            return SimpleNamespace(ids=list(text.encode()))

    ids = verify_prompt(Unknown(), V, 100)
    assert len(set(ids)) >= 4 and all(0 <= i < V for i in ids)
    assert verify_prompt(Bytes(), 256, 100) == list(VERIFY_TEXT.encode())[:100]  # a real tokenizer's ids are kept


def test_the_verify_prompt_starts_with_the_bos_the_model_is_run_with():
    """A model whose tokenizer puts a BOS before every text (Gemma 3) is verified on a prompt that starts with it, as
    `edgekv run` feeds it (tokenizer.bos_prefix); a model without one gets the text's ids alone."""
    from types import SimpleNamespace

    from edgekv.export.options import VERIFY_TEXT, verify_prompt
    from edgekv.export.tokenizer import bos_prefix

    class Bytes:
        def encode(self, text):
            return SimpleNamespace(ids=list(text.encode()))

    text = list(VERIFY_TEXT.encode())
    gemma = bos_prefix({"add_bos_token": True, "bos_token_id": 2})
    assert verify_prompt(Bytes(), 256, 100, gemma) == [2] + text[:99]
    assert verify_prompt(Bytes(), 256, 100, bos_prefix({"add_bos_token": False, "bos_token_id": 1})) == text[:100]
