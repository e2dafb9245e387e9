"""llama.cpp's decode rate at several filled contexts on one GGUF, one process per context (issue 40: on the Intel
Xeon VM llama.cpp's f16-cache row of the random Llama-3.2-1B decoded 1.49 tokens per CPU second at a filled 8k,
where it had 7.11-7.65 on the AMD EPYC VM; this says how its rate falls with the context here).

    python experiments/llamacpp_decode_by_ctx.py GGUF [--ctx 64,1024,4096] [--cache f16,q8_0] [--out JSON]

Each context and cache type: a fresh llama-cpp-python Llama (flash attention on, the prompt at 2 threads, decode at 1
thread, as benchmarks/filled_context.py's llamacpp rows), a prompt of N token ids, then 8 one-token decode steps:
tokens per CPU second of the process over those steps."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


CACHE = {"f16": 1, "q8_0": 8, "q4_0": 2}  # GGML type ids (ggml.h)


def child(gguf: str, n: int, cache: str) -> dict:
    from llama_cpp import Llama
    m = Llama(model_path=gguf, n_ctx=max(2048, n + 64), n_threads=1, n_threads_batch=2, flash_attn=True,
              verbose=False, n_batch=512, type_k=CACHE[cache], type_v=CACHE[cache])
    m.eval([(i * 7919) % 50000 + 100 for i in range(n)])
    c, w = time.process_time(), time.time()
    for i in range(8):
        m.eval([123 + i])
    return {"ctx": n, "cache": cache, "decode_tok_per_cpu_s": round(8 / (time.process_time() - c), 2),
            "decode_tok_s": round(8 / (time.time() - w), 2), "load": round(os.getloadavg()[0], 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--ctx", default="64,1024,4096")
    ap.add_argument("--cache", default="f16")
    ap.add_argument("--out")
    ap.add_argument("--child", type=int)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.gguf, a.child, a.cache)))
        return
    sys.path.insert(0, str(ROOT))
    from edgekv.children import child_setup
    rows = []
    for cache in a.cache.split(","):
        for n in map(int, a.ctx.split(",")):
            p = subprocess.run([sys.executable, __file__, a.gguf, "--child", str(n), "--cache", cache],
                               capture_output=True, text=True, preexec_fn=child_setup())
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else
                        {"ctx": n, "cache": cache, "error": (p.stderr.strip().splitlines() or [str(p.returncode)])[-1]})
            print(rows[-1], flush=True)
    if a.out:
        import llama_cpp
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
        Path(a.out).write_text(json.dumps({"experiment": "llamacpp_decode_by_ctx", "gguf": a.gguf,
                                           "machine": {"cpu": cpu}, "llama_cpp_python": llama_cpp.__version__,
                                           "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                                           "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
