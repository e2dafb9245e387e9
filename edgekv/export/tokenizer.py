"""The tokenizer an export carries: a `tokenizers` tokenizer.json, plus the special ids the manifest records.

From a GGUF: transformers' GGUF tokenizer conversion (vocabulary + merges -> byte-level BPE), with one correction at
the edge: llama.cpp's `smollm` pre-tokenizer splits every digit on its own before the GPT-2 regex
(llama.cpp src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\\p{N}" then the GPT-2 pattern), which transformers'
converter does not know. From an HF folder: its tokenizer.json as is.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import EdgekvError


def write_tokenizer(source: Path, out_dir: Path) -> dict | None:
    """Write out_dir/tokenizer.json for the model at `source`; returns the manifest's tokenizer entry, or None when
    the model carries no tokenizer (an HF folder without tokenizer.json)."""
    if source.suffix.lower() == ".gguf":
        return _from_gguf(source, out_dir)
    tj = source / "tokenizer.json"
    if not tj.is_file():
        return None
    shutil.copyfile(tj, out_dir / "tokenizer.json")
    cfg = json.loads((source / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    return {"file": "tokenizer.json", "source": "tokenizer.json of the HF folder",
            "bos_token_id": cfg.get("bos_token_id"), "eos_token_ids": eos if isinstance(eos, list) else
            ([eos] if eos is not None else []), "add_bos_token": False}


def _from_gguf(path: Path, out_dir: Path) -> dict:
    from tokenizers import pre_tokenizers
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, tdict, tconfig = get_gguf_tokenizer(str(path))
        tok, _ = convert_gguf_tokenizer(arch, tdict)
    except Exception as e:  # the converter raises ValueError/KeyError on files it cannot read
        raise EdgekvError(f"{path}: cannot build a tokenizer from the GGUF vocabulary "
                          f"({type(e).__name__}: {e})") from None
    pre = tdict.get("pre_tokenizer_type") or tdict.get("pre")
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(tconfig[t]) if tconfig.get(t) else None for t in ("bos_token", "eos_token")}
    return {"file": "tokenizer.json", "source": f"GGUF vocabulary + merges ({tdict.get('tokenizer_type')}, "
            f"pre-tokenizer {pre})", "bos_token_id": ids["bos_token"],
            "eos_token_ids": [ids["eos_token"]] if ids["eos_token"] is not None else [],
            "add_bos_token": bool(tconfig.get("add_bos_token", False))}
