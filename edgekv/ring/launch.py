"""Start N ranks on this machine, run ring prefill + decode on seeded inputs, collect timings (and outputs).

    result = run_ring(RingConfig(world=4, ctx=4096, n_heads=32, n_kv_heads=8, head_dim=128))

Ranks are torch.multiprocessing "spawn" processes, at most config.max_world() of them and only when the run's
estimated memory (config.memory_bytes) is available; each dies with the parent (edgekv.children). The parent hosts the rendezvous TCPStore itself (port 0 = a free
port picked by the OS, so no race between choosing and binding), ranks join it as clients and form a gloo group
(nccl when CUDA has a GPU per rank). Every wait has a timeout (init, barriers, each isend/irecv). The parent polls
the ranks: the first one that exits non-zero stops the rest (terminate, join with a timeout, then kill) and becomes
one EdgekvError line; so does a port that is taken. Ranks write results to a temporary folder (torch.save), not
through pipes, so a dead rank can never leave the parent blocked on a half-read message.

Inputs are random but reproducible by position: token p of layer i has q [h, d] and k, v [g, d] drawn from a
generator seeded by (seed, i, p // CHUNK), so each rank draws only its own shard and the checker (or a test) can
redraw any range. Decode token s sits at position ctx + s.

Shapes as in attention.py: q [l, h, d], kv [2, l, g, d], out [l, h, d].
"""
from __future__ import annotations

import os
import signal
import socket
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ..errors import EdgekvError
from .attention import (KVShard, StepStats, decode_leader, fan_out_pings, ping_pong, ring_decode_step,
                        ring_prefill)
from .config import RingConfig, check_resources, probe_large_bytes
from .model import split_sizes

CHUNK = 64                       # tokens per seeded chunk of inputs
PROBE_PAIR_ROUNDS = 100          # ping-pong round trips of ranks 0 and 1, and fan-out pings after the prefill
PROBE_STEP_PINGS = 16            # fan-out pings before each decode step: the latency sampled beside the decode
PROBE_RING_STEPS = 10            # ring steps of large messages
PROBE_REPEATS = 3                # a phase's messages without compute, timed this many times (per layer, per step)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HOST = "127.0.0.1"
__all__ = ["RingConfig", "RingResult", "run_ring", "check_errors", "make_rows", "reference_attention"]


@dataclass
class RingResult:
    config: RingConfig
    backend: str
    prefill: list[StepStats]                  # [rank], the real (overlapped) prefill, all layers
    prefill_probe: list[StepStats]            # [rank], the same messages without compute: the link's own time
    decode: list[list[StepStats]]             # [step][rank]
    decode_probe: list[list[StepStats]]       # [step][rank]
    prefill_out: list[torch.Tensor] | None    # [layer] -> [l, h, d], when keep_outputs
    decode_out: list[torch.Tensor] | None     # [layer] -> [decode_steps, h, d], when keep_outputs
    elapsed_s: float = 0.0
    link_probe: list[dict] | None = None      # [rank] attention.ping_pong's share of the link probe

    def link(self) -> dict | None:
        """The transport as attention.ping_pong measured it in this run: latency_s (one message when one rank pings
        every rank at once: the median of the pings beside the decode steps, else of those after the prefill),
        pair_latency_s (ranks 0 and 1 alone), bytes_per_s (per
        rank in a ring step of large messages: their bytes over the time beyond the latency), messages (timed ones).
        None at world 1."""
        probes = self.link_probe or []
        if len(probes) < 2 or not probes[0]["fan_s"]:
            return None
        # the pings beside the decode steps when there are any: the host's load moves within a run, and these
        # share the decode's moments; the prefill's ring steps are mostly bandwidth
        fan = [t for p in probes for t in p.get("step_fan_s", [])] or probes[0]["fan_s"]
        large = statistics.median(p["large_s"] for p in probes)
        small, nbytes, world, pings = statistics.median(fan), probes[0]["large_bytes"], len(probes), len(fan)
        return {"latency_s": small, "pair_latency_s": probes[0]["pair_s"],
                "bytes_per_s": nbytes / max(large - small, large / 2), "large_bytes": nbytes,
                "small_bytes": probes[0]["small_bytes"], "pings": pings,
                "messages": _probe_messages(world, probes)}

    def measured(self) -> dict:
        """Per phase: the busiest rank's compute_s, comm_s (from the probe), bytes_per_rank, wall_s, exposed comm."""
        out = {"prefill": _phase(self.prefill, self.prefill_probe)}
        if self.decode:
            cfg = self.config
            steps = [_phase(real, probe, decode_leader(cfg.ctx + s, cfg.world))
                     for s, (real, probe) in enumerate(zip(self.decode, self.decode_probe))]
            out["decode"] = {k: (statistics.median(s[k] for s in steps) if k != "bytes_per_rank"
                                 else max(s[k] for s in steps)) for k in steps[0]}
        return out


def _probe_messages(world: int, probes: list[dict]) -> int:
    """Timed messages of the link probe (warm-up rounds not counted): a fan-out ping is 2 (world - 1) messages, a
    pair round trip 2, a ring step one per rank."""
    pings = sum(len(p["fan_s"]) + len(p.get("step_fan_s", [])) for p in probes)
    return 2 * (world - 1) * pings + 2 * PROBE_PAIR_ROUNDS + world * PROBE_RING_STEPS


def _phase(real: list[StepStats], probe: list[StepStats], leader: int | None = None) -> dict:
    """compute: the busiest rank's; comm: the slowest rank's probe (messages only), or at decode the leader's (from
    its query out to the last partial in: the step's own path; the others' probe clocks also hold how late the
    leader left the barrier before it); bytes: the busiest link's; exposed_comm: what the busiest rank spent
    blocked on messages in the real, overlapped run."""
    busiest = max(real, key=lambda s: s.compute_s)
    return {"compute_s": busiest.compute_s,
            "comm_s": probe[leader].wall_s if leader is not None else max(s.wall_s for s in probe),
            "bytes_per_rank": max(s.bytes_sent + s.bytes_recv for s in real),
            "wall_s": max(s.wall_s for s in real),
            "exposed_comm_s": busiest.wait_s}


# ---------------------------------------------------------------------------------------------- inputs, reference

def make_rows(seed: int, layer: int, start: int, stop: int, n_heads: int, n_kv_heads: int, head_dim: int,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Reproducible inputs for positions start..stop-1 -> (q [t, h, d], kv [2, t, g, d])."""
    qs, kvs = [], []
    for chunk in range(start // CHUNK, (stop - 1) // CHUNK + 1):
        gen = torch.Generator().manual_seed(((seed * 1_000_003 + layer) * 1_000_033 + chunk) % (2**63))
        q = torch.randn(CHUNK, n_heads, head_dim, generator=gen)
        kv = torch.randn(2, CHUNK, n_kv_heads, head_dim, generator=gen)
        lo, hi = max(start, chunk * CHUNK) - chunk * CHUNK, min(stop, (chunk + 1) * CHUNK) - chunk * CHUNK
        qs.append(q[lo:hi])
        kvs.append(kv[:, lo:hi])
    return torch.cat(qs).to(dtype), torch.cat(kvs, dim=1).to(dtype)


def reference_attention(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Single-process causal attention, fp32: q [l, h, d], kv [2, l, g, d] -> out [l, h, d]."""
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], kv[0].float().transpose(0, 1)[None],
                                         kv[1].float().transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def check_errors(result: RingResult) -> dict:
    """Max abs difference of the ring outputs against single-process attention over the same inputs."""
    cfg = result.config
    if result.prefill_out is None:
        raise ValueError("run with keep_outputs=True to check")
    pre = dec = 0.0
    for layer in range(cfg.n_layers):
        q, kv = make_rows(cfg.seed, layer, 0, cfg.ctx + cfg.decode_steps, cfg.n_heads, cfg.n_kv_heads,
                          cfg.head_dim, DTYPES[cfg.dtype])
        ref = reference_attention(q, kv)
        pre = max(pre, (result.prefill_out[layer].float() - ref[:cfg.ctx]).abs().max().item())
        if cfg.decode_steps:
            dec = max(dec, (result.decode_out[layer].float() - ref[cfg.ctx:]).abs().max().item())
    return {"prefill_max_abs_err": pre, "decode_max_abs_err": dec if cfg.decode_steps else None}


# ---------------------------------------------------------------------------------------------- one rank

def _rank_main(rank: int, cfg: RingConfig, port: int, outdir: str, backend: str, parent: int | None = None) -> None:
    from ..children import die_with_parent
    die_with_parent(parent)  # a parent killed outright (SIGKILL) takes its ranks with it
    log = os.open(Path(outdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)   # gloo/c10d log from C++ straight to fd 2: keep it in the rank's log, not on the user's terminal
    os.dup2(log, 2)
    try:
        _rank_body(rank, cfg, port, outdir, backend)
    except BaseException as e:  # noqa: BLE001 - everything a rank hits becomes one line for the parent
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        Path(outdir, f"rank{rank}.err").write_text(f"{time.time()}\n{type(e).__name__}: {msg}\n"
                                                   f"{traceback.format_exc()}")
        os._exit(1)   # skip interpreter teardown: a half-open process group must not hang the exit
    os._exit(0)


def _rank_body(rank: int, cfg: RingConfig, port: int, outdir: str, backend: str) -> None:
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // cfg.world))
    timeout = timedelta(seconds=cfg.timeout_s)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=cfg.world, timeout=timeout)
    fault_kind, _, fault_rank = (cfg.fault or "").partition(":")
    dtype = DTYPES[cfg.dtype]
    h, g, d, world = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.world
    sizes = split_sizes(cfg.ctx, world)
    start = sum(sizes[:rank])

    # warm-up: connect every pair and touch the kernels, so the timed phases measure the steady state
    q0, kv0 = make_rows(cfg.seed + 1, 0, start, start + sizes[rank], h, g, d, dtype)
    ring_prefill(q0.to(device), kv0.to(device), cfg.ctx, timeout, compute=False)
    _barrier(timeout, "after warm-up")
    if fault_kind and int(fault_rank) == rank:
        if fault_kind == "die":
            os._exit(3)
        if fault_kind == "hang":
            time.sleep(10**6)

    shards, pre_out, pre_stats, probe_stats = [], [], StepStats(), StepStats()
    for layer in range(cfg.n_layers):
        q, kv = make_rows(cfg.seed, layer, start, start + sizes[rank], h, g, d, dtype)
        q, kv = q.to(device), kv.to(device)
        _barrier(timeout, f"before prefill of layer {layer}")
        out, _, st = ring_prefill(q, kv, cfg.ctx, timeout)
        pre_stats.add(st)
        _barrier(timeout, f"after prefill of layer {layer}")
        # the messages alone, PROBE_REPEATS times back to back, the median kept: the first after a barrier also
        # pays for the ranks leaving it one after another
        repeats = sorted((ring_prefill(q, kv, cfg.ctx, timeout, compute=False)[2] for _ in range(PROBE_REPEATS)),
                         key=lambda st: st.wall_s)
        probe_stats.add(repeats[len(repeats) // 2])
        if cfg.keep_outputs:
            pre_out.append(out.cpu())
        shards.append(KVShard.from_prefill(kv, start, cfg.decode_steps // world + 1))

    # the transport's own latency and bandwidth, between the phases, so the model can be fed what this run sees
    _barrier(timeout, "before the link probe")
    link = ping_pong(timeout, device, small_bytes=h * d * cfg.dtype_bytes, n_small=PROBE_PAIR_ROUNDS,
                     large_bytes=probe_large_bytes(cfg), n_large=PROBE_RING_STEPS)

    dec_stats, dec_probe, dec_out = [], [], [[] for _ in range(cfg.n_layers)]
    for step in range(cfg.decode_steps):
        pos = cfg.ctx + step
        leader = decode_leader(pos, world)
        real, probe = StepStats(), StepStats()
        _barrier(timeout, f"before decode step {step}")
        for layer in range(cfg.n_layers):
            qn = kvn = None
            if rank == leader:
                qn, kvn = make_rows(cfg.seed, layer, pos, pos + 1, h, g, d, dtype)
                qn, kvn = qn.to(device).contiguous(), kvn.to(device)
            out, st = ring_decode_step(shards[layer], pos, timeout, qn, kvn, n_heads=h)
            real.add(st)
            if out is not None and cfg.keep_outputs:
                dec_out[layer].append(out[0].cpu())
        _barrier(timeout, f"after decode step {step}")
        # the link's latency sampled here, from this step's leader, just before its messages are timed alone
        pings = fan_out_pings(timeout, device, h * d * cfg.dtype_bytes, PROBE_STEP_PINGS, root=leader)
        link.setdefault("step_fan_s", []).extend(pings)
        # the messages alone, PROBE_REPEATS times back to back, the median kept (as at prefill)
        repeats = []
        for _ in range(PROBE_REPEATS):
            probe = StepStats()
            for layer in range(cfg.n_layers):
                qn = torch.zeros(1, h, d, dtype=dtype, device=device) if rank == leader else None
                kvn = torch.zeros(2, 1, g, d, dtype=dtype, device=device) if rank == leader else None
                probe.add(ring_decode_step(shards[layer], pos, timeout, qn, kvn, n_heads=h, compute=False)[1])
            repeats.append(probe)
        dec_stats.append(real)
        dec_probe.append(sorted(repeats, key=lambda st: st.wall_s)[len(repeats) // 2])

    torch.save({"prefill": pre_stats, "prefill_probe": probe_stats, "decode": dec_stats, "decode_probe": dec_probe,
                "prefill_out": pre_out, "decode_out": dec_out, "link": link},
               Path(outdir, f"rank{rank}.pt"))
    _barrier(timeout, "at the end")
    dist.destroy_process_group()


def _barrier(timeout: timedelta, where: str) -> None:
    if dist.get_world_size() == 1:
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timeout)   # rank 0 names the rank that did not arrive
        else:
            dist.barrier()                            # nccl: bounded by the process group's timeout
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"rank {dist.get_rank()}: barrier {where} failed within {timeout.total_seconds():g} s: "
                           f"{first}") from None


# ---------------------------------------------------------------------------------------------- the parent

def pick_backend(cfg: RingConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.world else "gloo"


def _open_store(port: int, timeout_s: float) -> dist.TCPStore:
    if port:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:     # a clear answer before any rank starts
            try:
                s.bind((HOST, port))
            except OSError:
                raise EdgekvError(f"port {port} is already in use on {HOST}; pass --port 0 to pick a free one") \
                    from None
    try:
        return dist.TCPStore(HOST, port, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception as e:  # noqa: BLE001
        if "EADDRINUSE" in str(e) or "in use" in str(e):
            raise EdgekvError(f"port {port} is already in use on {HOST}; pass --port 0 to pick a free one") \
                from None
        raise EdgekvError(f"could not open the rendezvous store on {HOST}:{port}: {str(e).splitlines()[0]}") \
            from None


def run_ring(cfg: RingConfig, run_timeout_s: float | None = None) -> RingResult:
    """Run the ranks to completion; any failure becomes one EdgekvError line and no process is left behind."""
    cfg.validate()
    check_resources(cfg)
    backend = pick_backend(cfg)
    store = _open_store(cfg.port, cfg.timeout_s)
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgekv-ring-") as outdir:
        procs = [ctx.Process(target=_rank_main, args=(r, cfg, store.port, outdir, backend, os.getpid()),
                             daemon=True, name=f"edgekv-ring-{r}") for r in range(cfg.world)]
        try:
            for p in procs:
                p.start()
            _watch(procs, outdir, run_timeout_s)
        finally:
            _stop(procs)
            del store
        ranks = [torch.load(Path(outdir, f"rank{r}.pt"), weights_only=False) for r in range(cfg.world)]
    elapsed = time.perf_counter() - t0
    prefill_out = decode_out = None
    if cfg.keep_outputs:
        prefill_out = [torch.cat([rk["prefill_out"][layer] for rk in ranks]) for layer in range(cfg.n_layers)]
        decode_out = []
        for layer in range(cfg.n_layers):
            rows = [ranks[decode_leader(cfg.ctx + s, cfg.world)]["decode_out"][layer][_leader_index(cfg, s)]
                    for s in range(cfg.decode_steps)]
            decode_out.append(torch.stack(rows) if rows else torch.empty(0, cfg.n_heads, cfg.head_dim))
    return RingResult(config=cfg, backend=backend,
                      prefill=[rk["prefill"] for rk in ranks], prefill_probe=[rk["prefill_probe"] for rk in ranks],
                      decode=[[rk["decode"][s] for rk in ranks] for s in range(cfg.decode_steps)],
                      decode_probe=[[rk["decode_probe"][s] for rk in ranks] for s in range(cfg.decode_steps)],
                      prefill_out=prefill_out, decode_out=decode_out, elapsed_s=elapsed,
                      link_probe=[rk["link"] for rk in ranks])


def _leader_index(cfg: RingConfig, step: int) -> int:
    """Which of its own decode outputs the leader of `step` stored it as (it leads every world-th step)."""
    leader = decode_leader(cfg.ctx + step, cfg.world)
    return sum(1 for s in range(step) if decode_leader(cfg.ctx + s, cfg.world) == leader)


def _watch(procs, outdir: str, run_timeout_s: float | None) -> None:
    deadline = time.monotonic() + run_timeout_s if run_timeout_s else None
    while True:
        codes = [p.exitcode for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise EdgekvError(_failure_line(failed, codes, outdir))
        if all(c == 0 for c in codes):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise EdgekvError(f"ring run did not finish within {run_timeout_s:g} s; stopped all {len(procs)} ranks")
        time.sleep(0.02)


def _failure_line(failed: list[int], codes: list, outdir: str) -> str:
    """The root cause first: a rank that died without a message (crash, kill), else the earliest error written."""
    crashed = [r for r in failed if not Path(outdir, f"rank{r}.err").exists()]
    if crashed:
        r, c = crashed[0], codes[crashed[0]]
        how = f"was killed by {signal.Signals(-c).name}" if c < 0 else f"exited with code {c}"
        return f"ring rank {r} {how} without an error message; stopped the other ranks"
    errs = []
    for r in range(len(codes)):
        f = Path(outdir, f"rank{r}.err")
        if f.exists():
            lines = f.read_text().splitlines()
            errs.append((float(lines[0]), r, lines[1] if len(lines) > 1 else "error"))
    _, r, msg = min(errs)
    hint = "; if the ranks were only slow, raise --timeout" if ("failed within" in msg or "imed out" in msg) else ""
    return f"ring rank {r} failed: {msg[:300]}; stopped the other ranks{hint}"


def _stop(procs) -> None:
    """Terminate what is still running, wait a little, then kill: no rank outlives run_ring."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
