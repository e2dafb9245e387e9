"""Dump `edgekv plan --json` for the whole catalog over devices, contexts and runtimes into a folder, or compare two
such folders byte for byte.

A refactor of the planner must not change what it prints: run this on the old code (`dump BASE`), again on the new
(`dump NEW`), then `compare BASE NEW`. Each case is one `edgekv plan` call run in-process through click's test runner;
its file holds the exit code and the output, byte for byte.

    python scripts/plan_json_check.py dump /tmp/plan_new
    python scripts/plan_json_check.py compare /work/notes/plan_baseline /tmp/plan_new
"""
from __future__ import annotations

import sys
from pathlib import Path

DEVICES = ("pixel8", "h100")
CTXS = ("4k", "32k", "128k")
RUNTIMES = {"pixel8": (None, "executorch", "edgekv-pte", "onnxruntime", "llama.cpp"), "h100": (None,)}
# explicit specs with parameters, so parsing, labels and parameterised layouts are covered too
SPECS = ("kv", "kv-int8", "kv-int4:group=32", "kv-int2", "window:w=1024,sinks=4", "mla:rank=64",
         "mla:ratio=0.25", "ssm:dtype=int8", "linear", "hybrid", "ring:n=8")


def cases() -> list[tuple[str, list[str]]]:
    """(file name, plan arguments) for every case."""
    from edgekv.arch import catalog_names
    models = [a for n in catalog_names() for a in ("--model", n)]
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


def dump(folder: Path) -> None:
    from click.testing import CliRunner
    from edgekv.cli import main
    folder.mkdir(parents=True, exist_ok=True)
    runner = CliRunner()
    for name, args in cases():
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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
