"""Nothing outside the registries branches on a strategy's name or label, or on a family's name: code asks the
strategy object (edgekv.strategies) or the family entry (edgekv.models.FAMILIES). An AST scan of edgekv/ for a
comparison (==, !=, in, not in, startswith) between a registered strategy or family name and a strategy's or family's
name / label / spec."""
from __future__ import annotations

import ast
from pathlib import Path

from edgekv.arch.model_types import MODEL_TYPES as OTHER_TYPES
from edgekv.arch.variants import VARIANTS
from edgekv.models import FAMILIES
from edgekv.strategies import REGISTRY

PKG = Path(__file__).resolve().parent.parent / "edgekv"
REGISTRIES = {PKG / "strategies", PKG / "models" / "__init__.py"}  # where the names are defined and looked up
NAMES = set(REGISTRY) | {f.name for f in FAMILIES}
# what holds a strategy's or family's name: strategy.name, layout.strategy (its label), family.name, spec, label, ...
HOLDERS = {"name", "label", "strategy", "spec", "family", "short"}


def _holds_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in HOLDERS
    if isinstance(node, ast.Name):
        return node.id in HOLDERS or node.id.endswith(("_name", "_spec", "_label"))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("lower", "strip"):
        return _holds_name(node.func.value)
    return False


def _names_in(node: ast.AST) -> set[str]:
    """The registered names a string constant, or a tuple / list / set of them, spells (a prefix counts)."""
    consts = [node] if isinstance(node, ast.Constant) else getattr(node, "elts", [])
    out = set()
    for c in consts:
        if isinstance(c, ast.Constant) and isinstance(c.value, str):
            out |= {n for n in NAMES if c.value == n or c.value.split(":")[0] == n}
    return out


def branches_on_names(tree: ast.AST) -> list[tuple[int, str]]:
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_holds_name(s) for s in sides):
                found = set().union(*(_names_in(s) for s in sides))
                if found:
                    hits.append((node.lineno, ", ".join(sorted(found))))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
              and _holds_name(node.func.value) and node.args):
            found = _names_in(node.args[0])
            if found:
                hits.append((node.lineno, ", ".join(sorted(found))))
    return hits


def _outside_registries():
    for p in sorted(PKG.rglob("*.py")):
        if not any(p == r or r in p.parents for r in REGISTRIES):
            yield p


def test_no_module_outside_the_registries_compares_a_strategy_or_family_name():
    found = [f"{p.relative_to(PKG.parent)}:{line}: {names}" for p in _outside_registries()
             for line, names in branches_on_names(ast.parse(p.read_text()))]
    assert not found, "compare the strategy object's traits or the family entry instead:\n" + "\n".join(found)


def test_the_scan_sees_the_comparisons_it_forbids():
    src = """
if strategy.name == "kv-int8": pass
if layout.strategy.startswith("window"): pass
if s.label in ("kv", "mla"): pass
if family.name != "llama": pass
if m.kind == "ssm": pass
if w.cls == "linear": pass
"""
    assert [line for line, _ in branches_on_names(ast.parse(src))] == [2, 3, 4, 5]


# ---- model_type strings: declared in edgekv/arch/variants.py (the Llama-family variants) and
# edgekv/arch/model_types.py (every other family's) only ----

DECLARATIONS = {PKG / "arch" / "variants.py", PKG / "arch" / "model_types.py"}
MODEL_TYPES = set(VARIANTS) | set(OTHER_TYPES)
# what holds a config's model_type (or a GGUF architecture): x.model_type, mt, model_type, arch, cfg.get("model_type"),
# cfg["model_type"]
TYPE_HOLDERS = {"model_type", "mt", "arch"}


def _holds_type(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in TYPE_HOLDERS
    if isinstance(node, ast.Name):
        return node.id in TYPE_HOLDERS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("lower", "strip"):
            return _holds_type(node.func.value)
        if node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant):
            return node.args[0].value == "model_type"
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value == "model_type"
    return False


def _types_in(node: ast.AST, prefix: bool = False) -> set[str]:
    """The declared model types a string constant, or a tuple / list / set of them, names (prefix: or starts)."""
    consts = [node] if isinstance(node, ast.Constant) else getattr(node, "elts", [])
    out = set()
    for c in consts:
        if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value:
            out |= {t for t in MODEL_TYPES if t == c.value or (prefix and t.startswith(c.value))}
    return out


def branches_on_model_types(tree: ast.AST) -> list[tuple[int, str]]:
    """Comparisons of a model_type with a declared variant's, startswith on one, and literal lists or dict keys of
    two or more declared model types (a second registry)."""
    hits = []
    for node in ast.walk(tree):
        found: set[str] = set()
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_holds_type(s) for s in sides):
                found = set().union(*(_types_in(s) for s in sides))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
              and _holds_type(node.func.value) and node.args):
            found = _types_in(node.args[0], prefix=True)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            named = set().union(set(), *(_types_in(e) for e in elts if e is not None))
            found = named if len(named) >= 2 else set()
        if found:
            hits.append((node.lineno, ", ".join(sorted(found))))
    return hits


def test_no_module_outside_the_declarations_branches_on_a_declared_model_type():
    found = [f"{p.relative_to(PKG.parent)}:{line}: {names}" for p in sorted(PKG.rglob("*.py"))
             if p not in DECLARATIONS for line, names in branches_on_model_types(ast.parse(p.read_text()))]
    assert not found, ("ask the declaration (edgekv.arch.variants, edgekv.arch.model_types) instead:\n"
                       + "\n".join(found))


def test_the_model_type_scan_sees_what_it_forbids():
    src = """
if mt == "qwen2": pass
if cfg.get("model_type") in ("qwen3", "gemma3_text"): pass
if model_type.lower().startswith("gemma"): pass
TYPES = ("llama", "mistral")
ACT = {"llama": "silu", "phi3": "silu"}
if arch == "gemma3": pass
if cfg["model_type"] != "smollm3": pass
if mt == "deepseek_v3": pass
if m.kind == "llama": pass
if cfg.get("model_type") != "jamba": pass
READERS = {"mamba": 1, "mamba2": 2}
if arch.startswith("mamba"): pass
"""
    assert sorted({line for line, _ in branches_on_model_types(ast.parse(src))}) == [2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13]
