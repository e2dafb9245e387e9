"""How much room above the calibration text's largest values kv-int8c's static scales need: KL(fp32 || variant)
and top-1 agreement over real text for kv-int8c at several margins (scale = margin x max |x| / 127 per channel,
edgekv/export/calibrate.py), beside kv-int8 (a scale per token and head, set when the row is written) and the fp32
cache, all on the same eager module's weights (no weight quantization), fed in chunks of 64 tokens as analyze feeds
them. The text measured is analyze's default (the Python docs' topics first); the calibration text is another
(calibrate.CALIB_FILES), so the margin is judged on values calibration did not see.

Usage: python experiments/kv_int8c_margin.py [--model smollm2-135m] [--tokens 2000] [--margins 1,1.25,1.5,2]
Output: a table and benchmarks/results/kv_int8c_margin.json (--out), with the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--margins", default="1,1.25,1.5,2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_int8c_margin.json"))
    a = ap.parse_args(argv)
    import math
    try:
        margins = [float(m) for m in a.margins.split(",")]
    except ValueError:
        ap.error(f"--margins {a.margins!r}: comma-separated numbers")
    if a.tokens < 64 or not all(math.isfinite(m) and m > 0 for m in margins):
        ap.error("--tokens at least 64, margins finite and above 0")
    import torch

    from edgekv.analyze.run import Encoder, default_text, tokenize
    from edgekv.export import calibrate as cal
    from edgekv.models import load_any
    from edgekv.strategies import parse_strategy

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    res = {"benchmark": "kv_int8c_margin", "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
           "loadavg_start": list(os.getloadavg()), "model": a.model, "tokens": a.tokens, "chunk": 64,
           "calibration": {"tokens": cal.CALIB_TOKENS, "files": list(cal.CALIB_FILES)},
           "what": "KL(fp32 cache || variant) in nats and top-1 agreement, eager torch, fp32 weights", "rows": []}
    ctx = a.tokens + 1
    ref = load_any(a.model, parse_strategy("kv:dtype=fp32"), ctx)
    toks = tokenize(ref, default_text(), a.tokens)

    def run(m):
        st, outs = m.empty_state(), []
        with torch.no_grad():
            for s in range(0, len(toks), 64):
                o = m(torch.tensor([toks[s:s + 64]]), torch.tensor([s]), *st)
                outs.append(o[0][0])
                st = list(o[1:])
        return torch.cat(outs)

    def score(label, logits, **extra):
        lp, lq = want.log_softmax(-1), logits.log_softmax(-1)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        row = {"variant": label, **extra, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
               "top1_agree": float((want.argmax(-1) == logits.argmax(-1)).float().mean())}
        res["rows"].append(row)
        print(f"{label:<24} KL {row['kl_mean']:.3e}  top-1 {row['top1_agree']:.4f}", flush=True)

    want = run(ref.module)
    score("kv-int8 (per token)", run(load_any(a.model, parse_strategy("kv-int8"), ctx).module))
    var = load_any(a.model, parse_strategy("kv-int8c"), ctx)
    enc = Encoder.for_model(var) if var.arch.vocab != 256 else None
    for m in margins:
        cal.calibrate_loaded(var, enc, m)
        score(f"kv-int8c margin {m:g}", run(var.module), margin=m)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["loadavg_end"] = list(os.getloadavg())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"load average {res['loadavg_start']} -> {res['loadavg_end']}; {res['seconds']} s; wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
