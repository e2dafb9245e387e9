#!/usr/bin/env python
"""Does the recall probe need the model's BOS token? The probe's needles (edgekv/analyze/recall.py, seed 0) scored
with the fp32 cache twice over the same trials: starting with the BOS id the model's tokenizer metadata names
(run.Encoder.bos, from a GGUF's tokenizer.ggml.add_bos_token) and without it. Per trial: which of the 6 value tokens
are the model's top-1, their mean log-prob, the CPU seconds.

    python experiments/recall_bos_check.py gemma-3-270m 16,1024 8 fixtures/analysis/recall_gemma_bos.json
"""
import json
import sys
import time

import torch

from edgekv.analyze.recall import RecallProbe, make_trials, score
from edgekv.analyze.run import Encoder, default_text
from edgekv.strategies import parse_strategy


def main(model: str, dist_text: str, n: int, out_path: str) -> int:
    torch.set_num_threads(1)
    dists = [int(x) for x in dist_text.split(",")]
    probe = RecallProbe(model, parse_strategy("kv"), [], max(dists), 64, 0)
    enc = Encoder.for_model(probe.loaded)
    if enc.bos is None:
        print(f"{model}: its tokenizer metadata adds no BOS; nothing to compare", file=sys.stderr)
        return 2
    out = {"model": model, "command": "python experiments/recall_bos_check.py " + " ".join(sys.argv[1:]),
           "bos": enc.bos, "strategy": "kv:dtype=fp32", "chunk": 64, "seed": 0, "trials": []}
    text = default_text()
    for label, bos in (("bos", enc.bos), ("no-bos", None)):
        enc.bos = bos
        for k, row in enumerate(make_trials(enc, text, dists, n, 0)):
            for t in row:
                c0 = time.process_time()
                ok, lp = score(probe.modules[0], t, 64)
                out["trials"].append({"start": label, "trial": k, "distance": t.distance,
                                      "right": "".join("1" if x else "0" for x in ok.tolist()),
                                      "exact": bool(ok.all()), "logprob": round(float(lp.mean()), 3),
                                      "cpu_seconds": round(time.process_time() - c0, 2)})
    summary = {}
    for r in out["trials"]:
        s = summary.setdefault(f"{r['start']} d={r['distance']}", {"trials": 0, "exact": 0, "tokens_right": 0,
                                                                    "logprob_sum": 0.0})
        s["trials"] += 1
        s["exact"] += r["exact"]
        s["tokens_right"] += r["right"].count("1")
        s["logprob_sum"] += r["logprob"]
    out["summary"] = {k: {"trials": s["trials"], "exact": s["exact"] / s["trials"],
                          "value_tokens_right": s["tokens_right"] / (6 * s["trials"]),
                          "mean_logprob": round(s["logprob_sum"] / s["trials"], 3)} for k, s in summary.items()}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps(out["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
