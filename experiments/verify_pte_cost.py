"""What verify-pte's eager reference costs per call on a weight-quantized .pte's module, with torchao's eager linear
and with edgekv.export.eager_linear's buffered dequantization, and whether the two give the same logits (issue 40:
the random Llama-3.2-1B's .pte export spent 513 s of its 712 s of CPU in verify-pte).

The export pipeline runs as `edgekv export --format pte --weights W` does, through load and quantize (the narrow
route: no fp32 module), and stops before trace: nothing is lowered. Then, one thread:
1. torchao's path (eager_linear switched off): the reference's first prompt call (the .pte's chunk of tokens) and
   one decode step, each timed in CPU seconds, the decode step under cProfile (the top functions by own time);
2. the same two calls through eager_linear, their logits compared with 1. bit for bit;
3. verify.record as verify-pte runs it (the reference's calls and its noise floor's: prompt in the .pte's chunks,
   then the decode steps), timed per call.

    python experiments/verify_pte_cost.py /tmp/scale40/llama-3.2-1b --max-ctx 8192 \
        --out benchmarks/results/verify_pte_cost_llama_3.2_1b_random.json
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Stop(Exception):
    pass


def _cpu():
    return time.process_time()


def _profile(fn, top=10):
    pr = cProfile.Profile()
    t = _cpu()
    out = pr.runcall(fn)
    cpu = _cpu() - t
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    rows = sorted(((v[2], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in st.stats.items()), reverse=True)[:top]
    return out, cpu, [{"function": f, "own_s": round(o, 3)} for o, f in rows]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--max-ctx", type=int, default=8192)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import numpy as np
    import torch

    from edgekv.export import eager_linear, pipeline
    from edgekv.export.options import ExportOptions
    from edgekv.export.targets import PteTarget
    from edgekv.export.verify import record

    res = {"model": a.model, "weights": a.weights, "max_ctx": a.max_ctx, "threads": 1,
           "load_avg_at_start": [round(x, 2) for x in os.getloadavg()], "host_cpus": os.cpu_count()}
    t0 = time.perf_counter()

    def hook(x):
        pipeline._prompt(x)
        res["before_s"] = {"wall": round(time.perf_counter() - t0, 1), "cpu": round(_cpu(), 1)}
        res["prompt_tokens"], res["decode_steps"], res["chunk"] = len(x.prompt), x.steps, x.chunk
        art = SimpleNamespace(chunk=None, tail="pad", max_chunk=x.chunk)  # the .pte's forward: 1..chunk tokens
        first = x.prompt[:x.chunk]
        paths = {}
        for name, ctx in (("torchao", None), ("eager_linear", eager_linear.fast_quantized_linear)):
            ref, _ = PteTarget.references(x, art)
            real = eager_linear.fast_quantized_linear
            if ctx is None:  # torchao's own path: EagerStepper's context made a no-op
                eager_linear.fast_quantized_linear = contextlib.nullcontext
            try:
                t = _cpu()
                p = ref.step(first, 0)
                p_cpu = _cpu() - t
                d, d_cpu, top = _profile(lambda: ref.step([int(p[-1].argmax())], len(first)))
            finally:
                eager_linear.fast_quantized_linear = real
            paths[name] = (p, d)
            res[name] = {"prompt_call_tokens": len(first), "prompt_call_cpu_s": round(p_cpu, 3),
                         "decode_call_cpu_s_profiled": round(d_cpu, 3), "decode_call_top_own_time": top}
            del ref
        res["same_logits_bit_for_bit"] = bool(np.array_equal(paths["torchao"][0], paths["eager_linear"][0])
                                              and np.array_equal(paths["torchao"][1], paths["eager_linear"][1]))
        ref, noise = PteTarget.references(x, art)
        calls = []
        for s in (ref, noise):  # each module call (a prompt chunk or a decode step) timed
            s._call = (lambda f: lambda *aa: (lambda t: (f(*aa), calls.append(round(_cpu() - t, 2)))[0])(_cpu()))(
                s._call)
        t, w = _cpu(), time.perf_counter()
        record(ref, x.prompt, x.steps, noise)
        res["record"] = {"cpu_s": round(_cpu() - t, 1), "wall_s": round(time.perf_counter() - w, 1),
                         "calls": len(calls), "call_cpu_s": calls,
                         "note": "each module call in record()'s order: the reference's prompt chunks, the noise "
                                 "floor's, then each decode step's reference and noise calls in turn"}
        raise Stop

    real_trace = pipeline._trace
    pipeline._trace = hook
    out = Path("/tmp") / f"verify_pte_cost_{os.getpid()}"
    try:
        pipeline.export_model(ExportOptions(model=a.model, formats=("pte",), weights=a.weights, max_ctx=a.max_ctx,
                                            out=out, threads=1, force=True), echo=lambda s: print(s, flush=True))
    except Stop:
        pass
    finally:
        pipeline._trace = real_trace
    res["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)
    res["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    res["torch_threads"] = torch.get_num_threads()
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "record"}, indent=1))
    print("record:", res["record"]["cpu_s"], "s CPU over", res["record"]["calls"], "calls")


if __name__ == "__main__":
    main()
