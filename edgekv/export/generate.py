"""`edgekv run`: greedy generation from an export with nothing but its runtime, its manifest and its tokenizer."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from .tokenizer import bos_prefix

CONTEXT_TOKENS = 8


def open_export(folder: str | Path, runtime: str | None = None, threads: int | None = None):
    """(manifest, stepper, tokenizer) for an export folder. The runtime and the tokenizer load a private copy of the
    files they open, hashed as it was copied (manifest.private_copy), which is removed once they have loaded it."""
    from .manifest import check_files, load_export, loaded_files, private_copy
    from .runtime import open_stepper

    d = Path(folder)
    manifest = load_export(d, check_hashes=False)
    formats = [a["format"] for a in manifest["artifacts"]]
    if runtime is None:
        runtime = "ort" if "onnx" in formats else "executorch"
    names = loaded_files(manifest, runtime)
    check_files(d, manifest, skip=names)  # the files loaded are hashed as they are copied, below
    if manifest["tokenizer"] is None:
        raise EdgekvError(f"{d}: this export carries no tokenizer (its model folder had no tokenizer.json)")
    with private_copy(d, manifest, names) as copy:
        tok = load_tokenizer(copy / manifest["tokenizer"]["file"])
        return manifest, open_stepper(copy, manifest, runtime, threads), tok


def generate_with_runner(folder: str | Path, runtime: str, prompt: str, max_new_tokens: int, threads=None,
                         emit=None, after_prefill=None) -> dict:
    """`edgekv run --runtime genai|executorch-runner`: the runtime's own LLM API generates (its tokenizer, its loop,
    greedy), from an export made with --runner, loading a private copy of its files hashed as it was copied
    (manifest.private_copy), kept until the generation ends. The same dict as generate()."""
    from .manifest import load_export, loaded_files, private_copy
    d = Path(folder)
    manifest = load_export(d, copied_for=runtime)  # the loaded files are hashed as they are copied, below
    if runtime == "genai":
        from .genai import generate as run
    else:
        from .et_runner import generate as run
    with private_copy(d, manifest, loaded_files(manifest, runtime)) as copy:
        return run(copy, manifest, prompt, max_new_tokens, emit=emit, after_prefill=after_prefill, threads=threads)


def load_tokenizer(path: Path):
    """A `tokenizers` Tokenizer from its tokenizer.json; one EdgekvError line when the library cannot read it."""
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception for a malformed file
        raise EdgekvError(f"{path}: not a tokenizer the tokenizers library can read ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})") from None


def generate(manifest: dict, stepper, tok, prompt: str, max_new_tokens: int, emit=None, after_prefill=None,
             start: dict | None = None) -> dict:
    """Greedy decoding; emit(text) receives each new piece of text as soon as it is complete UTF-8;
    after_prefill() is called once the prompt is in the state (the runtime's own start-up logging is over by then).
    start: a state already in the stepper (edgekv.export.statefile.load: position, tokens, pending): the prompt
    continues it (no BOS; the pending token, generated but not yet fed, goes first). max_new_tokens 0: prefill only.
    The result's "state_tokens" are the ids the state holds afterwards and "pending" the last generated one (not
    fed; -1 when none), what --save-state keeps."""
    t_info = manifest["tokenizer"]
    ids = tok.encode(prompt).ids
    pos0, history = 0, []
    if start is not None:
        pos0, history = start["position"], list(start["tokens"])
        ids = ([start["pending"]] if start["pending"] >= 0 else []) + ids
    elif bos_prefix(t_info) and ids[:1] != bos_prefix(t_info):
        ids = bos_prefix(t_info) + ids
    if not ids:
        raise EdgekvError("the prompt encodes to no tokens")
    room = stepper.max_ctx - pos0 - len(ids)
    if room < (1 if max_new_tokens else 0):
        held = f" after the {pos0} resumed" if pos0 else ""
        raise EdgekvError(f"the prompt is {len(ids)} tokens{held}; this export holds {stepper.max_ctx} (max_ctx)")
    n_new = min(max_new_tokens, room)
    eos = set(t_info["eos_token_ids"])
    t0 = time.perf_counter()
    logits = stepper.prefill(ids, pos=pos0, last=True)
    t_prefill = time.perf_counter() - t0
    if after_prefill:
        after_prefill()
    out, shown, pos, text = [], "", pos0 + len(ids), ""
    if not max_new_tokens:
        return {"prompt_tokens": len(ids), "resumed_at": pos0, "new_tokens": 0, "tokens": [], "text": "",
                "prefill_s": t_prefill, "prefill_tok_s": len(ids) / t_prefill if t_prefill > 0 else None,
                "decode_tok_s": None, "stopped": "max_new_tokens", "state_tokens": history + ids, "pending": -1}
    # decode the new tokens after a little prompt context, so that decoders that join words (WordPiece,
    # SentencePiece) put the right separator before the first new token
    ctx = ids[-CONTEXT_TOKENS:]
    base = tok.decode(ctx, skip_special_tokens=True)
    nxt = int(np.argmax(logits[-1]))
    t1 = time.perf_counter()
    while True:
        out.append(nxt)
        full = tok.decode(ctx + out, skip_special_tokens=True)
        text = full[len(base):] if full.startswith(base) else tok.decode(out, skip_special_tokens=True)
        if emit and not text.endswith("\ufffd") and len(text) > len(shown):
            emit(text[len(shown):])
            shown = text
        if nxt in eos or len(out) >= n_new:
            break
        nxt = int(np.argmax(stepper.step([nxt], pos)[-1]))
        pos += 1
    t_decode = time.perf_counter() - t1
    steps = len(out) - 1  # decode calls made (the first new token came from the prefill)
    return {"prompt_tokens": len(ids), "resumed_at": pos0, "new_tokens": len(out), "tokens": out,
            "text": text, "prefill_s": t_prefill,
            "prefill_tok_s": len(ids) / t_prefill if t_prefill > 0 else None,
            "decode_tok_s": steps / t_decode if steps and t_decode > 0 else None,
            "stopped": "eos" if out[-1] in eos else ("max_ctx" if n_new < max_new_tokens else "max_new_tokens"),
            "state_tokens": history + ids + out[:-1], "pending": out[-1]}
