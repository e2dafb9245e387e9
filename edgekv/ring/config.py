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
