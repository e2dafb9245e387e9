"""lower_pte's copy of each XNNPACK partition's program before preprocessing shares its weight tensors instead of
copying them (edgekv.export.to_pte._preprocess_copies_share_weights): ExecuTorch's copy.deepcopy of every partition
held every delegated weight a second time through XNNPACK's preprocessing (the random Llama-3.2-1B's int4 codes:
1.2 GB). Checked on a small int4 program (an embedding on a portable kernel and an 8da4w linear that XNNPACK takes):
the copy is the program's own graph over the same weight storage, no weight of the traced program is written by the
lowering, and the .pte is the same bytes as with ExecuTorch's own deep copy."""
from contextlib import nullcontext

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("executorch")

from torch import nn  # noqa: E402

from edgekv.export import to_pte  # noqa: E402


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(96, 64)
        self.lin = nn.Linear(64, 160, bias=False)

    def forward(self, tokens):
        return self.lin(self.emb(tokens))


def _traced():
    from torchao.quantization import quantize_

    from edgekv.export.wquant import torchao_config
    torch.manual_seed(0)
    m = Small()
    quantize_(m, torchao_config("int4"), filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    return torch.export.export(m, (torch.tensor([[1, 5, 7]]),))


def _plain(ep) -> dict:
    """name -> plain tensor; a torchao tensor subclass (the quantized linear's weight) by its inner tensors."""
    out = {}
    for k, t in (*ep.state_dict.items(), *ep.constants.items()):
        if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
            out[k] = t
        else:
            out.update({f"{k}.{n}": getattr(t, n) for n in t.__tensor_flatten__()[0]})
    return out


def test_the_preprocess_copy_shares_the_weights_and_gives_the_same_pte(monkeypatch):
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    ep = _traced()
    with to_pte._preprocess_copies_share_weights():
        copy = XnnpackBackend.copy_exported_program_for_preprocess(ep, [])
    assert copy.graph_module is not ep.graph_module
    for k, t in ep.state_dict.items():
        assert copy.state_dict[k] is t
    theirs = XnnpackBackend.copy_exported_program_for_preprocess(ep, [])  # restored: ExecuTorch's deep copy
    assert all(theirs.state_dict[k] is not t for k, t in ep.state_dict.items())

    ep = _traced()
    before = {k: t.clone() for k, t in _plain(ep).items()}
    shared = to_pte.to_buffer(to_pte.lower_pte({"forward": ep}))
    for k, t in _plain(ep).items():  # no pass wrote into a weight it shared with the traced program
        assert torch.equal(t, before[k]), k
    monkeypatch.setattr(to_pte, "_preprocess_copies_share_weights", nullcontext)
    assert to_pte.to_buffer(to_pte.lower_pte({"forward": _traced()})) == shared
