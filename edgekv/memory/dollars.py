"""Datacenter serving: users one GPU holds and dollars per million tokens."""
from __future__ import annotations

import math

from .item import Item


def users_per_gpu(pool_bytes: float, per_user_bytes: float) -> Item:
    u = int(pool_bytes // per_user_bytes) if per_user_bytes > 0 else 0
    return Item(u, f"floor(KV pool {pool_bytes:,.0f} B / per-user state {per_user_bytes:,.0f} B) = {u}")


def usd_per_m_tokens(usd_per_hour: float, n_gpus: int, users: int, tok_s_per_user: float) -> Item:
    if users <= 0 or tok_s_per_user <= 0:
        return Item(math.inf, "no user fits: cost is unbounded")
    agg = users * tok_s_per_user
    v = n_gpus * usd_per_hour / (agg * 3600 / 1e6)
    return Item(v, f"{n_gpus} GPU x ${usd_per_hour}/h / ({users} users x {tok_s_per_user:.4g} tok/s x 3600 / 1e6) "
                   f"= ${v:.4g} per M tokens")
