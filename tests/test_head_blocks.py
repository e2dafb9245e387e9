"""An eager weight-quantized output head multiplies its matrix in blocks of rows (edgekv.models.head,
EAGER_QUANTIZED_ROWS: torchao's eager linear dequantizes the whole matrix on every call, the whole of Llama-3.2-1B's
head). Reference: torchao's F.linear over the whole matrix; the logits must be the same to fp32 rounding (each logit is
the same dot product, but the BLAS picks its kernel by the matrix's size, so a block of rows may sum in another order:
bit for bit on the AMD EPYC host, 1-ulp differences on an Intel Xeon VM), with a last block shorter than the others,
and a traced head must stay one linear (the .pte's graph unchanged)."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from torch import nn  # noqa: E402


def _quantized(v=1000, d=64):
    from torchao.quantization import quantize_

    from edgekv.export.wquant import torchao_config
    torch.manual_seed(0)
    lin = nn.Linear(d, v, bias=False)
    quantize_(nn.Sequential(lin), torchao_config("int4"))
    return lin.weight


def test_blocks_of_rows_give_the_whole_matrixs_logits(monkeypatch):
    from edgekv.models import head as h
    w = _quantized()
    x = torch.randn(1, 5, 64)
    whole = nn.functional.linear(x, w)
    monkeypatch.setattr(h, "EAGER_QUANTIZED_ROWS", 300)  # 300, 300, 300, 100
    calls = []
    from types import SimpleNamespace
    real = nn.functional.linear
    monkeypatch.setattr(h, "F", SimpleNamespace(linear=lambda a, b: calls.append(b.shape[0]) or real(a, b)))
    out = h.head(x, lambda t: t, w)
    assert calls == [300, 300, 300, 100]
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.head(x, lambda t: t, w, torch.tensor([4])), nn.functional.linear(x[:, 4:5], w),
                               rtol=1e-6, atol=1e-6)
    assert calls == [300, 300, 300, 100] * 2


def test_a_traced_head_is_one_linear(monkeypatch):
    from edgekv.models import head as h
    monkeypatch.setattr(h, "EAGER_QUANTIZED_ROWS", 300)
    w = _quantized()

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(w, requires_grad=False)

        def forward(self, x):
            return h.head(x, lambda t: t, self.w)
    ep = torch.export.export(Head(), (torch.randn(1, 5, 64),))
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert not any("cat" in o for o in ops) and sum("linear" in o for o in ops) == 1, ops
