"""Planner vs allocator: real state layouts and decode steps of the edgekv modules, on a GPU (or the CPU).

For each model config and context: build the export module (random weights of the catalog config's shapes), allocate
the StateLayout's tensors, run a few decode steps, and compare what the allocator holds with the planner's bytes for
the same Deployment (weights at the module's precision + state):
  cuda: torch.cuda.max_memory_allocated() after the steps vs planner weights + state + workspace
        (workspace: the planner's activations/scores/logits estimate for a decode step)
  cpu:  bytes of the parameters and state tensors the module holds vs planner weights + state
        (the CPU has no allocator statistics; this checks the layout and the weight arithmetic)
A Llama model with a plain float cache steps through serving_step (the cache written in place, attention over a
view of the written slots, as the planner's `vllm` runtime assumes); other layouts through the module's forward(),
which returns a new state each step (export-first), so on a GPU their peak holds a second state ("step" says which).
Fp16 / bf16 (the CUDA default): the linear and embedding matrices at that precision, run under autocast; norms, conv,
A, D and biases fp32, as the planner counts them.
Writes JSON: {"device", "runs": [{"model", "strategy", "ctx", "predicted": {...}, "measured_bytes", "error_pct",
"loaded_bytes" (cuda: allocated before the steps), "step"}]}.

  python benchmarks/gpu_baseline.py --device cuda --models llama-3.2-1b,mamba2-1.3b --ctx 1k,8k,32k --out gpu.json
  python benchmarks/gpu_baseline.py --device cpu --models smollm2-135m,mamba-130m --ctx 256,1k     (CI runs this)
One run fits in a few minutes on an H100/H200 (fp16 weights; a 1B model at 32k is ~3.5 GB).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from edgekv.arch import catalog_arch, catalog_entry  # noqa: E402
from edgekv.memory import weight_bytes, workspace_bytes  # noqa: E402
from edgekv.models.head import head, output_weight  # noqa: E402
from edgekv.models.layers import rope_cos_sin, rope_inv_freq  # noqa: E402
from edgekv.models.llama import Llama  # noqa: E402
from edgekv.strategies import build_layout, native_strategy, parse_strategy  # noqa: E402
from edgekv.units import parse_ctx_list  # noqa: E402


def build_module(name: str, strategy, ctx: int):
    """The export module of a catalog model with random weights (shapes from the published config)."""
    cfg = catalog_entry(name)["config"]
    arch = catalog_arch(name)
    layout = build_layout(arch, strategy, ctx)
    mt = cfg["model_type"]
    if mt in ("llama", "mistral", "qwen2"):
        from edgekv.models.llama import args_from_hf_config
        return Llama(args_from_hf_config(cfg, name), layout), layout, arch
    if mt in ("mamba", "mamba2"):
        from edgekv.models.mamba import MambaLM, args_from_hf_config
        return MambaLM(args_from_hf_config(cfg, name), layout), layout, arch
    raise SystemExit(f"{name}: model_type {mt} has no module in this benchmark (llama/qwen2/mistral/mamba/mamba2)")


def serving_step(module, token: int, pos: int, state: list) -> torch.Tensor:
    """One decode step of a Llama module with a plain float cache, run the way a GPU serving stack runs it (the
    planner's `vllm` runtime): the new key and value are written into the module's own state tensors in place, and
    attention reads the written slots through a view, with torch's fused attention. No second cache exists during
    the step. The module's forward() is export-first: it returns a new cache, blended from the old one, and reads it
    back in fp32, so a GPU running it would hold a second state per step. Same weights, same result
    (tests/test_gpu_baseline.py compares the logits and the state after several steps)."""
    import torch.nn.functional as F

    dev = state[0].device
    cos, sin = rope_cos_sin(torch.tensor([pos], device=dev), module.inv_freq)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [1, 1, D]
    x = module.model.embed_tokens(torch.tensor([[token]], device=dev))
    for i, blk in enumerate(module.model.layers):
        at = blk.self_attn
        q, k, v = at._qkv(blk.norm("attn_in", x), cos, sin)  # [1, H, D], [1, Hkv, D]
        kc, vc = state[2 * i], state[2 * i + 1]  # [1, Hkv, T, D]
        kc[0, :, pos] = k[0].to(kc.dtype)
        vc[0, :, pos] = v[0].to(vc.dtype)
        o = F.scaled_dot_product_attention(q.permute(1, 0, 2)[None].to(kc.dtype), kc[:, :, :pos + 1],
                                           vc[:, :, :pos + 1], enable_gqa=True).to(q.dtype)  # [1, H, 1, D]
        x = blk.residual(x, at.o_proj(o.permute(0, 2, 1, 3).reshape(1, 1, -1)))  # the variant's norms and MLP
    return head(x, module.model.norm, output_weight(module.model.embed_tokens, module.lm_head))[0, -1]


def run_one(name: str, spec: str | None, ctx: int, device: str, dtype: torch.dtype, steps: int) -> dict:
    arch = catalog_arch(name)
    strategy = parse_strategy(spec or native_strategy(arch))
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with torch.device("meta"):
        module, layout, arch = build_module(name, strategy, ctx)
        for m in module.modules():  # matrices at the precision asked; norms, conv, A, D, biases stay fp32 (planner)
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):  # cast while on meta: the device never holds
                m.weight.data = m.weight.data.to(dtype)               # an fp32 copy, so the peak is the run's own
    module = module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
        for name_b, b in module.named_buffers():  # non-persistent buffers (rope inverse frequencies) rebuilt
            if "inv_freq" in name_b:
                b.copy_(rope_inv_freq(module.args).to(device))
    state = [s.to(device) for s in module.empty_state()]
    in_place = isinstance(module, Llama) and module.fusable()  # a plain float cache in every layer
    loaded = torch.cuda.memory_allocated() if device == "cuda" else None
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    state_bytes = sum(s.numel() * s.element_size() for s in state)
    t0 = time.perf_counter()
    # the modules compute in fp32 where precision matters (norms, softmax, the cache read back) and hand fp32
    # activations to their linears: autocast runs those at the weights' precision, as a GPU serving stack does
    lowp = torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32)
    with torch.no_grad(), lowp:
        for i in range(steps):
            pos = min(i, ctx - 1)
            if in_place:
                serving_step(module, 1, pos, state)
            else:
                _, *state = module(torch.tensor([[1]], device=device), torch.tensor([pos], device=device), *state)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    prec = {torch.float16: "fp16", torch.bfloat16: "fp16", torch.float32: "fp32"}[dtype]
    w = weight_bytes(arch, prec)
    ws = workspace_bytes(arch, layout, strategy, "vllm", 1)
    predicted = {"weights": int(w["total"]), "state": layout.nbytes, "workspace": int(ws.value)}
    if device == "cuda":
        measured = torch.cuda.max_memory_allocated()
        pred = predicted["weights"] + predicted["state"] + predicted["workspace"]
        what = "torch.cuda.max_memory_allocated"
    else:
        measured = param_bytes + state_bytes
        pred = predicted["weights"] + predicted["state"]
        what = "parameter + state tensor bytes"
    del module, state
    return {"model": name, "strategy": strategy.label, "ctx": ctx, "dtype": str(dtype).replace("torch.", ""),
            "predicted": {**predicted, "compared": pred}, "measured_bytes": int(measured), "measured": what,
            "param_bytes": int(param_bytes), "state_bytes": int(state_bytes), "loaded_bytes": loaded,
            "step": "in place (serving_step)" if in_place else "module forward (returns a new state)",
            "error_pct": round(100.0 * (measured - pred) / pred, 2), "decode_s_per_step": dt / steps}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--models", default="smollm2-135m,mamba-130m")
    ap.add_argument("--strategy", default=None, help="one strategy for all (default: each model's native one)")
    ap.add_argument("--ctx", default="256,1k")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default=None, choices=["fp16", "bf16", "fp32"], help="default: fp16 on cuda, fp32 on cpu")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[
        a.dtype or ("fp16" if a.device == "cuda" else "fp32")]
    runs = [run_one(m, a.strategy, c, a.device, dtype, a.steps) for m in a.models.split(",")
            for c in parse_ctx_list(a.ctx)]
    out = {"device": a.device, "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None, "runs": runs}
    text = json.dumps(out, indent=2)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return out


if __name__ == "__main__":
    from edgekv.errors import EdgekvError

    try:
        main()
    except EdgekvError as e:  # an unknown model, a bad --ctx: one line
        raise SystemExit(f"error: {e}") from None
