"""What one `edgekv ring` run is: world, shape, dtype, timeouts. No torch here, so bad input fails fast."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import EdgekvError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RingConfig:
    world: int
    ctx: int
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    n_layers: int = 1
    decode_steps: int = 4
    dtype: str = "float32"
    seed: int = 0
    port: int = 0                # 0: a free port
    timeout_s: float = 120.0     # every init, barrier and message wait
    keep_outputs: bool = False   # bring prefill/decode outputs back to the parent (for checks)
    backend: str = "auto"        # auto: nccl if there is a GPU per rank, else gloo
    threads: int = 0             # torch threads per rank; 0: cpu_count // world
    fault: str | None = None     # tests only: "die:R" (rank R exits abruptly) or "hang:R" (rank R stops answering)

    def validate(self) -> None:
        if self.world < 1:
            raise EdgekvError(f"--world must be at least 1, got {self.world}")
        if self.ctx < self.world:
            raise EdgekvError(f"--ctx ({self.ctx}) must be at least --world ({self.world}): each rank needs a token")
        for name, v in (("--heads", self.n_heads), ("--kv-heads", self.n_kv_heads), ("--head-dim", self.head_dim),
                        ("--layers", self.n_layers)):
            if v < 1:
                raise EdgekvError(f"{name} must be at least 1, got {v}")
        if self.n_heads % self.n_kv_heads:
            raise EdgekvError(f"--heads ({self.n_heads}) must be a multiple of --kv-heads ({self.n_kv_heads})")
        if self.decode_steps < 0:
            raise EdgekvError(f"--decode-steps must be >= 0, got {self.decode_steps}")
        if self.dtype not in DTYPE_BYTES:
            raise EdgekvError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if not 0 <= self.port < 65536:
            raise EdgekvError(f"--port must be in 0..65535, got {self.port}")
        if not 1 <= self.timeout_s <= 86400:  # below 1 s the local rendezvous itself times out (a C++ error)
            raise EdgekvError(f"--timeout must be 1 to 86400 seconds, got {self.timeout_s}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise EdgekvError(f"backend must be auto, gloo or nccl, got {self.backend!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


# What one rank process holds before any tensor: the interpreter with torch and torch.distributed imported, gloo's
# buffers: the peak RSS of `import torch, torch.distributed` with headroom (rounded up from the import's own peak)
RANK_PROCESS_BYTES = 320 * 2**20
TILE_BYTES = 16 * 2**20         # attention.TILE_ELEMENTS fp32 scores: one tile's scores and probabilities at a time
MIN_WORLD_LIMIT = 4             # the default --world runs on any machine, one core included
PROBE_LARGE_BYTES = (1 << 20, 8 << 20)   # the link probe's large message: the prefill's K/V block, within these


def probe_large_bytes(cfg: "RingConfig") -> int:
    """Bytes of the link probe's large message (launch.py): one prefill K/V block, clamped to PROBE_LARGE_BYTES."""
    block = 2 * -(-cfg.ctx // cfg.world) * cfg.n_kv_heads * cfg.head_dim * cfg.dtype_bytes
    return min(max(block, PROBE_LARGE_BYTES[0]), PROBE_LARGE_BYTES[1])


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    import os
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_world() -> int:
    """The most ranks `edgekv ring` starts on this machine: two per usable core (a rank waits on messages part of the
    time), at least MIN_WORLD_LIMIT. Every rank is a whole torch process: more only time-share the cores and add
    RANK_PROCESS_BYTES each."""
    return max(MIN_WORLD_LIMIT, 2 * usable_cores())


def memory_bytes(cfg: RingConfig) -> int:
    """Bytes a run of cfg needs on this machine, all ranks and the parent together (an upper estimate from the shapes
    launch.py allocates; h heads, g KV heads, d head_dim, b dtype bytes, L layers, c the largest shard):
    each rank: its process (RANK_PROCESS_BYTES); per layer a KV shard of c + decode_steps // world + 1 slots
    (2*g*d*b per slot), kept for decode; while one layer runs, its q (c*h*d*b) and K/V (2*c*g*d*b) as drawn, the block
    in hand, the one arriving and the warm-up's, the fp32 out and accumulator (2 * c*h*d*4) and the score tiles;
    with --check each rank keeps every layer's fp32 outputs (L*c*h*d*4) and the parent gathers and concatenates them
    (2 * L*ctx*h*d*4) and draws the whole sequence for its reference (q and K/V in the dtype and in fp32, its out);
    with more than one rank, the link probe's two large buffers (probe_large_bytes)."""
    b, h, g, d, L = cfg.dtype_bytes, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    c = -(-cfg.ctx // cfg.world)
    kv_slot = 2 * g * d * b
    shards = L * (c + cfg.decode_steps // cfg.world + 1) * kv_slot
    live = c * h * d * b + 4 * c * kv_slot + 2 * c * h * d * 4 + 3 * TILE_BYTES
    outs = L * c * h * d * 4 if cfg.keep_outputs else 0
    probe = 2 * probe_large_bytes(cfg) if cfg.world > 1 else 0     # the link probe's send and receive buffers
    rank = RANK_PROCESS_BYTES + shards + live + outs + probe
    parent = 0
    if cfg.keep_outputs:
        n = cfg.ctx + cfg.decode_steps
        parent = 2 * L * n * h * d * 4 + n * (h * d + 2 * g * d) * (b + 4) + n * h * d * 4
    return cfg.world * rank + parent


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (not checked)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_resources(cfg: RingConfig) -> None:
    """Before any rank starts: the world within max_world() and the run's memory_bytes within the memory available
    now; else one line naming the limit."""
    limit = max_world()
    if cfg.world > limit:
        raise EdgekvError(f"--world {cfg.world}: this machine runs at most {limit} ranks (two per usable core, "
                          f"{usable_cores()} here; at least {MIN_WORLD_LIMIT}); every rank is a torch process "
                          "(--predict-only predicts any world without starting ranks)")
    need, have = memory_bytes(cfg), available_bytes()
    if have is not None and need > have:
        raise EdgekvError(f"this run needs about {need / 2**30:,.1f} GiB (ranks' processes, K/V shards and buffers"
                          f"{', --check outputs' if cfg.keep_outputs else ''}) but {have / 2**30:,.1f} GiB is "
                          "available: lower --ctx, --layers or --world, or use --predict-only")
