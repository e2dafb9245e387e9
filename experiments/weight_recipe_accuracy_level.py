"""Whether MatMulNBits' int8 activations (accuracy_level 4) cost an int4-mix export its KL (issue 38): the export's
model.onnx rewritten with accuracy_level 0 (fp32 activations) on the 4-bit nodes, the 8-bit ones or all, beside the
same model.onnx.data (hard links: ONNX Runtime refuses external data reached through a symbolic link), each run over
benchmarks/weight_recipe.py's tokens against its reference.

    python experiments/weight_recipe_accuracy_level.py EXPORT HF_FOLDER --model gemma-3-270m --out X.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
VARIANTS = {"as exported (4)": set(), "4-bit nodes accuracy_level 0": {4}, "8-bit nodes accuracy_level 0": {8},
            "all nodes accuracy_level 0": {4, 8}}


def main():
    import onnx

    import weight_recipe as wr
    ap = argparse.ArgumentParser()
    ap.add_argument("export")
    ap.add_argument("hf")
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out")
    a = ap.parse_args()
    src = Path(a.export)
    ids = wr.token_ids(a.model, a.tokens)
    ref = wr.reference(Path(a.hf), ids)
    out = {"loadavg_start": list(os.getloadavg()), "rows": {}}
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
        for label, which in VARIANTS.items():
            d = Path(tmp) / str(len(out["rows"]))
            d.mkdir()
            for f in src.iterdir():
                if f.name != "model.onnx":
                    os.link(f, d / f.name)
            m = onnx.load(str(src / "model.onnx"), load_external_data=False)
            n = 0
            for node in m.graph.node:
                bits = next((x.i for x in node.attribute if x.name == "bits"), None)
                if node.op_type == "MatMulNBits" and bits in which:
                    for x in node.attribute:
                        if x.name == "accuracy_level":
                            x.i, n = 0, n + 1
            onnx.save(m, str(d / "model.onnx"))
            r = {**wr.compare(ref, wr.edgekv_logits(d, ids, 1)), "nodes_changed": n}
            out["rows"][label] = r
            print(label, r, flush=True)
            shutil.rmtree(d)
    out["loadavg_end"] = list(os.getloadavg())
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
