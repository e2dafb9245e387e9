"""Where llama.cpp's memory above the baseline goes on a Q4_0 GGUF: its anonymous pages (the weights repacked for
this CPU, the cache, compute buffers) and the GGUF's mapped pages, with the file mapped (llama-cpp-python's default,
as benchmarks/filled_context.py's llamacpp rows run) and without (issue 40: `edgekv plan` charges the 1B's llama.cpp
rows 1002 MiB above the baseline where they measure 1498-1622 MiB).

    python experiments/llamacpp_mmap_rss.py GGUF [--ctx 8192] [--out JSON]

Each setting in a fresh process: load the GGUF (flash attention, an f16 cache of --ctx slots, 1 thread), evaluate 4
tokens, then read /proc/self/status (RssAnon, RssFile) before and after."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k + "_bytes"] = int(v.split()[0]) * 1024
    return out


def child(gguf: str, ctx: int, mmap: bool) -> dict:
    before = status()
    from llama_cpp import Llama, llama_print_system_info
    m = Llama(model_path=gguf, n_ctx=ctx, n_threads=1, flash_attn=True, verbose=False, use_mmap=mmap)
    m.eval([1, 2, 3, 4])
    return {"use_mmap": mmap, "before": before, "after": status(),
            "system_info": llama_print_system_info().decode().strip()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", choices=("0", "1"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.gguf, a.ctx, a.child == "1")))
        return 0
    from edgekv.children import child_setup
    rows = []
    for mmap in ("1", "0"):
        p = subprocess.run([sys.executable, __file__, a.gguf, "--ctx", str(a.ctx), "--child", mmap],
                           capture_output=True, text=True, preexec_fn=child_setup(), cwd=ROOT)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["above_baseline_MiB"] = round((r["after"]["VmRSS_bytes"] - r["before"]["VmRSS_bytes"]) / 2**20, 1)
        r["anon_MiB"] = round(r["after"]["RssAnon_bytes"] / 2**20, 1)
        r["file_MiB"] = round(r["after"]["RssFile_bytes"] / 2**20, 1)
        rows.append(r)
        print(f"use_mmap={r['use_mmap']}: {r['above_baseline_MiB']} MiB above the baseline "
              f"(anonymous {r['anon_MiB']}, file {r['file_MiB']})")
    doc = {"experiment": "llamacpp_mmap_rss", "gguf": a.gguf, "gguf_bytes": os.path.getsize(a.gguf), "ctx": a.ctx,
           "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                       None), "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
