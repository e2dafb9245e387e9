"""Calibration of a static-scale int8 cache (kv-int8c): the scale of each (layer, KV head, channel), for keys and for
values, from one eager fp32 pass over real text.

The module (edgekv.models.llama with a kv-int8c layout) is called once on CALIB_TOKENS tokens from position 0 with
every layer in calibration mode (Attention.calib): attention reads the exact fp32 rows and each layer records the
largest |value| per channel and, for keys, the largest norm of each RoPE pair (channels j and j + D/2, which the
rotation mixes as the position grows: a key channel at position 5000 can hold what its partner held at position 50,
so a per-channel maximum over 512 positions would clip later keys; bounding both by the pair's norm holds at every
position). scale = MARGIN x that / 127, so the calibration text's own values are coded without clipping, with room
above them; a later value beyond that saturates at -128 / 127. Keys'
outliers sit in fixed channels (KVQuant, arXiv 2401.18079), which a per-channel scale follows.

The text: the source of the standard library's json package and inspect module (code and docstrings, on every
machine with Python), apart from the text `edgekv analyze` measures on (the Python docs' topics first) and the
verification prompt, so that a quality measured on those is not measured on the calibration text. Byte-level
models (vocab 256) read its bytes; a model without a tokenizer (the tests' random ones) reads fixed pseudo-random ids.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

from ..errors import EdgekvError

CALIB_TOKENS = 512
# scale = MARGIN x max |x| / 127: room above the calibration text's largest values, where an unseen value would
# otherwise clip. Chosen by experiments/kv_int8c_margin.py (SmolLM2-135M, KL against the fp32 cache over 2000 tokens
# of analyze's text at margins 1, 1.25, 1.5, 2; results/kv_int8c_margin.json): clipping (1) costs more than the
# coarser grid of 1.5 or 2.
MARGIN = 1.25
CALIB_FILES = ("json/__init__.py", "json/decoder.py", "inspect.py")


def calibration_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / rel).read_text(errors="replace") for rel in CALIB_FILES if (stdlib / rel).is_file()]
    if not parts:
        raise EdgekvError(f"calibrating kv-int8c needs the standard library's {', '.join(CALIB_FILES)}: not found "
                          f"under {stdlib}")
    return "\n".join(parts)


def calibration_ids(tokenizer, vocab: int, n: int, bos: list[int] = ()) -> list[int]:
    """n token ids of calibration_text: bytes for vocab 256, the tokenizer's ids (a tokenizers.Tokenizer or a
    callable str -> ids) after `bos` (tokenizer.bos_prefix), or fixed pseudo-random ids when there is no tokenizer."""
    if vocab == 256:
        ids = list(calibration_text().encode("utf-8"))
    elif tokenizer is None:
        ids = []
    else:
        text = calibration_text()
        ids = list(bos) + (tokenizer(text) if callable(tokenizer) else tokenizer.encode(text).ids)
    if len(set(ids[:n])) < 4:  # no tokenizer, or one that reads the text as unknown words: spread ids
        import numpy as np
        ids = np.random.default_rng(1).integers(0, vocab, n).tolist()
    return [int(i) for i in ids[:n]]


def calibrate(module, ids: list[int], margin: float = MARGIN) -> dict:
    """Set every static-scale layer's kv_scale from one fp32 call over ids (at most the module's max_ctx), with room
    `margin` above the largest values (MARGIN unless a measurement of the margin itself asks for another). Returns
    what was done, for the manifest."""
    import torch

    from ..quant import EPS

    layers = [m for m in module.modules() if hasattr(m, "kv_scale")]
    if not layers:
        return {}
    ctx = module.layout.ctx
    ids = ids[:ctx]
    if not ids:
        raise EdgekvError("calibrating kv-int8c needs at least one token")
    for m in layers:
        m.calib = [None, None]
    try:
        with torch.no_grad():
            module(torch.tensor([ids], dtype=torch.int64), torch.zeros(1, dtype=torch.int64), *module.empty_state())
        for m in layers:
            absmax = torch.stack(m.calib)  # [2, Hkv, D]
            m.kv_scale.copy_((margin * absmax / 127).clamp_min(EPS))
    finally:
        for m in layers:
            m.calib = None
    return {"kind": "static per channel", "tokens": len(ids), "text": "stdlib " + ", ".join(CALIB_FILES),
            "margin": margin,
            "rule": f"scale = {margin} x max / 127 over the calibration tokens per (layer, K|V, KV head, channel): of |v| for "
                    "values, of each RoPE pair's norm for keys"}


def calibrate_loaded(loaded, encode, margin: float = MARGIN) -> dict:
    """A loaded module's static scales (kv-int8c), if it has any, from calibration_ids read by encode (str -> ids,
    edgekv analyze's Encoder): what `edgekv analyze` measures is then the cache an export would build."""
    if not any(hasattr(m, "kv_scale") for m in loaded.module.modules()):
        return {}
    n = min(CALIB_TOKENS, loaded.layout.ctx)
    return calibrate(loaded.module, calibration_ids(encode, loaded.args.vocab, n), margin)
