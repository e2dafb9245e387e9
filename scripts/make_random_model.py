#!/usr/bin/env python
"""Random-weight models at published shapes: an HF folder (config.json, model.safetensors, tokenizer.json) and the
same weights as a GGUF f16, from a catalog entry (edgekv/catalog/NAME.json) or a file in the catalog's format.

Speed, memory and export cost depend on a model's shapes, not on its trained values, so a 1B-4B model that cannot be
downloaded here is measured on seeded random weights of the exact shapes and dtype. Quality cannot be: these models
say nothing.

    python scripts/make_random_model.py llama-3.2-1b --out /tmp/rand/llama-3.2-1b        # HF folder + GGUF
    python scripts/make_random_model.py qwen2.5-1.5b --out /tmp/rand/qwen --no-gguf
    python scripts/make_random_model.py ./my-entry.json --out /tmp/rand/tiny             # a catalog-format file

What is written:
- config.json as transformers writes it for the model_type (AutoConfig.for_model(...).save_pretrained).
- model.safetensors in the config's torch_dtype (bf16 or fp16), the tensor names and shapes of transformers' own
  model class (built on the meta device, so nothing is allocated); a tied lm_head is not stored, as save_pretrained
  does. Written tensor by tensor (header first, then each tensor's bytes), so memory stays about one fp32 tensor.
- values: normal(0, --std, default 0.02, transformers' initializer_range) for matrices and embeddings, seeded per
  tensor from (--seed, name), so every run writes the same bytes (biases too, so that a misplaced one shows); RMSNorm
  weights 1 (Gemma's 0: its norm multiplies by 1 + w), so activations stay finite through every layer.
- tokenizer.json: edgekv's byte-level tokenizer (edgekv.export.tokenizer.write_byte_tokenizer: token id = UTF-8 byte
  value). Every catalog vocab is larger than 256, so ids 0-255 are bytes and the rest are never produced; the
  config's bos/eos ids are kept as published (they name ids above 255, which the byte tokenizer never emits).
- MODEL-f16.gguf (unless --no-gguf): the same values read back from model.safetensors, in llama.cpp's tensor names
  and layout as convert_hf_to_gguf.py writes them (edgekv.models.weights maps the same names back): matrices F16,
  1-D tensors F32; llama / mistral q and k rows permuted for llama.cpp's interleaved RoPE; Gemma 3 norms stored as
  1 + w; Llama 3's rope scaling as the rope_freqs.weight tensor (LlamaModel.generate_extra_tensors). The vocabulary
  is the 256 byte symbols plus unused fillers up to the model's vocab size (llama.cpp needs one token per row).
  Architectures with a GGUF writer here: llama, mistral, qwen2, qwen3, gemma3_text.

Everything is written into a temporary sibling folder and renamed into place; an existing --out is refused.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import zlib
from pathlib import Path

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def read_entry(spec: str) -> dict:
    """A catalog name or a JSON file in the catalog's format ({"name", "config": {...}}) -> the entry."""
    p = Path(spec)
    if p.suffix == ".json" and p.is_file():
        entry = json.loads(p.read_text())
        entry.setdefault("name", p.stem)
        return entry
    from edgekv.arch.catalog import catalog_entry
    return catalog_entry(spec)


def hf_config(entry: dict):
    """The transformers config object for the entry's config (its model_type's class, defaults filled in)."""
    from transformers import AutoConfig
    cfg = dict(entry["config"])
    cfg.pop("transformers_version", None)
    cfg.pop("_name_or_path", None)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def tensor_specs(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every stored tensor, in transformers' names: the model class built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    specs = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    if getattr(config, "tie_word_embeddings", False):  # save_pretrained stores a tied head once, as the embedding
        specs = [(k, s) for k, s in specs if k != "lm_head.weight"]
    return specs


def random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float, gemma_norm: bool):
    """The tensor's fp32 values: normal(0, std) seeded by (seed, name), biases included; norms 1 (Gemma: 0)."""
    import torch
    if len(shape) == 1 and "norm" in name:
        return torch.zeros(shape) if gemma_norm else torch.ones(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=g).mul_(std)


def write_safetensors(path: Path, specs, dtype: str, seed: int, std: float, gemma_norm: bool) -> int:
    """Header first (every tensor's offsets follow from the shapes), then each tensor's bytes: one tensor in memory.
    Returns the number of parameters written."""
    import torch
    tdt = getattr(torch, dtype)
    item = torch.empty((), dtype=tdt).element_size()
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in specs:
        n = math.prod(shape) * item
        header[name] = {"dtype": ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the safetensors format pads the header to 8 bytes with spaces
    count = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in specs:
            t = random_tensor(name, shape, seed, std, gemma_norm).to(tdt).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # little-endian, as safetensors stores
            count += t.numel()
            del t
    return count


# ---- GGUF ----

def _gguf_names(arch: str) -> dict:
    """transformers name -> llama.cpp name, the inverse of what edgekv.models.weights reads back."""
    from edgekv.arch.variants import GGUF_VARIANTS
    from edgekv.models.weights import _GGUF_TOP, gguf_block_names
    block = gguf_block_names(GGUF_VARIANTS[arch])  # the variant's norms and qk-norm (Qwen3's and Gemma 3's)
    return {"top": {v: k for k, v in _GGUF_TOP.items()}, "block": {v: k for k, v in block.items()}}


def _gguf_name(name: str, names: dict) -> str:
    if name in names["top"]:
        return names["top"][name]
    parts = name.split(".")  # model.layers.I.<hf part>.weight|bias
    if parts[:2] != ["model", "layers"]:
        raise SystemExit(f"no llama.cpp name for tensor {name}")
    part = ".".join(parts[3:-1])
    if part not in names["block"]:
        raise SystemExit(f"no llama.cpp name for tensor {name}")
    return f"blk.{parts[2]}.{names['block'][part]}.{parts[-1]}"


def _permute(w, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute: rows [n_head, 2, D/2] -> [n_head, D/2, 2]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_of(cfg: dict) -> tuple[float, dict]:
    """(rope base, rope scaling dict) of a config dict: transformers < 5 keeps rope_theta / rope_scaling at the top,
    transformers >= 5 nests them in rope_parameters (per layer type for Gemma 3: the full-attention layers' here)."""
    rp = cfg.get("rope_parameters") or {}
    if "full_attention" in rp:
        rp = rp["full_attention"]
    scaling = cfg.get("rope_scaling") or rp
    theta = cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0
    return float(theta), (scaling if scaling.get("rope_type", "default") != "default" else {})


def llama3_rope_factors(cfg: dict, head_dim: int):
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3's rope scaling as per-frequency factors."""
    import numpy as np
    base, rs = rope_of(cfg)
    factor, lo, hi = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_gguf(path: Path, folder: Path, config, specs) -> None:
    """The folder's safetensors, tensor by tensor (memory-mapped reads), as a GGUF f16 llama.cpp loads."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    mt = config.model_type
    arch = GGUF_ARCH[mt]
    cfg = config.to_dict()
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    vocab = cfg["vocab_size"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(folder.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(vocab)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta, rs = rope_of(cfg)
    w.add_rope_freq_base(theta)
    if rs.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rs["factor"])
    if mt == "gemma3_text" and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    # byte-level vocabulary: the 256 ByteLevel symbols (GPT-2's bytes_to_unicode), then unused fillers
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    symbol = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(rest)}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    # llama.cpp's BPE vocabulary needs a merges key with one merge at least, and transformers' converter a merge whose
    # parts and result are tokens: two fillers and their concatenation, which no text reaches (bytes never become a
    # filler), so the GGUF's tokenizer encodes text as the folder's byte-level tokenizer.json does
    fillers = [f"<unused_{i}>" for i in range(256, vocab)]
    fillers[-1] = fillers[0] + fillers[1]
    w.add_token_list([symbol[b] for b in range(256)] + fillers)
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.UNUSED] * (vocab - 256))
    w.add_token_merges([f"{fillers[0]} {fillers[1]}"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        v = cfg.get(key)
        v = v[0] if isinstance(v, list) else v
        if v is not None and v < vocab:
            add(int(v))
    w.add_add_bos_token(False)

    names = _gguf_names(arch)
    order = []
    if mt == "llama" and (rs.get("rope_type") == "llama3"):
        order.append(("rope_freqs.weight", None, (head_dim // 2,), np.float32))
    for name, shape in specs:
        order.append((_gguf_name(name, names), name, shape, np.float16 if len(shape) > 1 else np.float32))
    for gname, _, shape, dt in order:
        w.add_tensor_info(gname, shape, np.dtype(dt), math.prod(shape) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for gname, name, _, dt in order:
            if name is None:
                a = llama3_rope_factors(cfg, head_dim)
            else:
                a = f.get_tensor(name).float().numpy()
                if arch == "gemma3" and gname.endswith("norm.weight"):
                    a = a + 1.0  # convert_hf_to_gguf.py's Gemma norms: 1 + w
                if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
                    a = _permute(a, heads if gname.endswith("attn_q.weight") else kv)
            w.write_tensor_data(np.ascontiguousarray(a.astype(dt)))
            del a
    w.close()


def make(spec: str, out: Path, seed: int = 0, std: float = 0.02, dtype: str | None = None,
         gguf_file: bool = True, echo=print) -> dict:
    """Write the random model; returns {"params", "folder", "gguf"}."""
    entry = read_entry(spec)
    config = hf_config(entry)
    dtype = dtype or str(entry["config"].get("torch_dtype") or "bfloat16")
    if dtype not in ST_DTYPE:
        raise SystemExit(f"--dtype {dtype}: one of {', '.join(ST_DTYPE)}")
    config.torch_dtype = dtype
    if gguf_file and config.model_type not in GGUF_ARCH:
        raise SystemExit(f"{entry['name']}: no GGUF writer for model_type {config.model_type} here "
                         f"({', '.join(GGUF_ARCH)}); use --no-gguf")
    if out.exists():
        raise SystemExit(f"{out} exists: choose a new --out (nothing is overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        config.save_pretrained(tmp)
        specs = tensor_specs(config)
        echo(f"{entry['name']}: {len(specs)} tensors, {dtype}, seed {seed}, std {std}")
        n = write_safetensors(tmp / "model.safetensors", specs, dtype, seed, std, config.model_type == "gemma3_text")
        from edgekv.export.tokenizer import write_byte_tokenizer
        write_byte_tokenizer(tmp, tmp)
        gname = None
        if gguf_file:
            gname = f"{entry['name']}-f16.gguf"
            write_gguf(tmp / gname, tmp, config, specs)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    echo(f"wrote {out}: {n:,} parameters" + (f", {gname}" if gname else ""))
    return {"params": n, "folder": str(out), "gguf": str(out / gname) if gname else None}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a catalog name (edgekv/catalog/NAME.json) or a JSON file in the catalog's format")
    ap.add_argument("--out", required=True, type=Path, help="folder to create")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the random matrices")
    ap.add_argument("--dtype", choices=sorted(ST_DTYPE), default=None, help="default: the config's torch_dtype")
    ap.add_argument("--no-gguf", action="store_true", help="the HF folder only")
    a = ap.parse_args(argv)
    make(a.model, a.out, a.seed, a.std, a.dtype, not a.no_gguf)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
