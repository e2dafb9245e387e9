"""manifest.json: what an app (and `edgekv run`) reads to run an export, validated against manifest.schema.json.

Pure Python + jsonschema: no torch. Loading an export checks the sha256 of every file the manifest lists, so a
corrupted or swapped artifact fails in one line before any runtime touches it.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import EdgekvError
from ..jsonfile import read_json

SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")
MANIFEST = "manifest.json"


def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate(manifest: dict, where: str = MANIFEST) -> None:
    try:
        import jsonschema
    except ImportError:
        raise EdgekvError("validating a manifest needs jsonschema (pip install jsonschema)") from None
    try:
        jsonschema.validate(manifest, schema())
    except jsonschema.ValidationError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise EdgekvError(f"{where}: does not follow manifest.schema.json at {path}: {e.message}") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_table(folder: Path) -> dict:
    """{relative name: {sha256, bytes}} for every file in folder except the manifest."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(folder).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


ROWS, ROWS_AXIS = "rows", "rows"  # the input naming the logits rows a call returns, and its dynamic axis


def tensor_spec(name: str, dtype: str, shape) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape)}


def entry_point(name: str, tokens, layout, vocab: int, tail: str | None = None, max_tokens: int | None = None
                ) -> dict:
    """The inputs and outputs of one entry point: tokens, pos, the state (StateLayout order), then `rows`; and
    logits, the state back. tokens: an int (fixed) or the name of a dynamic axis, which takes 1..max_tokens tokens
    per call (max_tokens: written when it is less than max_ctx, as for the .pte `forward` method).
    rows: int64 [R], the indices (into this call's tokens, 1 <= R <= tokens) of the rows whose logits come back as
    logits [1, R, V]: the last one to generate or prefill, all of them to verify (edgekv.models.head). A one-token
    entry point takes [1] (rows = [0]); any other a dynamic axis ROWS_AXIS.
    tail (fixed-size prefill only): how a last chunk shorter than `tokens` runs: "pad" (pad it with token 0: the
    padded slots stay masked) or "decode" (token by token through `decode`: a recurrent state must not see padding)."""
    state = layout.tensors
    extra = {"tail": tail} if tail else {}
    if max_tokens:
        extra["max_tokens"] = max_tokens
    rows = 1 if tokens == 1 else ROWS_AXIS
    return {"name": name, "tokens": tokens, **extra,
            "inputs": [tensor_spec("tokens", "int64", [1, tokens]), tensor_spec("pos", "int64", [1])]
            + [tensor_spec(t.name, t.dtype, t.shape) for t in state] + [tensor_spec(ROWS, "int64", [rows])],
            "outputs": [tensor_spec("logits", "float32", [1, rows, vocab])]
            + [tensor_spec(t.output, t.dtype, t.shape) for t in state]}


def write_manifest(folder: Path, manifest: dict) -> None:
    validate(manifest, str(folder / MANIFEST))
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def load_export(folder: str | Path, check_hashes: bool = True) -> dict:
    """Read and validate folder/manifest.json; with check_hashes, every listed file must exist with its sha256."""
    d = Path(folder)
    mp = d / MANIFEST
    if not mp.is_file():
        raise EdgekvError(f"{d}: no {MANIFEST} there (not an edgekv export?)")
    manifest = read_json(mp)
    validate(manifest, str(mp))
    if check_hashes:
        for name, want in manifest["files"].items():
            p = d / name
            if not p.is_file():
                raise EdgekvError(f"{p}: listed in the manifest but missing")
            if p.stat().st_size != want["bytes"] or sha256_file(p) != want["sha256"]:
                raise EdgekvError(f"{p}: sha256 does not match the manifest (changed or corrupted since export; "
                                  "export again)")
    return manifest
