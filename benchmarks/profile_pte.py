"""Where a .pte's prefill and decode time goes, operator by operator: ExecuTorch's own profiler (ETDump) on an
edgekv export, the same prompt and greedy loop as benchmarks/decode_speed.py.

    python benchmarks/profile_pte.py out/decode_speed/exports/smollm2-135m-kv_dtype_fp32-wint4-c2048 [--threads 1,2]

For each thread count, in one process: a timed run without the profiler (wall ms per decode step and per prefill
call), then the same run with ETDump on, whose events are summed per call into
  xnnpack gemm        XNNPACK's fully-connected / batched matmul kernels (the linears, the lm_head)
  xnnpack other       every other op inside the XNNPACK delegate (norms, elementwise, reshapes)
  xnnpack dispatch    the delegate calls' time beyond the ops inside them
  custom_sdpa         ExecuTorch's LLM attention kernel (llama::custom_sdpa)
  edgekv sdpa         edgekv's own cache attention kernels (--pte-kernel edgekv: edgekv::int8_sdpa, fp16_sdpa,
                      packed_sdpa; edgekv/native; "int8_sdpa" in results written before the other two existed)
  cache write         index_put_ of this call's rows into the caller's state
  portable other      the remaining portable kernels (embedding, RoPE tables, casts)
  operator dispatch   the runtime's per-operator wrapper beyond the kernels
  method rest         Method::execute beyond its delegate and operator calls
  outside execute     the clean run's wall time per call minus Method::execute (the Python binding: inputs,
                      outputs, this loop)
The sum is the clean run's wall time.

--attention also times one layer's decode attention at a few positions, ExecuTorch's llama::custom_sdpa (the
kernel the .pte calls, in its eager form) next to torch's own bmm-softmax-bmm over the same written rows: if they
cost the same, the attention time is what CPU attention at that size costs, not a slow path of the export. The profiler adds its own cost to each event, so the categories are read
as shares of Method::execute, scaled to the clean run's execute time (wall minus what the binding costs with the
profiler on). Output: a table and JSON (--out, merged by artifact and thread count).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CATEGORIES = ("xnnpack gemm", "xnnpack other", "xnnpack dispatch", "custom_sdpa", "edgekv sdpa", "cache write",
              "portable other", "operator dispatch", "method rest", "outside execute")


def category_of(name: str, delegated: bool) -> str | None:
    """An ETDump event -> its category; None for the wrappers summed separately (DELEGATE_CALL, OPERATOR_CALL,
    Method::execute)."""
    if name in ("DELEGATE_CALL", "OPERATOR_CALL", "Method::execute"):
        return None
    if delegated:
        return "xnnpack gemm" if re.search(r"Fully Connected|Batch Matrix Multiply|GEMM", name) else "xnnpack other"
    if "custom_sdpa" in name:
        return "custom_sdpa"
    if re.search(r"edgekv::\w+_sdpa|(int8|fp16|packed)_sdpa", name):
        return "edgekv sdpa"
    if "index_put" in name:
        return "cache write"
    return "portable other"


def per_call(events, calls: slice, n: int | None = None) -> dict:
    """Summed ms per call of each category over the calls in `calls` (ETDump keeps one sample per call of the
    method for every event; events = [(name, delegated, [ms per call])]); n: the calls the events' samples are
    spread over, where events of different blocks (by_phase) each hold some of them."""
    sums = defaultdict(float)
    for name, delegated, raw in events:
        part = raw[calls]
        if not part:
            continue
        ms = sum(part) / (n or len(part))
        cat = category_of(name, delegated)
        if cat:
            sums[cat] += ms
        else:
            sums[name] += ms
    inner_delegated = sums["xnnpack gemm"] + sums["xnnpack other"]
    kernels = sums["custom_sdpa"] + sums["edgekv sdpa"] + sums["cache write"] + sums["portable other"]
    out = {c: sums[c] for c in ("xnnpack gemm", "xnnpack other", "custom_sdpa", "edgekv sdpa", "cache write",
                                "portable other")}
    out["xnnpack dispatch"] = max(0.0, sums["DELEGATE_CALL"] - inner_delegated)
    out["operator dispatch"] = max(0.0, sums["OPERATOR_CALL"] - kernels)
    out["method rest"] = max(0.0, sums["Method::execute"] - sums["DELEGATE_CALL"] - sums["OPERATOR_CALL"])
    out["execute"] = sums["Method::execute"]
    return out


def scaled(profile: dict, wall_ms: float, profiled_wall_ms: float) -> dict:
    """Categories of a profiled call rescaled so they add up to the clean run's wall time: the binding's cost
    (profiled wall - execute) is kept as measured, execute's categories share the rest in their profiled ratios.
    Where that cost alone is more than the clean wall time (a sub-millisecond step on a noisy host), the clean wall is
    split in the profiled run's own ratio instead, so the categories still add up to it."""
    outside = max(0.0, profiled_wall_ms - profile["execute"])
    if outside >= wall_ms and profiled_wall_ms > 0:
        outside = wall_ms * outside / max(profiled_wall_ms, outside + profile["execute"])
    execute = max(0.0, wall_ms - outside)
    k = execute / profile["execute"] if profile["execute"] else 0.0
    out = {c: round(profile[c] * k, 4) for c in CATEGORIES if c != "outside execute"}
    out["outside execute"] = round(outside, 4)
    out["wall"] = round(wall_ms, 4)
    return out


def _run(folder: Path, manifest: dict, threads: int, ids: list[int], new: int, etdump: Path | None) -> dict:
    import numpy as np

    from edgekv.export.pte_stepper import PteStepper

    st = PteStepper(manifest, folder, threads, etdump=etdump is not None)
    warm = 1 + (1 if st.chunk else 0)
    n = st.chunk or st.max_chunk
    pre_calls = math.ceil(len(ids) / n)
    t0 = time.perf_counter()
    nxt = int(np.argmax(st.prefill(ids, last=True)[-1]))
    t1 = time.perf_counter()
    pos, steps = len(ids), []
    for _ in range(new - 1):
        s = time.perf_counter()
        nxt = int(np.argmax(st.step([nxt], pos)[-1]))
        steps.append(time.perf_counter() - s)
        pos += 1
    if etdump is not None:
        st.write_etdump(etdump)
    return {"warm_calls": warm, "prefill_calls": pre_calls, "prefill_ms_per_call": (t1 - t0) / pre_calls * 1e3,
            "decode_ms_per_step": float(np.median(steps)) * 1e3, "decode_steps": len(steps),
            # ETDump's per-call figures are means over the calls: the profiled run is compared with its own mean
            "decode_ms_mean": float(np.mean(steps)) * 1e3,
            "prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": len(steps) / sum(steps)}


def _events(path: Path) -> list:
    import contextlib
    import io
    import warnings

    from executorch.devtools import Inspector

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        ins = Inspector(etdump_path=str(path))
    out = []  # one list of events per block of calls with the same events
    for block in ins.event_blocks:
        if block.name != "Execute":
            continue
        out.append([(e.name, bool(e.is_delegated_op), list(e.perf_data.raw)) for e in block.events
                    if e.perf_data is not None])
    return [b for b in out if b]


def by_phase(blocks: list, warm: int, prefill: int, decode: int) -> tuple[list, list, int]:
    """(prefill events, decode events, prefill calls), each event (name, delegated, [ms per call of that phase]).
    ETDump keeps one sample per run of the method for every event, and the Inspector groups the runs whose events are
    the same into one block, in order: a .pte whose one-token calls take another branch of a torch.cond
    (swaps.SdpaAttention's rows call) has a block for its one-token calls (some warm-up calls and every decode step)
    and one for the longer ones. The decode steps are the last calls, all one token: the last `decode` samples of the
    one block that holds that many. The rest are the prefill's, warm-up calls included where the calls split over
    blocks (which block a warm-up call ran in is not known here)."""
    if len(blocks) == 1:
        events = blocks[0]
        return ([(k, d, raw[warm:warm + prefill]) for k, d, raw in events],
                [(k, d, raw[warm + prefill:]) for k, d, raw in events], prefill)
    big = [b for b in blocks if len(b[0][2]) >= decode]
    if len(big) != 1:
        raise SystemExit(f"profile_pte: {len(big)} blocks of calls hold {decode} or more: cannot say which are the "
                         "decode steps")
    pre, dec = [], []
    for events in blocks:
        n = len(events[0][2])
        cut = n - decode if events is big[0] else n
        pre += [(k, d, raw[:cut]) for k, d, raw in events]
        dec += [(k, d, raw[cut:]) for k, d, raw in events if raw[cut:]]
    return pre, dec, warm + prefill


def profile(folder: Path, threads: int, prompt_tokens: int, new: int) -> dict:
    from tokenizers import Tokenizer

    from edgekv.analyze.run import default_text
    from edgekv.export.manifest import load_export

    manifest = load_export(folder, check_hashes=False)
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(default_text()).ids[:prompt_tokens]
    clean = _run(folder, manifest, threads, ids, new, None)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "etdump.etdp"
        prof = _run(folder, manifest, threads, ids, new, path)
        pre_events, dec_events, n_pre = by_phase(_events(path), prof["warm_calls"], prof["prefill_calls"],
                                                 prof["decode_steps"])
    pre = per_call(pre_events, slice(None), n_pre)
    dec = per_call(dec_events, slice(None))
    portable = defaultdict(float)  # the portable kernels by operator name, ms per decode step
    for name, delegated, part in dec_events:
        if part and not delegated and category_of(name, delegated) in ("portable other", "cache write"):
            portable[name] += sum(part) / len(part)
    top = dict(sorted(((k, round(v, 4)) for k, v in portable.items()), key=lambda kv: -kv[1])[:8])
    # the decode step's single largest events, in the step's order (index among its events): the tied head is one
    # fully-connected call of the vocabulary's rows, apart from the layers' linears (as profiled, not scaled)
    singles = [(i, name, d, sum(part) / len(part)) for i, (name, d, part) in enumerate(dec_events) if part]
    largest = [{"index": i, "name": name, "delegated": d, "ms": round(ms, 4)}
               for i, name, d, ms in sorted(singles, key=lambda e: -e[3])[:10]]
    by_name = defaultdict(float)  # the XNNPACK kernels by name (the weights' formats: QC8W int8, QB4W 8da4w ...)
    for name, delegated, part in dec_events:
        if part and delegated:
            by_name[name] += sum(part) / len(part)
    xnn = dict(sorted(((k, round(v, 4)) for k, v in by_name.items()), key=lambda kv: -kv[1])[:12])
    counts = defaultdict(int)  # events of each kind in one decode call (every event has one sample per call)
    for name, delegated, _ in dec_events:
        counts[category_of(name, delegated) or name] += 1
    return {"artifact": str(folder), "threads": threads, "loadavg_end": list(os.getloadavg()), "prompt_tokens": len(ids), "new_tokens": new,
            "weights": manifest["weights"]["dtype"], "strategy": manifest["strategy"]["label"],
            "decode_tok_s": round(clean["decode_tok_s"], 2), "prefill_tok_s": round(clean["prefill_tok_s"], 1),
            "decode_ms": scaled(dec, clean["decode_ms_per_step"], prof["decode_ms_mean"]),
            "prefill_ms_per_call": scaled(pre, clean["prefill_ms_per_call"], prof["prefill_ms_per_call"]),
            "events_per_call": dict(sorted(counts.items())),
            "portable_decode_ms_by_op": top,  # as profiled (not scaled to the clean wall time), the 8 largest
            "xnnpack_decode_ms_by_op": xnn,  # as profiled, the 12 largest
            "decode_largest_events": largest,
            "profiled": {"decode_execute_ms": round(dec["execute"], 4), "decode_wall_ms": round(prof["decode_ms_mean"], 4),
                         "prefill_execute_ms": round(pre["execute"], 4),
                         "prefill_wall_ms": round(prof["prefill_ms_per_call"], 4)}}


def attention_probe(manifest: dict, threads: int, positions=(64, 560, 2000), runs: int = 200) -> list[dict]:
    """µs per decode-step attention of one layer (the export's cache layout [Hkv, T, 1, D], G query heads per KV
    head), custom_sdpa vs bmm at each position, and their max abs difference."""
    import torch

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (registers llama::custom_sdpa)

    torch.set_num_threads(threads)
    key = next(t for t in manifest["state"]["tensors"] if t["role"] == "key")
    _, hkv, slots, d = key["shape"]
    g = manifest["model"]["config"]["n_heads"] // hkv
    kc, vc = torch.randn(hkv, slots, 1, d), torch.randn(hkv, slots, 1, d)
    q = torch.randn(hkv, 1, g, d)
    scale = 1 / math.sqrt(d)

    def timed(f):
        f()
        t0 = time.perf_counter()
        for _ in range(runs):
            f()
        return (time.perf_counter() - t0) / runs * 1e6

    out = []
    for pos in (p for p in positions if p < slots):
        n = pos + 1
        k3, v3, q3 = kc.view(hkv, slots, d)[:, :n], vc.view(hkv, slots, d)[:, :n], q.view(hkv, g, d)
        sdpa = lambda: torch.ops.llama.custom_sdpa(q, kc, vc, pos, None, 0.0, True, scale)  # noqa: E731
        bmm = lambda: torch.bmm(torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) * scale, -1), v3)  # noqa: E731
        diff = float((sdpa().reshape(hkv, g, d) - bmm()).abs().max())
        out.append({"position": pos, "custom_sdpa_us": round(timed(sdpa), 1), "torch_bmm_us": round(timed(bmm), 1),
                    "max_abs_diff": diff})
    return out


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines.append(f"{Path(r['artifact']).name}, {r['threads']} thread(s): decode {r['decode_tok_s']} tok/s, "
                     f"prefill {r['prefill_tok_s']} tok/s")
        lines.append(f"  {'ms':>20}  {'decode step':>11}  {'prefill call':>12}")
        for c in CATEGORIES + ("wall",):
            d, pf = r["decode_ms"][c], r["prefill_ms_per_call"][c]
            lines.append(f"  {c:>20}  {d:8.3f} {d / r['decode_ms']['wall']:4.0%}  {pf:8.2f} "
                         f"{pf / r['prefill_ms_per_call']['wall']:4.0%}")
        if r.get("portable_decode_ms_by_op"):
            lines.append("  portable kernels of a decode step (ms, profiled): " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["portable_decode_ms_by_op"].items()))
        for a in r.get("attention_probe", []):
            lines.append(f"  one layer's decode attention at position {a['position']}: custom_sdpa "
                         f"{a['custom_sdpa_us']} us, torch bmm {a['torch_bmm_us']} us (max diff {a['max_abs_diff']:.1e})")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="an edgekv export folder with a model.pte")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts (default 1)")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--attention", action="store_true", help="also time one layer's decode attention: "
                    "custom_sdpa vs torch bmm")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "profile_pte.json"))
    a = ap.parse_args(argv)
    folder = Path(a.folder)
    rows = [profile(folder, int(t), a.prompt_tokens, a.new_tokens) for t in a.threads.split(",")]
    if a.attention:
        from edgekv.export.manifest import load_export

        manifest = load_export(folder, check_hashes=False)
        for r in rows:
            r["attention_probe"] = attention_probe(manifest, r["threads"])
    print(table(rows))
    out = Path(a.out)
    old = json.loads(out.read_text())["runs"] if out.exists() else []
    keep = [r for r in old if (Path(r["artifact"]).name, r["threads"]) not in
            {(Path(n["artifact"]).name, n["threads"]) for n in rows}]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"runs": keep + rows}, indent=1) + "\n")
    tmp.replace(out)
    return rows


if __name__ == "__main__":
    main()
