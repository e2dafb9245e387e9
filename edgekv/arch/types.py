"""The types an Arch is made of: its blocks' sequence mixers (the part of a block that carries state across tokens:
attention, MLA, SSM, linear recurrence), its weight tensors, and the Arch itself."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field


# ---- mixers: the part of a block that carries state across tokens ----


@dataclass(frozen=True)
class Attention:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    window: int | None = None  # native sliding window (tokens), None = global
    kind: str = "attention"


@dataclass(frozen=True)
class MLA:
    n_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    kind: str = "mla"


@dataclass(frozen=True)
class SSM:
    version: int  # 1 = Mamba-1 (selective scan per channel), 2 = Mamba-2 (SSD, per head)
    d_inner: int
    d_state: int
    d_conv: int
    n_heads: int = 0  # Mamba-2
    head_dim: int = 0  # Mamba-2
    n_groups: int = 1  # Mamba-2

    kind: str = "ssm"

    @property
    def conv_dim(self) -> int:
        """Channels that pass through the causal conv (and so are kept in the conv state)."""
        return self.d_inner if self.version == 1 else self.d_inner + 2 * self.n_groups * self.d_state


@dataclass(frozen=True)
class Linear:
    """A linear-attention / RWKV recurrence. State per layer: n_vectors x width (RWKV-4) or n_heads x d_k x d_v."""
    n_heads: int
    d_k: int
    d_v: int
    n_vectors: int = 0  # RWKV-4 keeps 5 hidden-sized vectors per layer (transformers order: x_ffn, x_att, num, den, max)
    width: int = 0
    conv_dim: int = 0  # Gated DeltaNet (Qwen3.5): channels of the causal conv before the recurrence (q, k and v)
    d_conv: int = 0  # its kernel; the layer keeps the last d_conv - 1 inputs
    kind: str = "linear"


@dataclass(frozen=True)
class ShortConv:
    """LFM2's gated short convolution (transformers' Lfm2ShortConv): a depthwise causal conv of kernel d_conv over
    width channels between an input and an output gate. State per layer: its last d_conv - 1 inputs."""
    width: int
    d_conv: int
    kind: str = "conv"


Mixer = Attention | MLA | SSM | Linear | ShortConv


@dataclass(frozen=True)
class Weight:
    """One weight tensor. cls decides its quantization: linear | embedding | lm_head | small (norms, conv, A, D, biases).
    read_fraction < 1 for routed MoE experts: a decode step reads top_k of n_experts of them."""
    name: str
    shape: tuple[int, ...]
    cls: str
    read_fraction: float = 1.0
    gguf_type: str | None = None  # the stored type when read from a GGUF
    gguf_bytes: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Block:
    mixers: tuple[Mixer, ...]


@dataclass(eq=False)  # identity: Archs are cached and hashed by object
class Arch:
    name: str
    model_type: str
    family: str  # transformer | mla | ssm | linear | hybrid
    hidden: int
    vocab: int
    blocks: tuple[Block, ...]
    weights: tuple[Weight, ...]
    max_position: int | None = None
    source: str = ""
    gguf_path: str | None = None
    notes: list[str] = field(default_factory=list)
    # the context the model was trained at and where that number comes from (trained_ctx_of); None = unknown
    trained_ctx: tuple[int, str] | None = None

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @functools.cached_property
    def n_params(self) -> int:
        return sum(w.numel for w in self.weights)

    @functools.cached_property
    def n_active_params(self) -> float:
        """Parameters one decode token touches (routed experts weighted by top_k / n_experts)."""
        return sum(w.numel * w.read_fraction for w in self.weights)

    @property
    def non_embedding_params(self) -> int:
        return sum(w.numel for w in self.weights if w.cls not in ("embedding",))

    def mixers(self, kind: str) -> list[tuple[int, Mixer]]:
        """(block index, mixer) for every mixer of that kind, in order."""
        return [(i, m) for i, b in enumerate(self.blocks) for m in b.mixers if m.kind == kind]

    @property
    def kinds(self) -> set[str]:
        return {m.kind for b in self.blocks for m in b.mixers}

    @functools.cached_property  # the weights never change once the Arch is built
    def mlp_width(self) -> int:
        """The widest MLP up projection's output width: transformers names it `*up_proj.weight`, GGUF
        `blk.N.ffn_up.weight`; 4 x hidden when there is none."""
        ups = [w.shape[0] for w in self.weights if w.name.endswith(UP_PROJ_NAMES)]
        return max(ups, default=4 * self.hidden)


# the names of an MLP's up projection: transformers' `up_proj` / `gate_up_proj`, GGUF's `ffn_up`
UP_PROJ_NAMES = ("up_proj.weight", "ffn_up.weight")
