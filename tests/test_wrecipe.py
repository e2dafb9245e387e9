"""--weights int4-mix (edgekv.export.wrecipe): the bits each tensor gets, each block's search, and the export's blocks.

References: llama.cpp's llama_tensor_get_type for Q4_K_M worked by hand for published layer counts (and what its own
quantizer chose on the same weights: benchmarks/results/weight_recipe.json's tensor types); ONNX Runtime's own
MatMulNBitsQuantizer kernel (qbits_block_quant: the min/max blocks, packed, bit for bit) and its MatMulNBits kernel
running the exported tensors against numpy's x W^T.
"""
import re

import numpy as np
import pytest

from conftest import ROOT, traced_for_onnx

TINY = ROOT / "fixtures" / "tiny" / "llama"


def test_mix_bits_follow_llama_cpps_q4_k_m_rule_by_hand():
    """use_more_bits(i, n) = i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2 in C integer arithmetic, by hand:
    SmolLM2-135M (30 layers): n/8 = 3, 7n/8 = 26 -> 0-2, 26-29 and 5, 8, ..., 23: 14 layers, the 14 Q6_K ffn_down
    and 14 Q8_0 attn_v (Q6_K on a 576 width) llama.cpp's quantizer chose; Gemma-3-270M (18): n/8 = 2, 7n/8 = 15 ->
    0, 1, 15-17 and 4, 7, 10, 13: 9 layers (9 and 9 in its file)."""
    from edgekv.export.wrecipe import mix_bits
    for n, more in ((30, {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}), (18, {0, 1, 4, 7, 10, 13, 15, 16, 17}),
                    (4, {2, 3})):
        for role in ("attn_v", "ffn_down"):
            assert {i for i in range(n) if mix_bits(role, i, n) == 8} == more, (n, role)
        for role in ("q", "k", "o", "gate", "up"):
            assert all(mix_bits(role, i, n) == 4 for i in range(n))
        assert mix_bits("head", None, n) == 8


def _err(w, q, s, z, wt=None, block=32):
    from edgekv.export.wrecipe import dequantize
    d = (w - dequantize(q, s, z, block)).reshape(w.shape[0], -1, block) ** 2
    return (d if wt is None else d * wt.reshape(1, -1, block)).sum(-1)


@pytest.mark.parametrize("bits", [4, 8])
def test_search_never_loses_to_min_max_on_any_block(bits):
    """Gaussian, heavy-tailed, one-sided, constant and zero blocks, uniform and importance-weighted: every block's
    (weighted) squared error at most min/max's, and less in total."""
    from edgekv.export.wrecipe import minmax_blocks, search_blocks
    rng = np.random.default_rng(0)
    w = np.concatenate([rng.standard_normal((8, 256)), rng.standard_t(2, (8, 256)), np.abs(rng.standard_normal((4, 256))),
                        np.full((2, 256), 0.3), np.zeros((2, 256))]).astype(np.float32)
    for imp in (None, rng.gamma(0.5, 1.0, 256).astype(np.float32)):
        got, base = _err(w, *search_blocks(w, bits, importance=imp), wt=imp), _err(w, *minmax_blocks(w, bits), wt=imp)
        assert (got <= base * (1 + 1e-6) + 1e-12).all()
        assert got.sum() < 0.97 * base.sum()


@pytest.mark.parametrize("bits", [4, 8])
def test_min_max_blocks_packed_are_ort_quantizers_own(bits):
    """minmax_blocks + pack_matmul against ONNX Runtime's asymmetric kernel (MatMulNBitsQuantizer's
    qbits_block_quant) on the same weights, bit for bit: codes, scales and zero points, an odd block count too."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, \
        DefaultWeightOnlyQuantizer

    from edgekv.export.wrecipe import minmax_blocks, pack_matmul
    w = np.random.default_rng(1).standard_normal((24, 96)).astype(np.float32)  # [N, K], K/32 = 3 blocks
    q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, bits=bits))
    want = q.qbits_block_quant(np.ascontiguousarray(w.T))
    got = pack_matmul(*minmax_blocks(w, bits), bits)
    for g, x in zip(got, want):
        assert np.array_equal(g.reshape(-1), np.asarray(x).reshape(-1))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The tiny llama's graph as the streamed export lowers it, quantized with int4-mix."""
    from edgekv.export import onnx_quant
    from edgekv.export.to_onnx import lower_onnx, save_onnx

    ep, entry = traced_for_onnx(TINY)
    root = tmp_path_factory.mktemp("mix")
    (root / "fp32").mkdir()
    (root / "q").mkdir()
    save_onnx(lower_onnx(ep, entry, fold_weights=False), root / "fp32" / "model.onnx")
    rec = onnx_quant.quantize_onnx(root / "fp32" / "model.onnx", root / "q" / "model.onnx", "int4-mix", entry)
    return root, rec


def _unpack(b, zp, bits, n, k, block=32):
    kb = k // block
    if bits == 4:
        codes = np.stack([b & 15, b >> 4], -1).reshape(n, k)
        zeros = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :kb]
    else:
        codes, zeros = b.reshape(n, k), zp.reshape(n, kb)
    return codes, zeros


def test_int4_mix_export_bits_blocks_and_kernel(mixed):
    """Every MatMulNBits of the tiny llama (4 layers; q/k/v fused into one matrix on the ONNX route, so qkv and
    ffn_down of layers 2 and 3 at 8 bits, the head at 8, the rest 4) as the manifest's per-tensor record says. The
    8-bit ones are gguf's own Q8_0 of the fp32 weight, bit for bit, with the default zero point; the 4-bit ones an
    integer zero point plus the fp32 remainder the graph adds from the input's block sums, each block's error at most
    gguf's Q4_1's (the float minimum it generalizes). ONNX Runtime running each node's tensors (fp32 activations)
    plus the remainder term equals numpy's x W_q^T; the tied table is gathered from the head's own codes."""
    gguf = pytest.importorskip("gguf")
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgekv.export.onnx_stream import _stream_weights

    root, rec = mixed
    per = rec["per_tensor"]
    fp32 = onnx.load(str(root / "fp32" / "model.onnx"), load_external_data=False)
    base = str(root / "fp32")
    weights = {w.name: (numpy_helper.to_array(w, base) if tr else numpy_helper.to_array(w, base).T)
               for w, tr, _, _ in _stream_weights(fp32).values()}  # each as rows [N, K]
    m = onnx.load(str(root / "q" / "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    nodes = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 4 * 5 + 1 and not any(n.op_type == "MatMul" and n.input[1] in inits and
                                               not n.name.endswith(".remainder") for n in m.graph.node)
    by_name = {n.name: n for n in m.graph.node}
    rng = np.random.default_rng(2)
    for node in nodes:
        a = {x.name: x.i for x in node.attribute}
        name = next(k for k, v in per.items() if node.name == f"{v.get('node')}_Q{a['bits']}")
        tensor = np.ascontiguousarray(weights[name], dtype=np.float32)
        head = per[name]["role"] == "head"
        assert a["bits"] == per[name]["bits"] == (8 if head or re.search(r"layers\.[23]\..*(qkv|down)_proj", name) else 4), name
        n, k = a["N"], a["K"]
        x = rng.standard_normal((3, k)).astype(np.float32)
        if a["bits"] == 8:
            assert len(node.input) == 3  # no zero points: the default 128
            codes, scales = inits[node.input[1]].reshape(n, k), inits[node.input[2]].reshape(n, k // 32)
            deq = ((codes.reshape(n, -1, 32).astype(np.float32) - 128) * scales[..., None]).reshape(n, k)
            q80 = gguf.quants.dequantize(gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q8_0),
                                         gguf.GGMLQuantizationType.Q8_0)
            assert np.array_equal(deq, np.asarray(q80, np.float32)), name
            rem = np.zeros((3, n), np.float32)
        else:
            codes, zeros = _unpack(inits[node.input[1]], inits[node.input[3]], 4, n, k)
            r = inits[by_name[node.output[0][:-len(".nbits")] + ".remainder"].input[1]]  # [K/32, N]
            scales = inits[node.input[2]].reshape(n, k // 32)
            deq = ((codes.reshape(n, -1, 32).astype(np.float32) - zeros[..., None]) * scales[..., None]
                   + r.T[..., None]).reshape(n, k)
            rem = x.reshape(3, -1, 32).sum(-1) @ r
            q41 = np.asarray(gguf.quants.dequantize(gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q4_1),
                                                    gguf.GGMLQuantizationType.Q4_1), np.float32)
            mine = ((tensor - deq).reshape(n, -1, 32) ** 2).sum(-1)
            theirs = ((tensor - q41).reshape(n, -1, 32) ** 2).sum(-1)
            assert (mine <= theirs * (1 + 1e-4) + 1e-12).all(), name
        g = helper.make_graph([helper.make_node("MatMulNBits", ["x", "B", "s", "z"][:len(node.input)], ["y"],
                                                domain="com.microsoft", K=k, N=n, bits=a["bits"], block_size=32,
                                                accuracy_level=0)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
                              [numpy_helper.from_array(inits[node.input[i]], nm)
                               for i, nm in ((1, "B"), (2, "s"), (3, "z")) if i < len(node.input)])
        sess = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21),
                                                                        helper.make_opsetid("com.microsoft", 1)])
                                    .SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(sess.run(None, {"x": x})[0] + rem, x @ deq.T, rtol=1e-4, atol=1e-4)
    gbq = [n for n in m.graph.node if n.op_type == "GatherBlockQuantized"]
    head = next(n for n in nodes if per[next(k for k, v in per.items() if v.get("role") == "head")]["node"] + "_Q8"
                == n.name)
    assert len(gbq) == 1 and gbq[0].input[0] == head.input[1]  # one copy of the table's codes


def test_plan_prices_int4_mix_by_hand():
    """SmolLM2-135M (576 wide, 1536 MLP, 192-wide k and v, 30 layers): int4-mix holds v (192 x 576) and down (576 x
    1536) of 14 layers at int8's bytes (n + 2 B per row) instead of int4's (n / 2 + 2 B per 32): 7n/16 + 2 rows more
    each, 14 x (48,384 + 384 + 387,072 + 1,152) = 6,117,888 B; every 4-bit matrix adds its fp32 remainder, 4 B per
    32 (n / 8): q, k, o, gate, up of 30 layers (442,368 + 331,776 + 1,769,472 = 2,543,616 each) and v, down of the
    other 16 (110,592 + 884,736) are 92,233,728 weights, 11,529,216 B; the table is priced at int8 either way."""
    from edgekv.arch.catalog import load_arch
    from edgekv.memory.weights import weight_bytes
    a = load_arch("smollm2-135m")
    assert weight_bytes(a, "int4-mix")["total"] - weight_bytes(a, "int4")["total"] == 6_117_888 + 11_529_216


def test_int4_mix_for_the_pte_is_refused_in_one_line(tmp_path):
    """int4-mix is MatMulNBits blocks: a .pte export is refused before anything is loaded, exit 2, one line."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "edgekv.cli", "export", "-m", str(TINY), "--weights", "int4-mix",
                        "--format", "pte", "-c", "512", "-o", str(tmp_path / "out")], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "int4-mix" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_q8_blocks_are_ggufs_q8_0_bit_for_bit():
    """int4-mix's 8-bit tensors (the head, the tied table, use_more_bits' attn_v / ffn_down) are llama.cpp's Q8_0:
    q8_blocks' values against gguf's own Q8_0 quantize + dequantize (llama.cpp's Python reference), bit for bit,
    on Gaussian, heavy-tailed, ties at .5 and all-zero blocks."""
    gguf = pytest.importorskip("gguf")
    from edgekv.export.wrecipe import q8_blocks
    rng = np.random.default_rng(3)
    ties = np.tile(np.arange(-63.5, 64.5, 1.0), (2, 1))  # each block's d = 1 where 127 is its largest: x.5 ties
    ties[:, ::32] = 127
    w = np.concatenate([rng.standard_normal((6, 128)), rng.standard_t(2, (6, 128)), ties,
                        np.zeros((2, 128))]).astype(np.float32)
    codes, scales = q8_blocks(w)
    mine = ((codes.reshape(16, 4, 32).astype(np.float32) - 128) * scales[..., None]).reshape(16, 128)
    theirs = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                    gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(mine.view(np.uint32), np.asarray(theirs, np.float32).view(np.uint32))


def test_float_minimum_search_by_hand_and_against_ggufs_q4_1():
    """A block that is exactly 0.1 * q - 0.73 (q = 0..15, a fractional minimum) is found exactly (squared error
    under 1e-10), which no integer zero point can hold (0.73 / 0.1 is not an integer: the int4 search's error is
    over 1e-4); and on random blocks, uniform and importance-weighted, each block's (weighted) squared error is at
    most gguf's own Q4_1 (scale (max - min) / 15 and the block's minimum, llama.cpp's Python reference)."""
    gguf = pytest.importorskip("gguf")
    from edgekv.export.wrecipe import dequantize_fmin, search_blocks, search_blocks_fmin
    grid = (0.1 * np.tile(np.arange(16), 2) - 0.73).astype(np.float32)[None]
    assert ((grid - dequantize_fmin(*search_blocks_fmin(grid, 4))) ** 2).sum() < 1e-10
    assert _err(grid, *search_blocks(grid, 4)).sum() > 1e-4
    rng = np.random.default_rng(4)
    w = np.concatenate([rng.standard_normal((8, 256)), rng.standard_t(2, (8, 256)) + 0.4,
                        np.abs(rng.standard_normal((4, 256)))]).astype(np.float32)
    q41 = np.asarray(gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1),
                                            gguf.GGMLQuantizationType.Q4_1), np.float32)
    for imp in (None, rng.gamma(0.5, 1.0, 256).astype(np.float32)):
        wt = np.ones((8, 32), np.float32) if imp is None else imp.reshape(8, 32)
        mine = ((w - dequantize_fmin(*search_blocks_fmin(w, 4, importance=imp))).reshape(20, 8, 32) ** 2 * wt).sum(-1)
        theirs = ((w - q41).reshape(20, 8, 32) ** 2 * wt).sum(-1)
        assert (mine <= theirs * (1 + 1e-5)).all() and mine.sum() < 0.9 * theirs.sum()


def test_split_minimum_by_hand():
    """scale 0.1, minimum -0.73: z = round(7.3) = 7, r = -0.73 + 0.7 = -0.03, so 0.1 * q - 0.73 = 0.1 * (q - 7) - 0.03;
    a positive minimum 0.25 (scale 0.1) clips z at 0 and keeps r = 0.25; minimum -2.0 clips z at 15, r = -0.5."""
    from edgekv.export.wrecipe import split_minimum
    z, r = split_minimum(np.array([[0.1, 0.1, 0.1]], np.float32), np.array([[-0.73, 0.25, -2.0]], np.float32), 4)
    assert z.tolist() == [[7, 0, 15]] and z.dtype == np.uint8
    np.testing.assert_allclose(r, [[-0.03, 0.25, -0.5]], atol=1e-6)


def test_importance_is_the_mean_squared_input_by_hand():
    """Two Linear layers in sequence, inputs [[1, 2], [3, -4]] then [[0, 5], [6, 0]] (two windows of one token):
    the first's importance per input channel is ((1 + 9) / 2, (4 + 16) / 2) = (5, 10); the second (its input is the
    first's output, an identity here) the same; the fused names (qkv_proj, gate_up_proj) read q_proj's / gate_proj's."""
    import contextlib

    import torch

    from edgekv.export.wrecipe import eager_importance

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(2, 2, bias=False)
            self.gate_proj = torch.nn.Linear(2, 2, bias=False)
            with torch.no_grad():
                self.q_proj.weight.copy_(torch.eye(2))

        def forward(self, x):
            return self.gate_proj(self.q_proj(x))

    class Stepper:
        def __init__(self, m, feed):
            self.m, self.feed = m, feed

        def reset(self):
            pass

        def prefill(self, ids):
            return self.m(torch.tensor([self.feed[i] for i in ids], dtype=torch.float32)[None])

    m = torch.nn.Sequential(Block())
    feed = {0: [1.0, 2.0], 1: [3.0, -4.0]}
    imp = eager_importance(m, lambda n: contextlib.nullcontext({}), lambda s: Stepper(m, feed), [0, 1], window=1)
    for name in ("0.q_proj.weight", "0.gate_proj.weight", "0.qkv_proj.weight", "0.gate_up_proj.weight"):
        np.testing.assert_allclose(imp[name], [5.0, 10.0], rtol=1e-6)


def test_calibration_text_is_not_the_evaluation_text():
    """The importance matrix's text shares no paragraph with verify-quant's (textwrap's and argparse's docstrings)
    and is long enough for CALIBRATION_TOKENS (about 4 characters a token)."""
    from edgekv.export.quality import quality_text
    from edgekv.export.wrecipe import CALIBRATION_TOKENS, calibration_text
    cal, ev = calibration_text(), quality_text()
    assert len(cal) > 8 * CALIBRATION_TOKENS
    assert not {p for p in ev.split("\n\n") if len(p) > 40} & set(cal.split("\n\n"))
