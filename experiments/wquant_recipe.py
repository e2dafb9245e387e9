"""Where an int4 recipe loses a model's quality: each part of ONNX Runtime's MatMulNBits recipe applied alone to the
fp32 model (transformers, from the same GGUF), KL and top-1 against fp32 over verify-quant's text.

    python experiments/wquant_recipe.py                       # Gemma-3-270M, with and without its BOS
    python experiments/wquant_recipe.py --model smollm2-135m
    python experiments/wquant_recipe.py --speed               # MatMulNBits int4 symmetric vs asymmetric, CPU time

What is simulated, as MatMulNBits computes it (blocks of 32 along the input axis, `q_block` below):
  symmetric   scale = the block's largest-magnitude value / -8, codes round(w / scale) in -8..7
              (onnxruntime MlasQuantizeBlockwise, is_symmetric=True: what edgekv's int4 used first)
  asymmetric  scale = (max - min) / 15 over the block with 0 inside the range, a uint4 zero point round(-min / scale)
              (is_symmetric=False: edgekv's int4 now)
  int8        symmetric, 8 bits (the head and table kept wider, as llama.cpp's Q4_K_M keeps token_embd)
  act int8    every quantized matmul's input rounded to int8 per block of 32 (accuracy_level 4)
The output matrix is untied from the embedding table (each quantized on its own), as edgekv's export does. One full
forward over the text (the export's verify-quant prefills half and steps the rest; the numbers agree to a few %:
docs/export.md). `tests/test_wquant.py` checks q_block against ONNX Runtime's own quantizer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def q_block(w, bits: int = 4, symmetric: bool = True, block: int = 32, search: bool = False):
    """w [out, in] -> the values MatMulNBits' blocks of `block` along `in` hold (dequantized). search: the
    asymmetric block's scale and (integer) zero point chosen by least squared error (searched_block)."""
    import torch

    o, i = w.shape
    b = w.reshape(o, i // block, block)
    if search:
        return searched_block(b, bits).reshape(o, i)
    if symmetric:
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        vmax = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))
        scale = vmax / lo
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        return (torch.clamp(torch.round(b / scale), lo, hi) * scale).reshape(o, i)
    n = 2 ** bits - 1
    mn = torch.clamp(b.min(-1, keepdim=True).values, max=0)
    mx = torch.clamp(b.max(-1, keepdim=True).values, min=0)
    scale = (mx - mn) / n
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zp = torch.clamp(torch.round(-mn / scale), 0, n)
    return ((torch.clamp(torch.round(b / scale) + zp, 0, n) - zp) * scale).reshape(o, i)


def searched_block(b, bits: int = 4, steps: int = 24, chunk: int = 1 << 16):
    """Blocks b [..., block] -> their values dequantized from the codes, scale and integer zero point with the least
    squared error among candidates, in the spirit of llama.cpp's make_qkx2_quants (ggml-quants.c: scales tried
    around (max - min) / nmax, then a least-squares refit of scale and minimum to the codes), but with the zero
    point an integer, as MatMulNBits' uint4 zero points are: for each candidate scale s = f (max - min) / nmax
    (f in 0.75 .. 1.05) the zero points round(-min / s) and its two neighbours, codes clamp(round(x / s) + z),
    then s refit by least squares to those codes; the candidate with the least error wins."""
    import torch

    n = 2 ** bits - 1
    shape = b.shape
    flat = b.reshape(-1, shape[-1])
    out = torch.empty_like(flat)
    facs = torch.linspace(0.75, 1.05, steps, dtype=flat.dtype)
    for s0 in range(0, flat.shape[0], chunk):
        x = flat[s0:s0 + chunk]  # [B, K]
        mn = torch.clamp(x.min(-1, keepdim=True).values, max=0)
        mx = torch.clamp(x.max(-1, keepdim=True).values, min=0)
        rng = torch.where(mx - mn == 0, torch.ones_like(mx), mx - mn)
        best_err = torch.full_like(mn, float("inf"))
        best = torch.zeros_like(x)
        for f in facs:
            s = rng / n * f  # [B, 1]
            z0 = torch.round(-mn / s)
            for dz in (-1.0, 0.0, 1.0):
                z = torch.clamp(z0 + dz, 0, n)
                c = torch.clamp(torch.round(x / s) + z, 0, n) - z  # codes minus zero point
                den = (c * c).sum(-1, keepdim=True)
                s_fit = torch.where(den > 0, (x * c).sum(-1, keepdim=True) / den.clamp(min=1e-30), s)
                s_fit = torch.where(s_fit > 0, s_fit, s)
                y = c * s_fit
                err = ((x - y) ** 2).sum(-1, keepdim=True)
                take = err < best_err
                best_err = torch.where(take, err, best_err)
                best = torch.where(take, y, best)
        out[s0:s0 + chunk] = best
    return out.reshape(shape)


def act_int8(a, block: int = 32):
    """The input of a MatMulNBits at accuracy_level 4: int8 per block of `block` along the last axis."""
    import torch

    s = a.shape
    b = a.reshape(*s[:-1], s[-1] // block, block)
    sc = b.abs().amax(-1, keepdim=True) / 127
    sc = torch.where(sc == 0, torch.ones_like(sc), sc)
    return (torch.round(b / sc) * sc).reshape(s)


def recipes() -> list[tuple[str, dict]]:
    sym = {"bits": 4, "symmetric": True}
    asym = {"bits": 4, "symmetric": False}
    i8 = {"bits": 8, "symmetric": True}
    out = [("int4 symmetric + act int8 (edgekv's first recipe)", {"layers": sym, "head": sym, "table": sym, "act": 1}),
           ("int4 asymmetric + act int8 (edgekv's recipe)", {"layers": asym, "head": asym, "table": asym, "act": 1}),
           ("int4 asymmetric layers, head and table int8, act int8",
            {"layers": asym, "head": i8, "table": i8, "act": 1}),
           ("act int8 alone", {"act": 1}),
           ("head int4 symmetric alone", {"head": sym}),
           ("table int4 symmetric alone", {"table": sym}),
           ("layers int4 symmetric alone", {"layers": sym}),
           ("layers int4 asymmetric alone", {"layers": asym})]
    srch = {"bits": 4, "symmetric": False, "search": True}
    out += [("int4 searched + act int8", {"layers": srch, "head": srch, "table": srch, "act": 1}),
            ("int4 searched layers, head and table int8, act int8", {"layers": srch, "head": i8, "table": i8,
                                                                      "act": 1}),
            ("layers int4 searched alone", {"layers": srch}),
            ("head int4 searched alone", {"head": srch})]
    out += [(f"{k} int4 symmetric alone", {"layers": sym, "only": k}) for k in LAYER]
    for block in (64, 128):
        wide = {"bits": 4, "symmetric": False, "block": block}
        out += [(f"int4 asymmetric + act int8, head in blocks of {block}",
                 {"layers": asym, "head": wide, "table": asym, "act": 1}),
                (f"int4 asymmetric + act int8, every block {block}", {"layers": wide, "head": wide, "table": wide,
                                                                      "act": 1})]
    return out


def measure(model, ids, ref, recipe: dict) -> dict:
    import torch

    orig = model._edgekv_orig
    t0 = time.perf_counter()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(orig[n])
        lin = [(n, m) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in LAYER
               and recipe.get("only", n.split(".")[-1]) == n.split(".")[-1]]
        if "layers" in recipe:
            for _, m in lin:
                m.weight.copy_(q_block(m.weight, **recipe["layers"]))
        # accuracy_level 4 rounds each matmul's input in blocks of that matmul's weight blocks
        lb, hb = (recipe.get(k, {}).get("block", 32) for k in ("layers", "head"))
        hooks = [m.register_forward_pre_hook(lambda _m, a: (act_int8(a[0], lb),)) for _, m in lin] \
            if recipe.get("act") else []
        table = orig["model.embed_tokens.weight"]
        head = q_block(table, **recipe["head"]) if "head" in recipe else table
        model.model.embed_tokens.weight.copy_(q_block(table, **recipe["table"]) if "table" in recipe else table)
        h = model.model(torch.tensor([ids])).last_hidden_state
        logits = (act_int8(h, hb) if recipe.get("act") else h) @ head.T
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        for hk in hooks:
            hk.remove()
    lq = torch.log_softmax(logits[0].double(), -1)
    kl = (ref.exp() * (ref - lq)).sum(-1)
    return {"kl_mean": round(kl.mean().item(), 4), "kl_max": round(kl.max().item(), 3),
            "top1": round((ref.argmax(-1) == lq.argmax(-1)).double().mean().item(), 4),
            "seconds": round(time.perf_counter() - t0, 1)}


def speed(shapes: list[tuple[int, int]], threads: int, runs: int) -> list[dict]:
    """One MatMulNBits (int4, accuracy_level 4, M = 1: a decode step) per shape [K, N]: symmetric and asymmetric
    blocks of 32, and for the first shape (the output head) asymmetric blocks of 64 and 128 too; median CPU time per
    call (time.process_time: holds on a shared host with one thread), the calls going round the configurations."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(0)
    sessions = []  # (record, session, input): built first, then timed round the configurations
    for k, n in shapes:
        w = numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), "W")
        g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [w])
        x = rng.standard_normal((1, k)).astype(np.float32)
        configs = [(True, 32), (False, 32)] + ([(False, 64), (False, 128)] if (k, n) == shapes[0] else [])
        for symmetric, block in configs:
            q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), bits=4,
                                     block_size=block, is_symmetric=symmetric, accuracy_level=4)
            q.process()
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            sess = ort.InferenceSession(q.model.model.SerializeToString(), opts,
                                        providers=["CPUExecutionProvider"])
            for _ in range(3):
                sess.run(None, {"x": x})
            sessions.append(({"k": k, "n": n, "symmetric": symmetric, "block": block, "runs": runs}, sess, x, []))
    for _ in range(runs):
        for _, sess, x, times in sessions:
            c = time.process_time()
            sess.run(None, {"x": x})
            times.append(time.process_time() - c)
    out = []
    for rec, _, _, times in sessions:
        out.append({**rec, "cpu_ms_median": round(sorted(times)[len(times) // 2] * 1e3, 4)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m", help="packaged name or .gguf")
    ap.add_argument("--tokens", type=int, default=256, help="tokens of verify-quant's text (default 256)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", help="comma-separated substrings of recipe names")
    ap.add_argument("--speed", action="store_true", help="time MatMulNBits int4 symmetric vs asymmetric at the "
                    "model's head and MLP shapes instead (results/wquant_speed_<model>.json)")
    ap.add_argument("--runs", type=int, default=30, help="--speed: calls per configuration")
    ap.add_argument("--out", help="default benchmarks/results/wquant_recipe_<model>.json")
    a = ap.parse_args(argv)
    if a.tokens < 2 or a.threads < 1 or a.runs < 1:
        ap.error("--tokens at least 2, --threads and --runs at least 1")
    import torch
    import transformers

    from edgekv.export import quality
    from edgekv.export.tokenizer import bos_prefix, write_tokenizer
    from edgekv.models.weights import resolve_model

    torch.set_num_threads(a.threads)
    path = resolve_model(a.model).resolve()
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        entry = write_tokenizer(path, Path(d))
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(d) / entry["file"]))
    if a.speed:
        from edgekv.arch.catalog import load_arch
        arch = load_arch(str(path))
        ffn = next((w.shape[0] for w in arch.weights or [] if w.name.endswith("ffn_up.weight")), 4 * arch.hidden)
        shapes = [(arch.hidden, arch.vocab), (arch.hidden, ffn), (ffn, arch.hidden)]
        result = {"benchmark": "wquant_speed", "model": a.model, "threads": a.threads,
                  "what": "one MatMulNBits int4 call, M = 1, accuracy_level 4: symmetric vs asymmetric (zero "
                          "points), blocks of 32 (the head also 64, 128); shapes [K, N]: the output head, up/gate, "
                          "down",
                  "loadavg_start": list(os.getloadavg()), "calls": speed(shapes, a.threads, a.runs),
                  "loadavg_end": None}
        result["loadavg_end"] = list(os.getloadavg())
        out = Path(a.out or BENCH / "results" / f"wquant_speed_{Path(a.model).stem.replace('.', '_')}.json")
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
        return result
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    model._edgekv_orig = {n: p.detach().clone() for n, p in model.named_parameters()}
    load0 = os.getloadavg()
    result = {"benchmark": "wquant_recipe", "model": a.model, "gguf": path.name, "tokens": a.tokens,
              "threads": a.threads, "text": "edgekv.export.quality.quality_text (verify-quant's text)",
              "what": "KL(fp32 || recipe) in nats and top-1 agreement per position, one forward; parts of "
                      "MatMulNBits' int4 recipe simulated in torch (experiments/wquant_recipe.py)",
              "loadavg_start": list(load0), "runs": []}
    bos_options = [bos_prefix(entry)] + ([[]] if bos_prefix(entry) else [])
    for bos in bos_options:
        ids = quality.quality_tokens(tok, model.config.vocab_size, a.tokens, bos)
        with torch.no_grad():
            for n, p in model.named_parameters():  # the last recipe's weights out: the reference is fp32
                p.copy_(model._edgekv_orig[n])
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        for name, recipe in [r for r in recipes() if not a.only or any(k in r[0] for k in a.only.split(","))]:
            r = {"recipe": name, "bos": bool(bos), **measure(model, ids, ref, recipe)}
            print(json.dumps(r), flush=True)
            result["runs"].append(r)
    result["loadavg_end"] = list(os.getloadavg())
    out = Path(a.out or BENCH / "results" / f"wquant_recipe_{Path(a.model).stem.replace('.', '_')}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH))
    from speed_child import entry  # edgekv's errors (an unknown --model, too many --tokens) as one line, exit 2

    entry(main, lambda _spec: sys.exit("wquant_recipe.py runs no child rows"))
