"""Prefill and decode at a filled context: edgekv's int4-weight artifacts next to llama.cpp and ONNX Runtime GenAI,
with each row's quality beside its speed.

benchmarks/decode_speed.py decodes after a ~500-token prompt, where the weights dominate what a step reads. Here each
configuration fills its context: for a context of C slots the prompt is the first C - new real tokens of the Python
docs (edgekv analyze's default text), then `new` decode steps run at positions C - new .. C - 2, where the state is
nearly all of what attention reads. The decode steps are fed the text's own next tokens (teacher forcing, not greedy),
so every row decodes the same tokens at the same positions and its logits can be compared with the fp32 model's
(transformers, LlamaForCausalLM or Gemma3ForCausalLM from the same GGUF, over the same ids): mean KL(fp32 || row)
and top-1 agreement over the new positions. A fast row that is wrong shows as wrong.

Rows (name = family:variant):
  edgekv-pte:S/int4, edgekv-ort:S/int4  edgekv export --strategy S --weights int4 (.pte: torchao 8da4w, XNNPACK;
                                        ONNX: MatMulNBits), run by edgekv/export/runtime.py's steppers, for
                                        S in kv:dtype=fp32, kv (fp16), kv-int8, kv-int8c (static per-channel
                                        scales, read by GroupQueryAttention), kv-int4, window, mla (converted)
  edgekv-ort:S/gguf                     edgekv export --weights gguf: the GGUF's own blocks carried into MatMulNBits /
                                        GatherBlockQuantized, no second quantization (edgekv.export.gguf_blocks)
  llamacpp:f16 / q8_0 / q4_0            llama.cpp (llama-cpp-python), the same GGUF, flash attention on, K and V type
                                        (sliding layers: a window-sized cache, swa_full off)
  genai:int4                            ONNX Runtime GenAI, its own builder's int4 model of the same weights
  et-llama:kv-fp32/8da4w, kv-int8/8da4w ExecuTorch's own Llama export (export_llama 8da4w, XNNPACK; kv-int8: with
                                        --quantize_kv_cache), run by ExecuTorch's runtime (benchmarks/et_llama.py)
Every row runs in a fresh process (benchmarks/decode_speed.py's run_child) and the repeats go round the rows. Memory
above baseline: the peak RSS minus the RSS after importing the runtime, before loading the model. Bytes per token:
weights read per step plus the state read at the mean decode position (manifest for edgekv, the planner for peers;
an edgekv graph that attends over all slots reads them all, which at a filled context is the same).

Usage: python benchmarks/filled_context.py [--quick] [--model M] [--ctx 2048,8192] [--only S1,S2] [--repeats N]
  e.g. --model gemma-3-270m --ctx 16384 --only edgekv-ort:kv-int8c,llamacpp:f16 (rows in the order of --only)
  --quick: ctx 2048, 16 new tokens, rows edgekv kv:dtype=fp32 / kv-int8 in both formats, llamacpp:f16 / q8_0,
  genai:int4; 1 repeat. The full run (default): ctx 2048 and 8192 (capped at the model's trained context), every row.
Exports, the reference logits and built peer models are cached in --work (default out/filled_context, gitignored).
A model outside the catalog (e.g. scripts/make_random_model.py's GGUF) runs as --model FILE.gguf; an existing export
as --export ROW=FOLDER. Where the exports and the fp32 reference need the memory lock and the rows do not, run
--prepare under the lock, then the rows with --reference-later, then --fill-quality for the KL.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_speed as ds
import et_llama

ROOT = ds.ROOT
MIB = ds.MIB
STRATEGIES = ("kv:dtype=fp32", "kv", "kv-int8", "kv-int8c", "kv-int4", "window", "mla")
PEERS = ("llamacpp:f16", "llamacpp:q8_0", "llamacpp:q4_0", "genai:int4")
PEERS += et_llama.ROWS
QUICK = ("edgekv-pte:kv:dtype=fp32/int4", "edgekv-ort:kv:dtype=fp32/int4", "edgekv-pte:kv-int8/int4",
         "edgekv-ort:kv-int8/int4", "llamacpp:f16", "llamacpp:q8_0", "genai:int4")
GENAI_CHUNK = 512  # tokens per GenAI append_tokens call while prefilling
# llama.cpp K/V types as planner strategies: q8_0 / q4_0 store blocks of 32 codes with one fp16 scale
LLAMACPP_KV = {"f16": "kv", "q8_0": "kv-int8:group=32", "q4_0": "kv-int4:group=32"}


# ---- pure arithmetic (tests/test_filled_context.py) ----


def prompt_len(ctx: int, new_tokens: int) -> int:
    """The prompt that fills a context of ctx slots, leaving room for new_tokens - 1 decode steps (the first new
    token's logits come from the prefill)."""
    return ctx - new_tokens + 1


def export_arg(e: str) -> tuple[str, str, str]:
    """--export ROW=FOLDER -> (ROW, "=", FOLDER), or (e, "", "") without one. The row's strategy may hold "="
    (edgekv-ort:kv:dtype=fp32/gguf) and its weights never do, so ROW ends at the first "=" after its "/"."""
    at = e.find("=", e.find("/") + 1) if "/" in e else e.find("=")
    return (e[:at], "=", e[at + 1:]) if at >= 0 else (e, "", "")


def export_record(folder: str, m: dict) -> dict:
    """What a row run on a prebuilt export (--export) records of it: the folder, the model's source, the strategy,
    the weights, and the operators of edgekv's own that its .pte calls (--pte-kernel edgekv: the manifest's
    `custom_ops`), so a row on edgekv's int8 kernel is told from the stock export of the same strategy."""
    rec = {"folder": folder, "model_source": m["model"].get("source"), "strategy": m["strategy"]["label"],
           "weights": m["weights"]["dtype"]}
    ops = [op for a in m.get("artifacts", []) for op in (a.get("custom_ops") or {}).get("ops", [])]
    if ops:
        rec["custom_ops"] = ops
    return rec


def quality(ref, got, rows: int = 16) -> dict:
    """KL(ref || got) per position (natural log, from logits [T, V]) and whether the top-1 tokens agree; the
    positions' own KLs too (kl_per_position), so two rows over the same positions can be compared pairwise (paired).
    Computed `rows` positions at a time: a 262k vocabulary's float64 rows are 2 MB each."""
    import numpy as np

    ref, got = np.asarray(ref), np.asarray(got)
    if ref.shape != got.shape:
        raise ValueError(f"logits shapes differ: {ref.shape} vs {got.shape}")

    def logp(x):
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    kls, top1 = [], []
    for s in range(0, ref.shape[0], rows):
        r, g = ref[s:s + rows].astype(np.float64), got[s:s + rows].astype(np.float64)
        lp, lq = logp(r), logp(g)
        kls.append((np.exp(lp) * (lp - lq)).sum(axis=-1))
        top1.append(r.argmax(-1) == g.argmax(-1))
    kl, top1 = np.concatenate(kls), np.concatenate(top1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agree": float(top1.mean()),
            "positions": int(ref.shape[0]), "kl_per_position": [round(float(k), 6) for k in kl]}


def paired(a: dict, b: dict) -> dict | None:
    """Row a's KL minus row b's over the same positions (two quality() dicts): the mean of the per-position
    differences and its standard error (sample standard deviation / sqrt(n)). The positions' own KLs vary far more
    than two rows' differ at one position (a hard token is hard for both), so the paired difference is the one whose
    sign a run of n positions can tell; None where either lacks the per-position KLs or their counts differ."""
    import math
    import statistics

    ka, kb = a.get("kl_per_position"), b.get("kl_per_position")
    if not ka or not kb or len(ka) != len(kb) or len(ka) < 2:
        return None
    d = [x - y for x, y in zip(ka, kb)]
    se = statistics.stdev(d) / math.sqrt(len(d))
    return {"kl_diff_mean": round(statistics.fmean(d), 6), "kl_diff_se": round(se, 6), "positions": len(d),
            "a_lower_at": sum(x < 0 for x in d)}


def pairs(rows: list[dict]) -> list[dict]:
    """paired() for every two rows at the same context that both have per-position KLs, in the rows' order."""
    graded = [r for r in rows if (r.get("quality") or {}).get("kl_per_position")]
    out = []
    for i, a in enumerate(graded):
        for b in graded[i + 1:]:
            p = paired(a["quality"], b["quality"]) if a["ctx"] == b["ctx"] else None
            if p:
                out.append({"a": a["name"], "b": b["name"], "ctx": a["ctx"], **p})
    return out


def state_read(nbytes: dict, strategy: str | None) -> dict:
    """A window cache is full once the position passes its window: every step reads all of it."""
    if strategy and strategy.startswith("window"):
        nbytes = dict(nbytes, state_at_pos=nbytes["state_full"])
    return nbytes


# ---- the children (one fresh process each) ----


class PrefillStopped(Exception):
    """A row's prefill passed its CPU budget (--stop-prefill): what it did, as a rate."""

    def __init__(self, tokens: int, cpu_s: float, wall_s: float, of: int):
        super().__init__(f"prefill stopped after {cpu_s:.0f} CPU s at token {tokens} of {of}: "
                         f"{tokens / cpu_s:.1f} tok per CPU s so far")
        self.progress = {"tokens": tokens, "of": of, "cpu_s": round(cpu_s, 1), "wall_s": round(wall_s, 1),
                         "tok_per_cpu_s": round(tokens / cpu_s, 2)}


def prefill_budget(budget: float | None, chunk: int, n_prompt: int):
    """The stepper's after_call for a prompt sent in calls of `chunk` tokens: raises PrefillStopped once the CPU
    time since this was made passes `budget` seconds (None: never)."""
    calls, t0, c0 = [0], time.perf_counter(), time.process_time()

    def after_call():
        calls[0] += 1
        if budget and time.process_time() - c0 > budget:
            raise PrefillStopped(min(calls[0] * chunk, n_prompt), time.process_time() - c0,
                                 time.perf_counter() - t0, n_prompt)
    return after_call


def _forced(prefill, step, ids: list[int], n_prompt: int, n_new: int, logits_out: str) -> dict:
    """prefill(ids) -> last logits [V]; step(token, pos) -> logits [V]. Runs the first n_prompt ids, then feeds
    ids[n_prompt .. n_prompt + n_new - 2] one at a time; writes the n_new logit rows (the prefill's last, then each
    step's) to logits_out (.npy) and times the prompt and the n_new - 1 steps.

    Each row goes to the file as it comes (the page cache, not this process): an array of every row held here would
    add n_new x V x 4 bytes to the row's peak memory (33 MB at 33 positions of a 262k vocabulary), which is the
    benchmark's, not the model's."""
    import numpy as np

    t0, c0 = time.perf_counter(), time.process_time()
    first = np.asarray(prefill(ids[:n_prompt]), dtype=np.float32).reshape(-1)
    t1, c1 = time.perf_counter(), time.process_time()
    with open(logits_out, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                                                 "fortran_order": False, "shape": (n_new, first.shape[-1])})
        f.write(first.tobytes())
        for i in range(1, n_new):
            f.write(np.asarray(step(ids[n_prompt + i - 1], n_prompt + i - 1), dtype=np.float32).tobytes())
    t2, c2 = time.perf_counter(), time.process_time()
    tokens = _argmax_rows(logits_out, n_new, first.shape[-1])  # after the clock, as before
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_cpu_s": c1 - c0, "decode_cpu_s": c2 - c1,
            "tokens": tokens}


def _argmax_rows(path: str, n: int, width: int) -> list[int]:
    """The top token of each of the n rows of a float32 .npy [n, width], read one row at a time (a mapping of the
    whole file would count its pages in this process's peak)."""
    import numpy as np

    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return [int(np.fromfile(f, dtype=np.float32, count=width).argmax()) for _ in range(n)]


def child_edgekv(spec: dict) -> dict:
    from edgekv.export.manifest import load_export

    folder = Path(spec["folder"])
    if spec["runtime"] == "executorch":
        import torch  # noqa: F401  (the ExecuTorch Python runtime; part of its baseline)
        from executorch.extension.pybindings import portable_lib  # noqa: F401

        from edgekv.export.pte_stepper import PteStepper as Stepper
    else:
        import onnxruntime  # noqa: F401

        from edgekv.export.runtime import OrtStepper as Stepper
    baseline = ds._status_bytes("VmRSS")
    manifest = load_export(folder, check_hashes=False)
    st = Stepper(manifest, folder, spec["threads"])
    # the prompt goes in chunks of st.chunk (or the method's most) tokens: one call is one chunk
    after_call = prefill_budget(spec.get("stop_prefill_cpu_s"), st.chunk or st.max_chunk, spec["n_prompt"])
    try:
        r = _forced(lambda ids: st.prefill(ids, last=True, after_call=after_call)[-1],
                    lambda t, pos: st.step([t], pos)[-1], spec["ids"], spec["n_prompt"], spec["new_tokens"],
                    spec["logits_out"])
    except PrefillStopped as e:
        return {"baseline": baseline, "error": str(e), "prefill_stopped": e.progress}
    return {"baseline": baseline, **r}


def child_llamacpp(spec: dict) -> dict:
    """llama.cpp at its long-context settings (decode_speed.llamacpp_session), teacher-forced like the other rows."""
    baseline = ds._status_bytes("VmRSS")
    prefill, step = ds.llamacpp_session(spec)
    r = _forced(prefill, step, spec["ids"], spec["n_prompt"], spec["new_tokens"], spec["logits_out"])
    return {"baseline": baseline, **r}


def child_genai(spec: dict) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    baseline = ds._status_bytes("VmRSS")
    cfg = og.Config(spec["folder"])
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": spec["threads"]}}}}))
    model = og.Model(cfg)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=spec["ctx"], do_sample=False)
    gen = og.Generator(model, params)

    def run(tokens):
        # the prompt in calls of GENAI_CHUNK tokens (llama.cpp's n_batch): in one call GenAI's attention holds
        # [heads, n, n] scores, gigabytes at a 16k prompt (benchmarks/log/filled_context.md, GenAI at a filled 16k)
        for s in range(0, len(tokens), GENAI_CHUNK):
            gen.append_tokens(tokens[s:s + GENAI_CHUNK])  # runs the model over them
        return np.asarray(gen.get_logits(), dtype=np.float32).reshape(-1, spec["vocab"])[-1]

    r = _forced(lambda ids: run(ids), lambda t, pos: run([t]), spec["ids"], spec["n_prompt"], spec["new_tokens"],
                spec["logits_out"])
    return {"baseline": baseline, **r}


def child_reference(spec: dict) -> dict:
    """The fp32 model's logits at the decode positions: transformers from the GGUF (dequantized to fp32; its own
    class for the family: LlamaForCausalLM, Gemma3ForCausalLM) or from an HF folder, SDPA attention, the ids run in
    chunks through a DynamicCache built from the model's config (Gemma 3's sliding layers keep their window), so
    memory stays bounded at 16k+. The logits come from the model's own forward (logits_to_keep), so a family's final
    softcapping is applied as transformers applies it."""
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    p = Path(spec["model_path"])
    where, extra = (str(p.parent), {"gguf_file": p.name}) if p.suffix == ".gguf" else (str(p), {})
    model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, attn_implementation="sdpa",
                                                              **extra).eval()
    factors = _rope_freqs(p) if p.suffix == ".gguf" else None
    if factors is not None:
        rot = model.model.rotary_emb
        if getattr(rot, "rope_type", "default") != "default" or rot.inv_freq.shape != factors.shape:
            raise RuntimeError("the GGUF has rope_freqs.weight and transformers read a rope scaling of its own")
        rot.inv_freq = rot.inv_freq / torch.from_numpy(factors)
    n_prompt, n_new = spec["n_prompt"], spec["new_tokens"]
    ids = spec["ids"][:n_prompt + n_new - 1]
    want = n_prompt - 1  # logits of positions want .. want + n_new - 1
    cache = transformers.DynamicCache(config=model.config)
    rows = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in range(0, len(ids), spec["chunk"]):
            part = ids[s:s + spec["chunk"]]
            lo = max(want - s, 0)
            keep = len(part) - lo if lo < len(part) else 1  # the head only where a wanted position is
            out = model(input_ids=torch.tensor([part]), past_key_values=cache, use_cache=True, logits_to_keep=keep)
            if lo < len(part):
                rows.append(out.logits[0].float().numpy())
    logits = np.concatenate(rows)
    assert logits.shape[0] == n_new, logits.shape
    np.save(spec["logits_out"], logits)
    return {"baseline": 0, "seconds": time.perf_counter() - t0, "model_class": type(model).__name__}


def _rope_freqs(path: Path):
    """Llama 3's rope scaling as a GGUF stores it: rope_freqs.weight, one factor per frequency, by which llama.cpp
    divides the frequency (convert_hf_to_gguf.py LlamaModel.generate_extra_tensors). transformers' GGUF loader drops
    the tensor and runs plain RoPE, so the reference applies it to the rotary embedding's inverse frequencies."""
    import gguf
    import numpy as np

    t = next((t for t in gguf.GGUFReader(str(path)).tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else np.asarray(t.data, dtype=np.float32).reshape(-1).copy()


CHILDREN = {"edgekv": child_edgekv, "llamacpp": child_llamacpp, "genai": child_genai,
            "reference": child_reference, "bandwidth": ds.child_bandwidth, "hf_folder": ds.child_hf_folder}
CHILDREN["et-llama"] = lambda spec: et_llama.child(spec, _forced, ds._status_bytes)


def run_child(spec: dict, timeout: int) -> dict:
    return ds.run_child(spec, timeout, script=__file__)


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    r = CHILDREN[spec["kind"]](spec)
    r["peak_rss"] = ds._status_bytes("VmHWM")
    print("RESULT " + json.dumps(r), flush=True)


# ---- the run ----


def row_names(quick: bool) -> list[str]:
    if quick:
        return list(QUICK)
    return [f"edgekv-{rt}:{s}/int4" for s in STRATEGIES for rt in ("pte", "ort")] \
        + [f"edgekv-ort:{s}/gguf" for s in STRATEGIES] + list(PEERS)


def plan_row(name: str, work: ds.Work, ctx: int, threads: int, base: dict, arch, pos: float, formats: dict, log,
             exports: dict | None = None, prefill_threads: int | None = None):
    family, variant = name.split(":", 1)
    spec = dict(base, ctx=ctx, threads=threads)
    if family.startswith("edgekv-"):
        from edgekv.export.manifest import load_export
        strategy, weights = variant.rsplit("/", 1)
        folder = (exports or {}).get(name) or work.export(strategy, weights, ctx, formats[(strategy, weights)])
        spec.update(kind="edgekv", runtime="ort" if family == "edgekv-ort" else "executorch", folder=str(folder))
        return spec, state_read(ds.edgekv_bytes(load_export(folder, check_hashes=False), pos), strategy)
    if family == "llamacpp":
        import importlib.util
        if importlib.util.find_spec("llama_cpp") is None:
            raise RuntimeError("llama-cpp-python is not installed (pip install -r requirements-bench.lock)")
        spec.update(kind="llamacpp", kv=variant, prefill_threads=prefill_threads)
        return spec, ds.peer_bytes(arch, "gguf", LLAMACPP_KV[variant], ctx, pos)
    if family == "genai":
        spec.update(kind="genai", folder=str(work.genai_model(variant)), vocab=arch.vocab)
        return spec, ds.peer_bytes(arch, variant, "kv:dtype=fp32", ctx, pos)
    if family == "et-llama":
        spec.update(kind="et-llama", chunk=min(et_llama.MAX_TOKENS, ctx),
                    pte=str(et_llama.build(work.root, work.model_path, ctx, variant, log)))
        return spec, et_llama.bytes_per_token(arch, ctx, pos, variant)
    raise ValueError(name)


def _reference_path(work: ds.Work, ids, n_prompt: int, new: int, model: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(ids[:n_prompt + new]).encode()).hexdigest()[:12]  # the ids, BOS included
    m = model or work.model_path
    stem = m.stem if m.suffix == ".gguf" else m.name
    return work.root / "reference" / ds.slug(f"{stem}-p{n_prompt}-n{new}-{digest}.npy")


def cached_reference(work: ds.Work, ids, n_prompt: int, new: int, model: Path | None = None) -> Path | dict:
    out = _reference_path(work, ids, n_prompt, new, model)
    return out if out.is_file() else {"error": "not computed in this run (--reference-later): rerun with "
                                               "--fill-quality"}


def fill_quality(out: Path, done: list, refs: dict, new: int, log) -> dict:
    """Add each row's KL to the JSON an earlier --reference-later run wrote, from the logits it saved."""
    import numpy as np

    result = json.loads(out.read_text())
    specs = {(row["name"], ctx): spec for row, _, spec, _, ctx in done}
    for row in result["rows"]:
        spec, ref = specs.get((row["name"], row["ctx"])), refs.get(row["ctx"])
        if row.get("error") or spec is None or not Path(spec["logits_out"]).is_file():
            continue
        row["quality"] = ({"error": f"reference: {ref['error']}"} if isinstance(ref, dict)
                          else quality(np.load(ref, mmap_mode="r"), np.load(spec["logits_out"], mmap_mode="r")))
        log(f"{row['name']} ctx {row['ctx']}: KL {row['quality'].get('kl_mean')}")
    result["quality_filled_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)
    return result


def reference(work: ds.Work, ids, n_prompt: int, new: int, a, log) -> Path | dict:
    """The fp32 logits for (n_prompt, new), computed once and cached in the work folder."""
    model = Path(a.reference_model).resolve() if a.reference_model else work.model_path
    out = _reference_path(work, ids, n_prompt, new, model)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"reference fp32 logits, prompt {n_prompt} ...")
    r = run_child({"kind": "reference", "model_path": str(model), "ids": ids, "n_prompt": n_prompt,
                   "new_tokens": new, "threads": a.threads, "chunk": 1024, "logits_out": str(out)}, a.timeout * 2)
    if "error" in r:
        return r
    log(f"  {r['seconds']:.0f} s")
    return out


def summarize(runs: list[dict], n_prompt: int, new_tokens: int) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    mid = sorted(ok, key=lambda r: r["decode_s"])[len(ok) // 2]
    return {"prefill_tok_s": round(statistics.median(n_prompt / r["prefill_s"] for r in ok), 1),
            "decode_tok_s": round(statistics.median((new_tokens - 1) / r["decode_s"] for r in ok), 2),
            "peak_rss_bytes": mid["peak_rss"], "baseline_rss_bytes": mid["baseline"],
            "above_baseline_bytes": mid["peak_rss"] - mid["baseline"], "repeats": len(ok),
            "decode_tok_s_runs": [round((new_tokens - 1) / r["decode_s"], 2) for r in ok],
            # per CPU second of the row's process: with one thread, what a quiet core would give, nearly
            "decode_tok_per_cpu_s": round(statistics.median((new_tokens - 1) / r["decode_cpu_s"] for r in ok), 2),
            "prefill_tok_per_cpu_s": round(statistics.median(n_prompt / r["prefill_cpu_s"] for r in ok), 1),
            "prefill_tok_s_runs": [round(n_prompt / r["prefill_s"], 1) for r in ok]}


def table(rows: list[dict]) -> str:
    def f(v, spec, scale=1.0):
        return "-" if v is None else format(v * scale, spec)

    cols = ("ctx", "prefill", "decode", "dec/cpu", ">base", "MB/tok", "KL", "top1")
    lines = [f"{'row':<32} " + " ".join(f"{c:>8}" for c in cols),
             f"{'':<32} " + " ".join(f"{c:>8}" for c in ("", "tok/s", "tok/s", "tok/cpus", "MiB", "", "nats",
                                                          "%"))]
    for r in rows:
        head = f"{r['name']:<32} {r['ctx']:>8} "
        if r.get("error"):
            lines.append(head + f"error: {r['error'][:150]}")
            continue
        q = r.get("quality") or {}
        lines.append(head + " ".join((f(r.get("prefill_tok_s"), "8.0f"), f(r.get("decode_tok_s"), "8.2f"),
                                      f(r.get("decode_tok_per_cpu_s"), "8.2f"), f(r.get("above_baseline_bytes"), "8.0f", 1 / MIB),
                                      f(r.get("bytes_per_token"), "8.1f", 1e-6), f(q.get("kl_mean"), "8.4f"),
                                      f(q.get("top1_agree"), "8.0f", 100))))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="ctx 2048, 16 new tokens, 7 rows (minutes)")
    ap.add_argument("--only", help="comma-separated substrings of row names, e.g. kv-int8,llamacpp; the rows run in "
                                   "the order of these keys")
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    ap.add_argument("--export", action="append", default=[], metavar="ROW=FOLDER",
                    help="run the edgekv row ROW on an existing export instead of exporting it (one made earlier, e.g. "
                         "from the HF folder the GGUF was made from); the row records the folder and its source")
    ap.add_argument("--stop-prefill", action="append", default=[], metavar="ROW=CPU_S",
                    help="stop the edgekv row ROW once its prompt has used CPU_S seconds of CPU (a prefill known to "
                         "be hopeless); the row then records the tokens it prefilled and their rate, and no decode")
    ap.add_argument("--reference-later", action="store_true",
                    help="use a cached fp32 reference only: without one the rows run with no KL, and the same command "
                         "with --fill-quality (a process of the fp32 model's size) adds it to --out afterwards")
    ap.add_argument("--reference-model", help="the fp32 reference from this HF folder or GGUF instead of --model's "
                                              "(the same model: e.g. the HF folder a quantized GGUF was made from, so "
                                              "every row's KL includes its own weight quantization)")
    ap.add_argument("--fill-quality", action="store_true",
                    help="compute the fp32 reference and add the KL of every row in --out from its saved logits")
    ap.add_argument("--prepare", action="store_true",
                    help="build the rows' exports and the fp32 reference logits into --work, then stop: the heavy "
                         "steps (a 1B's export and fp32 reference need ~6 GB) can run under a memory lock, and a "
                         "later run with the same --work reuses them and runs the rows")
    ap.add_argument("--model", default="smollm2-135m", help="packaged name or .gguf")
    ap.add_argument("--ctx", help="comma-separated contexts to fill (default 2048,8192; --quick 2048); capped at "
                                  "the model's trained context")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-threads", type=int,
                    help="llama.cpp rows: threads for the prompt only (n_threads_batch), decode stays at --threads; "
                         "fills a large model's context sooner on a loaded host (the prefill columns are then not at "
                         "--threads)")
    ap.add_argument("--new-tokens", type=int, help="decode steps + 1 (default 32; --quick 16)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per row (fresh process each); medians reported")
    ap.add_argument("--bw-mib", type=int, default=512)
    ap.add_argument("--bw-runs", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per row process")
    ap.add_argument("--work", default=str(ROOT / "out" / "filled_context"))
    ap.add_argument("--out", help="default benchmarks/results/filled_context[_quick].json")
    a = ap.parse_args(argv)
    new = a.new_tokens or (16 if a.quick else 32)
    if new < 2 or a.repeats < 1 or a.threads < 1:
        ap.error("--new-tokens must be at least 2, --repeats and --threads at least 1")
    exports = {}
    for e in a.export:
        row, sep, folder = export_arg(e)
        if not sep or not row.startswith("edgekv-") or not (Path(folder) / "manifest.json").is_file():
            ap.error(f"--export {e!r}: ROW=FOLDER, an edgekv row and a folder with an edgekv manifest.json")
        exports[row] = str(Path(folder).resolve())
    stop_prefill = {}
    for e in a.stop_prefill:
        row, sep, cpu = e.partition("=")
        try:
            stop_prefill[row] = float(cpu)
        except ValueError:
            sep = ""
        if not sep or not row.startswith("edgekv-") or stop_prefill.get(row, 0) <= 0:
            ap.error(f"--stop-prefill {e!r}: ROW=CPU_S, an edgekv row and a positive number of seconds")
    # a row an --export names that the list has not (e.g. edgekv-pte:kv:dtype=fp16/int4 beside edgekv-pte:kv/int4:
    # the same cache built two ways, side by side in one run) joins the rows --only selects from
    names = ds.select(row_names(a.quick) + [r for r in exports if r not in row_names(a.quick)], a.only)
    if not a.only or "gguf" not in a.only:  # the carried-weight rows run when a key names them (--only .../gguf)
        names = [n for n in names if not n.endswith("/gguf")]
    if a.only:  # the rows run in the order of the keys they match first (a long run puts the rows it needs first)
        keys = [k.strip() for k in a.only.split(",") if k.strip()]
        names.sort(key=lambda n: next(i for i, k in enumerate(keys) if k in n))
    if a.list:
        print("\n".join(names))
        return {"rows": names}
    if not names:
        ap.error(f"--only {a.only!r} selects no row; rows: {', '.join(row_names(a.quick))}")
    try:
        ctxs = [int(c) for c in (a.ctx or ("2048" if a.quick else "2048,8192")).split(",")]
    except ValueError:
        ap.error(f"--ctx {a.ctx!r}: comma-separated integers")
    if min(ctxs) <= new:
        ap.error(f"--ctx {min(ctxs)} leaves no room for a prompt before {new} new tokens")

    from edgekv.arch import load_arch
    from edgekv.models.weights import resolve_model

    log = lambda s: print(s, file=sys.stderr, flush=True)
    t_start = time.perf_counter()
    model_path = resolve_model(a.model).resolve()
    arch = load_arch(str(model_path))
    trained = (arch.trained_ctx or (None,))[0] or arch.max_position
    if trained:
        skipped = [c for c in ctxs if c > trained]
        ctxs = [c for c in ctxs if c <= trained]
        if skipped:
            log(f"skipping ctx {skipped}: beyond the model's trained context {trained}")
        if not ctxs:
            ap.error(f"every --ctx exceeds the model's trained context {trained}")
    ids = ds.prompt_ids(model_path, max(ctxs) + 1)
    if len(ids) < max(ctxs):
        ap.error(f"the text has {len(ids)} tokens, fewer than ctx {max(ctxs)}")
    work = ds.Work(Path(a.work), str(model_path) if Path(a.model).exists() else a.model, model_path, log)
    out = Path(a.out or ROOT / "benchmarks" / "results" / ("filled_context_quick.json" if a.quick
                                                           else "filled_context.json"))
    result = {"benchmark": "filled_context", "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": ds.machine_info(), "versions": ds.versions(),
              "settings": {"model": a.model, "model_path": str(model_path), "trained_ctx": trained, "ctx": ctxs,
                           "new_tokens": new, "prompt_tokens": {str(c): prompt_len(c, new) for c in ctxs},
                           "prompt": "first tokens of edgekv.analyze.run.default_text() (Python docs); the decode "
                                     "steps are fed the text's next tokens",
                           "threads": a.threads, "prefill_threads_llamacpp": a.prefill_threads,
                           "repeats": a.repeats, "quick": a.quick, "only": a.only,
                           "order": "the repeats go round the rows", "genai_prompt_chunk": GENAI_CHUNK,
                           "quality": "KL(fp32 || row) mean over the new positions, natural log; top-1 agreement; "
                                      "fp32 = transformers (LlamaForCausalLM, Gemma3ForCausalLM) from the same GGUF"
                                      + (f" (here from {a.reference_model})" if a.reference_model else "")},
              "bandwidth": {}, "rows": []}
    bw_args = argparse.Namespace(bw_mib=a.bw_mib, bw_runs=a.bw_runs, timeout=a.timeout)
    ds.probe(result["bandwidth"], [a.threads], bw_args, log)
    formats: dict[tuple[str, str], set[str]] = {}
    for n in names:
        if n.startswith("edgekv-") and n not in exports:  # a row on a prebuilt export (--export) needs no format here
            fam, variant = n.split(":", 1)
            formats.setdefault(tuple(variant.rsplit("/", 1)), set()).add("onnx" if fam == "edgekv-ort" else "pte")

    done = []  # (row, nbytes, spec, runs, ctx)
    for ctx in ctxs:
        n_prompt = prompt_len(ctx, new)
        pos = ds.mean_decode_position(n_prompt, new)
        base = {"model_path": str(model_path), "ids": ids[:n_prompt + new - 1], "n_prompt": n_prompt,
                "new_tokens": new}
        for name in names:
            row = {"name": name, "ctx": ctx, "threads": a.threads, "prompt_tokens": n_prompt}
            try:
                spec, nbytes = plan_row(name, work, ctx, a.threads, base, arch, pos, formats, log, exports,
                                        a.prefill_threads)
                if name in exports:
                    from edgekv.export.manifest import load_export
                    m = load_export(Path(exports[name]), check_hashes=False)
                    row["export"] = export_record(exports[name], m)
                if name in stop_prefill:
                    spec["stop_prefill_cpu_s"] = stop_prefill[name]
                    row["stop_prefill_cpu_s"] = stop_prefill[name]
                spec["logits_out"] = str(work.root / "logits" / ds.slug(f"{name}-c{ctx}.npy"))
                Path(spec["logits_out"]).parent.mkdir(parents=True, exist_ok=True)
            except Exception as e:  # noqa: BLE001 (a row that cannot be prepared carries its error)
                row["error"] = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
                spec, nbytes = None, None
                log(f"{name} ctx {ctx}: error: {row['error']}")
            done.append((row, nbytes, spec, [], ctx))
    # the fp32 reference logits of every context, after the exports (a reference cached by an earlier run is reused)
    ref_model = Path(a.reference_model).resolve() if a.reference_model else None
    if a.reference_later and not a.fill_quality:
        refs = {ctx: cached_reference(work, ids, prompt_len(ctx, new), new, ref_model) for ctx in ctxs}
    else:
        refs = {ctx: reference(work, ids, prompt_len(ctx, new), new, a, log) for ctx in ctxs}
    if a.fill_quality:
        return fill_quality(out, done, refs, new, log)
    if a.prepare:
        failed = [f"{row['name']}: {row['error']}" for row, *_ in done if row.get("error")]
        failed += [f"reference ctx {c}: {r['error']}" for c, r in refs.items() if isinstance(r, dict)]
        log("prepared" if not failed else "not prepared: " + "; ".join(failed))
        return {"prepared": not failed, "errors": failed}
    def write(final: bool) -> None:
        """The JSON as it stands: after every row's run (partial, so a run cut short keeps what it measured) and at
        the end."""
        import numpy as np

        rows = []
        for ctx in refs:  # a reference another process (--prepare) computed while the rows ran
            if isinstance(refs[ctx], dict) and a.reference_later:
                refs[ctx] = cached_reference(work, ids, prompt_len(ctx, new), new, ref_model)
        for row, nbytes, spec, runs, ctx in done:
            row = dict(row)
            if spec is not None and runs:
                row.update(summarize(runs, spec["n_prompt"], new))
                stopped = [r["prefill_stopped"] for r in runs if "prefill_stopped" in r]
                if stopped:
                    row["prefill_stopped"] = stopped
                row["loadavg_runs"] = [r.get("loadavg") for r in runs]
                if "error" not in row:
                    ref = refs[ctx]
                    row["quality"] = ({"error": f"reference: {ref['error']}"} if isinstance(ref, dict)
                                      else quality(np.load(ref, mmap_mode="r"), np.load(spec["logits_out"], mmap_mode="r")))
            rows.append(ds.finish_row(row, nbytes, result["bandwidth"]))
        result["rows"] = rows
        result["paired"] = pairs(rows)
        result["partial"] = not final
        result["machine"]["loadavg_end"] = list(os.getloadavg())
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    for rep in range(a.repeats):
        for row, _, spec, runs, _ in done:
            if spec is None:
                continue
            log(f"{row['name']} ctx {row['ctx']} (run {rep + 1} of {a.repeats}) ...")
            r = run_child(spec, a.timeout)
            r["loadavg"] = list(os.getloadavg())
            runs.append(r)
            log("  " + (f"error: {r['error']}" if "error" in r else
                        f"prefill {spec['n_prompt'] / r['prefill_s']:.1f} tok/s, decode "
                        f"{(new - 1) / r['decode_s']:.2f} tok/s, peak {r['peak_rss'] / MIB:.0f} MiB"))
            write(final=False)
    ds.probe(result["bandwidth"], [a.threads], bw_args, log)
    write(final=True)
    print(table(result["rows"]))
    print(f"load average {result['machine']['loadavg_start']} -> {result['machine']['loadavg_end']}; wrote {out}")
    return result


if __name__ == "__main__":
    ds.entry(main, child_main)
