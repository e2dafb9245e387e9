"""Builders that append a module's weight tensors to a list the way transformers' modules define them (linear, norm
vector, gated MLP, MoE MLP, embedding and head, Mamba-1 / Mamba-2 mixers)."""
from __future__ import annotations

from ..errors import EdgekvError
from .types import SSM, Weight


def _lin(ws: list, name: str, n_in: int, n_out: int, bias: bool = False, cls: str = "linear", frac: float = 1.0):
    ws.append(Weight(f"{name}.weight", (n_out, n_in), cls, frac))
    if bias:
        ws.append(Weight(f"{name}.bias", (n_out,), "small", frac))


def _vec(ws: list, name: str, n: int, bias: bool = False):
    ws.append(Weight(f"{name}.weight", (n,), "small"))
    if bias:
        ws.append(Weight(f"{name}.bias", (n,), "small"))


def _mlp(ws: list, p: str, hidden: int, inter: int, bias: bool = False, frac: float = 1.0):
    _lin(ws, f"{p}.gate_proj", hidden, inter, bias, frac=frac)
    _lin(ws, f"{p}.up_proj", hidden, inter, bias, frac=frac)
    _lin(ws, f"{p}.down_proj", inter, hidden, bias, frac=frac)


def _embed_and_head(ws: list, vocab: int, hidden: int, tied: bool, head_name: str = "lm_head"):
    ws.insert(0, Weight("model.embed_tokens.weight", (vocab, hidden), "embedding"))
    if not tied:
        ws.append(Weight(f"{head_name}.weight", (vocab, hidden), "lm_head"))


def _moe_mlp(ws: list, p: str, hidden: int, inter: int, n_experts: int, top_k: int, n_shared: int,
             router_bias: bool = False, score_bias: bool = False):
    ws.append(Weight(f"{p}.gate.weight", (n_experts, hidden), "small" if n_experts * hidden < 2**16 else "linear"))
    if score_bias:
        ws.append(Weight(f"{p}.gate.e_score_correction_bias", (n_experts,), "small"))
    frac = top_k / n_experts
    for e in range(n_experts):
        _mlp(ws, f"{p}.experts.{e}", hidden, inter, frac=frac)
    if n_shared:
        _mlp(ws, f"{p}.shared_experts", hidden, inter * n_shared)


def _mamba1_mixer(ws: list, p: str, hidden: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int,
                  conv_bias: bool, proj_bias: bool, jamba_norms: bool = False) -> SSM:
    _lin(ws, f"{p}.in_proj", hidden, 2 * d_inner, proj_bias)
    ws.append(Weight(f"{p}.conv1d.weight", (d_inner, 1, d_conv), "small"))
    if conv_bias:
        ws.append(Weight(f"{p}.conv1d.bias", (d_inner,), "small"))
    _lin(ws, f"{p}.x_proj", d_inner, dt_rank + 2 * d_state)
    _lin(ws, f"{p}.dt_proj", dt_rank, d_inner, True)
    ws.append(Weight(f"{p}.A_log", (d_inner, d_state), "small"))
    ws.append(Weight(f"{p}.D", (d_inner,), "small"))
    _lin(ws, f"{p}.out_proj", d_inner, hidden, proj_bias)
    if jamba_norms:
        _vec(ws, f"{p}.dt_layernorm", dt_rank)
        _vec(ws, f"{p}.b_layernorm", d_state)
        _vec(ws, f"{p}.c_layernorm", d_state)
    return SSM(1, d_inner, d_state, d_conv)


def _mamba2_mixer(ws: list, p: str, hidden: int, d_inner: int, n_heads: int, head_dim: int, n_groups: int,
                  d_state: int, d_conv: int, conv_bias: bool, proj_bias: bool, gated_norm: bool = True,
                  out_bias: bool | None = None) -> SSM:
    """A Mamba-2 mixer's weights (out_bias None: out_proj's bias as in_proj's; Falcon-H1's projectors_bias)."""
    if n_heads * head_dim != d_inner:
        raise EdgekvError(f"{p}: mamba2 heads {n_heads} x head_dim {head_dim} != d_inner {d_inner}")
    conv_dim = d_inner + 2 * n_groups * d_state
    _lin(ws, f"{p}.in_proj", hidden, 2 * d_inner + 2 * n_groups * d_state + n_heads, proj_bias)
    ws.append(Weight(f"{p}.conv1d.weight", (conv_dim, 1, d_conv), "small"))
    if conv_bias:
        ws.append(Weight(f"{p}.conv1d.bias", (conv_dim,), "small"))
    ws.append(Weight(f"{p}.dt_bias", (n_heads,), "small"))
    ws.append(Weight(f"{p}.A_log", (n_heads,), "small"))
    ws.append(Weight(f"{p}.D", (n_heads,), "small"))
    if gated_norm:
        _vec(ws, f"{p}.norm", d_inner)
    _lin(ws, f"{p}.out_proj", d_inner, hidden, proj_bias if out_bias is None else out_bias)
    return SSM(2, d_inner, d_state, d_conv, n_heads, head_dim, n_groups)
