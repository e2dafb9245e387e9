"""Prefill once: `edgekv run --resume` of a saved state against re-prefilling the whole prompt, at a filled context.

For each row (a model, its ONNX export at max_ctx C) the prompt P is about C - 64 tokens of real text (the
Python docs filled_context.py reads) and Q the next 8 tokens, split where P + Q tokenizes as P then Q (checked with the
export's own tokenizer, with and without its special tokens). Three `edgekv run` invocations, each in a fresh process
(the CLI's own code, called in-process by the child so a 32k-token prompt needs no command line):
  save    run F --prompt P -n 0 --save-state S       the prefill of P: what re-prefilling costs
  resume  run F --resume S --prompt Q -n K           load + check the state file, prefill Q, generate K tokens
  whole   run F --prompt P+Q -n K                    re-prefill everything, generate K tokens
resume and whole must generate the same K tokens (greedy). Timings come from the child: the run's own stages (open =
hashes + runtime session, load = state file read and checked, prefill, save) as wall and CPU seconds of the process,
plus the whole process (imports included). The state file is dropped from the page cache (posix_fadvise DONTNEED on
that file only) before the resume, so its load is read from disk. ratios.first_token = whole's prefill over
resume's (load + prefill): the time to the first new token once the session is open; the process ratios include
Python and runtime start-up, which both pay.
Then the refusals, each a real `python -m edgekv.cli run` process that must exit 2 with one line on stderr: the state
file truncated, a state file from another export (the previous row's, or the same file with its strategy changed when
there is none), and a resume whose prompt overflows max_ctx.

Usage: python benchmarks/resume_state.py [--quick] [--only NAME,...] [--whole-max-ctx C] [--threads 1]
  --quick: SmolLM2-135M kv at ctx 1024 (minutes). Full: SmolLM2-135M kv and kv-int8c (int4 weights) at 8192,
  Gemma-3-270M kv (its native state: sliding layers a ring of 512; fp32 weights) at 32768. The whole (re-prefill)
  runs go last, so a run cut short keeps every save / resume; --whole-max-ctx skips them above a context. The JSON
  is written after every step; --keep keeps the rows of an earlier run in it that this run does not redo.
Exports are cached in --work (default out/resume_state, gitignored).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import filled_context as fc
from edgekv.children import child_setup  # a child dies with this process

ds = fc.ds
ROOT = ds.ROOT
MIB = ds.MIB
# name -> (model, strategy, weights, ctx)
ROWS = {"smollm2-135m:kv/int4@8192": ("smollm2-135m", "kv", "int4", 8192),
        "smollm2-135m:kv-int8c/int4@8192": ("smollm2-135m", "kv-int8c", "int4", 8192),
        # fp32 weights: its int4 ONNX export is refused by export's own verify-quant (the weights come from a Q4_K_M
        # GGUF, requantized to symmetric int4 they miss edgekv.export.wquant's KL threshold)
        "gemma-3-270m:kv/fp32@32768": ("gemma-3-270m", "kv", "fp32", 32768)}
QUICK = {"smollm2-135m:kv/int4@1024": ("smollm2-135m", "kv", "int4", 1024)}
ROOM, Q_TOKENS, NEW_TOKENS = 64, 8, 16  # P leaves ROOM slots; Q and the K new tokens fit in them


# ---- pure parts (tests/test_resume_state.py) ----


def split(tok, text: str, n_prompt: int, n_q: int, tries: int = 64) -> dict:
    """P (about n_prompt tokens of text) and Q (the next n_q) such that P + Q tokenizes as P then Q, with and without
    the tokenizer's special tokens. Starts at token n_prompt and moves back a token at a time until the split is
    stable; raises ValueError after `tries`."""
    enc = tok.encode(text, add_special_tokens=False)
    ids, offsets = enc.ids, enc.offsets
    if len(ids) <= n_prompt + n_q:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {n_prompt + n_q + 1}")
    for n in range(n_prompt, max(n_prompt - tries, 0), -1):
        a, b = offsets[n][0], offsets[n + n_q][0]
        p, q = text[:a], text[a:b]
        ip, iq = tok.encode(p, add_special_tokens=False).ids, tok.encode(q, add_special_tokens=False).ids
        if ip != ids[:n] or iq != ids[n:n + n_q] or tok.encode(p + q, add_special_tokens=False).ids != ip + iq:
            continue
        sp, sq, spq = (tok.encode(s).ids for s in (p, q, p + q))  # the special tokens the run's encode adds, if any
        return {"P": p, "Q": q, "p_ids": ip, "q_ids": iq, "moved_back": n_prompt - n,
                "special_tokens_added": [len(sp) - len(ip), len(sq) - len(iq), len(spq) - len(ip) - len(iq)]}
    raise ValueError(f"no split of the text within {tries} tokens before token {n_prompt} tokenizes as P then Q")


def ratios(save: dict | None, resume: dict | None, whole: dict | None) -> dict:
    """Re-prefill over resume: the time to the first new token once the session is open (whole's prefill over
    resume's load + prefill), and the whole processes' wall and CPU seconds. None where a side is missing."""
    def div(a, b):
        return round(a / b, 2) if a is not None and b else None

    out = {}
    if resume and "error" not in resume:
        first = resume["load_s"] + resume["prefill_s"]
        first_cpu = resume["load_cpu_s"] + resume["prefill_cpu_s"]
        if save and "error" not in save:  # the prefill of P alone, from the save run
            out["save_prefill_over_resume_first_token"] = div(save["prefill_s"], first)
            out["save_prefill_cpu_over_resume_first_token_cpu"] = div(save["prefill_cpu_s"], first_cpu)
        if whole and "error" not in whole:
            out["first_token"] = div(whole["prefill_s"], first)
            out["first_token_cpu"] = div(whole["prefill_cpu_s"], first_cpu)
            out["process_wall"] = div(whole["process_wall_s"], resume["process_wall_s"])
            out["process_cpu"] = div(whole["process_cpu_s"], resume["process_cpu_s"])
    return out


def one_line_error(returncode: int, stderr: str) -> dict:
    lines = [s for s in stderr.strip().splitlines() if s.strip()]
    return {"exit_code": returncode, "stderr": lines[-1][:300] if lines else "", "stderr_lines": len(lines),
            "ok": returncode == 2 and len(lines) == 1 and "Traceback" not in stderr}


# ---- the child: one `edgekv run`, in a fresh process ----


def child_run(spec: dict) -> dict:
    from click.testing import CliRunner

    import edgekv.export.generate as gen
    import edgekv.export.statefile as sf
    from edgekv.cli import main as cli

    t: dict = {}

    def timed(key, fn):
        def f(*a, **k):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                t[f"{key}_s"] = t.get(f"{key}_s", 0.0) + time.perf_counter() - w
                t[f"{key}_cpu_s"] = t.get(f"{key}_cpu_s", 0.0) + time.process_time() - c
        return f

    open_export = gen.open_export

    def opened(*a, **k):  # the stepper's prefill, timed in wall and CPU seconds
        manifest, stepper, tok = timed("open", open_export)(*a, **k)
        stepper.prefill = timed("prefill", stepper.prefill)
        return manifest, stepper, tok

    gen.open_export = opened
    sf.load, sf.save = timed("load", sf.load), timed("save", sf.save)
    args = ["run", spec["folder"], "--prompt", Path(spec["prompt_file"]).read_text(encoding="utf-8"),
            "-n", str(spec["new_tokens"]), "--threads", str(spec["threads"]), "--json", *spec["extra"]]
    r = timed("run", lambda: CliRunner().invoke(cli, args))()
    if r.exit_code != 0:
        return {"error": ds._last_line(r.stderr or r.output) or f"exit code {r.exit_code}"}
    out = json.loads(r.stdout)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    keep = ("prompt_tokens", "resumed_at", "new_tokens", "tokens", "text", "saved_state", "stopped")
    return {**{k: out[k] for k in keep if k in out}, **t, "process_cpu_s": ru.ru_utime + ru.ru_stime}


def run_child(spec: dict, timeout: int) -> dict:
    t0 = time.perf_counter()
    r = ds.run_child(dict(spec, kind="run"), timeout, script=__file__)
    r["process_wall_s"] = time.perf_counter() - t0
    r["loadavg"] = list(os.getloadavg())
    return r


def child_main(spec_json: str) -> None:
    r = child_run(json.loads(spec_json))
    r["peak_rss"] = ds._status_bytes("VmHWM")
    print("RESULT " + json.dumps(r), flush=True)


# ---- the run ----


def drop_from_page_cache(path: Path) -> None:
    """This one file's pages out of the page cache (they are clean: save fsyncs), so the next read is from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def refuse(folder: Path, state: Path, prompt: str, threads: int, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "edgekv.cli", "run", str(folder), "--resume", str(state), "--prompt", prompt,
           "-n", "4", "--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, preexec_fn=child_setup())
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout} s"}
    return {**one_line_error(p.returncode, p.stderr), "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="SmolLM2-135M kv at ctx 1024")
    ap.add_argument("--only", help="comma-separated substrings of row names")
    ap.add_argument("--whole-max-ctx", type=int, help="skip the whole (re-prefill) runs above this context")
    ap.add_argument("--no-refusals", action="store_true", help="skip the refused-file checks")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per process")
    ap.add_argument("--work", default=str(ROOT / "out" / "resume_state"))
    ap.add_argument("--out", help="default benchmarks/results/resume_state[_quick].json")
    ap.add_argument("--keep", action="store_true", help="keep the rows of an existing --out file that this run does "
                                                        "not redo (rows run by separate invocations, one file)")
    a = ap.parse_args(argv)
    table = QUICK if a.quick else ROWS
    names = ds.select(list(table), a.only)
    if not names:
        ap.error(f"--only {a.only!r} selects no row; rows: {', '.join(table)}")
    if a.threads < 1:
        ap.error("--threads must be at least 1")

    from edgekv.analyze.run import default_text
    from edgekv.export.generate import load_tokenizer
    from edgekv.models.weights import resolve_model

    log = lambda s: print(s, file=sys.stderr, flush=True)
    t_start = time.perf_counter()
    work_root = Path(a.work)
    out = Path(a.out or ROOT / "benchmarks" / "results" / ("resume_state_quick.json" if a.quick
                                                           else "resume_state.json"))
    result = {"benchmark": "resume_state", "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": ds.machine_info(), "versions": ds.versions(),
              "settings": {"rows": names, "room": ROOM, "q_tokens": Q_TOKENS, "new_tokens": NEW_TOKENS,
                           "threads": a.threads, "quick": a.quick, "whole_max_ctx": a.whole_max_ctx,
                           "format": "onnx (ONNX Runtime)",
                           "prompt": "P: about ctx - 64 tokens of edgekv.analyze.run.default_text() (Python docs), "
                                     "Q: the next 8 tokens, split where P + Q tokenizes as P then Q",
                           "page_cache": "the state file is dropped from the page cache before each resume"},
              "rows": []}
    kept = []
    if a.keep and out.is_file():
        kept = [r for r in json.loads(out.read_text()).get("rows", []) if r["name"] not in names]
        result["kept_rows"] = [r["name"] for r in kept]
    result["rows"] = kept

    def write(final: bool) -> None:
        for row in result["rows"]:
            row["ratios"] = ratios(row.get("save"), row.get("resume"), row.get("whole"))
        result["partial"] = not final
        result["machine"]["loadavg_end"] = list(os.getloadavg())
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    rows = []  # (row dict, spec base, run folder) of the rows that are ready
    # the state files saved so far, kept rows' included: a file from another export for the next rows' refusals
    states = [p for p in (work_root / "runs" / ds.slug(r["name"]) / "p.state" for r in kept) if p.is_file()]
    for name in names:
        model, strategy, weights, ctx = table[name]
        row = {"name": name, "model": model, "strategy": strategy, "weights": weights, "ctx": ctx,
               "run_started_utc": result["started_utc"]}
        result["rows"].append(row)
        try:
            model_path = resolve_model(model).resolve()
            folder = ds.Work(work_root, model, model_path, log).export(strategy, weights, ctx, {"onnx"})
            manifest = json.loads((folder / "manifest.json").read_text())
            tok = load_tokenizer(folder / manifest["tokenizer"]["file"])
            bos = 1 if manifest["tokenizer"]["add_bos_token"] else 0
            s = split(tok, default_text()[:ctx * 8], ctx - ROOM - bos, Q_TOKENS)
        except Exception as e:  # noqa: BLE001 (a row that cannot be prepared carries its error)
            row["error"] = str(e) if isinstance(e, RuntimeError | ValueError) else f"{type(e).__name__}: {e}"
            log(f"{name}: error: {row['error']}")
            write(final=False)
            continue
        d = work_root / "runs" / ds.slug(name)
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for key, text in (("P", s["P"]), ("Q", s["Q"]), ("PQ", s["P"] + s["Q"])):
            (d / f"{key}.txt").write_text(text, encoding="utf-8")
        row.update(folder=str(folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder),
                   state_strategy=manifest["strategy"]["label"], state_bytes_manifest=manifest["state"].get("bytes"),
                   prompt_tokens=len(s["p_ids"]) + bos, q_tokens=len(s["q_ids"]), bos=bool(bos),
                   split={"moved_back": s["moved_back"], "special_tokens_added": s["special_tokens_added"],
                          "p_chars": len(s["P"]), "q": s["Q"]})
        base = {"folder": str(folder), "threads": a.threads}
        rows.append((row, base, d))
        log(f"{name}: save (prefill of {row['prompt_tokens']} tokens) ...")
        state = d / "p.state"
        r = run_child(dict(base, prompt_file=str(d / "P.txt"), new_tokens=0, extra=["--save-state", str(state)]),
                      a.timeout)
        row["save"] = r
        if "error" not in r:
            row["state_file_bytes"] = state.stat().st_size
            row["position_saved"] = r["saved_state"]["position"]
            log(f"  prefill {r['prefill_s']:.1f} s ({r['prefill_cpu_s']:.1f} CPU s), save {r['save_s']:.2f} s, "
                f"{row['state_file_bytes'] / MIB:.1f} MiB")
            drop_from_page_cache(state)
            log(f"{name}: resume ...")
            r = run_child(dict(base, prompt_file=str(d / "Q.txt"), new_tokens=NEW_TOKENS,
                               extra=["--resume", str(state)]), a.timeout)
            row["resume"] = r
            if "error" not in r:
                log(f"  load {r['load_s']:.2f} s, prefill {r['prefill_s']:.2f} s, process {r['process_wall_s']:.1f} s")
        else:
            log(f"  error: {r['error']}")
        write(final=False)
        if not a.no_refusals and state.is_file():
            ref = row["refusals"] = {}
            cut = d / "truncated.state"
            cut.write_bytes(state.read_bytes()[:-4096])
            ref["truncated"] = refuse(folder, cut, s["Q"], a.threads, a.timeout)
            other = states[-1] if states else None
            if other is None:  # the same file, saved for another strategy (its metadata edited)
                raw = state.read_bytes()
                n = int.from_bytes(raw[:8], "little")
                h = json.loads(raw[8:8 + n])
                h["__metadata__"]["strategy"] = "kv-int4"
                hb = json.dumps(h).encode()
                other = d / "other.state"
                other.write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])
            ref["other_export"] = dict(refuse(folder, other, s["Q"], a.threads, a.timeout),
                                      file=str(other.relative_to(work_root)))
            over = default_text()[len(s["P"]) + len(s["Q"]):][:ROOM * 12]  # more than ROOM tokens
            ref["overflow"] = dict(refuse(folder, state, over, a.threads, a.timeout),
                                   prompt_tokens=len(tok.encode(over, add_special_tokens=False).ids))
            states.append(state)
            log("  refusals: " + ", ".join(f"{k} {'ok' if v['ok'] else 'NOT OK'}" for k, v in ref.items()))
            write(final=False)
    for row, base, d in rows:  # the re-prefill runs last: the longest
        if a.whole_max_ctx and row["ctx"] > a.whole_max_ctx:
            row["whole"] = {"error": f"not run (--whole-max-ctx {a.whole_max_ctx})"}
            continue
        log(f"{row['name']}: whole (prefill of {row['prompt_tokens'] + row['q_tokens']} tokens) ...")
        r = row["whole"] = run_child(dict(base, prompt_file=str(d / "PQ.txt"), new_tokens=NEW_TOKENS, extra=[]),
                                     a.timeout)
        if "error" not in r:
            res = row.get("resume") or {}
            row["same_tokens"] = r["tokens"] == res.get("tokens")
            log(f"  prefill {r['prefill_s']:.1f} s; same tokens as the resume: {row['same_tokens']}")
        write(final=False)
    write(final=True)
    print(summary(result["rows"]))
    print(f"load average {result['machine']['loadavg_start']} -> {result['machine']['loadavg_end']}; wrote {out}")
    return result


def summary(rows: list[dict]) -> str:
    def g(d, k, spec):
        v = (d or {}).get(k)
        return "-" if v is None else format(v, spec)

    lines = [f"{'row':<34} {'P tok':>6} {'state MiB':>9} {'prefill s':>9} {'cpu s':>7} {'load s':>7} "
             f"{'resume s':>8} {'whole s':>8} {'ratio':>6} {'same':>5}"]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['name']:<34} error: {r['error'][:120]}")
            continue
        res = r.get("resume") or {}
        first = res["load_s"] + res["prefill_s"] if "load_s" in res else None
        lines.append(f"{r['name']:<34} {r.get('prompt_tokens', 0):>6} "
                     f"{(r.get('state_file_bytes') or 0) / MIB:>9.1f} {g(r.get('save'), 'prefill_s', '9.1f')} "
                     f"{g(r.get('save'), 'prefill_cpu_s', '7.1f')} {g(res, 'load_s', '7.2f')} "
                     f"{'-' if first is None else format(first, '8.2f')} {g(r.get('whole'), 'prefill_s', '8.1f')} "
                     f"{g(r.get('ratios'), 'first_token', '6.1f')} {str(r.get('same_tokens', '-')):>5}")
    return "\n".join(lines)


if __name__ == "__main__":
    fc.ds.entry(main, child_main)
