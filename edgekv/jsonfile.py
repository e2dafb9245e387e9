"""Files a user hands us or asks for: read JSON with one clear line on failure (config.json, manifest.json, a
safetensors index, a profile report), check an output path before the work starts, and write it atomically.

Limits on JSON a user hands us: a config or a manifest is a few hundred KB (SmolLM2's manifest: 10 KB; a
tokenizer.json is not read here); MAX_JSON_BYTES leaves room for 1000x that, and Python's parser recurses once per
nesting level, so MAX_DEPTH levels (no edgekv file has more than 8) are checked before parsing.
"""
from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import time
from pathlib import Path

from .errors import EdgekvError

MAX_JSON_BYTES = 256 * 2**20  # 256 MiB
MAX_DEPTH = 64
PLOT_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg")  # what matplotlib writes, by the name's suffix


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


def check_writable(path: str | Path, option: str, suffixes: tuple[str, ...] | None = None) -> Path:
    """Before any work starts: can a file be written at path (its folder exists and is writable, it is not a
    folder, an existing file there is writable)? suffixes: the allowed name endings (e.g. PLOT_FORMATS).
    Raises one EdgekvError line naming the option; returns the Path."""
    p = Path(path)
    if suffixes is not None and p.suffix.lower() not in suffixes:
        raise EdgekvError(f"{option} {path}: the name must end in {', '.join(suffixes)} (it picks the format)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise EdgekvError(f"{option} {path}: folder {parent} does not exist")
    if p.is_dir():
        raise EdgekvError(f"{option} {path}: that is a folder; give a file name")
    try:  # a real file, removed at once: permission bits alone do not say it (root, read-only mounts, /proc)
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.probe-{os.getpid()}-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise EdgekvError(f"{option} {path}: cannot write in folder {parent} ({e.strerror or e})") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise EdgekvError(f"{option} {path}: the file exists and is not writable")
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from open(): 0666 less the umask (0644 under the usual 022)."""
    return 0o666 & ~_umask()


def write_atomic(path: str | Path, data: str | bytes, writer=None) -> Path:
    """Write data (or call writer(tmp_path)) to a hidden file of a fresh name beside path, then rename it into
    place: readers see the old file or the whole new one, never a part; nothing else beside it is touched. The file
    gets the mode open() would give it. Errors are one EdgekvError line."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.tmp-{os.getpid()}-", suffix=p.suffix, dir=parent)
    except OSError as e:
        raise EdgekvError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            if writer is None:
                f.write(data.encode() if isinstance(data, str) else data)
        if writer is not None:
            writer(tmp)
        os.chmod(tmp, file_mode())
        os.replace(tmp, p)
    except OSError as e:
        raise EdgekvError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return p
