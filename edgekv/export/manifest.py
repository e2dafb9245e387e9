"""manifest.json: what an app (and `edgekv run`) reads to run an export, validated against manifest.schema.json.

Pure Python + jsonschema (+ onnx for an ONNX artifact's graph): no torch. What loading an export guarantees before any runtime touches a file:
- every path the manifest names (`files`, artifacts[].file and .external_data, tokenizer.file) is a plain relative
  path that resolves inside the export folder (no `..`, no absolute path, no symlink leading out);
- every file a runtime opens (the artifact, its ONNX external data, the tokenizer) is listed in `files`, and (with
  check_hashes) every listed file exists with its size and sha256, so a corrupted, swapped or unlisted file fails in
  one line;
- the manifest agrees with itself: each entry point's state inputs / outputs are the state's tensors (name, dtype,
  shape), the state was laid out for max_ctx, and a cache's slots hold max_ctx tokens (a window's at most that);
- the ONNX graph's own external-data locations (read from model.onnx without its weights) are listed files too;
- what a runtime loads is what was hashed: the files it opens are copied into a private folder, hashed as they are
  copied, and loaded from there (private_copy), so a file swapped in the export folder after the check never runs.
The runtimes then check the manifest against the graph's own inputs and outputs (runtime.check_graph_io).
Nothing in an export folder is executed or unpickled: ONNX and .pte are data for their runtimes, JSON is parsed.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import EdgekvError
from ..jsonfile import dumps, encode_nonfinite, read_json

SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")
MANIFEST = "manifest.json"
PARTIAL = ".edgekv-partial"  # marks an export folder still being written (edgekv.export.pipeline); never listed


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
        if p.is_file() and p.name not in (MANIFEST, PARTIAL):
            out[p.relative_to(folder).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


ROWS, ROWS_AXIS = "rows", "rows"  # the input naming the logits rows a call returns, and its dynamic axis


def tensor_spec(name: str, dtype: str, shape) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape)}


def entry_point(name: str, tokens, layout, vocab: int, tail: str | None = None, max_tokens: int | None = None,
                one_row: bool = False) -> dict:
    """The inputs and outputs of one entry point: tokens, pos, the state (StateLayout order), then `rows`; and
    logits, the state back. tokens: an int (fixed) or the name of a dynamic axis, which takes 1..max_tokens tokens
    per call (max_tokens: written when it is less than max_ctx, as for the .pte `forward` method).
    rows: int64 [R], the indices (into this call's tokens, 1 <= R <= tokens) of the rows whose logits come back as
    logits [1, R, V]: the last one to generate or prefill, all of them to verify (edgekv.models.head). A one-token
    entry point takes [1] (rows = [0]); any other a dynamic axis ROWS_AXIS, or [1] where one_row (a call gives one
    row of logits, the one generation and a chunked prefill ask for: a memory-planned runtime (ExecuTorch) then
    holds one row of logits where it would hold max_tokens (Gemma-3-270M's 262,144-wide rows: 1 MiB, not 32);
    edgekv.export.stepper splits a call that wants every row into calls of one token).
    tail (fixed-size prefill only): how a last chunk shorter than `tokens` runs: "pad" (pad it with token 0: the
    padded slots stay masked) or "decode" (token by token through `decode`: a recurrent state must not see padding)."""
    state = layout.tensors
    extra = {"tail": tail} if tail else {}
    if max_tokens:
        extra["max_tokens"] = max_tokens
    rows = 1 if tokens == 1 or one_row else ROWS_AXIS
    return {"name": name, "tokens": tokens, **extra,
            "inputs": [tensor_spec("tokens", "int64", [1, tokens]), tensor_spec("pos", "int64", [1])]
            + [tensor_spec(t.name, t.dtype, t.shape) for t in state] + [tensor_spec(ROWS, "int64", [rows])],
            "outputs": [tensor_spec("logits", "float32", [1, rows, vocab])]
            + [tensor_spec(t.output, t.dtype, t.shape) for t in state]}


def write_manifest(folder: Path, manifest: dict) -> None:
    """folder/manifest.json, strict JSON (a non-finite float in the model's config, e.g. a Mamba's dt_limit, is
    written {"__float__": "Infinity"}, as transformers writes it into config.json)."""
    validate(manifest, str(folder / MANIFEST))
    (folder / MANIFEST).write_text(dumps(encode_nonfinite(manifest)) + "\n")


# files edgekv itself may write into an export folder after the export: `edgekv report`'s page (its default --out),
# `edgekv profile --adb`'s pulled report. --force may replace a folder holding these beside what `files` lists.
AFTERWARDS = ("report.html", "report.md", "report.android.json")
SLOT_ROLES = ("key", "value", "latent")  # state tensors with one row per cached token: [1, heads, slots, d], [1, slots, r]


def _full_cache(name) -> bool:
    """Whether the named strategy keeps a cache row for every position up to max_ctx (its class's full_cache)."""
    from ..strategies import REGISTRY
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    return bool(cls and cls.full_cache)


def member(folder: Path, name, what: str) -> Path:
    """folder/name for a path read from a manifest, refused unless it is a plain relative path (no `..`, not
    absolute, no backslash or NUL) that stays inside folder once symlinks are resolved."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise EdgekvError(f"{folder / MANIFEST}: {what} {name!r} is not a file name")
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts or name.startswith("/"):
        raise EdgekvError(f"{folder / MANIFEST}: {what} {name!r} points outside the export folder")
    p = folder / name
    try:
        inside = p.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise EdgekvError(f"{p}: cannot resolve it ({type(e).__name__}: {e})") from None
    if not inside:
        raise EdgekvError(f"{p}: a symlink leading outside the export folder")
    return p


def opened_files(manifest: dict) -> list[tuple[str, str]]:
    """(what, relative path) of every file a runtime opens: the artifacts, their ONNX external data, the tokenizer."""
    out = []
    for a in manifest["artifacts"]:
        out.append((f"artifacts[{a['format']}].file", a["file"]))
        if a.get("external_data"):
            out.append((f"artifacts[{a['format']}].external_data", a["external_data"]))
        for name in a.get("runner_files", []):  # genai_config.json, tokenizer_config.json: what a runner opens
            out.append((f"artifacts[{a['format']}].runner_files", name))
    tok = manifest.get("tokenizer")
    if tok and tok.get("file"):
        out.append(("tokenizer.file", tok["file"]))
    return out


def check_consistent(manifest: dict, where: str) -> None:
    """The manifest against itself: every entry point's state inputs/outputs are the state's tensors, the state was
    laid out for max_ctx, and a cache holds max_ctx slots (a window at most that)."""
    max_ctx = manifest["max_ctx"]
    state = manifest["state"]
    if state.get("ctx") is not None and state["ctx"] != max_ctx:
        raise EdgekvError(f"{where}: state laid out for {state['ctx']} tokens but max_ctx is {max_ctx}")
    tensors = state["tensors"]
    n = len(tensors)
    for a in manifest["artifacts"]:
        if a.get("state_location") == "mutable_buffers":  # the runner .pte: the state is the program's buffers
            continue
        for ep in a["entry_points"]:
            ins, outs = ep["inputs"][2:2 + n], ep["outputs"][1:1 + n]
            for t, i, o in zip(tensors, ins, outs):
                for side, spec, name in (("input", i, t["input"]), ("output", o, t["output"])):
                    if (spec["name"], spec["dtype"], spec["shape"]) != (name, t["dtype"], t["shape"]):
                        raise EdgekvError(f"{where}: {a['format']} {ep['name']} {side} {spec['name']} "
                                          f"{spec['dtype']}{spec['shape']} is not the state's {name} "
                                          f"{t['dtype']}{t['shape']}")
            if len(ins) != n or len(outs) != n:
                raise EdgekvError(f"{where}: {a['format']} {ep['name']} does not carry the state's {n} tensors")
    slots = [t["shape"][1 if t["role"].startswith("latent") else 2] for t in tensors
             if t["role"].split(".")[0] in SLOT_ROLES and len(t["shape"]) >= 3]
    if slots and max(slots) > max_ctx:
        raise EdgekvError(f"{where}: a cache of {max(slots)} slots is larger than max_ctx {max_ctx}")
    # a full cache keeps every position, but a native sliding-window layer only its W (Phi-3-mini: every layer)
    windows = ((manifest.get("model") or {}).get("config") or {}).get("windows") or [None]
    full = max(min(w, max_ctx) if w else max_ctx for w in windows)
    if slots and _full_cache(manifest["strategy"]["name"]) and max(slots) != full:
        raise EdgekvError(f"{where}: max_ctx is {max_ctx} but the cache holds {max(slots)} tokens")


def owned_export(folder: Path) -> str | None:
    """None when folder is an edgekv export and holds nothing else (its manifest, the files it lists, and what
    edgekv writes there afterwards: AFTERWARDS); else why not, in words. What `export --force` may replace."""
    if folder.is_symlink() or not folder.is_dir():
        return "it is not a folder"
    mp = folder / MANIFEST
    if not mp.is_file():
        return f"it has no {MANIFEST}"
    try:
        m = read_json(mp, nonfinite=True)
    except EdgekvError as e:
        return str(e)
    if not (isinstance(m, dict) and "edgekv_version" in m and isinstance(m.get("files"), dict)):
        return f"its {MANIFEST} was not written by edgekv"
    known = {MANIFEST, *AFTERWARDS, *m["files"]}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_dir() and not p.is_symlink() and any(k.startswith(rel + "/") for k in known):
            continue
        if rel not in known:
            return f"it holds {rel}, which edgekv did not write"
    return None


def onnx_external_files(path: Path) -> list[str]:
    """Every external-data file an ONNX model names (the `location` of its external tensors: initializers and
    attribute tensors, subgraphs included), read from the graph without loading any weights."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    found = []

    def tensors(g):
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    yield from tensors(sub)

    for t in tensors(model.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc not in found:
                found.append(loc)
    return found


def check_onnx_external(manifest: dict, folder: Path, graph_file: str) -> None:
    """The files ONNX Runtime will open for this graph's external data: each must be listed in the manifest's
    `files` (so hashed) and lie inside the folder (manifest.member). One EdgekvError line otherwise."""
    where = folder / graph_file
    try:
        names = onnx_external_files(where)
    except ImportError:
        raise EdgekvError("loading an ONNX export needs onnx: pip install 'edgekv[runtime]'") from None
    except Exception as e:  # onnx raises DecodeError and others on a damaged file
        raise EdgekvError(f"{where}: not a readable ONNX model ({type(e).__name__}: {e})") from None
    for name in names:
        member(folder, name, f"{graph_file}'s external data")
        if name not in manifest["files"]:
            raise EdgekvError(f"{where}: its external data {name} is not listed in the manifest's `files`; refusing "
                              "to load a file the manifest does not vouch for")


def utf8_path(d: Path, what: str = "") -> None:
    """ONNX Runtime, ExecuTorch and the tokenizers library take a file's path as UTF-8 text: a path whose name holds
    other bytes (b'\\xff') cannot be opened by them, which is said here instead of as the first library's failure."""
    try:
        str(Path(d).resolve()).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(str(d)).decode("utf-8", "backslashreplace")
        raise EdgekvError(f"{what + ' ' if what else ''}{shown}: the path is not valid UTF-8, and the runtimes open "
                          f"files by UTF-8 path; rename it") from None


def check_files(folder: Path, manifest: dict, skip=()) -> None:
    """Every listed file but `skip` (files the caller hashes as it copies them: private_copy) exists with its size and
    sha256; one EdgekvError line otherwise."""
    for name, want in manifest["files"].items():
        if name in skip:
            continue
        p = folder / name
        if not p.is_file():
            raise EdgekvError(f"{p}: listed in the manifest but missing")
        if p.stat().st_size != want["bytes"] or sha256_file(p) != want["sha256"]:
            raise EdgekvError(f"{p}: sha256 does not match the manifest (changed or corrupted since export; "
                              "export again)")


def load_export(folder: str | Path, check_hashes: bool = True, copied_for: str | None = None) -> dict:
    """Read and validate folder/manifest.json (schema, paths inside the folder, every opened file listed, the
    manifest consistent with itself); with check_hashes, every listed file must exist with its size and sha256.
    copied_for: a runtime whose files (loaded_files) the caller hashes as it copies them (private_copy): those are
    not read twice."""
    d = Path(folder)
    mp = d / MANIFEST
    if not mp.is_file():
        raise EdgekvError(f"{d}: no {MANIFEST} there (not an edgekv export?)")
    utf8_path(d)
    manifest = read_json(mp, nonfinite=True)
    validate(manifest, str(mp))
    files = manifest["files"]
    for name in files:
        member(d, name, "file")
    for what, name in opened_files(manifest):
        member(d, name, what)
        if name not in files:
            raise EdgekvError(f"{mp}: {what} {name} is not listed in `files` with its sha256; refusing to load a "
                              "file the manifest does not vouch for (export again)")
    check_consistent(manifest, str(mp))
    if check_hashes:
        check_files(d, manifest, set(loaded_files(manifest, copied_for)) if copied_for else ())
    for a in manifest["artifacts"]:
        if a["format"] == "onnx" and (d / a["file"]).is_file():
            # here, not in OrtStepper: a profile child reads the manifest before its memory baseline, so the onnx
            # import and the graph's parse are not counted as the model's memory
            check_onnx_external(manifest, d, a["file"])
    return manifest


# --runtime -> the artifact format it loads
RUNTIME_FORMATS = {"ort": "onnx", "executorch": "pte", "genai": "onnx", "executorch-runner": "pte"}


def loaded_files(manifest: dict, runtime: str) -> list[str]:
    """The listed files `runtime` opens: every artifact of its format (the file, its ONNX external data, the runner
    files: GenAI's genai_config.json and tokenizer_config.json) and the tokenizer."""
    fmt = RUNTIME_FORMATS.get(runtime, runtime)
    names = []
    for a in manifest["artifacts"]:
        if a["format"] == fmt:
            names += [a["file"], *([a["external_data"]] if a.get("external_data") else []), *a.get("runner_files", [])]
    tok = manifest.get("tokenizer")
    if tok and tok.get("file"):
        names.append(tok["file"])
    return [n for n in dict.fromkeys(names) if n in manifest["files"]]


def copy_checked(src: Path, dst: Path, want: dict) -> None:
    """Copy src to a new file dst (mode 0600), hashing the bytes as they are copied: dst holds exactly the bytes the
    manifest's size and sha256 vouch for, else one EdgekvError line (and no dst). src must be a regular file (a FIFO
    or a device swapped in is refused, not read); at most the listed size plus one byte is read."""
    import os
    import stat
    size = int(want["bytes"])
    try:
        fd = os.open(src, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens at once, to be refused
    except FileNotFoundError:
        raise EdgekvError(f"{src}: listed in the manifest but missing") from None
    except OSError as e:
        raise EdgekvError(f"{src}: cannot read it ({e.strerror})") from None
    h = hashlib.sha256()
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise EdgekvError(f"{src}: not a regular file")
        with open(dst, "xb") as out, os.fdopen(fd, "rb", closefd=False) as f:
            os.chmod(dst, 0o600)
            left = size + 1
            while left > 0:
                block = f.read(min(1 << 20, left))
                if not block:
                    break
                left -= len(block)
                h.update(block)
                out.write(block)
        if left != 1 or h.hexdigest() != want["sha256"]:
            dst.unlink()
            raise EdgekvError(f"{src}: sha256 does not match the manifest (changed or corrupted since export; "
                              "export again)")
    finally:
        os.close(fd)


def in_memory(path: str | Path) -> bool:
    """Whether path lies on a file system held in RAM (tmpfs, ramfs: /proc/self/mounts on Linux; elsewhere False)."""
    import os
    try:
        real = os.path.realpath(path)
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    best, kind = "", ""
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind in ("tmpfs", "ramfs")


def copy_folder() -> str | None:
    """Where private_copy makes its folder: the system's temporary folder ($TMPDIR), unless that is held in RAM (a
    tmpfs /tmp), where a copy of the weights would take memory the runtime's own mapping of them does not: then the
    user's cache folder ($XDG_CACHE_HOME or ~/.cache)/edgekv when that is on disk. None: tempfile's default."""
    import os
    import tempfile
    if not in_memory(tempfile.gettempdir()):
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgekv"
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return None if in_memory(cache) else str(cache)


COPY_PREFIX = "edgekv-load-"  # + host + "-" + pid + "-" + mkdtemp's random part


def _host() -> str:
    """This machine's name as it goes into a copy's folder name (letters, digits, '.', '_'; a home folder shared
    between machines holds copies of processes of several)."""
    import re
    import socket
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())[:64] or "host"


def clean_dead_copies(where: Path) -> list[Path]:
    """Remove the private copies (private_copy) in `where` that a killed edgekv left: a SIGKILL runs no cleanup. A
    folder goes only if all of these hold: its name is COPY_PREFIX + this host + "-" + a pid + "-" + a suffix, it
    is a directory (not a symlink) owned by this user, and that pid is not a living process. Anything else there
    is left alone. Returns what was removed."""
    import re
    import shutil

    from ..outputs import dead_process_entries

    pat = re.compile(rf"{re.escape(COPY_PREFIX + _host())}-(\d+)-[A-Za-z0-9_]+")
    removed = []
    for e in dead_process_entries(where, (pat,)):
        try:
            if not e.is_dir(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        removed.append(Path(e.path))
    return removed


class private_copy:
    """`with private_copy(folder, manifest, names) as d:` the named files (listed in `files`) copied into a new
    private folder d (mode 0700, in the system's temporary folder unless that is in RAM: copy_folder), each hashed as
    it is copied (copy_checked), with the manifest as read beside them. A runtime loads from d, so what it loads is what was
    hashed: a file renamed over, or rewritten in, the export folder after the check is never read. The folder is
    removed when the block ends, also on an error or SIGTERM (edgekv.children), and after a SIGKILL by the next
    copy made (clean_dead_copies); a runtime that maps a file it
    loaded keeps its copy's pages until it is closed. An EdgekvError from inside the block names the export folder,
    not the copy."""

    def __init__(self, folder: Path, manifest: dict, names):
        self.folder, self.manifest, self.names = Path(folder), manifest, list(names)
        self.path: Path | None = None

    def __enter__(self) -> Path:
        import tempfile
        where = copy_folder()
        clean_dead_copies(Path(where or tempfile.gettempdir()))
        # mode 0700: only this user reads or writes it
        self.path = Path(tempfile.mkdtemp(prefix=f"{COPY_PREFIX}{_host()}-{os.getpid()}-", dir=where))
        try:
            (self.path / MANIFEST).write_text(dumps(encode_nonfinite(self.manifest)) + "\n")
            for name in self.names:
                member(self.folder, name, "file")
                dst = self.path / name
                dst.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                copy_checked(self.folder / name, dst, self.manifest["files"][name])
            for a in self.manifest["artifacts"]:
                if a["format"] == "onnx" and a["file"] in self.names:  # the copy's graph names only listed files
                    check_onnx_external(self.manifest, self.path, a["file"])
        except BaseException as e:
            self.__exit__(type(e), e, None)
            raise
        return self.path

    def __exit__(self, kind, e, tb):
        import shutil
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if isinstance(e, EdgekvError) and self.path is not None and str(self.path) in str(e):
            raise EdgekvError(self.rename(str(e))) from None
        return False

    def rename(self, text: str) -> str:
        """text with the copy's folder named as the export folder."""
        return text.replace(str(self.path), str(self.folder)) if self.path is not None else text
