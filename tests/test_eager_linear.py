"""verify's eager reference of a weight-quantized .pte runs torchao's quantized linears with each weight dequantized
into a reused buffer in blocks of rows (edgekv.export.eager_linear). Reference: torchao's own F.linear on the same
weight, outside the context; the outputs must be the same bit for bit, for every weight layout the export makes (8da4w
in groups of 32 with bf16 scales, the head's groups of 64, int8 per channel with fp32 scales), asymmetric codes (a
zero point to subtract), a row count that is not a multiple of the block, a slice of rows (the eager head's blocks),
one token and several."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from conftest import random_llama  # noqa: E402
from torch import nn  # noqa: E402


def _weight(config, rows=200, cols=128, seed=0):
    from torchao.quantization import quantize_
    torch.manual_seed(seed)
    lin = nn.Linear(cols, rows, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    quantize_(nn.Sequential(lin), config)
    return lin.weight.detach()


def _configs():
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    from edgekv.export.wquant import torchao_config
    return {"int4": torchao_config("int4"), "int8": torchao_config("int8"),
            "head-int4-64": Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4, weight_granularity=PerGroup(64),
                weight_mapping_type=MappingType.SYMMETRIC_NO_CLIPPING_ERR, weight_scale_dtype=torch.bfloat16),
            "asymmetric-int4": Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4, weight_granularity=PerGroup(32), weight_mapping_type=MappingType.ASYMMETRIC)}


@pytest.mark.parametrize("name", ["int4", "int8", "head-int4-64", "asymmetric-int4"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_the_buffered_dequantization_gives_torchaos_outputs_bit_for_bit(name, tokens):
    from edgekv.export.eager_linear import dequantized, fast_quantized_linear
    w = _weight(_configs()[name])
    if name == "asymmetric-int4":
        assert w.zero_point.abs().max() > 0  # the subtraction is exercised
    x = torch.randn(1, tokens, w.shape[1])
    whole, part = nn.functional.linear(x, w), nn.functional.linear(x, w[64:190])
    assert torch.equal(dequantized(w), w.dequantize())
    with fast_quantized_linear():
        assert torch.equal(nn.functional.linear(x, w), whole)
        assert torch.equal(nn.functional.linear(x, w[64:190]), part)
        # an nn.Linear's forward goes the same way
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        assert torch.equal(lin(x), whole)


def test_the_context_takes_the_path_and_gives_it_back(monkeypatch):
    """Inside, F.linear over the quantized weight does not call torchao's dequantize; outside (and after a nested
    context) it does again, and the buffer is freed."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    from edgekv.export import eager_linear
    w = _weight(_configs()["int4"])
    x = torch.randn(1, 3, w.shape[1])
    calls = []
    real = IntxUnpackedToInt8Tensor.dequantize
    monkeypatch.setattr(IntxUnpackedToInt8Tensor, "dequantize", lambda self: calls.append(1) or real(self))
    with eager_linear.fast_quantized_linear():
        with eager_linear.fast_quantized_linear():
            nn.functional.linear(x, w)
        nn.functional.linear(x, w)
        assert calls == [] and eager_linear._buffer is not None
    assert eager_linear._buffer is None
    nn.functional.linear(x, w)
    assert calls == [1]


def test_the_eager_stepper_of_a_quantized_module_gives_its_plain_calls_logits(tmp_path):
    """EagerStepper (verify's reference) through the context against the module called outside it: the same logits."""
    from edgekv.export.runtime import EagerStepper
    from edgekv.export.wquant import quantize_module
    from edgekv.models import load_any
    from edgekv.strategies import parse_strategy

    random_llama(tmp_path, num_hidden_layers=1)
    loaded = load_any(str(tmp_path / "m"), parse_strategy("kv"), 64)
    quantize_module(loaded.module, "int4")
    manifest = {"max_ctx": 64, "state": loaded.layout.to_json(), "artifacts": []}
    ref = EagerStepper(manifest, loaded.module, max_chunk=8)
    got = ref.prefill(list(range(1, 12)))
    state = [torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"])) for t in manifest["state"]["tensors"]]
    rows = []
    with torch.no_grad():
        for s in (0, 8):
            toks = list(range(1, 12))[s:s + 8]
            out = loaded.module(torch.tensor([toks]), torch.tensor([s]), *state, rows=torch.arange(len(toks)))
            state = list(out[1:])
            rows.append(out[0][0].float().numpy())
    assert np.array_equal(got, np.concatenate(rows))

