"""GGUF: the header gives the shapes and the exact stored bytes of every tensor, and its metadata (llama.cpp's key
names, gguf-py/gguf/constants.py Keys) the config. `gguf_config` is the one reader of that metadata: the planner's
read_gguf and the export's weight loader (edgekv.models.weights) both build on it. Torch-free (gguf-py needs numpy
only)."""
from __future__ import annotations

from pathlib import Path

from ..errors import EdgekvError
from .readers import arch_from_config
from .types import Arch, Weight

GGUF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3": "gemma3_text", "phi3": "phi3", "mamba": "mamba", "mamba2": "mamba2"}
# transformers' config default activation per GGUF architecture (hidden_act; Gemma's hidden_activation)
_ACT = {"llama": "silu", "mistral": "silu", "qwen2": "silu", "qwen3": "silu", "phi3": "silu"}


def _gguf_class(name: str) -> str:
    if name.startswith("token_embd"):
        return "embedding"
    if name.startswith("output."):
        return "lm_head"
    if name.endswith(".bias") or "norm" in name or any(t in name for t in ("ssm_conv", "ssm_a", "ssm_d", "ssm_dt.bias")):
        return "small"
    return "linear"


def gguf_field(reader, where: str):
    """field(key[, default]): a metadata value, or a one-line error naming the missing key when there is no default."""
    def field(key, default=...):
        f = reader.fields.get(key)
        if f is None:
            if default is ...:
                raise EdgekvError(f"{where}: GGUF metadata lacks '{key}'")
            return default
        return f.contents()
    return field


def gguf_arch(reader, where: str) -> str:
    """general.architecture, refused unless edgekv reads it."""
    arch = gguf_field(reader, where)("general.architecture")
    if arch not in GGUF_ARCH:
        raise EdgekvError(f"{where}: GGUF architecture {arch!r} is not supported; supported: "
                          f"{', '.join(sorted(GGUF_ARCH))}")
    return arch


def gguf_config(reader, where: str) -> dict:
    """A transformers-style config dict from a GGUF's metadata; a malformed value is one line naming the file."""
    arch = gguf_arch(reader, where)
    try:
        return _config(arch, gguf_field(reader, where), reader)
    except (TypeError, ValueError, KeyError, IndexError, ArithmeticError, AttributeError) as e:
        raise EdgekvError(f"{where}: malformed GGUF metadata ({type(e).__name__}: {e})") from None


def _config(arch: str, field, reader) -> dict:
    names = {t.name for t in reader.tensors}
    vocab = field(f"{arch}.vocab_size", None) or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {"model_type": GGUF_ARCH[arch], "vocab_size": int(vocab),
           "hidden_size": int(field(f"{arch}.embedding_length")), "num_hidden_layers": int(field(f"{arch}.block_count")),
           "max_position_embeddings": field(f"{arch}.context_length", None),
           "tie_word_embeddings": "output.weight" not in names}
    if arch.startswith("mamba"):
        cfg.update(intermediate_size=field(f"{arch}.ssm.inner_size"), state_size=field(f"{arch}.ssm.state_size"),
                   conv_kernel=field(f"{arch}.ssm.conv_kernel"), time_step_rank=field(f"{arch}.ssm.time_step_rank"))
        return cfg
    heads = field(f"{arch}.attention.head_count")
    if not heads:
        raise ValueError(f"{arch}.attention.head_count is {heads!r}")
    heads = int(heads)
    eps = field(f"{arch}.attention.layer_norm_rms_epsilon", None)
    cfg.update(num_attention_heads=heads, num_key_value_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
               head_dim=int(field(f"{arch}.attention.key_length", cfg["hidden_size"] // heads)),
               intermediate_size=int(field(f"{arch}.feed_forward_length")),
               rms_norm_eps=None if eps is None else float(eps),
               rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
               attention_bias="blk.0.attn_output.bias" in names,
               sliding_window=field(f"{arch}.attention.sliding_window", None))
    if arch in _ACT:
        cfg["hidden_act"] = _ACT[arch]
    if arch == "qwen2":  # Qwen2's q/k/v always carry a bias, its config has no attention_bias
        cfg.pop("attention_bias")
    if arch == "gemma3":
        # what the GGUF header does not carry, as llama.cpp's gemma3 loader fixes it (src/llama-model.cpp,
        # LLM_ARCH_GEMMA3): 5 sliding layers per global one (set_swa_pattern(6)), the sliding layers' RoPE base 10k
        # (rope_freq_base_train_swa), scores scaled by 1/sqrt(head_dim) (f_attention_scale, every size but 27B);
        # Gemma3TextConfig's defaults are the same (sliding_window_pattern 6, rope_local_base_freq 1e4,
        # query_pre_attn_scalar 256 = head_dim of the 270M / 1B / 4B models), and Gemma 3 has no logit softcapping.
        cfg.update(hidden_activation="gelu_pytorch_tanh", sliding_window_pattern=6, rope_local_base_freq=10000.0,
                   query_pre_attn_scalar=cfg["head_dim"])
    rtype = field(f"{arch}.rope.scaling.type", "none")
    if rtype not in ("none", ""):
        factor = field(f"{arch}.rope.scaling.factor", None)
        cfg["rope_scaling"] = {"rope_type": rtype, "factor": None if factor is None else float(factor)}
    rot = int(field(f"{arch}.rope.dimension_count", cfg["head_dim"]))
    if rot != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = rot / cfg["head_dim"]
    return cfg


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
    cfg = gguf_config(reader, str(p))
    # the planner takes context_length as the trained length: a GGUF header rarely names the length a rope scaling
    # stretched (rope.scaling.original_context_length), so its scaling is not passed on to trained_ctx_of
    cfg.pop("rope_scaling", None)
    base = arch_from_config(cfg, p.stem, str(p))
    # rope_freqs.weight (Llama 3's rope scaling as per-frequency factors, convert_hf_to_gguf.py's
    # generate_extra_tensors) is a rope table, not a parameter: an HF folder computes it at load and is planned
    # without it, so the GGUF is too
    weights = tuple(Weight(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), _gguf_class(t.name),
                           gguf_type=t.tensor_type.name, gguf_bytes=int(t.n_bytes)) for t in reader.tensors
                    if t.name != "rope_freqs.weight")
    ftype = gguf_field(reader, str(p))("general.file_type", None)
    base.weights = weights
    base.gguf_path = str(p)
    base.notes.append(f"weights as stored in the GGUF (file_type {ftype}): exact bytes per tensor")
    return base
