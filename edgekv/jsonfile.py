"""JSON a user hands us or edgekv writes: read with one clear line on failure (config.json, manifest.json, a
safetensors index, a profile report), written without NaN or Infinity. Where outputs may be written: outputs.py.

Limits on JSON a user hands us: a config or a manifest is a few hundred KB (SmolLM2's manifest: 10 KB; a
tokenizer.json is not read here); MAX_JSON_BYTES leaves room for 1000x that, and Python's parser recurses once per
nesting level, so MAX_DEPTH levels (no edgekv file has more than 8) are checked before parsing.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path

from .errors import EdgekvError

MAX_JSON_BYTES = 256 * 2**20  # 256 MiB
MAX_DEPTH = 64


def _depth(text: str) -> int:
    """The deepest nesting of [ and { outside strings."""
    depth = most = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            most = max(most, depth)
        elif ch in "]}":
            depth -= 1
    return most


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_json(path: str | Path, what: str = "", nonfinite: bool = False):
    """The parsed JSON of path; files beyond MAX_JSON_BYTES or MAX_DEPTH levels of nesting are refused, and so are
    NaN / Infinity (not JSON) unless nonfinite (manifests of earlier edgekv versions carry a Mamba's dt_limit as
    Infinity). what: how to name the file in errors (default: its path). A model's config.json is read with
    read_config, which takes them."""
    p = Path(path)
    name = what or str(p)
    try:
        with open(p, "rb") as f:  # one read, bounded: a pipe (/dev/stdin) has no size to check first
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise EdgekvError(f"{name}: larger than any edgekv JSON file ({MAX_JSON_BYTES:,} bytes at most)")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EdgekvError(f"{name}: cannot read it ({type(e).__name__}: {e})") from None
    return _parse(text, name, nonfinite)


def _parse(text: str, name: str, nonfinite: bool = False):
    """read_json's parse of text, with the same limits (MAX_DEPTH, no NaN / Infinity unless nonfinite)."""
    if "[" in text or "{" in text:
        d = _depth(text)
        if d > MAX_DEPTH:
            raise EdgekvError(f"{name}: JSON nested {d} levels deep (at most {MAX_DEPTH})")
    try:
        return json.loads(text) if nonfinite else json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise EdgekvError(f"{name}: not valid JSON ({type(e).__name__}: {e})") from None


def read_config(path: str | Path, what: str = ""):
    """A model's config.json as transformers reads it: Python's json module, which takes the bare NaN / Infinity /
    -Infinity that transformers writes for a non-finite float (Mamba-2's time_step_limit [0.0, Infinity] in
    mistralai/Mamba-Codestral-7B-v0.1). Only files edgekv writes itself are read strictly (read_json). A non-finite
    size is still refused where it is read (arch.config.Cfg.int)."""
    return read_json(path, what, nonfinite=True)


STABLE_S = 2  # a file changed this recently is read afresh: its time may not move within one clock tick


def parsed(path: str | Path):
    """json.loads of a file edgekv ships and reads on every plan row (edgekv/measurements/), parsed once per process
    while its modification time, size and inode stay the same; one changed in the last STABLE_S seconds is parsed
    each time. The result is shared between callers: read it, never change it. Raises what reading and json.loads
    raise (OSError, ValueError)."""
    st = os.stat(path)
    if time.time_ns() - st.st_mtime_ns < STABLE_S * 1e9:
        return json.loads(Path(path).read_text())
    return _parsed(str(path), st.st_mtime_ns, st.st_size, st.st_ino)


@functools.lru_cache(maxsize=128)
def _parsed(path: str, mtime_ns: int, size: int, inode: int):
    return json.loads(Path(path).read_text())


def dumps(obj, indent: int | None = 2) -> str:
    """JSON text of obj; NaN and infinities are not JSON, so they are refused (ValueError) rather than printed."""
    return json.dumps(obj, indent=indent, allow_nan=False)


def nonfinite_to_null(obj):
    """obj with every NaN / infinite float replaced by None: a number that does not exist (e.g. $ per token when no
    user fits) is null in edgekv's JSON output, never NaN or Infinity, which are not JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: nonfinite_to_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nonfinite_to_null(v) for v in obj]
    return obj


def output_json(obj, indent: int | None = 2, default=None) -> str:
    """What `--json` prints and `--out` writes: strict JSON, non-finite numbers as null."""
    return json.dumps(nonfinite_to_null(obj), indent=indent, allow_nan=False, default=default)


def encode_nonfinite(obj):
    """obj with every NaN / infinite float written as transformers writes them into config.json,
    {"__float__": "Infinity"}, so that the text is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj).replace("inf", "Infinity").replace("nan", "NaN")}
    if isinstance(obj, dict):
        return {k: encode_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_nonfinite(v) for v in obj]
    return obj


def finite(obj) -> bool:
    """Does obj (nested dicts / lists) hold only finite floats?"""
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(finite(v) for v in obj)
    return True
