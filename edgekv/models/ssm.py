"""The Mamba-1 and Mamba-2 mixers with explicit state, their args and the check of their state's layout: what the
mamba family (edgekv.models.mamba) and the hybrids with SSM layers (Jamba, Granite-4.0-H, Falcon-H1, Zamba2) share.
Shape symbols, the state and how the numbers match transformers: edgekv/models/mamba.py's docstring."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import EdgekvError
from ..strategies import StateLayout
from .base import state_dtype
from .layers import RMSNorm, causal_conv_step, scan_tokens


class GatedRMSNorm(nn.Module):
    """transformers' MambaRMSNormGated (norm_before_gate=False): RMSNorm(x * silu(z)) per group of Di / G channels;
    with norm_before_gate (FalconH1RMSNormGated's default), RMSNorm(x) * silu(z)."""

    def __init__(self, d: int, group_size: int, eps: float, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.group_size, self.eps, self.before = group_size, eps, norm_before_gate

    def forward(self, x, z):  # x, z [1, C, Di] -> [1, C, Di]
        x = x.float() if self.before else x.float() * F.silu(z.float())
        *pre, last = x.shape
        g = x.view(*pre, last // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * g.view(*pre, last)
        return y * F.silu(z.float()) if self.before else y


class Mamba1Mixer(nn.Module):
    """Selective scan (Mamba paper, Algorithm 2), one channel per state row: h [Di, N].

    Parameter names as transformers' MambaMixer (and JambaMambaMixer, which adds RMSNorms on dt, B and C: pass
    bcdt_norm_eps)."""

    def __init__(self, d: int, di: int, n: int, k: int, dt_rank: int, conv_bias: bool = True, proj_bias: bool = False,
                 bcdt_norm_eps: float | None = None):
        super().__init__()
        self.di, self.n, self.dt_rank = di, n, dt_rank
        self.in_proj = nn.Linear(d, 2 * di, bias=proj_bias)
        self.conv1d = nn.Conv1d(di, di, k, groups=di, bias=conv_bias, padding=k - 1)  # weights only: [Di, 1, K]
        self.x_proj = nn.Linear(di, dt_rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(dt_rank, di, bias=True)
        self.A_log = nn.Parameter(torch.zeros(di, n))
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = nn.Linear(di, d, bias=proj_bias)
        self.norms = bcdt_norm_eps is not None
        if self.norms:
            self.dt_layernorm = RMSNorm(dt_rank, bcdt_norm_eps)
            self.b_layernorm = RMSNorm(n, bcdt_norm_eps)
            self.c_layernorm = RMSNorm(n, bcdt_norm_eps)

    def forward(self, x, conv_state, ssm_state):
        """x [1, C, d]; conv_state [1, Di, K-1]; ssm_state [1, Di, N] -> y [1, C, d], conv_state, ssm_state."""
        xs, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # [1, Di, C] each
        xs, conv_state = causal_conv_step(xs, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias)
        xs = F.silu(xs)
        dt, b, cm = torch.split(self.x_proj(xs.transpose(1, 2)), [self.dt_rank, self.n, self.n], dim=-1)
        if self.norms:
            dt, b, cm = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(cm)
        dt = F.softplus(dt @ self.dt_proj.weight.t() + self.dt_proj.bias)  # [1, C, Di]
        a = -torch.exp(self.A_log.float())  # [Di, N]
        dt0, x0 = dt[0], xs[0].t()  # [C, Di]
        d_a = torch.exp(dt0[:, :, None] * a)  # [C, Di, N]: everything but the recurrence, for all C at once
        d_bx = dt0[:, :, None] * b[0][:, None, :] * x0[:, :, None]  # [C, Di, N]

        def step(carry, inp):  # h [1, Di, N]; d_a_t, d_bx_t [Di, N]
            h = inp[0] * carry[0] + inp[1]
            return (h,), (h,)

        (h,), (hs,) = scan_tokens(step, (ssm_state.float(),), (d_a, d_bx))  # hs [C, 1, Di, N]
        y = (hs[:, 0] * cm[0][:, None, :]).sum(-1)  # [C, Di]: y_t = h_t C_t
        y = y.t()[None] + xs * self.D[None, :, None]  # [1, Di, C]
        y = y * F.silu(z)
        return self.out_proj(y.transpose(1, 2)), conv_state, h.to(ssm_state.dtype)


class Mamba2Mixer(nn.Module):
    """SSD (Mamba-2 paper, section 7 / ssd_minimal.py) as its recurrence: per head a scalar decay exp(dt A_h) and
    h [P, N]; B, C shared by the H / G heads of a group. Parameter names as transformers' Mamba2Mixer.

    The output gate: the gated RMSNorm (norm=True; norm_before_gate as GatedRMSNorm), or without a norm y * silu(z)
    (norm=False: FalconH1Mixer with mamba_rms_norm false). out_bias None: out_proj's bias as in_proj's (proj_bias);
    Falcon-H1 gives out_proj its own (projectors_bias)."""

    def __init__(self, d: int, n_heads: int, head_dim: int, n_groups: int, n: int, k: int, eps: float,
                 conv_bias: bool = True, proj_bias: bool = False, dt_limit=(0.0, math.inf), norm: bool = True,
                 norm_before_gate: bool = False, out_bias: bool | None = None):
        super().__init__()
        self.h, self.p, self.g, self.n = n_heads, head_dim, n_groups, n
        self.di = n_heads * head_dim
        self.dc = self.di + 2 * n_groups * n
        self.dt_limit = tuple(float(v) for v in dt_limit)
        self.in_proj = nn.Linear(d, self.di + self.dc + n_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.dc, self.dc, k, groups=self.dc, bias=conv_bias, padding=k - 1)
        self.dt_bias = nn.Parameter(torch.zeros(n_heads))
        self.A_log = nn.Parameter(torch.zeros(n_heads))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm = GatedRMSNorm(self.di, self.di // n_groups, eps, norm_before_gate) if norm else None
        self.out_proj = nn.Linear(self.di, d, bias=proj_bias if out_bias is None else out_bias)

    def forward(self, x, conv_state, ssm_state):
        """x [1, C, d]; conv_state [1, Dc, K-1]; ssm_state [1, H, P, N] -> y [1, C, d], conv_state, ssm_state."""
        c, hh, p, g, n = x.shape[1], self.h, self.p, self.g, self.n
        z, xbc, dt = torch.split(self.in_proj(x), [self.di, self.dc, hh], dim=-1)
        xbc, conv_state = causal_conv_step(xbc.transpose(1, 2), conv_state, self.conv1d.weight[:, 0],
                                           self.conv1d.bias)
        xs, b, cm = torch.split(F.silu(xbc).transpose(1, 2), [self.di, g * n, g * n], dim=-1)
        xs = xs.reshape(1, c, hh, p)
        b = b.reshape(1, c, g, 1, n).expand(1, c, g, hh // g, n).reshape(1, c, hh, n)  # head h <- group h // (H/G)
        cm = cm.reshape(1, c, g, 1, n).expand(1, c, g, hh // g, n).reshape(1, c, hh, n)
        dt = F.softplus(dt + self.dt_bias)  # [1, C, H]
        if self.dt_limit != (0.0, math.inf):
            dt = torch.clamp(dt, self.dt_limit[0], self.dt_limit[1])
        a = -torch.exp(self.A_log.float())  # [H]
        x0 = xs[0]  # [C, H, P]
        d_a = torch.exp(dt[0] * a)[:, None, :, None, None]  # [C, 1, H, 1, 1]: all but the recurrence, at once
        d_bx = ((dt[0][:, :, None, None] * b[0][:, :, None, :]) * x0[:, :, :, None])[:, None]  # [C, 1, H, P, N]

        def step(carry, inp):  # h [1, H, P, N]; d_a_t [1, H, 1, 1]; d_bx_t [1, H, P, N]
            h = carry[0] * inp[0] + inp[1]
            return (h,), (h,)

        (h,), (hs,) = scan_tokens(step, (ssm_state.float(),), (d_a, d_bx))  # hs [C, 1, H, P, N]
        y = (hs[:, 0] * cm[0][:, :, None, :]).sum(-1) + x0 * self.D[:, None]  # [C, H, P]: C_t h_t + D x_t
        y = y.reshape(1, c, self.di)
        y = self.norm(y, z) if self.norm is not None else y * F.silu(z)
        return self.out_proj(y), conv_state, h.to(ssm_state.dtype)


# ---- the model ----


@dataclass
class MambaArgs:
    """The numbers the forward pass needs, read from a transformers config.json (model_type mamba or mamba2)."""
    version: int
    vocab: int
    hidden: int
    n_layers: int
    d_inner: int
    d_state: int
    d_conv: int
    eps: float = 1e-5
    dt_rank: int = 0  # Mamba-1
    n_heads: int = 0  # Mamba-2
    head_dim: int = 0
    n_groups: int = 1
    dt_limit: tuple = (0.0, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False
    tied: bool = True
    model_type: str = "mamba"

    def to_json(self) -> dict:
        return asdict(self)


def check_ssm_layout(a: MambaArgs, layout: StateLayout, layers: list[int] | None = None) -> None:
    """The layout must be (conv, ssm) per SSM block with the shapes this module keeps."""
    layers = list(range(a.n_layers)) if layers is None else layers
    dc = a.d_inner if a.version == 1 else a.d_inner + 2 * a.n_groups * a.d_state
    ssm = (1, a.d_inner, a.d_state) if a.version == 1 else (1, a.n_heads, a.head_dim, a.d_state)
    by = {(t.layer, t.role): t for t in layout.tensors}
    for i in layers:
        for role, shape in (("conv", (1, dc, a.d_conv - 1)), ("ssm", ssm)):
            t = by.get((i, role))
            if t is None or t.shape != shape:
                raise EdgekvError(f"strategy {layout.strategy}: block {i} needs a {role} state {shape}, "
                                  f"the layout has {t.shape if t else 'none'}")
            state_dtype(layout, t)
