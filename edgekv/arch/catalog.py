"""The built-in catalog (edgekv/catalog/*.json: a published config.json per model) and load_arch, which reads any
model spec: a catalog name, an HF folder, a config.json or a .gguf."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from ..errors import EdgekvError
from .gguf import read_gguf
from .readers import arch_from_config, read_config_json
from .types import Arch


CATALOG_DIR = Path(__file__).resolve().parent.parent / "catalog"


def catalog_names() -> list[str]:
    return sorted(p.stem for p in CATALOG_DIR.glob("*.json"))


def catalog_entry(name: str) -> dict:
    p = CATALOG_DIR / f"{name.lower()}.json"
    if not p.is_file() and ("/" in name or "\\" in name or name.lower().endswith((".json", ".gguf"))):
        hint = _suggest(name)  # an HF repo id the catalog holds the shape of: Qwen/Qwen2.5-0.5B -> qwen2.5-0.5b
        raise EdgekvError(f"{name}: no such file or folder (a model is a catalog name, a config.json, an HF model "
                          "folder or a .gguf file, on this machine: nothing is downloaded; "
                          + (f"the catalog has a model's shape: {hint})" if hint else "`edgekv models` lists the catalog)"))
    if not p.is_file():
        hint = _suggest(name)
        raise EdgekvError(f"unknown model {name!r}; " + (f"{hint} (" if hint else "") + "`edgekv models` lists the "
                          "catalog" + ("; or" if hint else " (or") + " pass a config.json, an HF model folder or a "
                          ".gguf file)")
    return json.loads(p.read_text())


def _suggest(name: str) -> str:
    """'did you mean NAME?' for a catalog name typed loosely or an HF repo id (whole, or its last part) the catalog
    holds, else ''."""
    from ..names import suggestion
    aliases = {}
    for n in catalog_names():
        repo = json.loads((CATALOG_DIR / f"{n}.json").read_text()).get("hf_repo") or ""
        if repo:
            aliases[repo] = n
            aliases.setdefault(repo.rsplit("/", 1)[-1], n)
    return suggestion(name, catalog_names(), aliases)


@functools.lru_cache(maxsize=None)
def catalog_arch(name: str) -> Arch:
    """Cached: catalog Archs are built once per process and must not be mutated."""
    e = catalog_entry(name)
    a = arch_from_config(e["config"], e["name"], e.get("config_source", str(CATALOG_DIR / f"{name}.json")))
    if e.get("trained_ctx"):  # the catalog's cited training length overrides what the config implies
        a.trained_ctx = (int(e["trained_ctx"]["value"]), e["trained_ctx"]["source"])
    a.notes.append(f"catalog: {e.get('display_name', e['name'])} ({e.get('hf_repo', '')})")
    return a


def load_arch(spec: str) -> Arch:
    """A catalog name, an HF model folder, a config.json, or a .gguf file."""
    p = Path(spec)
    if p.suffix.lower() == ".gguf":
        return read_gguf(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").is_file() and ggufs:
            return read_gguf(ggufs[0])
        return read_config_json(p)
    if p.suffix.lower() == ".json" or p.exists():
        return read_config_json(p)
    return catalog_arch(spec)
