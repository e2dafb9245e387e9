"""experiments/wquant_recipe.py simulates ONNX Runtime's MatMulNBits blocks in torch to say which part of the int4
recipe costs quality. Its blocks must be the ones ONNX Runtime's own quantizer writes: a MatMul over a random matrix,
quantized by MatMulNBitsQuantizer (fp32 activations, accuracy_level 0) and fed the identity, returns the dequantized
matrix, which q_block must reproduce."""
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
wr = load_benchmark("wquant_recipe")


def ort_dequantized(w: np.ndarray, bits: int, symmetric: bool) -> np.ndarray:
    """w [K, N] (MatMul's B) -> what ONNX Runtime's MatMulNBits multiplies by, read back through an identity input."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    k, n = w.shape
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])],
                          [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=32, is_symmetric=symmetric, accuracy_level=0)
    q.process()
    assert [n.op_type for n in q.model.model.graph.node] == ["MatMulNBits"]
    s = ort.InferenceSession(q.model.model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": np.eye(k, dtype=np.float32)})[0]


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True)])
def test_q_block_holds_the_values_onnx_runtimes_blocks_hold(bits, symmetric):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 48)) * 0.05).astype(np.float32)
    w[:, 5] += 0.2  # a skewed column: asymmetric blocks need a zero point away from the middle
    want = ort_dequantized(w, bits, symmetric)
    got = wr.q_block(torch.from_numpy(w.T.copy()), bits, symmetric).numpy().T
    assert not np.allclose(want, w, atol=1e-4)  # quantized, so not the matrix itself
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_act_int8_rounds_each_block_of_32_on_its_own_scale():
    a = torch.cat([torch.linspace(-1, 1, 32), torch.linspace(-100, 100, 32)])[None]
    q = wr.act_int8(a)
    assert torch.allclose(q[0, :32], torch.round(a[0, :32] * 127) / 127)
    assert torch.allclose(q[0, 32:], torch.round(a[0, 32:] / (100 / 127)) * (100 / 127))


def test_searched_blocks_are_on_an_integer_zero_point_grid_and_no_worse_than_min_max_blocks():
    """Each searched block is s * (c - z) with codes c and zero point z integers in 0..15 (what MatMulNBits' uint4
    codes and zero points can hold), and its squared error is at most that of ONNX Runtime's min/max block (one of
    the candidates, before the refit) — strictly less over the whole matrix."""
    rng = np.random.default_rng(1)
    w = torch.from_numpy((rng.standard_normal((16, 64)) * 0.05).astype(np.float32))
    w[:, 3] += 0.3
    got = wr.q_block(w, 4, False, search=True)
    minmax = wr.q_block(w, 4, False)
    blocks, mm = (w - got).reshape(-1, 32), (w - minmax).reshape(-1, 32)
    assert ((blocks ** 2).sum(-1) <= (mm ** 2).sum(-1) + 1e-9).all()
    assert (blocks ** 2).sum() < 0.95 * (mm ** 2).sum()
    for b in got.reshape(-1, 32):  # a block's values are integer multiples of its step (0 on the grid: the
        v = torch.unique(b)  # zero point an integer), at most 15 steps from end to end
        step = (v[1:] - v[:-1]).min()
        assert torch.allclose(v / step, torch.round(v / step), atol=1e-3), v / step
        assert round(float((v[-1] - v[0]) / step)) <= 15
