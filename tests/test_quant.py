"""The state quantizers against llama.cpp's reference quantizers (gguf-py's numpy port) and hand arithmetic."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gg_dequantize, quantize as gg_quantize

from edgekv.arch import catalog_arch
from edgekv.quant import dequantize, dequantize_planar, pack, planar_order, quantize, roundtrip, unpack
from edgekv.strategies import build_layout, parse_strategy

X = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)


def test_int8_group32_is_llama_cpp_q8_0():
    # q8_0: scale = amax / 127 per 32 values, stored fp16. llama.cpp divides by the fp32 scale, edgekv by the stored
    # fp16 one (self-consistent with what is dequantized), so a value on a rounding boundary may land one step apart
    ref = gg_dequantize(gg_quantize(X, GT.Q8_0), GT.Q8_0)
    ours = roundtrip(torch.from_numpy(X), 8, 32).numpy()
    step = np.abs(X.reshape(-1, 32)).max(1) / 127
    assert (ref == ours).mean() > 0.99
    assert (np.abs(ref - ours).reshape(-1, 32) <= step[:, None] * 1.01).all()


def test_int4_group32_matches_llama_cpp_q4_1():
    # same scale/min per 32 values; llama.cpp rounds with the fp32 scale and stores fp16, edgekv rounds with the stored
    # fp16 values, so a value on a rounding boundary can land one step apart
    ref = gg_dequantize(gg_quantize(X, GT.Q4_1), GT.Q4_1)
    ours = roundtrip(torch.from_numpy(X), 4, 32).numpy()
    step = (X.reshape(-1, 32).max(1) - X.reshape(-1, 32).min(1)) / 15
    assert (np.abs(ref - ours) < 1e-3).mean() > 0.99
    assert (np.abs(ref - ours).reshape(-1, 32) <= step[:, None] * 1.01).all()


def test_packing_by_hand():
    # 2-bit codes 0,1,2,3 -> 0 + 1*4 + 2*16 + 3*64 = 228; 4-bit codes 5, 12 -> 5 + 12*16 = 197
    assert pack(torch.tensor([[0, 1, 2, 3]]), 2).tolist() == [[228]]
    assert pack(torch.tensor([[5, 12]]), 4).tolist() == [[197]]
    assert unpack(torch.tensor([[228]], dtype=torch.uint8), 2).tolist() == [[0, 1, 2, 3]]


def test_planar_dequantize_is_dequantize_in_planar_channel_order():
    """The .pte's packed read-back (planes whole, no interleave): by hand, 4-bit bytes 197 = codes (5, 12) and 33 =
    (1, 2) with one group (scale 0.5, zero -1) give channels 0..3 = 1.5, 5, -0.5, 0 and planar order 0, 2, 1, 3; then
    on real-sized groups it equals dequantize() (llama.cpp-checked above) permuted, bit for bit."""
    by_hand = dequantize_planar(torch.tensor([[197, 33]], dtype=torch.uint8), torch.tensor([[0.5]]).half(),
                                torch.tensor([[-1.0]]).half(), 4)
    assert planar_order(4, 4).tolist() == [0, 2, 1, 3]
    assert by_hand.tolist() == [[1.5, -0.5, 5.0, 0.0]]
    x = torch.from_numpy(X).reshape(8, 8, 64)
    for bits, group in ((4, 32), (4, 8), (2, 16), (2, 4)):
        codes, scale, zero = quantize(x, bits, group)
        want = dequantize(codes, scale, zero, bits, group)[..., planar_order(64, bits)]
        assert torch.equal(dequantize_planar(codes, scale, zero, bits, group), want)
    with pytest.raises(ValueError, match="multiple of 4"):
        dequantize_planar(codes, scale, zero, 2, 2)


def test_values_on_the_grid_survive_exactly():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0] * 8])  # 2 bits: scale (3 - 0) / 3 = 1, exact in fp16
    assert torch.equal(roundtrip(x, 2, 32), x)
    x = torch.arange(32.0).reshape(1, 32) % 16  # 4 bits: scale 15 / 15 = 1
    assert torch.equal(roundtrip(x, 4, 32), x)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_error_is_at_most_half_a_step(bits):
    x = torch.from_numpy(X)
    codes, scale, zero = quantize(x, bits, 32)
    err = (dequantize(codes, scale, zero, bits, 32) - x).abs().reshape(64, 2, 32)
    assert (err <= scale.float().unsqueeze(-1) * 0.5 + 1e-3).all()


def test_stochastic_rounding_is_unbiased():
    x = torch.full((1, 32), 0.3)
    x[0, 0], x[0, 1] = 0.0, 1.0  # min 0, max 1 -> 3 steps of 1/3 at 2 bits; 0.3 lies between 0 and 1/3
    g = torch.Generator().manual_seed(0)
    mean = torch.stack([roundtrip(x, 2, 32, "stochastic", g) for _ in range(4000)]).mean(0)
    assert abs(mean[0, 5].item() - 0.3) < 0.01
    assert roundtrip(x, 2, 32)[0, 5].item() == pytest.approx(1 / 3, abs=1e-3)  # nearest always rounds up here


@pytest.mark.parametrize("spec", ["kv-int8", "kv-int4", "kv-int2", "kv-int8:group=32"])
def test_quantizer_output_is_exactly_the_state_layout(spec):
    """The layout the planner counts is the tensors the quantizer produces: same shapes, same dtypes."""
    layout = build_layout(catalog_arch("smollm2-135m"), parse_strategy(spec), 16)
    key, scale = layout.tensors[0], layout.tensors[1]
    s = parse_strategy(spec)
    codes, sc, zero = quantize(torch.randn(1, 3, 16, 64), s.kv_bits, s.params["group"])
    assert tuple(codes.shape) == key.shape and str(codes.dtype) == f"torch.{key.dtype}"
    assert tuple(sc.shape) == scale.shape and str(sc.dtype) == f"torch.{scale.dtype}"
    if s.kv_bits < 8:
        zt = layout.tensors[2]
        assert zt.role == "key.zero" and tuple(zero.shape) == zt.shape
    else:
        assert zero is None and layout.tensors[2].role == "value"
