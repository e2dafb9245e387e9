"""A cache of lowered .pte programs between exports of one model: lowering (ExecuTorch's to_edge_transform_and_lower,
XNNPACK partitioning and preprocessing, to_executorch) is nearly all of a .pte export's time, and its result is a
function of the traced program alone. An export whose traced program, weights and lowering code are the same as an
earlier one's (the same model again with another --verify-steps or --out, a run that failed after lowering, a
benchmark re-run) copies that model.pte instead of lowering again.

The key is a sha256 over everything the lowered bytes depend on, so an entry is never stale: every node of every
traced method (op, target, arguments, the shape, dtype and strides of its value), the graph signatures and dynamic
ranges, the bytes of every weight and constant the programs hold (a quantized weight's inner tensors), the lowering's
own flags (in place, the ExecuTorch runner's metadata), the source of the lowering code (to_pte.py, et_runner.py),
and the versions of edgekv, torch, torchao and executorch. What the key cannot see changes the key anyway: a weight
whose layout it cannot read gives a key of its own every time (a miss, never a wrong hit). A hit is also checked
against the sha256 recorded when it was stored, and the export verifies the .pte against eager torch as always.

Where: $XDG_CACHE_HOME/edgekv/pte (default ~/.cache/edgekv/pte), one KEY.pte and its KEY.json per entry. Bounded:
EDGEKV_PTE_CACHE is the most it holds (e.g. 4GB; default DEFAULT_LIMIT), least recently used entries removed first
after each store; EDGEKV_PTE_CACHE=off (or 0) turns it off. Only files named like its entries are ever removed, and
the temporaries of its own stores whose process is gone.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

DEFAULT_LIMIT = 8 * 10**9
ENV = "EDGEKV_PTE_CACHE"
_ENTRY = re.compile(r"\A[0-9a-f]{64}\.(pte|json)\Z")
_TEMP = re.compile(r"\A\.[0-9a-f]{64}\.(pte|json)\.tmp-(\d+)\Z")  # a store's temporary (store), of process PID
_CODE = ("to_pte.py", "et_runner.py", "pte_cache.py")  # the lowering code (beside this file)


def folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgekv" / "pte"


def limit() -> int | None:
    """The cache's bound in bytes from EDGEKV_PTE_CACHE, or None when it is off. A value that is not a size is
    one clear line (EdgekvError)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT
    if text.lower() in ("0", "off", "no", "false", "none"):
        return None
    from ..errors import EdgekvError
    from ..units import parse_bytes
    try:
        n = parse_bytes(text)
    except (EdgekvError, ValueError):
        raise EdgekvError(f"{ENV}={text!r}: give a size such as 4GB, or off") from None
    return n if n > 0 else None


def _norm(a) -> str:
    """An fx argument as text that names its nodes and spells out any tensor's bytes (str() of a tensor elides)."""
    import torch
    if isinstance(a, torch.fx.Node):
        return f"%{a.name}"
    if isinstance(a, torch.Tensor):
        h = hashlib.sha256()
        _tensor(h, a)
        return f"tensor:{h.hexdigest()}"
    if isinstance(a, (list, tuple)):
        return type(a).__name__ + "(" + ",".join(_norm(x) for x in a) + ")"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k!r}:{_norm(v)}" for k, v in a.items()) + "}"
    return repr(a)


def _val(v) -> str:
    """A node's meta["val"]: a (fake) tensor's shape, dtype and strides; a symbolic or plain value as text."""
    import torch
    if isinstance(v, torch.Tensor):
        return f"T{tuple(v.shape)}:{v.dtype}:{tuple(v.stride()) if v.layout == torch.strided else v.layout}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_val(x) for x in v) + ")"
    return str(v)


def _tensor(h, t) -> None:
    """A weight's bytes into h: a plain tensor's storage in row order, a tensor subclass's (torchao's quantized
    weights) inner tensors and its flatten context."""
    import torch
    if isinstance(t, torch.nn.Parameter):
        t = t.data
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, ctx = t.__tensor_flatten__()
        h.update(f"{type(t).__module__}.{type(t).__qualname__}:{ctx!r}:{tuple(t.shape)}".encode())
        for n in names:
            _tensor(h, getattr(t, n))
        return
    t = t.detach().to("cpu").contiguous()
    h.update(f"{t.dtype}:{tuple(t.shape)}".encode())
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def program_key(eps: dict, **flags) -> str:
    """{method: ExportedProgram} and the lowering's flags (in_place, the runner's metadata) -> the entry's name."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__
    h = hashlib.sha256()

    def put(*parts):
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\0")
    put("edgekv .pte cache 1", __version__)
    for pkg in ("torch", "torchao", "executorch"):
        try:
            put(pkg, version(pkg))
        except PackageNotFoundError:
            put(pkg, None)
    here = Path(__file__).parent
    for name in _CODE:
        put(name, hashlib.sha256((here / name).read_bytes()).hexdigest())
    put(json.dumps(flags, sort_keys=True, default=str))
    for name in sorted(eps):
        ep = eps[name]
        put("method", name, ep.graph_signature, ep.range_constraints)
        for n in ep.graph.nodes:
            put(n.op, n.name, n.target, _norm(n.args), _norm(n.kwargs), _val(n.meta.get("val")))
        for kind, tensors in (("state", ep.state_dict), ("constant", ep.constants)):
            for k in sorted(tensors):
                put(kind, k)
                _tensor(h, tensors[k])
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch(key: str, dest: Path) -> dict | None:
    """The entry's info ({"delegation": ..., "sha256": ..., "bytes": ...}) with its .pte copied to dest (a new file in
    the export's own temporary folder), or None on a miss. An entry whose .pte is not the file it recorded is a
    miss (and dest is not left behind)."""
    if limit() is None:
        return None
    base = folder() / key
    try:
        info = json.loads((base.with_suffix(".json")).read_text())
        shutil.copyfile(base.with_suffix(".pte"), dest)
    except (OSError, ValueError):
        return None
    try:
        if not isinstance(info, dict) or _sha256(dest) != info.get("sha256"):
            dest.unlink()
            return None
        os.utime(base.with_suffix(".json"))  # least recently used: a hit counts as a use
    except OSError:
        return None
    return info


def store(key: str, pte: Path, info: dict) -> bool:
    """pte (the export's new model.pte) into the cache as KEY.pte (a hard link where the cache is on the same
    file system, else a copy) with info in KEY.json, both written atomically; then the least recently used
    entries past the limit are removed. False when the cache is off or cannot be written (the export goes on)."""
    from ..outputs import generator
    cap = limit()
    if cap is None or pte.stat().st_size > cap:
        return False
    d = folder()
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = d / f".{key}.pte.tmp-{os.getpid()}"
        try:
            os.link(pte, tmp)
        except OSError:
            shutil.copyfile(pte, tmp)
        os.replace(tmp, d / f"{key}.pte")
        doc = {"generator": generator(), "bytes": pte.stat().st_size, "sha256": _sha256(pte), **info}
        tmp = d / f".{key}.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, d / f"{key}.json")
    except OSError:
        return False
    evict(cap, keep=key)
    return True


def evict(cap: int, keep: str | None = None) -> list[str]:
    """Remove whole entries, least recently used first (their .json's mtime), until the cache holds at most cap
    bytes; keep is never removed. A .pte without its .json (a store that was killed) goes first. Returns the keys
    removed. Only files named like entries (64 hex digits + .pte / .json) are looked at."""
    d = folder()
    try:
        listed = list(d.iterdir())
    except OSError:
        return []
    for p in listed:  # temporaries of stores that were killed (their process is gone)
        m = _TEMP.match(p.name)
        if m and not _alive(int(m.group(2))):
            try:
                p.unlink()
            except OSError:
                pass
    names = [p for p in listed if _ENTRY.match(p.name) and p.is_file() and not p.is_symlink()]
    entries: dict[str, dict] = {}
    for p in names:
        e = entries.setdefault(p.stem, {"bytes": 0, "used": -1.0, "files": []})
        st = p.stat()
        e["bytes"] += st.st_size
        e["files"].append(p)
        if p.suffix == ".json":
            e["used"] = st.st_mtime
    total = sum(e["bytes"] for e in entries.values())
    removed = []
    for k, e in sorted(entries.items(), key=lambda kv: kv[1]["used"]):
        if total <= cap:
            break
        if k == keep:
            continue
        for p in e["files"]:
            try:
                p.unlink()
            except OSError:
                pass
        total -= e["bytes"]
        removed.append(k)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True
