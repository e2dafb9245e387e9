"""Datacenter serving: a Deployment batched on one GPU (users per GPU, speed, $ per M tokens), ring attention's
network time, and the published "quadratic tax" analysis reproduced from its stated assumptions."""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import memory as M
from .arch import SSM, Arch, Attention, Block, Linear
from .devices import DeviceProfile
from .errors import EdgekvError
from .strategies import Strategy, parse_strategy


@dataclass
class BaselineRow:
    strategy: Strategy
    ctx: int
    state_bytes_per_user: int
    pool_bytes: int
    users: M.Item
    tok_s_per_user: float
    usd: M.Item
    n_gpus: int = 1
    assumptions: str = ""

    def to_json(self, explain: bool = False) -> dict:
        d = {"strategy": self.strategy.name, "params": self.strategy.params, "ctx": self.ctx, "state_bytes_per_user": self.state_bytes_per_user,
             "users": int(self.users.value), "usd_per_m_tokens": None if math.isinf(self.usd.value)
             else round(self.usd.value, 4), "tokens_per_s_per_user": round(self.tok_s_per_user, 3),
             "pool_bytes": self.pool_bytes, "gpus": self.n_gpus}
        if explain:
            d["explain"] = {"users": self.users.formula, "usd_per_m_tokens": self.usd.formula,
                            "assumptions": self.assumptions}
        return d


def serve(device: DeviceProfile, arch: Arch, dep: M.Deployment) -> BaselineRow:
    """Batch decoding on one datacenter GPU: KV pool = the device budget (HBM x the serving engine's memory
    utilisation) - weights - runtime - workspace; users = floor(pool / per-user state); every step reads the weights
    once and every user's state; $ per M tokens from the GPU's hourly price."""
    s, ctx, ov = dep.strategy, dep.ctx, dep.runtime_overhead
    per_user = dep.layout.nbytes
    pool = device.budget_bytes - dep.weights["total"] - ov - dep.workspace.value
    users = M.users_per_gpu(max(pool, 0), per_user)
    n = s.n_gpus
    u = max(int(users.value), 1)
    step = max((dep.weights["read_per_token"] + u * per_user) / (device.bandwidth * device.decode_efficiency),
               u * M.decode_flops(arch, dep.layout, s).value / (device.flops * device.prefill_efficiency))
    if s.splits_over_gpus:
        step += ring_decode_comm_s(device, arch, ctx, n)
    tok = 1 / step
    return BaselineRow(s, ctx, per_user, int(pool), users, tok,
                       M.usd_per_m_tokens(device.usd_per_hour, n, int(users.value), tok), n,
                       f"{dep.weight_precision} weights {dep.weights['total']:,.0f} B, {dep.runtime} overhead "
                       f"{ov:,.0f} B, budget {device.budget_bytes:,} B of {device.ram_bytes:,} B HBM; decode step = "
                       f"max((weights + users x state bytes) / (bandwidth x {device.decode_efficiency}), compute)"
                       + (" + ring network time" if s.splits_over_gpus else ""))


def ring_decode_comm_s(device: DeviceProfile, arch: Arch, ctx: int, n: int) -> float:
    """Network time of one ring decode step over the device's fastest interconnect, from the ring cost model that
    `edgekv ring` checks against measurement (edgekv/ring/model.py): the query goes to every rank and partial
    outputs come back, per attention layer."""
    from .ring.model import predict_for_device

    if not device.interconnect:
        raise EdgekvError(f"device {device.id} has no interconnect: ring needs one")
    link = max(device.interconnect, key=lambda k: device.interconnect[k].bytes_per_s.value)
    attn = arch.mixers("attention")
    if n <= 1 or not attn:
        return 0.0
    m = attn[0][1]
    return predict_for_device("decode", device, link, n, ctx, m.n_heads, m.n_kv_heads, m.head_dim,
                              n_layers=len(attn)).comm_s


# ---- the published "quadratic tax" analysis, reproduced from its stated assumptions ----

QUADRATIC_TAX = {
    "source": "https://www.artificialintelligencemadesimple.com/p/how-long-context-inference-is-rewriting "
              "(numbers via https://promitb.dev/daily/2026-03-09/engineer/; the arithmetic behind each row is "
              "its users and cost formulas above)",
    "pool_bytes": 39_000_000_000, "usd_per_hour": 2.00, "tok_s_per_user": 28.0,
    "layers": 80, "kv_heads": 8, "head_dim": 128, "q_heads": 64, "hidden": 8192,
}


def _tax_archs() -> dict[str, Arch]:
    q = QUADRATIC_TAX
    att = Attention(q["q_heads"], q["kv_heads"], q["head_dim"])
    L = q["layers"]
    mk = lambda name, fam, blocks: Arch(name, "preset", fam, q["hidden"], 128256, tuple(blocks), ())
    jamba_ssm = SSM(1, 2 * q["hidden"], 16, 4)  # Jamba's mamba layers: d_inner = 2 x hidden, d_state 16
    mamba2 = SSM(2, 2 * q["hidden"], 128, 4, n_heads=128, head_dim=128, n_groups=1)
    return {
        "kv": mk("llama-3-70b-shape", "transformer", [Block((att,))] * L),
        "hybrid": mk("jamba-style-70b", "hybrid", [Block((att,)) if i % 8 == 4 else Block((jamba_ssm,))
                                                     for i in range(L)]),
        "ssm": mk("mamba2-style-70b", "ssm", [Block((mamba2,))] * L),
        "linear": mk("linear-attention-70b", "linear", [Block((Linear(q["q_heads"], q["head_dim"],
                                                                      q["head_dim"]),))] * L),
    }


def quadratic_tax() -> list[BaselineRow]:
    q = QUADRATIC_TAX
    archs = _tax_archs()
    cases = [
        ("kv", 4000, "kv:dtype=fp8", "KV at 1 byte per value: 2 x 80 layers x 8 KV heads x 128 x 1 B = 163,840 B/token"),
        ("kv", 128000, "kv:dtype=fp8", "same, 128,000 tokens"),
        ("kv", 128000, "mla:ratio=0.067,dtype=fp8",
         "MLA latent = 6.7% of the KV (DeepSeek-V2's -93.3%, applied to the 70B shape as the article does)"),
        ("hybrid", 128000, "hybrid:dtype=fp8,state_dtype=fp8",
         "1 attention layer in 8 (10 of 80) keep KV; 70 Jamba-style Mamba layers (d_inner 16384, d_state 16) keep "
         "an SSM state at 1 B and a conv state in fp32"),
        ("ssm", 128000, "ssm:dtype=fp8", "assumption: a 70B-class Mamba-2 (80 layers, d_inner 16384, 128 heads x 128, "
                                         "d_state 128), state at 1 B, conv state fp32; the article's own SSM "
                                         "config was not recovered"),
        ("linear", 128000, "linear:dtype=fp8", "assumption: 80 layers of linear attention, 64 heads x 128 x 128 state "
                                               "at 1 B (feature-map size = head_dim)"),
        ("kv", 128000, "ring:n=8,dtype=fp8", "ring over 8 GPUs: each GPU holds 1/8 of every user's KV in the same "
                                             "39 GB pool; cost counts all 8 GPUs; per-user speed kept at 28 tok/s "
                                             "(optimistic: decode waits on the network, see edgekv ring)"),
    ]
    rows = []
    for arch_key, ctx, spec, why in cases:
        s = parse_strategy(spec)
        arch = archs[arch_key]
        layout = s.layout(arch, ctx)
        per_user = layout.nbytes
        users = M.users_per_gpu(q["pool_bytes"], per_user)
        n = s.n_gpus
        usd = M.usd_per_m_tokens(q["usd_per_hour"], n, int(users.value), q["tok_s_per_user"])
        rows.append(BaselineRow(s, ctx, per_user, q["pool_bytes"], users, q["tok_s_per_user"], usd, n,
                                f"{why}. Pool 39 GB (decimal) of an 80 GB H100, ${q['usd_per_hour']:.2f}/GPU-hour, "
                                f"{q['tok_s_per_user']:.0f} tok/s per user. Source: {q['source']}"))
    return rows
