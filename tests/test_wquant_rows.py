"""The output layer is quantized in blocks of rows (edgekv.export.wquant.quantize_rows: torchao's quantizer holds
several fp32 temporaries the size of the matrix, 2.3 GB over the random Llama-3.2-1B's head at once). Reference:
torchao's quantize_ over the whole matrix in one call; the joined blocks must be the same codes, scales and zero
points, bit for bit, with a last block shorter than the others."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from torch import nn  # noqa: E402


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_row_blocks_quantize_to_the_whole_matrixs_codes(weights):
    from torchao.quantization import quantize_

    from edgekv.export.wquant import quantize_rows, torchao_config
    torch.manual_seed(0)
    w = torch.randn(1000, 96) * torch.rand(1000, 1)  # rows of different ranges: a scale per row group
    whole, blocks = nn.Linear(96, 1000, bias=False), nn.Linear(96, 1000, bias=False)
    with torch.no_grad():
        whole.weight.copy_(w)
        blocks.weight.copy_(w)
    quantize_(nn.Sequential(whole), torchao_config(weights))
    quantize_rows(blocks, torchao_config(weights), rows=300)  # 300, 300, 300, 100
    a, b = whole.weight, blocks.weight
    assert type(a) is type(b) and a.shape == b.shape and a.block_size == b.block_size
    for name in ("qdata", "scale", "zero_point"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.activation_quantization == b.activation_quantization and a.target_dtype == b.target_dtype
    inp = torch.randn(2, 96)
    assert torch.equal(whole(inp), blocks(inp))
