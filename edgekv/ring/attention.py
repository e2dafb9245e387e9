"""Exact attention with the KV cache sharded by sequence over the ranks of a torch.distributed group.

Prefill is ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889): each
rank keeps the queries and K/V of one contiguous shard; K/V blocks travel around the ring with isend/irecv while the
rank attends to the block it holds (blockwise attention with online softmax, Milakov & Gimelshein 2018,
arXiv:1805.02867; the (out, lse) merge follows FlashAttention-2's and zhuzilin/ring-flash-attention's update).
Decode is the flash-decoding split: the step's leader sends the query to every rank, each attends over its shard,
and the leader merges the partials exactly with their log-sum-exps. All softmax arithmetic is fp32, whatever the
dtype on the wire.

Shape glossary
  l   sequence length (ctx), split over n ranks by model.split_sizes
  n   world size
  c   tokens in one shard (this rank's, or the block in hand)
  t   query tokens in a tile (prefill) or in a decode step (1)
  h   query heads;  g  KV heads;  r = h // g  query heads per KV head (GQA: query head i reads KV head i // r)
  d   head dim
Layouts are sequence-first, as in flash-attn's varlen API: q [c, h, d], a K/V block kv [2, c, g, d] (K and V packed
so one ring step is one message), out [c, h, d], lse [c, h].

Where it differs from the reference and why the result is the same: the reference computes softmax(q k^T / sqrt(d))
over the whole row at once; here each row's softmax is assembled from per-block (out, lse) pairs with
out = sum_b exp(lse_b - lse) out_b, lse = log sum_b exp(lse_b) — an identity, so only rounding differs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .model import split_sizes

TILE_ELEMENTS = 1 << 22          # scores per tile (16 MiB of fp32): bounds memory whatever the block size


@dataclass
class StepStats:
    """What one rank spent in one step (prefill or one decode step), summed over layers."""
    compute_s: float = 0.0       # attention arithmetic
    wait_s: float = 0.0          # blocked waiting for messages (exposed communication)
    wall_s: float = 0.0
    bytes_sent: int = 0
    bytes_recv: int = 0

    def add(self, other: "StepStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class KVShard:
    """One rank's part of one layer's KV cache: a preallocated [2, capacity, g, d] buffer and its fill level.

    Decode appends token p to rank p % n (model.split_sizes' rule), so shards stay within one token of each other."""
    kv: torch.Tensor
    length: int
    positions: list[int] = field(default_factory=list)   # global positions held, for checks and debugging

    @classmethod
    def from_prefill(cls, kv: torch.Tensor, start: int, extra: int) -> "KVShard":
        """kv [2, c, g, d] of positions start..start+c-1, with room for `extra` more tokens."""
        two, c, g, d = kv.shape
        buf = kv.new_empty(2, c + extra, g, d)
        buf[:, :c] = kv
        return cls(buf, c, list(range(start, start + c)))

    def append(self, kv_new: torch.Tensor, position: int) -> None:
        """kv_new [2, t, g, d]."""
        t = kv_new.shape[1]
        if self.length + t > self.kv.shape[1]:
            grown = self.kv.new_empty(2, max(2 * self.kv.shape[1], self.length + t), *self.kv.shape[2:])
            grown[:, :self.length] = self.kv[:, :self.length]
            self.kv = grown
        self.kv[:, self.length:self.length + t] = kv_new
        self.length += t
        self.positions.extend(range(position, position + t))

    def view(self) -> torch.Tensor:
        """[2, c, g, d] of the tokens held."""
        return self.kv[:, :self.length]


def attend_block(q: torch.Tensor, kv: torch.Tensor, q_start: int, k_start: int, causal: bool,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [t, h, d] over one block kv [2, c, g, d] -> (out [t, h, d] fp32, lse [t, h] fp32).

    q holds positions q_start.., the block k_start..; causal masks key position > query position. A row that sees
    no key gets out = 0 and lse = -inf, which merge() weighs as nothing."""
    t, h, d = q.shape
    _, c, g, _ = kv.shape
    r = h // g
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k_t = kv[0].float().permute(1, 2, 0)                        # [g, d, c]
    v = kv[1].float().permute(1, 0, 2)                          # [g, c, d]
    out = torch.empty(t, h, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    tile = max(1, TILE_ELEMENTS // max(1, c * h))
    k_pos = torch.arange(k_start, k_start + c, device=q.device)
    for t0 in range(0, t, tile):
        t1 = min(t, t0 + tile)
        tt = t1 - t0
        # the r query heads sharing a KV head become extra rows: one [g] batch of plain matmuls, K/V not repeated
        qt = (q[t0:t1].float() * scale).view(tt, g, r, d).permute(1, 2, 0, 3).reshape(g, r * tt, d)
        s = torch.bmm(qt, k_t)                                                   # [g, r*tt, c]
        if causal and k_start + c - 1 > q_start + t0:                           # some key is in some row's future
            q_pos = torch.arange(q_start + t0, q_start + t1, device=q.device)
            s.view(g, r, tt, c).masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)                                         # [g, r*tt, 1]
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)                  # rows with no key: avoid inf - inf
        p = s.sub_(m).exp_()
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.bmm(p, v).div_(denom.clamp_min(torch.finfo(torch.float32).tiny))  # [g, r*tt, d]
        out[t0:t1] = o.view(g, r, tt, d).permute(2, 0, 1, 3).reshape(tt, h, d)
        lse[t0:t1] = (m + torch.log(denom)).view(g, r, tt).permute(2, 0, 1).reshape(tt, h)
    return out, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of two partial attentions over disjoint key sets: out [t, h, d], lse [t, h] (fp32)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait(works, timeout: timedelta, what: str) -> None:
    for w in works:
        try:
            w.wait(timeout)
        except Exception as e:  # gloo raises RuntimeError on timeout or a closed peer
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"{what}: {first}") from None


def ring_prefill(q: torch.Tensor, kv: torch.Tensor, ctx: int, timeout: timedelta, overlap: bool = True,
                 compute: bool = True) -> tuple[torch.Tensor, torch.Tensor, StepStats]:
    """Causal ring attention for this rank's shard -> (out [c, h, d] in q's dtype, lse [c, h] fp32, stats).

    q [c, h, d] and kv [2, c, g, d] are the queries and K/V of this rank's shard of a ctx-token sequence
    (split_sizes(ctx, n)[rank] tokens starting at sum of the earlier ranks' sizes). At step s the rank holds the
    block of rank (rank - s) % n, sends it to rank + 1 and receives the next from rank - 1, while it attends to the
    block in hand; blocks wholly in its future are passed on without compute.
    overlap=False waits for each message before computing; compute=False only moves the blocks (a comm probe)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = split_sizes(ctx, world)
    starts = [sum(sizes[:i]) for i in range(world)]
    if q.shape[0] != sizes[rank] or kv.shape[1] != sizes[rank]:
        raise ValueError(f"rank {rank} expects {sizes[rank]} tokens, got q {tuple(q.shape)}, kv {tuple(kv.shape)}")
    stats = StepStats()
    t_start = time.perf_counter()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    block, src = kv.contiguous(), rank
    for step in range(world):
        works, incoming = [], None
        if step < world - 1:
            incoming = block.new_empty(2, sizes[(src - 1) % world], *block.shape[2:])
            # one batch: with NCCL, a lone send and recv to the same peer (world 2) would wait on each other
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, block, nxt, tag=step),
                                            dist.P2POp(dist.irecv, incoming, prv, tag=step)])
            stats.bytes_sent += block.numel() * block.element_size()
            stats.bytes_recv += incoming.numel() * incoming.element_size()
            if not overlap:
                t0 = time.perf_counter()
                _wait(works, timeout, f"rank {rank}: ring step {step} (to {nxt}, from {prv})")
                _sync(q.device)
                stats.wait_s += time.perf_counter() - t0
                works = []
        if compute and starts[src] <= starts[rank] + sizes[rank] - 1:      # block not wholly in the future
            t0 = time.perf_counter()
            o_b, lse_b = attend_block(q, block, starts[rank], starts[src], causal=True)
            out, lse = merge(out, lse, o_b, lse_b)
            _sync(q.device)
            stats.compute_s += time.perf_counter() - t0
        if works:
            t0 = time.perf_counter()
            _wait(works, timeout, f"rank {rank}: ring step {step} (to {nxt}, from {prv})")
            _sync(q.device)
            stats.wait_s += time.perf_counter() - t0
        if incoming is not None:
            block, src = incoming, (src - 1) % world
    stats.wall_s = time.perf_counter() - t_start
    return out.to(q.dtype), lse, stats


def decode_leader(length: int, world: int) -> int:
    """The rank that stores the token at position `length` (and leads that decode step)."""
    return length % world


def ring_decode_step(shard: KVShard, length: int, timeout: timedelta, q: torch.Tensor | None = None,
                     kv_new: torch.Tensor | None = None, n_heads: int | None = None,
                     compute: bool = True) -> tuple[torch.Tensor | None, StepStats]:
    """One decode step for one layer: the token at position `length` attends over all `length` + 1 tokens.

    Every rank calls it with its shard. The leader (decode_leader(length, n)) passes q [1, h, d] and
    kv_new [2, 1, g, d]; it appends kv_new to its shard, sends q to every rank, and merges the partials
    (out [h, d] + lse [h], packed fp32 [h, d + 1]) they send back. Returns (out [1, h, d] on the leader, else None).
    compute=False moves the same messages without attending (a comm probe; the shard is left unchanged)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    leader = decode_leader(length, world)
    stats = StepStats()
    t_start = time.perf_counter()
    d = shard.kv.shape[3]
    if rank == leader:
        if q is None or kv_new is None:
            raise ValueError(f"rank {rank} leads the step at position {length}: it needs q and kv_new")
        h = q.shape[1]
        if compute:
            shard.append(kv_new, length)
        works = [dist.isend(q, p, tag=1) for p in range(world) if p != leader]
        stats.bytes_sent += (world - 1) * q.numel() * q.element_size()
    else:
        h = n_heads
        q = shard.kv.new_empty(1, h, d)
        works = [dist.irecv(q, leader, tag=1)]
        stats.bytes_recv += q.numel() * q.element_size()
    t0 = time.perf_counter()
    _wait(works, timeout, f"rank {rank}: decode query from rank {leader}")
    _sync(q.device)
    stats.wait_s += time.perf_counter() - t0

    t0 = time.perf_counter()
    if compute:
        out, lse = attend_block(q, shard.view(), length, 0, causal=False)      # [1, h, d], [1, h]
    else:
        out = torch.zeros(1, h, d, dtype=torch.float32, device=q.device)
        lse = torch.zeros(1, h, dtype=torch.float32, device=q.device)
    _sync(q.device)
    stats.compute_s += time.perf_counter() - t0

    if rank != leader:
        packed = torch.cat([out[0], lse[0].unsqueeze(-1)], dim=-1).contiguous()   # [h, d + 1]
        works = [dist.isend(packed, leader, tag=2)]
        stats.bytes_sent += packed.numel() * packed.element_size()
        t0 = time.perf_counter()
        _wait(works, timeout, f"rank {rank}: decode partial to rank {leader}")
        stats.wait_s += time.perf_counter() - t0
        stats.wall_s = time.perf_counter() - t_start
        return None, stats
    parts = {p: torch.empty(h, d + 1, dtype=torch.float32, device=q.device) for p in range(world) if p != leader}
    works = [dist.irecv(buf, p, tag=2) for p, buf in parts.items()]
    stats.bytes_recv += sum(b.numel() * b.element_size() for b in parts.values())
    t0 = time.perf_counter()
    _wait(works, timeout, f"rank {rank}: decode partials from ranks {sorted(parts)}")
    _sync(q.device)
    stats.wait_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    for buf in parts.values():
        out, lse = merge(out, lse, buf[None, :, :d], buf[None, :, d])
    stats.compute_s += time.perf_counter() - t0
    stats.wall_s = time.perf_counter() - t_start
    return out.to(q.dtype), stats






def _timed(n: int, once, device: torch.device) -> list[float]:
    """Seconds of each of n calls of once(), after two uncounted ones that warm the path up."""
    times = []
    for i in range(n + 2):
        t0 = time.perf_counter()
        once()
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def fan_out_pings(timeout: timedelta, device: torch.device, nbytes: int, n: int, root: int = 0) -> list[float]:
    """Every rank calls it: root sends nbytes to every other rank at once and waits for each one's answer, n times,
    as a decode step's query and partials travel. Returns half of each round trip (root's; [] elsewhere): one
    message's latency as the ring sees it. When the ranks outnumber the cores, a woken rank may wait for a core,
    and that wait is in the number."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return []
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    what = f"rank {rank}: link probe"
    others = [p for p in range(world) if p != root]

    def once():
        if rank == root:
            _wait([dist.isend(buf, p, tag=4) for p in others], timeout, what)
            bufs = [torch.empty_like(buf) for _ in others]
            _wait([dist.irecv(b, p, tag=5) for p, b in zip(others, bufs)], timeout, what)
        else:
            _wait([dist.irecv(buf, root, tag=4)], timeout, what)
            _wait([dist.isend(buf, root, tag=5)], timeout, what)

    times = _timed(n, once, device)
    return [t / 2 for t in times] if rank == root else []


def ping_pong(timeout: timedelta, device: torch.device, small_bytes: int = 64, large_bytes: int = 4 << 20,
              n_small: int = 100, n_large: int = 10) -> dict:
    """Time messages over the group's own transport; every rank calls it. Returns this rank's share:

    pair_s     (rank 0) median one-way time of a small_bytes ping-pong between ranks 0 and 1 alone
    fan_s      (rank 0) fan_out_pings' half round trips (a list; launch.py samples more beside each decode step)
    large_s    median time of one ring step with large_bytes: every rank sends to the next and receives from the
               previous at once, as in a prefill ring step (the ranks share the cores here as they do there)
    A hundred or more small messages make the medians stable against the odd scheduling hiccup; the large ones
    are few because each costs milliseconds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"small_bytes": small_bytes, "large_bytes": large_bytes, "fan_s": []}
    if world == 1:
        return out
    what = f"rank {rank}: link probe"
    small = torch.zeros(max(1, small_bytes // 4), dtype=torch.float32, device=device)

    def pair_round():
        for op in ((dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend)):
            _wait([op(small, 1 - rank, tag=3)], timeout, what)

    if rank < 2:
        t = _timed(n_small, pair_round, device)
        if rank == 0:
            out["pair_s"] = sorted(t)[len(t) // 2] / 2
    out["fan_s"] = fan_out_pings(timeout, device, small_bytes, n_small)
    send = torch.zeros(max(1, large_bytes // 4), dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    t = _timed(n_large, lambda: _wait(dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, nxt, tag=6), dist.P2POp(dist.irecv, recv, prv, tag=6)]), timeout, what),
        device)
    out["large_s"] = sorted(t)[len(t) // 2]
    return out
