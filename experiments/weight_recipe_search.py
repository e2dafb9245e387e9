"""Which int4 recipe from fp weights comes nearest llama.cpp's Q4_K_M (issue 38), by fake quantization in transformers:
each matrix replaced by its blocks' dequantized values, KL(fp32 || quantized) over the same tokens as
benchmarks/weight_recipe.py (verify-quant's text). MatMulNBits' int8 activations (accuracy_level 4) are not
modelled, so the exported artifact measures somewhat more; this ranks the variants, benchmarks/weight_recipe.py
measures the chosen one end to end.

    python experiments/weight_recipe_search.py --model smollm2-135m [--perturb 0.5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main():
    import torch
    import transformers

    import weight_recipe as wr
    from edgekv.export import wrecipe

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--work", default="/tmp/edgekv_weight_recipe")
    ap.add_argument("--perturb", type=float, default=0.0)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--variants", default="int,int+imat,fmin,fmin+imat")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    f16, hf = wr.sources(a.model, Path(a.work), a.perturb)
    ids = wr.token_ids(a.model, a.tokens)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie: table and head apart
    orig = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim == 2}
    n_layers = model.config.num_hidden_layers

    def logits():
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0]
            return np.concatenate([model.lm_head(h[i:i + 64]).numpy() for i in range(0, len(ids), 64)])

    ref = wr.log_probs(logits())
    imat = wrecipe.importance(model, wrecipe.calibration_ids(lambda t: wr.tokenize(a.model, t), wrecipe.CALIBRATION_TOKENS))

    def role(name):
        if name == "lm_head.weight":
            return "head", None
        if name.endswith("embed_tokens.weight"):
            return "embed", None
        layer = int(name.split("layers.")[1].split(".")[0])
        proj = name.split(".")[-2].replace("_proj", "")
        return ({"q": "attn_v", "k": "attn_v", "v": "attn_v", "down": "ffn_down"}.get(proj, proj), layer)

    result = {"model": a.model, "perturb": a.perturb, "loadavg_start": list(os.getloadavg()), "rows": {}}
    for variant in a.variants.split(","):
        t0 = time.process_time()
        kind, use_imat, table8 = variant.split("+")[0], "imat" in variant, "t8" in variant
        for name, p in model.named_parameters():
            if name not in orig:
                continue
            w = orig[name].numpy()
            r, layer = role(name)
            bits = 8 if r == "embed" and table8 else 4 if r == "embed" else wrecipe.mix_bits(r, layer, n_layers)
            if r == "embed" or bits == 8:
                q = wrecipe.dequantize(*wrecipe.minmax_blocks(w, bits))
            else:
                imp = imat.get(name) if use_imat else None
                if kind == "fmin":
                    q = wrecipe.dequantize_fmin(*wrecipe.search_blocks_fmin(w, bits, importance=imp))
                else:
                    q = wrecipe.dequantize(*wrecipe.search_blocks(w, bits, importance=imp))
            with torch.no_grad():
                p.copy_(torch.from_numpy(q))
        row = wr.compare(ref, logits())
        row["cpu_s"] = round(time.process_time() - t0, 1)
        result["rows"][variant] = row
        print(variant, json.dumps(row), flush=True)
    result["loadavg_end"] = list(os.getloadavg())
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
