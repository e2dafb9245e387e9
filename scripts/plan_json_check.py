"""Dump `edgekv plan --json` for the whole catalog over devices, contexts and runtimes into a folder, or compare two
such folders byte for byte.

A refactor of the planner must not change what it prints: run this on the old code (`dump BASE`), again on the new
(`dump NEW`), then `compare BASE NEW`. Each case is one `edgekv plan` call run in-process through click's test runner;
its file holds the exit code and the output, byte for byte.

    python scripts/plan_json_check.py dump /tmp/plan_new [--models smollm2-135m,llama-3.2-1b]
    python scripts/plan_json_check.py compare /work/notes/plan_baseline /tmp/plan_new
    python scripts/plan_json_check.py diff /work/notes/plan_baseline /tmp/plan_new [--json out.json]

`diff` says where two dumps differ when they are expected to (a commit that deliberately changed the plan, a newer
catalog): options are matched by (model, strategy, params), and each JSON leaf that changed, or that one side lacks,
is counted by its path (options[].bytes.load ...), with the files it changed in and the rows only one side has.
A tree older than this script: run this file with the working directory and PYTHONPATH at that tree (a `git archive`
of the commit), and give both dumps `--models` the names both catalogs have.
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

DEVICES = ("pixel8", "h100")
CTXS = ("4k", "32k", "128k")
RUNTIMES = {"pixel8": (None, "executorch", "edgekv-pte", "onnxruntime", "llama.cpp"), "h100": (None,)}
# explicit specs with parameters, so parsing, labels and parameterised layouts are covered too
SPECS = ("kv", "kv-int8", "kv-int4:group=32", "kv-int2", "window:w=1024,sinks=4", "mla:rank=64",
         "mla:ratio=0.25", "ssm:dtype=int8", "linear", "hybrid", "ring:n=8")


def cases(names: list[str] | None = None) -> list[tuple[str, list[str]]]:
    """(file name, plan arguments) for every case, over the catalog or the given model names."""
    from edgekv.arch import catalog_names
    models = [a for n in names or catalog_names() for a in ("--model", n)]
    out = []
    for dev in DEVICES:
        for ctx in CTXS:
            base = ["plan", "--device", dev, "--ctx", ctx, "--json"]
            out.append((f"{dev}_{ctx}_default", base))
            for rt in RUNTIMES[dev]:
                rt_args = ["--runtime", rt] if rt else []
                out.append((f"{dev}_{ctx}_{rt or 'devrt'}_catalog", base + models + rt_args + ["--all", "--explain"]))
            specs = [a for s in SPECS for a in ("--strategy", s)]
            out.append((f"{dev}_{ctx}_specs", base + models + specs + ["--all", "--explain"]))
            out.append((f"{dev}_{ctx}_fp8", base + models + ["--strategy", "kv:dtype=fp8", "--all"]))
    for ctx in ("4k,32k,128k",):  # edgekv baseline: datacenter serving, every strategy, and the published preset
        for m in ("llama-3.1-8b", "jamba-v0.1", "deepseek-v2-lite"):
            out.append((f"baseline_h100_{m}", ["baseline", "--device", "h100", "--model", m, "--ctx", ctx, "--json",
                                               "--explain"]))
    out.append(("baseline_quadratic_tax", ["baseline", "--preset", "quadratic-tax", "--json", "--explain"]))
    for w in ("fp16", "int8", "int4"):
        out.append((f"pixel8_32k_w{w}", ["plan", "--device", "pixel8", "--ctx", "32k", "--json", "--weights", w]
                    + models + ["--all"]))
    return out


def dump(folder: Path, names: list[str] | None = None) -> None:
    from click.testing import CliRunner
    from edgekv.cli import main
    folder.mkdir(parents=True, exist_ok=True)
    runner = CliRunner()
    for name, args in cases(names):
        r = runner.invoke(main, args, catch_exceptions=False)
        (folder / f"{name}.txt").write_text(f"exit {r.exit_code}\n{r.output}")
        print(f"{name}: exit {r.exit_code}, {len(r.output)} chars", flush=True)


def compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.glob("*.txt")} | {p.name for p in b.glob("*.txt")})
    bad = [n for n in names if not (a / n).exists() or not (b / n).exists()
           or (a / n).read_bytes() != (b / n).read_bytes()]
    for n in bad:
        print(f"DIFFERS: {n}")
    print(f"{len(names) - len(bad)}/{len(names)} identical")
    return 1 if bad else 0


def _leaves(v, path: str, out: dict) -> None:
    """path -> leaf; a list of plan options is keyed by (model, strategy, params) instead of its order."""
    if isinstance(v, dict):
        for k, x in v.items():
            _leaves(x, f"{path}.{k}", out)
    elif isinstance(v, list) and v and all(isinstance(x, dict) and "model" in x and "strategy" in x for x in v):
        for x in v:
            key = f"{x['model']}|{x['strategy']}|{json.dumps(x.get('params'), sort_keys=True)}|{x.get('ctx', '')}"
            _leaves(x, f"{path}[{key}]", out)
    elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        for i, x in enumerate(v):
            _leaves(x, f"{path}[{i}]", out)
    else:
        out[path] = v


def _read(p: Path) -> tuple[str, object]:
    code, _, body = p.read_text().partition("\n") if p.exists() else ("missing", "", "")
    try:
        return code, json.loads(body)
    except json.JSONDecodeError:
        return code, {"text": body}


def diff(a: Path, b: Path) -> dict:
    leaf_kind = re.compile(r"\[[^\]]*\]")
    changed, only_a, only_b, files, exits = Counter(), Counter(), Counter(), {}, []
    rows_only = {"a": set(), "b": set()}
    for name in sorted({p.name for p in a.glob("*.txt")} | {p.name for p in b.glob("*.txt")}):
        (ca, ja), (cb, jb) = _read(a / name), _read(b / name)
        if ca != cb:
            exits.append(f"{name}: {ca} -> {cb}")
        la, lb = {}, {}
        _leaves(ja, "", la)
        _leaves(jb, "", lb)
        for k in la.keys() | lb.keys():
            kind = leaf_kind.sub("[]", k)
            if k in la and k in lb:
                if la[k] != lb[k]:
                    changed[kind] += 1
                    files.setdefault(kind, set()).add(name)
                continue
            (only_a if k in la else only_b)[kind] += 1
            row = re.search(r"\[([^|\]]+)\|([^|\]]+)\|", k)
            if row:
                rows_only["a" if k in la else "b"].add(f"{row.group(1)} {row.group(2)}")
    return {"a": str(a), "b": str(b), "exit_codes": exits, "changed": dict(sorted(changed.items())),
            "changed_in": {k: sorted(v) for k, v in sorted(files.items())},
            "only_in_a": dict(sorted(only_a.items())), "only_in_b": dict(sorted(only_b.items())),
            "rows_only_in_a": sorted(rows_only["a"]), "rows_only_in_b": sorted(rows_only["b"])}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(Path(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[1] == "dump" and sys.argv[3] == "--models":
        dump(Path(sys.argv[2]), sys.argv[4].split(","))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    elif len(sys.argv) in (4, 6) and sys.argv[1] == "diff" and (len(sys.argv) == 4 or sys.argv[4] == "--json"):
        result = diff(Path(sys.argv[2]), Path(sys.argv[3]))
        text = json.dumps(result, indent=1) + "\n"
        if len(sys.argv) == 6:
            Path(sys.argv[5]).write_text(text)
        print(text, end="")
    else:
        sys.exit(__doc__)
