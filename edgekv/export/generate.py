"""`edgekv run`: greedy generation from an export with nothing but its runtime, its manifest and its tokenizer."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..clibase import one_line
from ..errors import EdgekvError
from ..safetext import printable
from .tokenizer import bos_prefix

CONTEXT_TOKENS = 8


def open_export(folder: str | Path, runtime: str | None = None, threads: int | None = None):
    """(manifest, stepper, tokenizer) for an export folder, for any --runtime (edgekv.export.runtime.open_stepper):
    the tokenizer is the runtime's own where its LLM API has one (Stepper.own_tokenizer), else tokenizer.json's.
    The runtime and the tokenizer load a private copy of the files they open, hashed as it was copied
    (manifest.private_copy), which is removed once they have loaded it."""
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
    vocab = manifest["model"]["vocab"]
    with private_copy(d, manifest, names) as copy:
        tok = load_tokenizer(copy / manifest["tokenizer"]["file"], vocab)
        stepper = open_stepper(copy, manifest, runtime, threads)
        own = stepper.own_tokenizer()
        return manifest, stepper, (Tokenizer(own, tok.path, vocab) if own is not None else tok)


@contextlib.contextmanager
def _tokenizer_calls(path: Path, what: str):
    """Around every call into the `tokenizers` library: its Rust code can panic on a hostile tokenizer.json (an
    Oniguruma pre-tokenizer regex that backtracks past the library's retry limit: the search error is unwrapped).
    pyo3 raises that panic as PanicException, a BaseException that `except Exception` lets through, and Rust's panic
    hook writes the panic and its backtrace to file descriptor 2 before Python sees it; both become one line here."""
    sys.stderr.flush()
    try:
        saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:  # no stderr to keep quiet (closed)
        saved = quiet = None
    if quiet is not None:
        os.dup2(quiet, 2)
    try:
        yield
    except EdgekvError:
        raise
    except Exception as e:  # tokenizers' own errors
        raise EdgekvError(f"{printable(path)}: the tokenizer cannot {what} ({type(e).__name__}: "
                          f"{one_line(e, 200)})") from None
    except BaseException as e:  # pyo3_runtime.PanicException: a panic in the Rust library
        if type(e).__name__ != "PanicException":
            raise
        raise EdgekvError(f"{printable(path)}: the tokenizer failed to {what} (a panic in the tokenizers library: "
                          f"{one_line(e, 200)})") from None
    finally:
        if quiet is not None:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(quiet)


class Tokenizer:
    """A `tokenizers` Tokenizer whose calls end in one EdgekvError line, never a panic's traceback, and whose ids
    are checked against the model's vocabulary (ONNX Runtime's Gather fails on an id past the embedding; ExecuTorch
    reads past it)."""

    def __init__(self, tok, path: Path, vocab: int | None):
        self.tok, self.path, self.vocab = tok, path, vocab

    def encode(self, text: str, *args, **kw):
        with _tokenizer_calls(self.path, "encode this text"):
            enc = self.tok.encode(text, *args, **kw)
        if self.vocab is not None:
            check_ids(enc.ids, self.vocab, f"{printable(self.path)}: the tokenizer")
        return enc

    def decode(self, ids, **kw) -> str:
        with _tokenizer_calls(self.path, "decode these ids"):
            return self.tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def check_ids(ids, vocab: int, who: str) -> None:
    """Every id inside the model's vocabulary [0, vocab), or one line naming the first that is not."""
    bad = next((i for i in ids if not 0 <= int(i) < vocab), None)
    if bad is not None:
        raise EdgekvError(f"{who} gives token id {bad}, outside the model's vocabulary of {vocab:,} (ids 0 to "
                          f"{vocab - 1:,}): the tokenizer does not belong to this model")


def load_tokenizer(path: Path, vocab: int | None = None) -> Tokenizer:
    """A `tokenizers` Tokenizer from its tokenizer.json (read here, so a path that is not UTF-8 does not matter to
    the library); one EdgekvError line when the library cannot read it or its vocabulary has an id past the model's
    (vocab: the manifest's; an added token past it, such as an unused special token, is refused when encoded)."""
    from tokenizers import Tokenizer as HFTokenizer
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise EdgekvError(f"{printable(path)}: cannot read the tokenizer ({e.strerror or e})") from None
    with _tokenizer_calls(path, "be read"):
        try:
            tok = HFTokenizer.from_buffer(data)
        except Exception as e:  # tokenizers raises its own Exception for a malformed file
            raise EdgekvError(f"{printable(path)}: not a tokenizer the tokenizers library can read "
                              f"({type(e).__name__}: {one_line(e, 200)})") from None
        top = max(tok.get_vocab(with_added_tokens=False).values(), default=-1)
    if vocab is not None and top >= vocab:
        raise EdgekvError(f"{printable(path)}: the tokenizer's vocabulary reaches id {top:,}, past the model's "
                          f"{vocab:,} tokens (ids 0 to {vocab - 1:,}): the tokenizer does not belong to this model")
    return Tokenizer(tok, Path(path), vocab)


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
    check_ids(ids, int(manifest["model"]["vocab"]), "the prompt (with the manifest's special tokens)")
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
