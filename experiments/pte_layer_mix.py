"""Which of Gemma-3-270M's decoder layers can go from int8 per channel to 8da4w (4-bit groups of 32) in the int4 .pte
without moving the KL much (issue 39): eager torchao against eager fp32 over the first T tokens of verify-quant's
quality text (one prefill, as docs/export.md's recipe table), for the recipe (every decoder layer int8, the output
layer 8da4w), each layer alone at 8da4w, groups of layers, and the greedy mixes that add layers in order of their
own cost. The .pte computes what its eager module does (docs/export.md, pte_layer_diff), so the eager KL is the
.pte's.

    python experiments/pte_layer_mix.py [T] [--src GGUF] [--out JSON]

One fp32 module (about 1.2 GB), its decoder layers copied once at 8da4w, the mixes made by swapping layers.
"""
import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pte_layer_diff import GGUF, Tap, kl  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens", type=int, nargs="?", default=160)
    ap.add_argument("--src", default=str(GGUF))
    ap.add_argument("--out", default="benchmarks/results/pte_layer_mix_gemma3.json")
    o = ap.parse_args()
    torch.set_num_threads(1)
    import tempfile

    from tokenizers import Tokenizer
    from torchao.quantization import quantize_

    from edgekv.export.tokenizer import bos_prefix, write_tokenizer
    from edgekv.export.quality import quality_tokens
    from edgekv.export.wquant import quantize_module, torchao_config
    from edgekv.models import load_any
    from edgekv.strategies import parse_strategy

    T = o.tokens
    m = load_any(o.src, parse_strategy("kv:dtype=fp32"), max(64, T)).module.eval()
    with tempfile.TemporaryDirectory() as td:
        entry = write_tokenizer(Path(o.src), Path(td))
        tok = Tokenizer.from_file(str(Path(td) / "tokenizer.json"))
    ids = quality_tokens(tok, m.args.vocab, T, bos_prefix(entry))[:T]
    toks, pos = torch.tensor([ids]), torch.tensor([0])
    with torch.no_grad():
        fp32 = Tap(m)(toks, pos)[0][0].numpy()
    four = copy.deepcopy(m.model.layers)
    quantize_(four, torchao_config("int4"), filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear)
              and mod.in_features % 32 == 0)
    quantize_module(m, "int4")  # the recipe: decoder layers int8 per channel, the output layer 8da4w
    eight = m.model.layers
    n = len(eight)

    def measure(at4: set[int]) -> dict:
        m.model.layers = torch.nn.ModuleList([four[i] if i in at4 else eight[i] for i in range(n)])
        t0 = time.process_time()
        with torch.no_grad():
            q = Tap(m)(toks, pos)[0][0].numpy()
        k = kl(fp32, q)
        return {"layers_8da4w": sorted(at4), "kl": round(float(k.mean()), 4),
                "top1": round(float((fp32.argmax(-1) == q.argmax(-1)).mean()), 3),
                "cpu_s": round(time.process_time() - t0, 1)}

    rows = {"recipe": measure(set()), "all": measure(set(range(n)))}
    print(json.dumps(rows), flush=True)
    alone = []
    for i in range(n):
        alone.append(measure({i}))
        print(json.dumps(alone[-1]), flush=True)
    thirds = [measure(set(range(a, a + n // 3))) for a in range(0, n, n // 3)]
    for r in thirds:
        print(json.dumps(r), flush=True)
    order = sorted(range(n), key=lambda i: alone[i]["kl"])
    greedy = []
    for k in (3, 6, 9, 12, 15):
        greedy.append(measure(set(order[:k])))
        print(json.dumps(greedy[-1]), flush=True)
    res = {"question": "KL against fp32 of Gemma-3-270M's int4 .pte recipe with some decoder layers at 8da4w "
                       "(eager torchao, one prefill of the quality text)",
           "model": o.src, "tokens": T, "load": list(os.getloadavg()), **rows, "alone": alone, "thirds": thirds,
           "order_by_own_kl": order, "greedy": greedy}
    Path(o.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
