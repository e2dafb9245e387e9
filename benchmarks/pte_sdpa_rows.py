"""One-token custom_sdpa with a KV head's G query heads as G rows of one head, against the per-head call it replaced
(issue 39; edgekv.models.swaps.SdpaAttention._custom_sdpa), in the .pte of a random model with Gemma-3-270M's
attention geometry at a filled context (benchmarks/pte_ring_in_place.py's model: 18 layers, every 6th global, 4 query
heads on 1 KV head of 256, a narrow rest, fp32 weights, kv:dtype=fp32, state in place). Per head, custom_sdpa runs one
attention per query head and each reads the whole cache: a decode step reads each global layer's 16k keys and values
G = 4 times over a one-row product. Variants:
  rows       the export as edgekv makes it (a torch.cond picks the rows call for one token)
  per-head   the same export with every call per head (the .pte before)
Each variant runs in a fresh process, the repeats going round the variants, as pte_ring_in_place.py runs them (its
child_run: the prompt fills ctx - new slots, then new - 1 decode steps, timed per CPU second); the variants' logits
must agree.

Usage: python benchmarks/pte_sdpa_rows.py [--ctx 16384] [--new 17] [--repeats 2] [--work out/pte_sdpa_rows]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import pte_ring_in_place as ring  # noqa: E402

VARIANTS = ("rows", "per-head")


def child_export(src: str, out: str, variant: str, ctx: int) -> None:
    from edgekv.export.options import ExportOptions
    from edgekv.export.pipeline import export_model
    from edgekv.models import swaps

    if variant == "per-head":
        import torch

        def per_head(self, qg, kc, vc, start, c, pos, rows_ok=True):
            return torch.ops.llama.custom_sdpa(qg, kc, vc, start, None, 0.0, True, self.scale)

        swaps.SdpaAttention._custom_sdpa = per_head
    m = export_model(ExportOptions(model=src, strategy="kv:dtype=fp32", formats=("pte",), max_ctx=ctx, out=Path(out),
                                   verify_steps=0, force=True, threads=1), echo=lambda s: None)
    ops = m["artifacts"][0]["delegation"]["forward"]["portable_ops"]
    assert ("cond" in ops) == (variant == "rows"), ops


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--new", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / "out" / "pte_sdpa_rows"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pte_sdpa_rows_gemma3_geometry.json"))
    a = ap.parse_args(argv)
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_families import tiny

    work = Path(a.work)
    src = work / "model"
    if not (src / "config.json").is_file():
        tiny("gemma3", src, **ring.GEOMETRY)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = {"benchmark": "pte_sdpa_rows", "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
              "loadavg_start": list(os.getloadavg()), "settings": {"ctx": a.ctx, "new": a.new, "repeats": a.repeats,
              "model": {k: v for k, v in ring.GEOMETRY.items() if k != "layer_types"} | {"global_layers": [5, 11, 17]},
              "weights": "fp32", "strategy": "kv:dtype=fp32", "threads": 1}, "exports": {}, "runs": []}
    for v in VARIANTS:
        folder = work / f"pte-{v}-c{a.ctx}"
        if not (folder / "manifest.json").is_file():
            t0, l0 = time.perf_counter(), os.getloadavg()[0]
            p = subprocess.run([sys.executable, __file__, "--export", str(src), str(folder), v, str(a.ctx)], env=env,
                               capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"export {v} failed: {p.stderr.strip().splitlines()[-1:]}")
            result["exports"][v] = {"wall_s": round(time.perf_counter() - t0, 1), "loadavg": l0}
    for rep in range(a.repeats):
        for v in VARIANTS:
            folder = work / f"pte-{v}-c{a.ctx}"
            p = subprocess.run([sys.executable, ring.__file__, "--run", str(folder), str(a.ctx), str(a.new),
                                str(work / f"logits-{v}.npy")], env=env, capture_output=True, text=True)
            line = [s for s in p.stdout.splitlines() if s.startswith("RESULT ")]
            if p.returncode or not line:
                raise SystemExit(f"run {v} failed: {p.stderr.strip().splitlines()[-1:]}")
            r = json.loads(line[0][7:]) | {"variant": v, "repeat": rep, "loadavg": list(os.getloadavg())}
            r["decode_tok_per_cpu_s"] = round(r["steps"] / r["decode_cpu_s"], 2)
            r["above_baseline_mib"] = round((r["peak_rss"] - r["baseline"]) / 2**20, 1)
            result["runs"].append(r)
            print(f"{v}: {r['decode_tok_per_cpu_s']} tok per CPU s, prefill {r['prefill_cpu_s']:.1f} CPU s, "
                  f"load {r['loadavg'][0]:.1f}", file=sys.stderr, flush=True)
    a_, b_ = (np.load(work / f"logits-{v}.npy") for v in VARIANTS)
    result["logits_max_abs_diff_over_scale"] = float(np.abs(a_ - b_).max() / np.abs(b_).max())
    med = {}
    for v in VARIANTS:
        xs = sorted(r["decode_tok_per_cpu_s"] for r in result["runs"] if r["variant"] == v)
        ps = sorted(r["prefill_cpu_s"] for r in result["runs"] if r["variant"] == v)
        med[v] = {"decode_tok_per_cpu_s": xs[len(xs) // 2], "prefill_cpu_s": round(ps[len(ps) // 2], 1)}
    result["median"] = med
    result["loadavg_end"] = list(os.getloadavg())
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(med))
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--export":
        child_export(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
