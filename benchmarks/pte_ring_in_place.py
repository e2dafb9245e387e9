"""A .pte of a model with sliding layers (Gemma 3) with its whole state written in place, side by side with the copy
it replaced (issue 39).

Before edgekv.models.swaps.RingSdpaAttention, Gemma 3's sliding layers kept the eager ring with a blended state, so
the .pte could not write its state in place: every call copied the whole state (the 3 global layers' ctx slots and
the 15 rings) into the method's planned buffers and back out, at a filled 16k ~116 MB each way. This runs the same
random model both ways:
  in-place   every layer swapped (custom_sdpa on the global layers, the rings written by an index_put);
  copied     the ring swap removed before the export (the sliding layers eager), as the .pte was before.
The model has Gemma-3-270M's attention geometry (18 layers, every 6th global; 4 query heads on 1 KV head of 256;
sliding window 512) and a narrow rest (hidden 64, MLP 128, vocab 512), so that each export takes minutes and its
steps are mostly what the state costs; fp32 weights, kv:dtype=fp32, --prefill-chunk 32 (the filled-context rows').
Each variant runs in a fresh process, the repeats going round the variants: the prompt fills ctx - new slots, then
`new` - 1 decode steps, timed per CPU second; memory above the baseline is the peak RSS minus the RSS after importing
the runtime. The variants' logits are compared with each other (same weights, same ids: they must agree).

Usage: python benchmarks/pte_ring_in_place.py [--ctx 16384] [--new 17] [--repeats 2] [--work out/pte_ring]
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
from edgekv.children import child_setup  # a child dies with this process

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("in-place", "copied")
GEOMETRY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=18, num_attention_heads=4,
                num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512,
                query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=1e4,
                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)])


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child_export(src: str, out: str, variant: str, ctx: int) -> None:
    from edgekv.export.options import ExportOptions
    from edgekv.export.pipeline import export_model
    from edgekv.models import swaps

    if variant == "copied":  # the sliding layers keep the eager blend: not every layer swapped, state not in place
        swaps.SWAPS["executorch"] = [s for s in swaps.SWAPS["executorch"] if s.make is swaps._sdpa_make]
    m = export_model(ExportOptions(model=src, strategy="kv:dtype=fp32", formats=("pte",), max_ctx=ctx, out=Path(out),
                                   verify_steps=0, force=True, threads=1), echo=lambda s: None)
    want = variant == "in-place"
    assert bool(m["artifacts"][0].get("state_in_place")) == want, m["artifacts"][0].get("state_in_place")


def child_run(folder: str, ctx: int, new: int, logits_out: str) -> dict:
    import numpy as np
    import torch  # noqa: F401  (the ExecuTorch Python runtime; part of its baseline)
    from executorch.extension.pybindings import portable_lib  # noqa: F401

    from edgekv.export.manifest import load_export
    from edgekv.export.pte_stepper import PteStepper

    baseline = _rss("VmRSS")
    st = PteStepper(load_export(Path(folder), check_hashes=False), Path(folder), 1)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 512, ctx)]
    n_prompt = ctx - new + 1
    c0 = time.process_time()
    rows = [st.prefill(ids[:n_prompt], last=True)[-1]]
    c1, t1 = time.process_time(), time.perf_counter()
    for i in range(1, new):
        rows.append(st.step([ids[n_prompt + i - 1]], n_prompt + i - 1)[-1])
    c2, t2 = time.process_time(), time.perf_counter()
    np.save(logits_out, np.stack(rows))
    return {"prefill_cpu_s": c1 - c0, "decode_cpu_s": c2 - c1, "decode_s": t2 - t1, "baseline": baseline,
            "peak_rss": _rss("VmHWM"), "steps": new - 1}


def side_by_side(benchmark: str, variants, script: str, description: str, work: str, out: str, argv=None) -> dict:
    """Export the random model of GEOMETRY once per variant (`script --export SRC FOLDER VARIANT CTX` in a fresh
    process), run each variant's .pte in a fresh process with the repeats going round the variants (child_run), and
    write the runs, their medians and the variants' logits' largest difference to `out` (results/NAME.json)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--new", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / "out" / work))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / out))
    a = ap.parse_args(argv)
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_families import tiny

    work = Path(a.work)
    src = work / "model"
    if not (src / "config.json").is_file():
        tiny("gemma3", src, **GEOMETRY)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = {"benchmark": benchmark, "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
              "loadavg_start": list(os.getloadavg()), "settings": {"ctx": a.ctx, "new": a.new, "repeats": a.repeats,
              "model": {k: v for k, v in GEOMETRY.items() if k != "layer_types"} | {"global_layers": [5, 11, 17]},
              "weights": "fp32", "strategy": "kv:dtype=fp32", "threads": 1}, "exports": {}, "runs": []}
    for v in variants:
        folder = work / f"pte-{v}-c{a.ctx}"
        if not (folder / "manifest.json").is_file():
            t0, l0 = time.perf_counter(), os.getloadavg()[0]
            p = subprocess.run([sys.executable, script, "--export", str(src), str(folder), v, str(a.ctx)], env=env,
                               capture_output=True, text=True, preexec_fn=child_setup())
            if p.returncode:
                raise SystemExit(f"export {v} failed: {p.stderr.strip().splitlines()[-1:]}")
            result["exports"][v] = {"wall_s": round(time.perf_counter() - t0, 1), "loadavg": l0}
    for rep in range(a.repeats):
        for v in variants:
            folder = work / f"pte-{v}-c{a.ctx}"
            p = subprocess.run([sys.executable, __file__, "--run", str(folder), str(a.ctx), str(a.new),
                                str(work / f"logits-{v}.npy")], env=env, capture_output=True, text=True, preexec_fn=child_setup())
            line = [s for s in p.stdout.splitlines() if s.startswith("RESULT ")]
            if p.returncode or not line:
                raise SystemExit(f"run {v} failed: {p.stderr.strip().splitlines()[-1:]}")
            r = json.loads(line[0][7:]) | {"variant": v, "repeat": rep, "loadavg": list(os.getloadavg())}
            r["decode_tok_per_cpu_s"] = round(r["steps"] / r["decode_cpu_s"], 2)
            r["above_baseline_mib"] = round((r["peak_rss"] - r["baseline"]) / 2**20, 1)
            result["runs"].append(r)
            print(f"{v}: {r['decode_tok_per_cpu_s']} tok per CPU s, prefill {r['prefill_cpu_s']:.1f} CPU s, "
                  f"{r['above_baseline_mib']} MiB above baseline, load {r['loadavg'][0]:.1f}", file=sys.stderr,
                  flush=True)
    a_, b_ = (np.load(work / f"logits-{v}.npy") for v in variants)
    result["logits_max_abs_diff_over_scale"] = float(np.abs(a_ - b_).max() / np.abs(b_).max())

    def median(v, key):
        xs = sorted(r[key] for r in result["runs"] if r["variant"] == v)
        return xs[len(xs) // 2]

    result["median"] = {v: {"decode_tok_per_cpu_s": median(v, "decode_tok_per_cpu_s"),
                            "above_baseline_mib": median(v, "above_baseline_mib"),
                            "prefill_cpu_s": round(median(v, "prefill_cpu_s"), 1)} for v in variants}
    result["loadavg_end"] = list(os.getloadavg())
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median"]))
    return result


def main(argv=None) -> dict:
    return side_by_side("pte_ring_in_place", VARIANTS, __file__, __doc__.splitlines()[0], "pte_ring",
                        "pte_ring_in_place_gemma3_geometry.json", argv)

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--export":
        child_export(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--run":
        print("RESULT " + json.dumps(child_run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])),
              flush=True)
    else:
        main()
