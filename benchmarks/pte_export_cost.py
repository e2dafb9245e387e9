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


def run_cell(model: str, ctx: int, extra: list[str], work: Path) -> dict:
    from export_cost import measure, with_gb
    out = work / f"{Path(model).name}-{ctx}"
    load0 = os.getloadavg()
    r = with_gb(measure(["-m", model, "--format", "pte", "--max-ctx", str(ctx), "-o", str(out), "--force", "--json",
                         *extra]))
    r.pop("timeline", None)
    r["load_avg"] = {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]}
    r["pte_bytes"] = (r.get("files") or {}).get("model.pte")
    shutil.rmtree(out, ignore_errors=True)
    return {"model": model, "max_ctx": ctx, **r}


def lowering_side_by_side(model: str, ctx: int, repeats: int = 1) -> dict:
    """One process: load once, then lower the same traced program with ExecuTorch's full XNNPACK pass list and edge
    IR checks (as before edgekv trimmed them) and with edgekv's lower_pte, alternately; CPU seconds of each trace +
    lowering + to_executorch, and the sha256 of each .pte (they must be equal)."""
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
    rows = {"full": [], "edgekv": []}
    for _ in range(repeats):
        for name, lower in (("full", full), ("edgekv", lambda: to_pte.lower_pte(traced(), x.in_place))):
            t = time.process_time()
            buf = to_pte.to_buffer(lower(), x.in_place)
            rows[name].append({"cpu_s": round(time.process_time() - t, 2),
                               "sha256": hashlib.sha256(buf).hexdigest(), "bytes": len(buf)})
    return {"model": model, "max_ctx": ctx, "n_layers": x.args.n_layers, "lowering": rows,
            "load_avg_end": [round(v, 2) for v in os.getloadavg()]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="MODEL:CTX[,CTX...] (repeatable)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--note", default="", help="what differs in this run (stored as `how`)")
    ap.add_argument("--lowering", action="store_true", help="lower each cell's traced program both ways in one "
                    "process (lowering_side_by_side) instead of running exports")
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
    if a.lowering:
        for model, ctx in cells(a.model):
            doc["rows"].append(lowering_side_by_side(model, ctx))
            write()
            print(json.dumps(doc["rows"][-1]), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="pte_export_cost.") as work:
        for model, ctx in cells(a.model):
            row = run_cell(model, ctx, extra, Path(work))
            doc["rows"].append(row)
            write()
            print(json.dumps({k: row.get(k) for k in ("model", "max_ctx", "returncode", "wall_s", "cpu_s",
                                                      "peak_rss_gb", "pte_bytes", "timings_s")}), flush=True)


if __name__ == "__main__":
    main()
