#!/usr/bin/env python
"""Is a transformer fixture's recall limit a distance or a position? The recall probe's needles (edgekv/analyze/recall.py,
seed 0, 8 trials) at short distances (16, 64 bytes), with extra stdlib filler put in front of each trial so the needle
and the cue sit at later absolute positions. Scored with transformers' own forward over the whole sequence (top-1 of
the 6 value bytes), independent of edgekv's cache code.

    python experiments/recall_position.py fixtures/tiny-recall/llama fixtures/analysis/recall_tiny-recall_llama_position.json
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from edgekv.analyze.recall import make_trials
from edgekv.analyze.run import Encoder, default_text

SHIFTS = (0, 128, 256, 384, 512, 1024, 2048, 4096)  # filler bytes asked for; cut back to a line end
DISTANCES = (16, 64)
FILLER_AT = 200_000  # offset of the extra filler in the probe's default text


def main(folder: str, out_path: str) -> int:
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    text = default_text()
    raw = text.encode()
    rows = make_trials(Encoder(), text, list(DISTANCES), 8, seed=0)
    out = {"model": folder, "command": "python experiments/recall_position.py " + " ".join(sys.argv[1:]),
           "note": f"extra stdlib filler (whole lines from byte {FILLER_AT} of the probe's default text) inserted "
                   "before each trial, moving needle and cue to later absolute positions at the same distance; "
                   "transformers' forward over the whole sequence, top-1 of the 6 value bytes; chance 1/36",
           "points": []}
    t0 = time.time()
    for shift in SHIFTS:
        pad = raw[FILLER_AT:FILLER_AT + shift]
        if shift:
            pad = pad[:pad.rindex(b"\n") + 1]
        for j, d in enumerate(DISTANCES):
            right = exact = 0
            for row in rows:
                t = row[j]
                with torch.no_grad():
                    pred = hf(input_ids=torch.tensor([list(pad) + t.tokens])).logits[0].argmax(-1)
                ok = [int(pred[len(pad) + t.value_at + i - 1]) == v for i, v in enumerate(t.value)]
                right += sum(ok)
                exact += all(ok)
            cues = [len(pad) + row[j].cue_at for row in rows]
            out["points"].append({"filler_bytes": len(pad), "distance": d, "cue_position": [min(cues), max(cues)],
                                  "accuracy": round(right / (len(rows) * 6), 4), "exact": exact / len(rows),
                                  "trials": len(rows)})
            print(out["points"][-1], flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    with open(out_path, "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: recall_position.py MODEL_FOLDER OUT.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))
