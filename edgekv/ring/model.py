"""The planner's ring-attention cost model: pure Python (no torch, no numpy), so `edgekv plan` can import it.

What it models is exactly what edgekv/ring/attention.py does, so every predicted number has a measured twin:

  prefill  the sequence is split into `world` contiguous shards (split_sizes); each rank keeps its shard's K/V and
           passes K/V blocks around the ring (world-1 steps, one packed [2, c, g, d] message per step), overlapped
           with the blockwise online-softmax compute. Causal: a rank skips blocks that lie wholly in its future, and
           computes its own (diagonal) block in full with a mask, so the LAST rank is the busiest (about 2x the mean;
           zigzag/striped sharding would balance it, not done here).
  decode   one new token per step. The rank that will store the token's K/V (position % world, which keeps shards
           balanced) is the step's leader: it sends the query to every other rank, each rank attends over its shard,
           and the leader gathers the partial results (out in fp32 + log-sum-exp in fp32) and combines them exactly.
           Nothing the size of the KV cache crosses the network. The naive alternative, passing KV blocks around the
           ring as in prefill, is also predicted (`naive_comm_s`, `naive_bytes_per_rank`): that is the network
           bottleneck at decode.

Public functions (all arguments plain numbers; times in seconds, bytes as ints, rates per second):

  split_sizes(ctx, world) -> list[int]
      tokens per rank: ctx // world, the first ctx % world ranks one more.

  predict(phase, world, ctx, n_heads, n_kv_heads, head_dim, n_layers=1, dtype_bytes=2,
          link_bytes_per_s=..., link_latency_s=..., flops=..., mem_bandwidth=...,
          q_tokens=1, partial_bytes=4) -> RingCost
      phase "prefill": ctx = prompt length. phase "decode": ctx = tokens already cached; one step adds q_tokens
      (the implementation uses 1; >1 is priced as q_tokens independent queries, e.g. speculative drafts).
      flops / mem_bandwidth are what ONE rank can use (pass effective numbers: peak x efficiency).
      RingCost.compute_s   busiest rank's attention compute, roofline max(flops/F, bytes/BW), all layers
      RingCost.comm_s      link time, all layers (prefill: world-1 ring steps; decode: leader's broadcast + gather)
      RingCost.bytes_per_rank  bytes sent + received by the busiest rank, all layers
      RingCost.wall_s      prefill: lockstep ring with comm overlapped (sum over steps of max(compute, comm));
                           decode: compute_s + comm_s (a decode step cannot overlap: q first, partials after)
      RingCost.naive_comm_s / naive_bytes_per_rank  (decode only) the same step if KV blocks moved instead.
      The planner's per-token attention time for the `ring` strategy is predict("decode", ...).wall_s.

  predict_for_device(phase, device, link, world, ctx, n_heads, n_kv_heads, head_dim, n_layers=1, dtype_bytes=2,
                     shared_host=None, q_tokens=1) -> RingCost
      reads link bandwidth/latency, compute_flops x prefill_efficiency (prefill) or x decode_efficiency (decode)
      and mem_bandwidth x the same efficiency from a DeviceProfile (edgekv.devices). When the ranks share one
      machine (default: device class "host"), each rank gets 1/world of the machine's flops, memory bandwidth
      and link bandwidth (loopback is the host's own memory copies, and all ranks send at once).

  datacenter_decode_ratio(device, link_name, world=8, ctx=131072, dtype_bytes=2) -> DecodeRatio
      Llama-3-70B shape (80 layers, 64 heads, 8 KV heads, head_dim 128): decode communication / compute ratio of the
      attention per token, with the naive KV-moving ratio beside it and the assumptions as text.

Formulas per layer (h heads, g kv heads, d head_dim, b dtype bytes, c_i shard sizes, alpha latency, B link bytes/s):
  prefill compute, rank i:  flops = sum_{j<=i} 4*h*d*c_i*c_j   bytes = sum_{j<=i} b*d*(2*h*c_i + 2*g*c_j)
  prefill comm:             (world-1) * (alpha + b*2*g*d*max_i(c_i) / B)
  decode compute:           flops = 4*h*d*c*t   bytes = b*d*(2*g*c + 2*h*t)   c = largest shard after the append
  decode comm (leader):     2*alpha + (world-1) * t * (b*h*d + p*h*(d+1)) / B   p = partial_bytes (fp32 = 4)
  naive decode comm:        (world-1) * (alpha + b*2*g*d*c / B)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

PHASES = ("prefill", "decode")

# Llama-3-70B attention shape, from meta-llama/Meta-Llama-3-70B config.json
# (num_hidden_layers 80, num_attention_heads 64, num_key_value_heads 8, hidden_size 8192 / 64 heads = head_dim 128).
LLAMA3_70B = dict(name="Llama-3-70B", n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128)


@dataclass(frozen=True)
class RingCost:
    phase: str
    world: int
    ctx: int
    compute_s: float
    comm_s: float
    bytes_per_rank: int
    wall_s: float
    naive_comm_s: float | None = None
    naive_bytes_per_rank: int | None = None
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        return d


@dataclass(frozen=True)
class DecodeRatio:
    model: str
    device: str
    link: str
    world: int
    ctx: int
    ratio: float              # comm_s / compute_s of decode attention, per token
    naive_ratio: float        # the same if KV blocks were passed around the ring instead
    cost: RingCost
    assumptions: tuple[str, ...]

    def to_json(self) -> dict:
        return {"model": self.model, "device": self.device, "link": self.link, "world": self.world,
                "ctx": self.ctx, "ratio": self.ratio, "naive_ratio": self.naive_ratio,
                "cost": self.cost.to_json(), "assumptions": list(self.assumptions)}


def split_sizes(ctx: int, world: int) -> list[int]:
    """Tokens per rank for a sequence of ctx tokens over world ranks: sizes differ by at most one, larger first.

    Appending one token to a sequence of L tokens grows rank L % world, so decode keeps the same rule."""
    if world < 1 or ctx < 0:
        raise ValueError(f"split_sizes needs world >= 1 and ctx >= 0, got world={world}, ctx={ctx}")
    base, extra = divmod(ctx, world)
    return [base + (1 if i < extra else 0) for i in range(world)]


def _check(world: int, ctx: int, n_heads: int, n_kv_heads: int, head_dim: int, n_layers: int) -> None:
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if ctx < world:
        raise ValueError(f"ctx ({ctx}) must be at least world ({world}): every rank holds at least one token")
    if min(n_heads, n_kv_heads, head_dim, n_layers) < 1:
        raise ValueError("heads, kv heads, head_dim and layers must be >= 1")
    if n_heads % n_kv_heads:
        raise ValueError(f"heads ({n_heads}) must be a multiple of kv heads ({n_kv_heads})")


def _roofline(flops: float, nbytes: float, peak_flops: float, mem_bandwidth: float) -> float:
    return max(flops / peak_flops, nbytes / mem_bandwidth)


def predict(phase: str, world: int, ctx: int, n_heads: int, n_kv_heads: int, head_dim: int, n_layers: int = 1,
            dtype_bytes: int = 2, *, link_bytes_per_s: float, link_latency_s: float, flops: float,
            mem_bandwidth: float, q_tokens: int = 1, partial_bytes: int = 4) -> RingCost:
    """Predicted compute, communication and bytes per rank of one ring-attention step (see the module docstring)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    _check(world, ctx, n_heads, n_kv_heads, head_dim, n_layers)
    h, g, d, b, L = n_heads, n_kv_heads, head_dim, dtype_bytes, n_layers
    alpha, B = link_latency_s, link_bytes_per_s
    if phase == "prefill":
        return _predict_prefill(world, ctx, h, g, d, b, L, alpha, B, flops, mem_bandwidth)
    return _predict_decode(world, ctx, h, g, d, b, L, alpha, B, flops, mem_bandwidth, q_tokens, partial_bytes)


def _predict_prefill(world, ctx, h, g, d, b, L, alpha, B, peak, bw) -> RingCost:
    sizes = split_sizes(ctx, world)

    def block(i: int, j: int) -> float:
        """Seconds for rank i's queries against rank j's keys (0 when block j is wholly in rank i's future)."""
        if j > i:
            return 0.0
        ci, cj = sizes[i], sizes[j]
        return _roofline(4 * h * d * ci * cj, b * d * (2 * h * ci + 2 * g * cj), peak, bw)

    kv_msg = [b * 2 * g * d * c for c in sizes]               # one packed K/V block per ring step
    step_comm = alpha + max(kv_msg) / B if world > 1 else 0.0
    compute = max(sum(block(i, j) for j in range(world)) for i in range(world))
    # rank i at step s holds rank (i - s)'s block; it sends it on and receives rank (i - s - 1)'s (s < world - 1)
    wall = 0.0
    for s in range(world):
        busiest = max(block(i, (i - s) % world) for i in range(world))
        wall += max(busiest, step_comm) if s < world - 1 else busiest
    moved = max(sum(kv_msg[(i - s) % world] + kv_msg[(i - s - 1) % world] for s in range(world - 1))
                for i in range(world))
    return RingCost(
        phase="prefill", world=world, ctx=ctx, compute_s=L * compute, comm_s=L * (world - 1) * step_comm,
        bytes_per_rank=L * moved, wall_s=L * wall,
        assumptions=(
            f"{world} contiguous shards of {min(sizes)}-{max(sizes)} tokens; causal: future blocks skipped, the "
            f"diagonal block computed in full and masked; busiest rank = the last",
            f"{world - 1} ring steps per layer, each one message of max(K/V block) = {max(kv_msg)} B, at "
            f"latency {alpha:.3g} s + bytes / {B:.4g} B/s; send and receive overlap (full duplex)",
            f"compute per block: roofline max(4*h*d*c_i*c_j / {peak:.4g} FLOP/s, bytes of q,k,v,o / {bw:.4g} B/s)",
            "ranks advance in lockstep; comm of step s overlaps compute of step s",
        ))


def _predict_decode(world, ctx, h, g, d, b, L, alpha, B, peak, bw, t, p) -> RingCost:
    c = max(split_sizes(ctx + t, world))                       # busiest shard after the new token(s) join it
    compute = _roofline(4 * h * d * c * t, b * d * (2 * g * c + 2 * h * t), peak, bw)
    q_msg, partial_msg = t * b * h * d, t * p * h * (d + 1)    # query out; out (h*d) + lse (h) back
    if world > 1:
        comm = 2 * alpha + (world - 1) * (q_msg + partial_msg) / B
        naive_comm = (world - 1) * (alpha + b * 2 * g * d * c / B)
    else:
        comm = naive_comm = 0.0
    moved = (world - 1) * (q_msg + partial_msg)                # the leader's traffic; others move q_msg + partial_msg
    naive_moved = 2 * (world - 1) * b * 2 * g * d * c
    return RingCost(
        phase="decode", world=world, ctx=ctx, compute_s=L * compute, comm_s=L * comm, bytes_per_rank=L * moved,
        wall_s=L * (compute + comm), naive_comm_s=L * naive_comm, naive_bytes_per_rank=L * naive_moved,
        assumptions=(
            f"{t} new token(s) per step attend over {ctx + t} tokens; busiest shard {c} tokens",
            f"leader (the rank storing the new token) sends q ({q_msg} B) to {world - 1} ranks and gathers their "
            f"partials (out + lse in {p}-byte floats, {partial_msg} B each): 2 latencies of {alpha:.3g} s + "
            f"{world - 1} x {q_msg + partial_msg} B / {B:.4g} B/s through the leader's link",
            f"compute: roofline max(4*h*d*c / {peak:.4g} FLOP/s, K/V bytes / {bw:.4g} B/s) — decode is "
            f"memory-bound: it reads the shard's K/V once",
            "no overlap at decode: the query must arrive before compute and partials leave after it",
            f"naive alternative: pass K/V blocks ({b * 2 * g * d * c} B each) around the ring, "
            f"{world - 1} x (latency + block / bandwidth)",
        ))


def predict_for_device(phase: str, device, link: str, world: int, ctx: int, n_heads: int, n_kv_heads: int,
                       head_dim: int, n_layers: int = 1, dtype_bytes: int = 2, shared_host: bool | None = None,
                       q_tokens: int = 1, measured_link: dict | None = None) -> RingCost:
    """predict() with the link, flops and bandwidth read from a DeviceProfile (edgekv.devices.load_device).

    shared_host: all ranks share the one machine (default: the profile's class is "host"), so each rank gets
    flops/world and bandwidth/world.
    measured_link: {"latency_s", "bytes_per_s"} as a ping-pong over the run's own transport measured them, every
    pair of ranks at once (launch.RingResult.link): used instead of the profile's link, as they are (the sharing
    of the machine is already in them)."""
    if link not in device.interconnect:
        have = ", ".join(sorted(device.interconnect)) or "none"
        raise KeyError(f"device {device.id!r} has no interconnect {link!r} (it has: {have})")
    ic = device.interconnect[link]
    eff = device.prefill_efficiency if phase == "prefill" else device.decode_efficiency
    share = world if (shared_host if shared_host is not None else device.device_class == "host") else 1
    if measured_link:
        link_bw, link_lat = float(measured_link["bytes_per_s"]), float(measured_link["latency_s"])
    else:
        link_bw, link_lat = float(ic.bytes_per_s.value) / share, float(ic.latency_s.value)
    cost = predict(phase, world, ctx, n_heads, n_kv_heads, head_dim, n_layers, dtype_bytes,
                   link_bytes_per_s=link_bw, link_latency_s=link_lat,
                   flops=device.flops * eff / share, mem_bandwidth=device.bandwidth * eff / share, q_tokens=q_tokens)
    extra = (f"device {device.id}: {device.flops:.4g} FLOP/s and {device.bandwidth:.4g} B/s x {phase} efficiency "
             f"{eff:g}" + (f"; {share} ranks share one machine: each gets 1/{share} of its compute, memory "
                           "bandwidth" + ("" if measured_link else f" and {link} bandwidth (all ranks send at once)")
                           if share > 1
                           else "; one device and one link per rank"),
             (f"link {link} as measured in this run (ping-pong, all rank pairs at once): latency {link_lat:.3g} s "
              f"per message, {link_bw:.4g} B/s per rank" if measured_link else
              f"link {link}: {ic.bytes_per_s.value:.4g} B/s per direction ({_why(ic.bytes_per_s)}); latency "
              f"{ic.latency_s.value:.3g} s ({_why(ic.latency_s)})"))
    return RingCost(**{**cost.__dict__, "assumptions": cost.assumptions + extra})


def _why(fact) -> str:
    return f"source: {fact.source}" if getattr(fact, "source", None) else str(getattr(fact, "estimate", "") or "")


def datacenter_decode_ratio(device, link_name: str, world: int = 8, ctx: int = 131072,
                            dtype_bytes: int = 2) -> DecodeRatio:
    """Decode comm/compute ratio of ring attention for Llama-3-70B on `device` GPUs joined by `link_name`."""
    a = LLAMA3_70B
    cost = predict_for_device("decode", device, link_name, world, ctx, a["n_heads"], a["n_kv_heads"], a["head_dim"],
                              a["n_layers"], dtype_bytes, shared_host=False)
    ratio = cost.comm_s / cost.compute_s
    naive = cost.naive_comm_s / cost.compute_s
    assumptions = (
        f"{a['name']} attention: {a['n_layers']} layers, {a['n_heads']} query heads, {a['n_kv_heads']} KV heads, "
        f"head_dim {a['head_dim']}, K/V and q in {dtype_bytes}-byte floats, partials in fp32",
        f"{world} GPUs, one rank each, context {ctx} tokens split evenly ({max(split_sizes(ctx + 1, world))} per GPU)",
        "batch 1, one new token per step; only the attention is counted (weights, MLP and tensor parallelism excluded)",
        "compute is memory-bound: each GPU reads its K/V shard once per layer at mem bandwidth x decode efficiency",
        f"communication: the leader sends q to {world - 1} GPUs and gathers out+lse, 2 link latencies per layer "
        f"plus bytes / link bandwidth; messages are small, so latency dominates",
        "no overlap between communication and compute within a step",
    ) + cost.assumptions[-2:]
    return DecodeRatio(model=a["name"], device=device.id, link=link_name, world=world, ctx=ctx, ratio=ratio,
                       naive_ratio=naive, cost=cost, assumptions=assumptions)
