"""What the export modules share besides layers: reading an HF folder's config and weights, the state's torch dtypes,
the empty (all-zeros) state of a StateLayout, and the model shell (DecoderShell)."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import EdgekvError
from ..strategies import StateLayout
from .head import head, output_weight
from .weights import load_strict  # noqa: F401  (the modules' builders load through it)

STATE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
STATE_TORCH = {**STATE_DTYPES, "uint8": torch.uint8}  # and a packed (int4/int2) cache's codes


def config_value(v):
    """transformers writes float('inf') into config.json as {"__float__": "Infinity"}; undo that."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    if isinstance(v, list):
        return [config_value(x) for x in v]
    return v


def read_folder(spec: str, max_ctx: int):
    """spec (HF folder or packaged name) -> (path, config, fp32 state dict, Arch). GGUF is refused: only the llama
    family reads GGUF weights."""
    from ..arch import read_config_json
    from .weights import load_hf_folder, resolve_model

    if max_ctx < 1:
        raise EdgekvError(f"max_ctx must be at least 1, got {max_ctx}")
    path = resolve_model(spec)
    if path.suffix.lower() == ".gguf":
        raise EdgekvError(f"{path}: GGUF weights are read for llama-family models only; pass an HF folder")
    arch = read_config_json(path)
    cfg, sd = load_hf_folder(path)
    return path, {k: config_value(v) for k, v in cfg.items()}, sd, arch


def read_source(spec: str, max_ctx: int, make_args, convert=None, head: str = "lm_head.weight"):
    """An HF folder of a family read by its own config reader (make_args(cfg, arch, where) -> its args dataclass):
    max_ctx checked against the trained context (where the args carry one: max_position), a tied head's duplicate
    (`head`) dropped, the tensors renamed or folded by convert(sd, args) -> Source (edgekv.models.FAMILIES). The
    reader of every family that loads from an HF folder only (all but the llama family, which also reads GGUF)."""
    from . import Source

    path, cfg, sd, arch = read_folder(spec, max_ctx)
    args = make_args(cfg, arch, str(path / "config.json"))
    cap = getattr(args, "max_position", None)
    if cap and max_ctx > cap:
        raise EdgekvError(f"max_ctx {max_ctx} exceeds the model's trained context {cap}")
    if args.tied:
        sd.pop(head, None)
    return Source(path, "safetensors", cfg, convert(sd, args) if convert else sd, args, arch)


def state_dtype(layout: StateLayout, t) -> torch.dtype:
    if t.dtype not in STATE_DTYPES:
        raise EdgekvError(f"strategy {layout.strategy}: state dtype {t.dtype} ({t.name}) is not supported by the "
                          f"export module yet (supported: {', '.join(STATE_DTYPES)})")
    return STATE_DTYPES[t.dtype]


def empty_state(layout: StateLayout) -> list[torch.Tensor]:
    """The state before any token: zeros in every tensor of the layout, in its dtypes."""
    return [torch.zeros(t.shape, dtype=STATE_TORCH[t.dtype]) for t in layout.tensors]


class DecoderShell(nn.Module):
    """The shell every export module shares (edgekv.models.protocol.ExportModule): its args and StateLayout, the
    body (an embedding, the blocks and the final norm, under the checkpoint's own names so its state dict loads with
    strict=True), the output head (tied to the embedding, or its own matrix) over the rows a call asks for, and the
    empty state. A family's module subclasses it, checks its layout, calls make_body and writes forward."""

    def __init__(self, args, layout: StateLayout):
        super().__init__()
        self.args, self.layout = args, layout

    def make_body(self, blocks, norm: nn.Module, body: str | None = "model",
                  names: tuple[str, str, str] = ("embed_tokens", "layers", "norm"), head_name: str = "lm_head"):
        """self.<body>.<names[0]> = Embedding(vocab, hidden), .<names[1]> = the blocks, .<names[2]> = norm (body None:
        on self itself), and self.<head_name> = None when args.tied (the embedding is the output matrix), else a
        Linear(hidden, vocab) without bias."""
        a = self.args
        holder = self
        if body is not None:
            holder = nn.Module()
            setattr(self, body, holder)
        setattr(holder, names[0], nn.Embedding(a.vocab, a.hidden))
        setattr(holder, names[1], nn.ModuleList(blocks))
        setattr(holder, names[2], norm)
        setattr(self, head_name, None if a.tied else nn.Linear(a.hidden, a.vocab, bias=False))
        self._shell = (body, *names, head_name)

    def _part(self, i: int):
        holder = self if self._shell[0] is None else getattr(self, self._shell[0])
        return getattr(holder, self._shell[i])

    @property
    def embeddings(self) -> nn.Embedding:
        return self._part(1)

    @property
    def blocks(self) -> nn.ModuleList:
        return self._part(2)

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [1, C, d] -> logits [1, R, V] of the chosen rows (rows None: all C): final norm, then the output matrix."""
        w = output_weight(self.embeddings, getattr(self, self._shell[4]))
        return head(x, self._part(3), w, rows)

    def empty_state(self) -> list[torch.Tensor]:
        return empty_state(self.layout)
