"""What the int4 embedding table (the output layer's own codes, edgekv.export.wquant.gather_head_codes) costs Gemma-3-270M's
int4 .pte: eager KL against fp32 over the first T tokens of the quality text (one prefill, as pte_layer_mix.py), the
export's recipe with the fp32 table and with the int4 table.

    python experiments/pte_embedding_kl.py [T]
"""
import copy
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pte_layer_diff import GGUF, Tap, kl  # noqa: E402


def main():
    import tempfile

    from tokenizers import Tokenizer

    from edgekv.export import wquant
    from edgekv.export.quality import quality_tokens
    from edgekv.export.tokenizer import bos_prefix, write_tokenizer
    from edgekv.models import load_any
    from edgekv.strategies import parse_strategy

    T = int(sys.argv[1]) if len(sys.argv) > 1 else 160
    torch.set_num_threads(1)
    m = load_any(str(GGUF), parse_strategy("kv:dtype=fp32"), max(64, T)).module.eval()
    with tempfile.TemporaryDirectory() as td:
        entry = write_tokenizer(GGUF, Path(td))
        tok = Tokenizer.from_file(str(Path(td) / "tokenizer.json"))
    ids = torch.tensor([quality_tokens(tok, m.args.vocab, T, bos_prefix(entry))[:T]])
    pos = torch.tensor([0])
    with torch.no_grad():
        fp32 = Tap(m)(ids, pos)[0][0].numpy()
    out = {"model": str(GGUF), "tokens": T, "load": list(os.getloadavg())}
    for name in ("fp32 table", "int4 table"):
        q = copy.deepcopy(m) if name == "fp32 table" else m
        keep = wquant.gather_head_codes
        if name == "fp32 table":
            wquant.gather_head_codes = lambda *a: None
        rec = wquant.quantize_module(q, "int4")
        wquant.gather_head_codes = keep
        with torch.no_grad():
            got = Tap(q)(ids, pos)[0][0].numpy()
        k = kl(fp32, got)
        out[name] = {"kl": round(float(k.mean()), 4), "top1": round(float((fp32.argmax(-1) == got.argmax(-1)).mean()), 3),
                     "embedding": rec["embedding"], "layers_int8": rec.get("layers_int8", {}).get("layers")}
        print(json.dumps(out[name]), flush=True)
        del q
    Path("benchmarks/results/pte_embedding_kl_gemma3.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
