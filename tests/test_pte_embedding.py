"""The .pte's quantized embedding table (edgekv.export.wquant.gather_head_codes): an int8 / int4 .pte gathers its
input rows from int codes with ExecuTorch's quantized_decomposed::embedding_byte / embedding_4bit, the output layer's
own codes for a tied model. Checked against torchao's own dequantization of the quantized output layer (the values a
tied model's table must hold), in eager torch and in ExecuTorch's runtime."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("executorch")

from edgekv.export import wquant  # noqa: E402
from edgekv.models import load_model  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

TINY = "fixtures/tiny/llama"
IDS = [0, 1, 7, 100, 200, 255, 7]  # repeats and both ends of the 256-token vocabulary


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model(TINY, parse_strategy("kv:dtype=fp32"), 64).module


def quantized(tiny, w):
    q = copy.deepcopy(tiny)
    rec = wquant.quantize_module(q, w)
    # the rows a tied model's table holds: torchao's dequantization of the quantized output layer
    want = q.lm_head.weight.dequantize().float()[IDS]
    return q, rec, want


def run_pte(module, ids):
    """module(ids) lowered as edgekv lowers a .pte and run by ExecuTorch's runtime."""
    from executorch.extension.pybindings import portable_lib

    import executorch.kernels.quantized  # noqa: F401 (the embedding_byte / embedding_4bit kernels)
    from edgekv.export.to_pte import delegation_summary, lower_pte, to_buffer

    edge = lower_pte({"forward": torch.export.export(module.eval(), (ids,), strict=False)})
    ops = delegation_summary(edge)["forward"]["portable_ops"]
    buf = to_buffer(edge)
    return portable_lib._load_for_executorch_from_buffer(buf).forward((ids,))[0].numpy(), ops


@pytest.mark.parametrize("w, bits", [("int8", 8), ("int4", 4)])
def test_table_is_the_output_layers_codes_eager_and_in_the_pte(tiny, w, bits):
    q, rec, want = quantized(tiny, w)
    table = q.model.embed_tokens
    assert f"int{bits}" in rec["embedding"] and "tied" in rec["embedding"]
    v, d = tiny.model.embed_tokens.weight.shape
    assert table.codes.numel() * table.codes.element_size() == v * d * bits // 8  # 1 or 1/2 byte a value
    ids = torch.tensor([IDS])
    eager = table(ids)[0]
    np.testing.assert_array_equal(eager.detach().numpy(), want.numpy())
    got, ops = run_pte(table, ids)
    assert f"embedding_{'byte' if bits == 8 else '4bit'}" in " ".join(ops), ops
    np.testing.assert_array_equal(got[0], want.numpy())


def test_an_untied_table_gets_the_heads_recipe_on_its_own_values(tiny):
    """A model with its own output layer: the table is quantized from its own values (not the head's), int4 groups
    of 32 as the head."""
    q = copy.deepcopy(tiny)
    q.lm_head = torch.nn.Linear(tiny.args.hidden, tiny.args.vocab, bias=False)
    torch.nn.init.normal_(q.lm_head.weight, std=0.02)
    rec = wquant.quantize_module(q, "int4")
    assert "quantized like the output layer" in rec["embedding"]
    ref = tiny.model.embed_tokens.weight.detach()[IDS]
    got = q.model.embed_tokens(torch.tensor([IDS]))[0].detach()
    step = ref.abs().reshape(len(IDS), -1, 32).amax(-1).repeat_interleave(32, -1) / 7  # one int4 step per group
    assert bool(((got - ref).abs() <= step * 0.5 + 1e-7).all())
    assert not torch.equal(got, q.lm_head.weight.dequantize().float()[IDS])


def test_fp32_weights_keep_the_fp32_table(tiny):
    q = copy.deepcopy(tiny)
    assert wquant.quantize_module(q, "fp32") == {"dtype": "float32"}
    assert isinstance(q.model.embed_tokens, torch.nn.Embedding)
