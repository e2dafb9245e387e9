#!/usr/bin/env python
"""What a .pte export costs, stage by stage, per model and --max-ctx: wall and CPU seconds, peak RSS, the size of
model.pte, and the host's load while it ran (the shared 2-core host's wall time is mostly the other jobs' share, so
CPU seconds are the figure to compare between runs).

    python benchmarks/pte_export_cost.py --model smollm2-135m:2048 --model gemma-3-270m:8192,32768 \
        --out benchmarks/results/pte_export_cost.json -- --threads 1

Each cell is one `edgekv export -m MODEL --format pte --max-ctx N` run by benchmarks/export_cost.py's measure (a
child that dies with this process, its RSS sampled and charged to the stage it printed last); arguments after `--`
go to every export. The stages are the export's own (edgekv.export.pipeline: load, trace, lower-pte = ExecuTorch's
to_edge_transform_and_lower with XNNPACK partitioning and preprocessing, serialize-pte = to_executorch's memory
planning and emit plus the write, verify-pte = the .pte against eager torch), from the manifest's timings_s. The JSON
is rewritten atomically after each cell, so a grid stopped part-way keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def cells(specs: list[str]) -> list[tuple[str, int]]:
    """["MODEL:CTX[,CTX...]", ...] -> [(model, ctx), ...]; a ctx may be written 8k / 32k."""
    from edgekv.units import parse_ctx
    out = []
    for spec in specs:
        model, _, ctxs = spec.rpartition(":")
        if not model or not ctxs:
            raise SystemExit(f"--model {spec!r}: write MODEL:CTX[,CTX...], e.g. gemma-3-270m:8k,32k")
        out += [(model, parse_ctx(c)) for c in ctxs.split(",")]
    return out


def run_cell(model: str, ctx: int, extra: list[str], work: Path, code: Path | None = None,
             strategy: str | None = None) -> dict:
    """One export; code: another checkout of edgekv whose export runs instead of this one (--before); strategy: the
    cell's --strategy (None: the export's default, or whatever extra names)."""
    import export_cost
    if strategy:
        extra = ["--strategy", strategy, *extra]
    out = work / f"{Path(model).name}-{ctx}" if not strategy else \
        work / f"{Path(model).name}-{ctx}-{''.join(c if c.isalnum() or c in '-_' else '_' for c in strategy)}"
    load0 = os.getloadavg()
    root = export_cost.ROOT
    export_cost.ROOT = code or root  # measure runs `python -m edgekv.cli` with PYTHONPATH and cwd = ROOT
    try:
        r = export_cost.with_gb(export_cost.measure(["-m", model, "--format", "pte", "--max-ctx", str(ctx), "-o",
                                                     str(out), "--force", "--json", *extra]))
    finally:
        export_cost.ROOT = root
    r.pop("timeline", None)
    r["load_avg"] = {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]}
    r["pte_bytes"] = (r.get("files") or {}).get("model.pte")
    shutil.rmtree(out, ignore_errors=True)
    return {"model": model, "max_ctx": ctx, **({"strategy": strategy} if strategy else {}),
            "code": "before" if code else "this checkout", **r}


LOWERINGS = ("full", "trimmed", "edgekv")


def lowering_side_by_side(model: str, ctx: int, repeats: int = 1, variants: tuple = LOWERINGS) -> dict:
    """One process: load once, then lower the same traced program each way in variants, alternately: `full`
    ExecuTorch's full XNNPACK pass list and edge IR checks (as before edgekv trimmed them), `trimmed` edgekv's
    lower_pte with ExecuTorch's three re-decompositions (before _decompose_once), `edgekv` lower_pte as it is; CPU
    and wall seconds of each trace + lowering + to_executorch, and the sha256 of each .pte (they must be equal)."""
    import hashlib

    import torch

    import edgekv.export.manifest as mf
    from edgekv.export import to_pte
    from edgekv.export.pipeline import Export, _entry_points, _load, _trace
    from edgekv.export.options import ExportOptions, Stages
    from edgekv.strategies import parse_strategy
    torch.set_num_threads(1)
    opts = ExportOptions(model=model, formats=("pte",), max_ctx=ctx, threads=1)
    x = Export(opts, parse_strategy("kv"), Stages(["load", "trace"], echo=lambda *a: None), Path("/tmp"), mf)
    _load(x)
    x.qmodule = x.module
    _entry_points(x)

    def traced():  # lowering consumes the ExportedProgram's constants: each lowering gets its own trace
        x.eps.clear()
        _trace(x)
        return {e["name"]: x.eps[f"pte:{e['name']}"] for e in x.entries["pte"]}

    def full():  # ExecuTorch's own defaults: every XNNPACK pass, the edge dialect verified after each step
        from executorch.exir import to_edge_transform_and_lower
        edge = to_edge_transform_and_lower(traced(), partitioner=[to_pte._partitioner(x.in_place)])
        if x.in_place:  # as lower_pte does
            for method in edge.methods:
                to_pte.write_state_in_place(edge.exported_program(method))
        return edge
    ways = {"full": full, "trimmed": lambda: to_pte.lower_pte(traced(), x.in_place, decompose_once=False),
            "edgekv": lambda: to_pte.lower_pte(traced(), x.in_place)}
    rows = {name: [] for name in variants}
    for _ in range(repeats):
        for name in variants:
            t, w, load0 = time.process_time(), time.perf_counter(), os.getloadavg()[0]
            buf = to_pte.to_buffer(ways[name](), x.in_place)
            rows[name].append({"cpu_s": round(time.process_time() - t, 2), "wall_s": round(time.perf_counter() - w, 2),
                               "load_avg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
                               "sha256": hashlib.sha256(buf).hexdigest(), "bytes": len(buf)})
            del buf
    return {"model": model, "max_ctx": ctx, "n_layers": x.args.n_layers, "lowering": rows,
            "load_avg_end": [round(v, 2) for v in os.getloadavg()]}


# py-spy's frames (`Class.function (file:line)`, the file's path from its package's root) that mark what a sample was doing: a sample counts once per row whose any
# pattern one of its frames contains (a "A / B" row: both A's and B's)
PROFILE_ROWS = {
    "export (edgekv export, whole)": ("export_model (edgekv/export/pipeline.py",),
    "load": ("_load (edgekv/export/pipeline.py",),
    "tokenizer": ("_tokenizer (edgekv/export/pipeline.py",),
    "trace": ("_trace (edgekv/export/pipeline.py",),
    "lower-pte": ("lower_pte (", "lower (edgekv/export/et_runner.py"),
    "serialize-pte (to_executorch, write)": ("to_buffer (",),
    "verify-pte": ("_verify (edgekv/export/pipeline.py",),
    "run_decompositions (to_edge)": ("run_decompositions (",),
    "edge-dialect program (_generate_edge_program)": ("_generate_edge_program (",),
    "partitioner (partition)": ("XnnpackPartitioner.partition (",),
    "partition submodules (create_submodule_from_nodes)": ("create_submodule_from_nodes (",),
    "XNNPACK preprocess (per partition)": ("XnnpackBackend.preprocess (",),
    "XNNPACK passes (XNNPACKPassManager)": ("XNNPACKPassManager.transform (",),
    "to_executorch (memory planning, emit)": ("to_executorch (",),
    "serialize (flatbuffer, the file's bytes)": ("serialize_pte_binary (", "_program_json_to_flatbuffer (",
                                                 "write_bytes ("),
    "any: fake-tensor dispatch": ("torch/_subclasses/fake_tensor.py",),
    "any: symbolic shapes (sym_node.py, symbolic_shapes.py, sympy)": ("symbolic_shapes.py", "sym_node.py", "sympy/"),
    "any: GraphModule.recompile": ("recompile (torch/fx/graph_module.py",),
    "any: verifier (Verifier.check)": ("check (torch/_export/verifier.py",),
}


def summarize_profile(raw: Path) -> dict:
    """py-spy's `record -f raw` output (one line per distinct stack: frames joined by ;, then the sample count) ->
    samples per PROFILE_ROWS row and their share of the export's samples, plus the XNNPACK passes' own samples."""
    import re
    rows = dict.fromkeys(PROFILE_ROWS, 0)
    passes: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        total += n
        for name, pats in PROFILE_ROWS.items():
            if any(p in stack for p in pats):
                rows[name] += n
        m = re.search(r"(\w+)\.call \((?:backends/xnnpack/_passes|exir/passes)/", stack)
        if m and "XNNPACKPassManager.transform (" in stack:
            passes[m.group(1)] = passes.get(m.group(1), 0) + n
    whole = rows["export (edgekv export, whole)"] or total
    return {"samples_total": total, "samples": rows,
            "share_of_export": {k: round(v / whole, 3) for k, v in rows.items()},
            "xnnpack_pass_samples": dict(sorted(passes.items(), key=lambda kv: -kv[1]))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="MODEL:CTX[,CTX...] (repeatable)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--strategy", action="append", default=[], help="a cache strategy (repeatable): every "
                    "--model cell is exported once per strategy, e.g. --strategy kv-int4 --strategy window")
    ap.add_argument("--note", default="", help="what differs in this run (stored as `how`)")
    ap.add_argument("--lowering", action="store_true", help="lower each cell's traced program both ways in one "
                    "process (lowering_side_by_side) instead of running exports")
    ap.add_argument("--variants", default=",".join(LOWERINGS), help="with --lowering: which lowerings, of "
                    f"{', '.join(LOWERINGS)}")
    ap.add_argument("--before", type=Path, help="another checkout of edgekv (e.g. `git archive` of the commit before "
                    "a change): each cell's export runs with it first, then with this one, in the same run")
    ap.add_argument("--profile", type=Path, help="summarize this py-spy `record -f raw` file of an export "
                    "(summarize_profile) into --out, and run nothing")
    ap.add_argument("export_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    extra = [x for x in a.export_args if x != "--"]
    import platform

    import psutil
    doc = {"how": a.note or f"edgekv export --format pte {' '.join(extra)}, one cell at a time",
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "mem_total": psutil.virtual_memory().total},
           "rows": []}

    def write():
        tmp = a.out.with_name(f".{a.out.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(a.out)
    if a.profile:
        doc = {"how": a.note or f"py-spy record -f raw of an export: {a.profile.name}", "date_utc": doc["date_utc"],
               **summarize_profile(a.profile)}
        write()
        return
    os.environ.setdefault("EDGEKV_PTE_CACHE", "off")  # the lowering is what is measured: no cached .pte
    if a.lowering:
        for model, ctx in cells(a.model):
            doc["rows"].append(lowering_side_by_side(model, ctx, variants=tuple(a.variants.split(","))))
            write()
            print(json.dumps(doc["rows"][-1]), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="pte_export_cost.") as work:
        for model, ctx in cells(a.model):
            for strategy in a.strategy or [None]:
                for code in ([a.before.resolve()] if a.before else []) + [None]:
                    row = run_cell(model, ctx, extra, Path(work), code, strategy)
                    doc["rows"].append(row)
                    write()
                    print(json.dumps({k: row.get(k) for k in ("model", "max_ctx", "strategy", "code", "returncode",
                                                              "wall_s", "cpu_s", "peak_rss_gb", "pte_bytes",
                                                              "timings_s", "verification", "error")}), flush=True)


if __name__ == "__main__":
    main()
