"""Where an arm64 run's greedy token differs from the x86 one (benchmarks/results/arm64_vs_x86*.json), how near a tie
it was: runs the export on this host and in the arm64 root (`make arm64-env`; as root) as `edgekv profile --arch
arm64` does (same prompt, the arm64 run fed the host's tokens), keeps both runs' logits, and writes per position the
host's top-1 minus top-2 logit, the arm64 argmax, and how far the host's pick sits below it in the arm64 logits.
Usage (from the repository root): python experiments/arm64_margins.py EXPORT RUNTIME(ort|executorch) CTX STEPS OUT_JSON"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from edgekv.export.manifest import load_export
from edgekv.profile.arm64 import check_env, run_arm64, run_host
from edgekv.profile.run import prompt_tokens


def main() -> None:
    folder, rt, ctx, steps, out = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    prompt = prompt_tokens(folder, load_export(folder), ctx - steps)
    with tempfile.TemporaryDirectory() as hd, tempfile.TemporaryDirectory() as ad:
        h = run_host(folder, Path(hd), rt, prompt, steps, 1)
        a = run_arm64(check_env(), folder, Path(ad), rt, prompt, steps, 1, force=h["tokens"][:steps])
        lh, la = np.load(Path(hd) / "result.npz")["logits"], np.load(Path(ad) / "result.npz")["logits"]
    rows = []
    for i, (x, y) in enumerate(zip(lh, la)):
        o = np.argsort(-x)
        rows.append({"position": i, "host_top1": int(o[0]), "arm64_top1": int(y.argmax()),
                     "host_top1_minus_top2": float(x[o[0]] - x[o[1]]),
                     "arm64_logit_of_host_top1_minus_its_max": float(y[o[0]] - y.max()),
                     "max_abs_diff": float(np.abs(x - y).max()), "logit_scale": float(np.abs(x).max())})
    doc = {"what": "per position of one run (the last prompt position, then each decode step): the x86 host's top-1 "
                   "minus top-2 logit, the arm64 (qemu max core) argmax, and the host's pick's logit below the arm64 "
                   "maximum; the arm64 run is fed the host's tokens",
           "made_by": f"experiments/arm64_margins.py {folder.name} {rt} {ctx} {steps}", "artifact": folder.name,
           "runtime": rt, "prompt_tokens": len(prompt), "steps": steps, "host_tokens": h["tokens"],
           "arm64_tokens": a["tokens"], "positions": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
