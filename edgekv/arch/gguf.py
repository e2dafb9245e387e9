"""GGUF: the header gives the shapes and the exact stored bytes of every tensor."""
from __future__ import annotations

from pathlib import Path

from ..errors import EdgekvError
from .readers import arch_from_config
from .types import Arch, Weight


GGUF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3": "gemma3_text", "phi3": "phi3", "mamba": "mamba", "mamba2": "mamba2"}


def _gguf_class(name: str) -> str:
    if name.startswith("token_embd"):
        return "embedding"
    if name.startswith("output."):
        return "lm_head"
    if name.endswith(".bias") or "norm" in name or any(t in name for t in ("ssm_conv", "ssm_a", "ssm_d", "ssm_dt.bias")):
        return "small"
    return "linear"


def read_gguf(path: str | Path) -> Arch:
    p = Path(path)
    if not p.is_file():
        raise EdgekvError(f"{path}: no such GGUF file")
    try:
        import gguf  # pure Python, numpy only
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # the reader raises many kinds of error on a damaged file
        raise EdgekvError(f"{p}: not a readable GGUF file (truncated or corrupt?: {type(e).__name__}: {e})") from None
    size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise EdgekvError(f"{p}: truncated GGUF (tensor {t.name} ends past the end of the file)")

    def field(key, default=...):
        f = reader.fields.get(key)
        if f is None:
            if default is ...:
                raise EdgekvError(f"{p}: GGUF metadata lacks '{key}'")
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch not in GGUF_ARCH:
        raise EdgekvError(f"{p}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCH))}")
    tensors = {t.name: t for t in reader.tensors}
    try:
        cfg = _gguf_config(arch, field, reader, tensors)
    except (TypeError, ValueError, KeyError, IndexError, ArithmeticError, AttributeError) as e:
        raise EdgekvError(f"{p}: malformed GGUF metadata ({type(e).__name__}: {e})") from None
    base = arch_from_config(cfg, p.stem, str(p))
    weights = tuple(Weight(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), _gguf_class(t.name),
                           gguf_type=t.tensor_type.name, gguf_bytes=int(t.n_bytes)) for t in reader.tensors)
    ftype = field("general.file_type", None)
    base.weights = weights
    base.gguf_path = str(p)
    base.notes.append(f"weights as stored in the GGUF (file_type {ftype}): exact bytes per tensor")
    return base


def _gguf_config(arch: str, field, reader, tensors) -> dict:
    """A config.json-style dict from a GGUF's metadata (llama.cpp's key names)."""
    vocab = field(f"{arch}.vocab_size", None) or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {"model_type": GGUF_ARCH[arch], "vocab_size": int(vocab),
           "hidden_size": field(f"{arch}.embedding_length"), "num_hidden_layers": field(f"{arch}.block_count"),
           "max_position_embeddings": field(f"{arch}.context_length", None),
           "tie_word_embeddings": "output.weight" not in tensors}
    if arch.startswith("mamba"):
        cfg.update(intermediate_size=field(f"{arch}.ssm.inner_size"), state_size=field(f"{arch}.ssm.state_size"),
                   conv_kernel=field(f"{arch}.ssm.conv_kernel"), time_step_rank=field(f"{arch}.ssm.time_step_rank"))
    else:
        heads = field(f"{arch}.attention.head_count")
        if not heads:
            raise ValueError(f"{arch}.attention.head_count is {heads!r}")
        cfg.update(num_attention_heads=heads, num_key_value_heads=field(f"{arch}.attention.head_count_kv", heads),
                   intermediate_size=field(f"{arch}.feed_forward_length"),
                   head_dim=field(f"{arch}.attention.key_length", cfg["hidden_size"] // heads),
                   sliding_window=field(f"{arch}.attention.sliding_window", None))
    return cfg
