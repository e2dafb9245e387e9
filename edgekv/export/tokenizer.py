"""The tokenizer an export carries: a `tokenizers` tokenizer.json, plus the special ids the manifest records.

From a GGUF: transformers' GGUF tokenizer conversion (vocabulary + merges -> byte-level BPE), with one correction at
the edge: llama.cpp's `smollm` pre-tokenizer splits every digit on its own before the GPT-2 regex
(llama.cpp src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\\p{N}" then the GPT-2 pattern), which transformers'
converter does not know. From an HF folder: its tokenizer.json as is.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import EdgekvError
from ..jsonfile import read_config


def write_tokenizer(source: Path, out_dir: Path, vocab: int | None = None) -> dict | None:
    """Write out_dir/tokenizer.json for the model at `source`; returns the manifest's tokenizer entry, or None when
    the model carries no tokenizer (an HF folder without tokenizer.json that is not byte-level, vocab 256)."""
    if source.suffix.lower() == ".gguf":
        return _from_gguf(source, out_dir)
    tj = source / "tokenizer.json"
    if tj.is_file():
        shutil.copyfile(tj, out_dir / "tokenizer.json")
        return {"file": "tokenizer.json", "source": "tokenizer.json of the HF folder", **_special_ids(source)}
    if vocab == 256:
        return write_byte_tokenizer(source, out_dir)
    return None


def _special_ids(folder: Path) -> dict:
    """bos / eos ids from the folder's config.json (eos may be one id or a list), for the manifest."""
    cfg = read_config(folder / "config.json") if (folder / "config.json").is_file() else {}
    eos = cfg.get("eos_token_id")
    return {"bos_token_id": cfg.get("bos_token_id"),
            "eos_token_ids": eos if isinstance(eos, list) else ([eos] if eos is not None else []),
            "add_bos_token": False}


def write_byte_tokenizer(source: Path, out_dir: Path) -> dict:
    """A byte-level model (vocab 256, token id = byte value, no tokenizer of its own: fixtures/README.md) ships a
    tokenizer.json that encodes text to its UTF-8 bytes and decodes bytes back: a BPE over the 256 byte symbols of
    the ByteLevel pre-tokenizer's alphabet (GPT-2's bytes_to_unicode) with no merges, so any app's `tokenizers`
    runs it as is."""
    _save_byte_tokenizer(out_dir)
    return {"file": "tokenizer.json", "source": "bytes: token id = UTF-8 byte value (vocab 256, the model folder "
            "has no tokenizer)", "kind": "bytes", **_special_ids(source)}


def byte_symbols() -> list[str]:
    """The ByteLevel pre-tokenizer's symbol of each byte value 0..255 (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    symbol = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(rest)}
    return [symbol[b] for b in range(256)]


def _save_byte_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE({s: b for b, s in enumerate(byte_symbols())}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out_dir / "tokenizer.json"))


def _byte_vocabulary(tdict: dict) -> bool:
    """A GGUF whose vocabulary is the 256 byte symbols in byte order, and where no merge of two byte symbols gives a
    token (every longer token needs such a merge first), so text encodes to its bytes: scripts/make_random_model.py's
    files (bytes, then unused fillers, and the one merge llama.cpp requires)."""
    tokens, syms = list(tdict.get("tokens") or []), byte_symbols()
    if tokens[:256] != syms:
        return False
    vocab, byte_set = set(tokens), set(syms)
    for m in tdict.get("merges") or []:
        a, _, b = m.partition(" ")
        if a in byte_set and b in byte_set and a + b in vocab:
            return False
    return True


def _from_gguf(path: Path, out_dir: Path) -> dict:
    from tokenizers import pre_tokenizers
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, tdict, tconfig = get_gguf_tokenizer(str(path))
        if _byte_vocabulary(tdict):  # transformers' converter refuses a vocabulary without GPT-2's merged tokens
            _save_byte_tokenizer(out_dir)
            index = {t: i for i, t in enumerate(tdict["tokens"])}
            ids = {t: index.get(tconfig[t]) if tconfig.get(t) else None for t in ("bos_token", "eos_token")}
            return {"file": "tokenizer.json", "source": "bytes: token id = UTF-8 byte value (the GGUF's vocabulary "
                    "is the 256 byte symbols)", "kind": "bytes", "bos_token_id": ids["bos_token"],
                    "eos_token_ids": [ids["eos_token"]] if ids["eos_token"] is not None else [],
                    "add_bos_token": bool(tconfig.get("add_bos_token", False))}
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


def bos_prefix(entry: dict | None) -> list[int]:
    """[bos id] when the model's tokenizer puts one before every text (GGUF tokenizer.ggml.add_bos_token, as Gemma 3's
    does), else []. What `edgekv run` feeds first (generate.py), so verify-quant and kv-int8c's calibration read their
    text as the model is run: without it Gemma 3 reads its first text token as it never does in use, and its int4
    weights measure far worse against fp32 there (docs/export.md#weight-quantization)."""
    if entry and entry.get("add_bos_token") and entry.get("bos_token_id") is not None:
        return [int(entry["bos_token_id"])]
    return []
