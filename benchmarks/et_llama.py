"""ExecuTorch's own Llama export of the same weights, as a peer row of benchmarks/filled_context.py.

ExecuTorch 1.5.1 ships its Llama recipe in the wheel: examples/models/llama/export_llama (export_llama_lib.py, model.py,
llama_transformer.py). It reads a checkpoint in Meta's layout (tok_embeddings / layers.N.attention.wq ... / output,
q and k rows in Meta's interleaved rotary order, a params.json of ModelArgs) and, with the flags below, writes a .pte
whose `forward(tokens [1, seq], input_pos [1])` returns the last token's logits and keeps the KV cache in the program's
mutable buffers, as ExecuTorch's LLM runner calls it. Its SmolLM2 path downloads the HF repo and converts it through
torchtune (not pinned here), so this module writes the checkpoint itself from the GGUF edgekv reads:

  hf_to_meta()   HF names -> Meta names, q / k rows permuted back to Meta's interleaved rope (ExecuTorch's
                 ModelArgs.use_hf_rope stays False, its default and what its smollm2 recipe uses), the tied output
                 layer written out as `output.weight`; tests/test_et_llama.py checks it against transformers.
  build()        export_llama -kv --use_sdpa_with_kv_cache -X -qmode 8da4w -G 32 -d fp32 (dynamic token axis, its
                 default), --max_seq_length CHUNK (ExecuTorch's default 128; its token axis then takes 1..127
                 tokens per call, how its runner prefills) --max_context_length ctx, optionally --quantize_kv_cache (int8 codes with a scale and zero
                 point per token and head, read by llama::custom_quantized_sdpa); cached in the work folder.
  child()        the row: ExecuTorch's Python runtime (portable_lib, a loaded Method), the prompt prefilled in calls of
                 MAX_TOKENS tokens and the decode tokens fed one per call, as filled_context.py's other rows.

Row names: et-llama:kv-fp32/8da4w and et-llama:kv-int8/8da4w (with --quantize_kv_cache).

Usage (by hand): python benchmarks/et_llama.py --ctx 2048 [--kvq] [--work out/filled_context] exports one .pte;
python benchmarks/et_llama.py --check [--tokens 8] compares the converted checkpoint in ExecuTorch's eager Llama with
transformers on the real weights.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from edgekv.children import child_setup  # a child dies with this process

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 128  # export_llama's default --max_seq_length
MAX_TOKENS = CHUNK - 1  # the most tokens one forward call takes: its dynamic token axis ends at max_seq_length - 1
GROUP = 32  # -G: edgekv's int4 group (edgekv/export/wquant.py GROUP)
# row variant (cache/weights, as edgekv's rows name theirs) -> (the export's folder tag, --quantize_kv_cache)
VARIANTS = {"kv-fp32/8da4w": ("8da4w", False), "kv-int8/8da4w": ("8da4w-kvq", True)}
ROWS = tuple(f"et-llama:{v}" for v in VARIANTS)


# ---- the checkpoint (tests/test_et_llama.py) ----


def meta_params(cfg: dict) -> dict:
    """A transformers Llama config (dict) -> ExecuTorch's params.json (ModelArgs fields)."""
    if cfg.get("model_type", "llama") not in ("llama", "mistral"):
        raise ValueError(f"a {cfg.get('model_type')} model: ExecuTorch's Llama export takes Llama-family weights here")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim * heads != cfg["hidden_size"]:
        raise ValueError(f"head_dim {head_dim} x {heads} heads != hidden {cfg['hidden_size']}")
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope scaling {scaling} is not converted")
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return {"dim": cfg["hidden_size"], "n_layers": cfg["num_hidden_layers"], "n_heads": heads,
            "n_kv_heads": cfg.get("num_key_value_heads") or heads, "vocab_size": cfg["vocab_size"],
            "hidden_dim": cfg["intermediate_size"], "norm_eps": cfg["rms_norm_eps"], "rope_theta": float(rope),
            "use_hf_rope": False, "use_scaled_rope": False, "attention_qkv_bias": False}


def to_interleaved(w, n_heads: int):
    """HF's rotary layout (each head's rows: first halves, then second halves) -> Meta's (pairs side by side): the
    inverse of the permute in transformers' convert_llama_weights_to_hf."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


HF_TO_META = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
              "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
              "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
              "post_attention_layernorm": "ffn_norm"}


def hf_to_meta(sd: dict, cfg: dict) -> dict:
    """A transformers Llama state dict (model.* / lm_head.weight) -> Meta's names, as ExecuTorch's Transformer loads
    them. Every key is used or the call fails: nothing is silently dropped."""
    out = {}
    for k, v in sd.items():
        if k == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = v
        elif k == "model.norm.weight":
            out["norm.weight"] = v
        elif k == "lm_head.weight":
            out["output.weight"] = v
        elif k.startswith("model.layers.") and k.endswith(".weight"):
            i, name = k[len("model.layers."):-len(".weight")].split(".", 1)
            if name not in HF_TO_META:
                raise ValueError(f"no Meta name for {k}")
            if name == "self_attn.q_proj":
                v = to_interleaved(v, cfg["num_attention_heads"])
            elif name == "self_attn.k_proj":
                v = to_interleaved(v, cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
            out[f"layers.{i}.{HF_TO_META[name]}.weight"] = v
        elif k.endswith("rotary_emb.inv_freq"):
            continue  # a buffer, recomputed from rope_theta
        else:
            raise ValueError(f"no Meta name for {k}")
    if "output.weight" not in out:  # tied embeddings: ExecuTorch's Transformer has its own output layer
        out["output.weight"] = out["tok_embeddings.weight"].clone()
    return out


def eager(params: dict, meta_sd: dict, max_len: int = 64):
    """ExecuTorch's eager Llama (no KV cache, every position's logits) with the converted weights, loaded strictly."""
    import torch
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs

    args = ModelArgs(max_seq_len=max_len, max_context_len=max_len, use_kv_cache=False, generate_full_logits=True,
                     **params)
    model = construct_transformer(args)
    missing, unexpected = model.load_state_dict(meta_sd, strict=False)
    missing = [m for m in missing if not m.endswith(("mask", "freqs_cos", "freqs_sin"))]  # buffers
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit ExecuTorch's Llama: missing {missing}, unexpected {unexpected}")
    return model.eval().to(torch.float32)


def load_model(model_path: Path) -> tuple[dict, dict]:
    """The GGUF (or HF folder) as edgekv reads it: (transformers config, fp32 state dict in HF names)."""
    from edgekv.models.weights import load_gguf, load_hf_folder

    if model_path.suffix == ".gguf":
        cfg, sd, freq_factors, _ = load_gguf(model_path)
        if freq_factors is not None:
            raise ValueError(f"{model_path}: rope frequency factors are not converted")
        return cfg, sd
    return load_hf_folder(model_path)


def write_checkpoint(model_path: Path, folder: Path) -> tuple[Path, Path]:
    """checkpoint.pth (torch.save of the Meta-named fp32 state dict, what export_llama's -c reads) + params.json.
    The file name must not contain "int8" or "8da4w": ExecuTorch's model.py reads those as a pre-quantized
    checkpoint."""
    import torch

    ckpt, params = folder / "checkpoint.pth", folder / "params.json"
    if ckpt.is_file() and params.is_file():
        return ckpt, params
    folder.mkdir(parents=True, exist_ok=True)
    cfg, sd = load_model(model_path)
    tmp = ckpt.with_suffix(".tmp")
    torch.save(hf_to_meta(sd, cfg), tmp)
    params.write_text(json.dumps(meta_params(cfg), indent=1) + "\n")
    tmp.rename(ckpt)
    return ckpt, params


# ---- the export ----


def pte_path(work: Path, model_path: Path, ctx: int, variant: str) -> Path:
    return work / "et_llama" / f"{model_path.stem}-{VARIANTS[variant][0]}-c{ctx}" / "model.pte"


def build(work: Path, model_path: Path, ctx: int, variant: str, log=print, timeout: int = 7200) -> Path:
    """export_llama's .pte for (ctx, variant), built once into work/et_llama/ (reused when it is there)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {', '.join(VARIANTS)}")
    work = Path(work).resolve()  # the export runs in the .pte's folder: a relative checkpoint path would miss there
    pte = pte_path(work, model_path, ctx, variant)
    if pte.is_file():
        return pte
    ckpt, params = write_checkpoint(model_path, work / "et_llama" / f"{model_path.stem}-meta")
    pte.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--export-llama", "--model", "smollm2",
           "-c", str(ckpt), "-p", str(params), "-kv", "--use_sdpa_with_kv_cache", "-X", "-qmode", "8da4w",
           "-G", str(GROUP), "-d", "fp32", "--max_seq_length", str(min(CHUNK, ctx)), "--max_context_length", str(ctx),
           "-o", str(pte.parent), "-n", "model.tmp.pte"] + (["--quantize_kv_cache"] if VARIANTS[variant][1] else [])
    log(f"  export_llama {variant} ctx {ctx} ...")
    t = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    logf = pte.parent / "export.log"
    with logf.open("w") as f:  # streamed, so a long export can be followed
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=pte.parent, env=env, timeout=timeout, preexec_fn=child_setup())
    made = pte.parent / "model.tmp.pte"
    if p.returncode != 0 or not made.is_file():
        lines = [s for s in logf.read_text().splitlines() if s.strip()]
        raise RuntimeError(f"export_llama failed ({logf}): {lines[-1][:300] if lines else p.returncode}")
    made.rename(pte)
    log(f"  exported {pte.parent.name} in {time.perf_counter() - t:.0f} s")
    return pte


def export_llama_main(argv: list[str]) -> None:
    """`python -m executorch.examples.models.llama.export_llama ARGV`, with one change that does not alter the
    program: every attention layer's causal mask (a bool [max_context, max_context] buffer each, 30 x 64 MiB at 8k,
    which --use_sdpa_with_kv_cache's custom_sdpa never reads) is one shared tensor, so an 8k export fits in memory
    beside other jobs."""
    import runpy

    from executorch.examples.models.llama import attention

    init, shared = attention.AttentionMHA.__init__, {}

    def one_mask(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.mask = shared.setdefault(tuple(self.mask.shape), self.mask)

    attention.AttentionMHA.__init__ = one_mask
    sys.argv = ["export_llama", *argv]
    runpy.run_module("executorch.examples.models.llama.export_llama", run_name="__main__")


# ---- the row (run in filled_context.py's fresh child process) ----


class EtLlama:
    """export_llama's .pte through ExecuTorch's Method API, called as its LLM runner calls it: forward(tokens,
    input_pos), at most get_max_seq_len tokens per call, the last token's logits back; the cache is the program's."""

    def __init__(self, pte: Path, threads: int):
        import torch
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (llama::custom_sdpa / update_cache)
        import executorch.kernels.quantized  # noqa: F401 (quantize_per_token for --quantize_kv_cache)
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(threads)  # XNNPACK's pool
        torch.set_num_threads(threads)  # the llama:: kernels' (edgekv/export/pte_stepper.py says why both)
        self.torch = torch
        self.program = portable_lib._load_program(str(pte))
        self.method = self.program.load_method("forward")

    def call(self, tokens: list[int], pos: int):
        t = self.torch
        inputs = [t.tensor([tokens], dtype=t.int64), t.tensor([pos], dtype=t.int64)]  # the method reads them in
        self.method.set_inputs(inputs)  # place: they must stay alive until execute() returns
        self.method.execute()
        return self.method.get_outputs(clone_outputs=False)[0].float().numpy().reshape(-1).copy()

    def prefill(self, ids: list[int], chunk: int):
        out = None
        for s in range(0, len(ids), chunk):
            out = self.call(ids[s:s + chunk], s)
        return out


def child(spec: dict, forced, status_bytes) -> dict:
    """spec: pte, threads, chunk, ids, n_prompt, new_tokens, logits_out; forced: filled_context._forced."""
    import torch  # noqa: F401 (the runtime's baseline, as for edgekv's .pte rows)
    from executorch.extension.pybindings import portable_lib  # noqa: F401

    baseline = status_bytes("VmRSS")
    et = EtLlama(Path(spec["pte"]), spec["threads"])
    et.call([0], 0)  # XNNPACK packs its weights on the first call: loading, not the prompt's prefill
    et.call([0] * min(2, spec["chunk"]), 0)  # (the slot written here is overwritten by the prompt's)
    r = forced(lambda ids: et.prefill(ids, spec["chunk"]), lambda t, pos: et.call([t], pos), spec["ids"],
               spec["n_prompt"], spec["new_tokens"], spec["logits_out"])
    return {"baseline": baseline, **r}


def bytes_per_token(arch, ctx: int, pos: float, variant: str) -> dict:
    """The planner's arithmetic for the row (decode_speed.peer_bytes): int4 weights; the cache fp32, or int8 with a
    fp32 scale and an int8 zero point per token and KV head (ExecuTorch's QuantizedKVCache)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import decode_speed as ds

    nb = ds.peer_bytes(arch, "int4", "kv:dtype=fp32", ctx, pos)
    if VARIANTS[variant][1]:  # per token and KV head: head_dim int8 codes, a fp32 scale, an int8 zero point
        hd = next(m.head_dim for b in arch.blocks for m in b.mixers if m.kind == "attention")
        f = (hd + 4 + 1) / (4 * hd)
        nb = dict(nb, state_at_pos=nb["state_at_pos"] * f, state_full=nb["state_full"] * f)
    return nb


# ---- by hand ----


def check(model_path: Path, tokens: list[int]) -> float:
    """Max |logits| difference between ExecuTorch's eager Llama (converted checkpoint) and transformers, over tokens."""
    import numpy as np
    import torch
    import transformers

    cfg, sd = load_model(model_path)
    et = eager(meta_params(cfg), hf_to_meta(sd, cfg), max_len=max(8, len(tokens)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([tokens])
        a = et(ids).float().numpy()[0]
        b = hf(ids).logits.float().numpy()[0]
    return float(np.abs(a - b).max() / np.abs(b).max())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--variant", default="kv-fp32/8da4w", choices=list(VARIANTS))
    ap.add_argument("--work", default=str(ROOT / "out" / "filled_context"))
    ap.add_argument("--check", action="store_true", help="converted checkpoint vs transformers, a few tokens")
    ap.add_argument("--tokens", type=int, default=8)
    a = ap.parse_args(argv)
    from edgekv.models.weights import resolve_model

    model_path = resolve_model(a.model).resolve()
    if a.check:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import decode_speed as ds

        ids = ds.prompt_ids(model_path, a.tokens)[:a.tokens]
        print(f"max |ExecuTorch eager - transformers| / max |transformers| over {len(ids)} tokens: "
              f"{check(model_path, ids):.2e}")
        return
    print(build(Path(a.work), model_path, a.ctx, a.variant))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--export-llama":
        export_llama_main(sys.argv[2:])
    else:
        main()
