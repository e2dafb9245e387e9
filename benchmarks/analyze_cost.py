"""What `edgekv analyze` costs per variant, against one plain forward pass of the same model over the same text.

Measured in one run, side by side, `--repeats` times alternately (these machines are shared and noisy: the best of
the repeats of each, and ratios rather than absolute times):
  plain_s      the reference module alone over the tokens, in the same calls (chunk) and under the same torch mode
               (inference_mode) analyze uses
  analyze_s    Runner.run with the reference + N variants (metrics included)
  per_variant  (analyze_s - plain_s) / N / plain_s: the cost of one more variant in units of a plain pass
  *_cpu_s, per_variant_cpu   the same from process CPU time (less sensitive to other processes on the machine)
Target (issue 4): <= 1.5 per variant. JSON to stdout or --out.

  python benchmarks/analyze_cost.py --model fixtures/tiny/mamba2 --strategy ssm --ctx 512
  python benchmarks/analyze_cost.py --model smollm2-135m --strategy kv-int4 --ctx 1k
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from edgekv.analyze.run import Curves, Runner, default_text, make_variants, tokenize  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402
from edgekv.units import parse_ctx  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fixtures/tiny/mamba2")
    ap.add_argument("--strategy", default="ssm")
    ap.add_argument("--ctx", default="512")
    ap.add_argument("--bits", default=None, help="comma-separated state bits (default: the strategy's)")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--rounding", default="nearest", help="nearest, stochastic or nearest,stochastic")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = parse_strategy(a.strategy)
    ctx = parse_ctx(a.ctx)
    bits = [int(b) for b in a.bits.split(",")] if a.bits else None
    variants = make_variants(base, bits, a.rounding.split(","), None)
    chunk = a.chunk or (1 if base.recurrent else 64)
    runner = Runner(a.model, base, variants, ctx, chunk)
    tokens = tokenize(runner.ref, default_text(), ctx)

    ids = torch.tensor(tokens[:-1])[None]

    def plain():
        with torch.inference_mode():
            state = runner.ref.module.empty_state()
            for s in range(0, ids.shape[1], chunk):
                _, *state = runner.ref.module(ids[:, s:s + chunk], torch.tensor([s]), *state)

    def analyze():
        runner.curves = [Curves() for _ in variants]
        runner.run(tokens)

    times = {"plain": [], "analyze": []}
    for _ in range(a.repeats):
        for name, fn in (("plain", plain), ("analyze", analyze)):
            w, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - w, time.process_time() - c))
    (pw, pc), (fw, fc) = ([min(t[k] for t in times[name]) for k in (0, 1)] for name in ("plain", "analyze"))
    n = len(variants)
    out = {"model": a.model, "strategy": base.label, "ctx": ctx, "chunk": chunk, "variants": n,
           "labels": [v.label for v in variants], "threads": a.threads, "repeats": a.repeats,
           "plain_s": round(pw, 3), "analyze_s": round(fw, 3), "per_variant": round((fw - pw) / n / pw, 3),
           "plain_cpu_s": round(pc, 3), "analyze_cpu_s": round(fc, 3),
           "per_variant_cpu": round((fc - pc) / n / pc, 3), "target_per_variant": 1.5}
    text = json.dumps(out, indent=2)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return out


if __name__ == "__main__":
    main()
