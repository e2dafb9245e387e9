"""`edgekv run --save-state FILE` / `--resume FILE`: an explicit-state export's state, kept between runs.

The file is a safetensors file (https://github.com/huggingface/safetensors, format: 8-byte little-endian header
length N, N bytes of JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}},
then the tensors' bytes, contiguous in header order), so any safetensors reader opens it. It holds:
- every state tensor under its manifest input name (past_key_values.{i}.key, ...scale, past_ssm.{i}, ...), in the
  manifest's dtype and shape;
- "edgekv.tokens": int64 [position], the token ids the state has consumed;
- metadata: format "edgekv-state", format_version, the model's name and parameter count, the strategy label, the
  runtime, the artifact's files with their sha256 (from the manifest's file table: the weights are in them), max_ctx,
  position, and pending (the last generated token, not yet fed to the model; -1 when none), plus the tensors'
  dtypes and shapes.

Reading trusts nothing in the file: the header's declared length is bounded by the file size and MAX_HEADER before
it is read, every tensor's name, dtype, shape and byte range must be the manifest's (so every size read comes from
the manifest, not the file), the byte ranges must tile the data exactly, and the bytes are read straight into the
stepper's own state buffers. Writing goes to a temporary file in the same folder, then os.replace (outputs.write_atomic):
a crash leaves either the old file or the new one, and the next save removes the temporary a killed one left. The
output rule of every edgekv output holds (outputs.check_writable, checked before the run and again before the
rename): an existing FILE is replaced only with --force and only if edgekv wrote it; a FIFO or device is refused
without being opened for reading.
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from .stepper import NP_DTYPES, entry

FORMAT = "edgekv-state"
FORMAT_VERSION = 1
TOKENS = "edgekv.tokens"
MAX_HEADER = 16 * 2**20  # 16 MiB: a state of thousands of tensors has a header of a few hundred KiB
# safetensors' dtype codes (safetensors/src/tensor.rs Dtype) for the dtypes a state holds
ST_DTYPES = {"float32": "F32", "float16": "F16", "int64": "I64", "int8": "I8", "uint8": "U8"}
RUNTIME_FORMAT = {"ort": "onnx", "executorch": "pte"}


def binding(manifest: dict, runtime: str) -> dict:
    """What a state file must agree on with the export and runtime that read it (metadata strings)."""
    fmt = RUNTIME_FORMAT.get(runtime)
    if fmt is None:
        raise EdgekvError(f"--save-state / --resume need a runtime whose state is explicit I/O (ort, executorch); "
                          f"{runtime} keeps its state inside")
    a = entry(manifest, fmt)
    files = [a["file"]] + ([a["external_data"]] if a.get("external_data") else [])
    table = manifest.get("files") or {}
    sha = {f: (table.get(f) or {}).get("sha256") for f in files}
    return {"format": FORMAT, "format_version": str(FORMAT_VERSION), "model": manifest["model"]["name"],
            "model_params": str(manifest["model"].get("n_params")), "strategy": manifest["strategy"]["label"],
            "runtime": runtime, "artifact_sha256": json.dumps(sha, sort_keys=True),
            "max_ctx": str(int(manifest["max_ctx"]))}


def expected(manifest: dict) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of each state tensor, in the manifest's order."""
    out = []
    for t in manifest["state"]["tensors"]:
        if t["dtype"] not in ST_DTYPES:
            raise EdgekvError(f"state tensor {t['input']} is {t['dtype']}: a state file holds "
                              f"{', '.join(ST_DTYPES)}")
        out.append((t["input"], t["dtype"], [int(d) for d in t["shape"]]))
    return out


def _nbytes(dtype: str, shape: list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(NP_DTYPES[dtype]).itemsize


def _read_header(path: Path) -> tuple[dict, int, int]:
    """(header, data start, file size), with the declared header length checked before it is read."""
    from ..outputs import open_regular

    f = open_regular(path, follow=True)  # a FIFO or device is refused before it is opened for reading
    try:
        size = os.fstat(f.fileno()).st_size
        with f:
            head = f.read(8)
            if len(head) < 8:
                raise EdgekvError(f"{path}: not an edgekv state file (too short: {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > MAX_HEADER or 8 + n > size:
                raise EdgekvError(f"{path}: not an edgekv state file (header length {n} is outside 2..{MAX_HEADER} "
                                  f"or past the end of the {size}-byte file)")
            raw = f.read(n)
    except OSError as e:
        raise EdgekvError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise EdgekvError(f"{path}: not an edgekv state file (its header is not JSON)") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict) \
            or header["__metadata__"].get("format") != FORMAT:
        raise EdgekvError(f"{path}: not an edgekv state file (no {FORMAT!r} format in its metadata)")
    return header, 8 + n, size


def is_state_file(path: Path) -> bool:
    try:
        _read_header(path)
        return True
    except EdgekvError:
        return False


def save(path: str | Path, manifest: dict, stepper, position: int, tokens: list[int], pending: int,
         force: bool = False) -> int:
    """Write the stepper's state atomically; returns the bytes written. force: --force (replace an existing file
    edgekv wrote)."""
    from ..outputs import check_writable, write_atomic

    path = check_writable(path, "--save-state", force=force)
    specs = expected(manifest)
    arrays = stepper.state_arrays()
    if len(arrays) != len(specs) or len(tokens) != position:
        raise EdgekvError(f"internal: {len(arrays)} state tensors for {len(specs)} in the manifest, "
                          f"{len(tokens)} tokens at position {position}")
    meta = {**binding(manifest, stepper.runtime), "position": str(int(position)), "pending": str(int(pending)),
            "tensors": json.dumps([[n, d, s] for n, d, s in specs])}
    header, parts, at = {"__metadata__": meta}, [], 0
    tok = np.asarray(tokens, dtype=np.int64)
    for (name, dtype, shape), a in [*zip(specs, arrays), ((TOKENS, "int64", [position]), tok)]:
        a = np.ascontiguousarray(a)
        if a.dtype != np.dtype(NP_DTYPES[dtype]) or list(a.shape) != shape:
            raise EdgekvError(f"internal: state tensor {name} is {a.dtype} {list(a.shape)}, the manifest says "
                              f"{dtype} {shape}")
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": shape, "data_offsets": [at, at + a.nbytes]}
        parts.append(a)
        at += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header with spaces to 8-byte alignment

    def writer(tmp):
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for a in parts:
                f.write(memoryview(a).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    write_atomic(path, writer=writer, option="--save-state", force=force)
    return 8 + len(raw) + at


def _int(meta: dict, key: str, path: Path) -> int:
    v = meta.get(key)
    # ASCII digits only: str.isdigit() is also true of '²', which int() refuses
    if not isinstance(v, str) or not re.fullmatch(r"-?[0-9]{1,19}", v):
        raise EdgekvError(f"{path}: damaged state file ({key} is {v!r}, not an integer)")
    return int(v)


def load(path: str | Path, manifest: dict, stepper) -> dict:
    """Check the file against the manifest and the stepper's runtime, then read its state into the stepper.
    Returns {"position", "tokens", "pending"}."""
    from ..outputs import path_text

    path = Path(path)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise EdgekvError(f"--resume {path_text(path)}: no such file") from None
    except OSError as e:  # a name too long for the file system (ENAMETOOLONG), a folder that cannot be searched
        raise EdgekvError(f"--resume {path_text(path)}: {e.strerror or e}") from None
    if not path.is_file():
        raise EdgekvError(f"--resume {path_text(path)}: not a plain file")
    header, start, size = _read_header(path)
    meta = header["__metadata__"]
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise EdgekvError(f"{path}: state file format version {meta.get('format_version')!r}; this edgekv reads "
                          f"{FORMAT_VERSION}")
    want = binding(manifest, stepper.runtime)
    for key in ("model", "model_params", "strategy", "runtime", "max_ctx", "artifact_sha256"):
        if meta.get(key) != want[key]:
            what = "artifact sha256" if key == "artifact_sha256" else key
            raise EdgekvError(f"{path}: saved for another export or runtime ({what} {meta.get(key)!r}, this one "
                              f"{want[key]!r})")
    max_ctx = int(manifest["max_ctx"])
    position, pending = _int(meta, "position", path), _int(meta, "pending", path)
    if not 0 < position < max_ctx:
        raise EdgekvError(f"{path}: position {position} is outside 1..{max_ctx - 1} (max_ctx {max_ctx})")
    vocab = int(manifest["model"]["vocab"])
    if not -1 <= pending < vocab:
        raise EdgekvError(f"{path}: damaged state file (pending token {pending} outside the vocabulary)")
    specs = expected(manifest) + [(TOKENS, "int64", [position])]
    names = {k for k in header if k != "__metadata__"}
    if names != {n for n, _, _ in specs}:
        extra, missing = sorted(names - {n for n, _, _ in specs}), sorted({n for n, _, _ in specs} - names)
        raise EdgekvError(f"{path}: its tensors are not this export's state (extra: {', '.join(extra[:4]) or '-'}; "
                          f"missing: {', '.join(missing[:4]) or '-'})")
    at = 0
    for name, dtype, shape in specs:  # the manifest's order, which save writes: the ranges must tile the data
        h = header[name]
        n = _nbytes(dtype, shape)
        if not isinstance(h, dict) or h.get("dtype") != ST_DTYPES[dtype] or h.get("shape") != shape \
                or h.get("data_offsets") != [at, at + n]:
            raise EdgekvError(f"{path}: tensor {name} is {h.get('dtype') if isinstance(h, dict) else h} "
                              f"{h.get('shape') if isinstance(h, dict) else ''} at {h.get('data_offsets') if isinstance(h, dict) else ''}; "
                              f"this export's state has {ST_DTYPES[dtype]} {shape} at {[at, at + n]}")
        at += n
    if start + at != size:
        raise EdgekvError(f"{path}: truncated or damaged ({size} bytes; its header describes {start + at})")
    targets = stepper.state_arrays()
    tokens = np.empty(position, dtype=np.int64)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            for (name, _, _), dst in zip(specs, [*targets, tokens]):
                view = memoryview(dst).cast("B")
                if f.readinto(view) != len(view):
                    raise EdgekvError(f"{path}: truncated while reading {name}")
                if dst.dtype.kind == "f" and not np.isfinite(dst).all():
                    raise EdgekvError(f"{path}: damaged state file ({name} holds NaN or infinity)")
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise EdgekvError(f"{path}: damaged state file (a token id outside the vocabulary 0..{vocab - 1})")
    except BaseException:
        stepper.reset()  # no half-read state is left in the stepper
        raise
    return {"position": position, "tokens": tokens.tolist(), "pending": pending}
