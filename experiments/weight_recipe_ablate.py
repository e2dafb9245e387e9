"""Which matrices cost int4-mix its KL (issue 38, target 3), by fake quantization in transformers: every matrix at
int4-mix's bits (4-bit blocks: searched scale and float minimum with the importance matrix; 8-bit: Q8_0; the tied
table and head one 8-bit Q8_0 copy), then one group of its 4-bit matrices at a time raised to 8 bits (Q8_0), by role
across every layer (q, k, v, o, gate, up, down) and by layer (all of one layer's 4-bit matrices); each row's KL and
the bytes the raise adds, so a bit mix can be chosen by KL saved per byte. KL(fp32 || row) in nats per position over
benchmarks/weight_recipe.py's tokens; MatMulNBits' int8 activations are not modelled (the ONNX artifact measures a
little more), benchmarks/weight_recipe.py measures the chosen recipe end to end.

    python experiments/weight_recipe_ablate.py --model gemma-3-270m --perturb 0.5 --out X.json [--groups role,layer]

Gemma-3-270M peaks at about 7 GB (the model, its fp32 tied table twice, every matrix's 4- and 8-bit values, the
reference's log-probabilities): run it in a shared memory slot. The JSON is rewritten after every row, so a run that
is stopped keeps the rows it reached.
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

# bytes per weight as the ONNX file holds them (blocks of 32, fp32 scales): 4-bit codes + scale + uint4 zero point +
# fp32 remainder; 8-bit codes + scale (the default zero point)
BYTES_4 = 0.5 + (4 + 0.5 + 4) / 32
BYTES_8 = 1 + 4 / 32


def main():
    import torch
    import transformers

    import weight_recipe as wr
    from edgekv.export import wrecipe

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--work", default="/tmp/edgekv_weight_recipe")
    ap.add_argument("--perturb", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--groups", default="role,layer")
    ap.add_argument("--extra", default="", help="';'-separated sets of roles raised to 8 bits together, e.g. "
                                               "'q,k,v,gate,up;gate,up'")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    _, hf = wr.sources(a.model, Path(a.work), a.perturb)
    ids = wr.token_ids(a.model, a.tokens)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    n_layers = model.config.num_hidden_layers
    head = model.get_output_embeddings().weight
    assert head is model.get_input_embeddings().weight, "a tied table and head"

    def logprob_chunks():
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0]
            for i in range(0, len(ids), 64):
                yield wr.log_probs(model.lm_head(h[i:i + 64]).numpy())

    def kl_row():
        kl, top = [], []
        for i, lq in enumerate(logprob_chunks()):
            lp = ref[i * 64:(i + 1) * 64].astype(np.float64)
            lq = lq.astype(np.float64)
            kl.append((np.exp(lp) * (lp - lq)).sum(-1))
            top.append(lp.argmax(-1) == lq.argmax(-1))
        kl, top = np.concatenate(kl), np.concatenate(top)
        return {"kl_mean": round(float(kl.mean()), 5), "top1": round(float(top.mean()), 4)}

    ref = np.concatenate(list(logprob_chunks()))
    t0 = time.process_time()
    imat = wrecipe.importance(model, wrecipe.calibration_ids(lambda t: wr.tokenize(a.model, t),
                                                             wrecipe.CALIBRATION_TOKENS))
    mats = {}  # name: (role, layer, numel, {bits: dequantized values})
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or ".layers." not in name:
            continue
        layer = int(name.split("layers.")[1].split(".")[0])
        role = name.split(".")[-1].replace("_proj", "")
        w = mod.weight.detach().numpy().copy()
        bits = wrecipe.mix_bits({"v": "attn_v", "down": "ffn_down"}.get(role, role), layer, n_layers)
        if role in ("q", "k"):  # the ONNX graph's fused q/k/v takes v's bits
            bits = wrecipe.mix_bits("attn_qkv", layer, n_layers)
        c8, d8 = wrecipe.q8_blocks(w)
        q = {8: wrecipe.dequantize(c8, d8, np.full(d8.shape, 128, np.uint8))}
        if bits == 4:
            q[4] = wrecipe.dequantize_fmin(*wrecipe.search_blocks_fmin(w, 4, importance=imat.get(name + ".weight")))
        mats[name] = (role, layer, w.size, bits, q, mod)
    tw = head.detach().numpy().copy()
    c8, d8 = wrecipe.q8_blocks(tw)
    table8 = wrecipe.dequantize(c8, d8, np.full(d8.shape, 128, np.uint8))
    quant_cpu = round(time.process_time() - t0, 1)

    def apply(raise_to_8=frozenset(), head_fp=False):
        with torch.no_grad():
            for name, (_, _, _, bits, q, mod) in mats.items():
                mod.weight.copy_(torch.from_numpy(q[8 if name in raise_to_8 else bits]))
            head.copy_(torch.from_numpy(tw if head_fp else table8))

    four = {n for n, m in mats.items() if m[3] == 4}
    result = {"experiment": "experiments/weight_recipe_ablate.py", "model": a.model, "perturb": a.perturb,
              "tokens": a.tokens, "command": "python experiments/weight_recipe_ablate.py " + " ".join(sys.argv[1:]),
              "what": __doc__.split("\n\n")[0].replace("\n", " "), "quantize_cpu_s": quant_cpu,
              "bytes_per_weight": {"4": BYTES_4, "8": BYTES_8},
              "matrices": {"4bit": len(four), "8bit": len(mats) - len(four),
                           "4bit_weights": int(sum(mats[n][2] for n in four))},
              "loadavg_start": list(os.getloadavg()), "rows": {}}

    def row(label, raised=frozenset(), head_fp=False):
        t = time.process_time()
        apply(raised, head_fp)
        r = kl_row()
        r["added_bytes"] = int(sum(mats[n][2] for n in raised) * (BYTES_8 - BYTES_4))
        r["raised"] = len(raised)
        r["cpu_s"] = round(time.process_time() - t, 1)
        result["rows"][label] = r
        print(label, json.dumps(r), flush=True)
        if a.out:
            tmp = Path(a.out + ".tmp")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            os.replace(tmp, a.out)

    row("int4-mix")
    row("int4-mix, table and head fp32", head_fp=True)
    roles = sorted({m[0] for m in mats.values()})
    if "role" in a.groups:
        for role in roles:
            row(f"{role} to 8 bits", frozenset(n for n in four if mats[n][0] == role))
    if "layer" in a.groups:
        for i in range(n_layers):
            row(f"layer {i} to 8 bits", frozenset(n for n in four if mats[n][1] == i))
    for s in filter(None, a.extra.split(";")):
        rs = set(s.split(","))
        row(f"{'+'.join(sorted(rs))} to 8 bits", frozenset(n for n in four if mats[n][0] in rs))
    result["loadavg_end"] = list(os.getloadavg())
    if a.out:
        tmp = Path(a.out + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
