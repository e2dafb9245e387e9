"""ONNX Runtime GenAI's decode step at a filled context: its builder's graph alone against its own generator loop.

    python benchmarks/genai_step.py GENAI_FOLDER [--points 980/1024,4000/4096,8100/8192] [--steps 24] [--repeats 2]
                                    [--kinds graph,generator,one_call] [--one-call-points ...] [--profile-at 8100/8192]
                                    [--out benchmarks/results/genai_step_smollm2_8k.json]
    python benchmarks/genai_step.py --fit RESULT.json [...]   # the generator's added seconds per 4 KiB page

GENAI_FOLDER: a model ONNX Runtime GenAI's builder wrote (benchmarks/speed_child.py Work.genai_model, as
benchmarks/filled_context.py builds its genai:int4 rows: `builder -p int4 -e cpu`). Each configuration runs in a
fresh process, the repeats going round them, 1 thread, process CPU time per decode step (median over --steps), at
every point AT/SLOTS (one token at positions AT.., a cache of SLOTS positions: GenAI's max_length):
  graph      GenAI's model.onnx in an ONNX Runtime session (its own options: memory arena on), past and present
             bound to one buffer of SLOTS positions (GenAI's past_present_share_buffer) holding random values: the
             graph's step, nothing around it
  generator  GenAI's generator (og.Generator, max_length SLOTS) after a prompt of AT tokens appended in calls of 512
             (filled_context GENAI_CHUNK), then one token appended per step and its logits read, as filled_context's
             child_genai decodes: append_ms (append_tokens: GenAI's inputs, the session run, its outputs) and
             logits_ms (get_logits copied out) apart
  one_call   the generator after the same prompt appended in one call (its graph then outputs the logits of every
             prompt position, AT x vocabulary fp32)
  graph_small_pages     the graph with numpy's huge-page advice off (NUMPY_MADVISE_HUGEPAGE=0): its cache in 4 KiB
                        pages, as GenAI's generator holds its own
  generator_huge_pages  the generator with glibc's malloc advising huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1):
                        its cache in 2 MiB pages, as the graph's numpy arrays (and edgekv's runtime) hold theirs
Each child records getrusage's user and system ms and page faults per step and its AnonHugePages (ENV says why).
The graph kinds bind a layer's cache at SLOTS, a sliding-window layer's (Gemma 3: GroupQueryAttention with
sliding_window_cache, its past past_sliding_length rows) at the window + SLIDING_EXTRA rows, as GenAI binds it.
--profile-at AT/SLOTS: the graph and the generator once more with ONNX Runtime's profiler on (the generator's
session through genai_config's session_options enable_profiling): kernel milliseconds per step by operator type,
the session's model_run (the graph's run inside ONNX Runtime) per step, and for the generator its step's wall time
less model_run (GenAI's own work around the session).
benchmarks/plan_vs_filled.py charges GenAI's rows as the graph's ops at the kernel rates (GroupQueryAttention on a
fp32 cache, MatMulNBits 4-bit blocks of 32) plus what this benchmark measures the generator adding, which is its
cache's page size (GENAI_PAGES: pages_fit's cost per 4 KiB page, edgekv/costs/attention_rates.json cache_pages).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 512  # filled_context.GENAI_CHUNK
KINDS = ("graph", "graph_small_pages", "generator", "generator_huge_pages", "one_call")
# what a kind changes in its child's environment: the page size the cache lands in. numpy asks the kernel for
# transparent huge pages (madvise) on arrays of 4 MB and more, so the graph's cache (numpy arrays bound as OrtValues,
# as edgekv's runtime and benchmarks/attention_rates.py bind theirs) sits in 2 MiB pages where THP is "madvise";
# GenAI allocates its cache through ONNX Runtime's allocator (glibc malloc: 4 KiB pages) unless glibc's tunable
# glibc.malloc.hugetlb=1 (glibc 2.35+) makes malloc madvise them too
ENV = {"graph_small_pages": {"NUMPY_MADVISE_HUGEPAGE": "0"},
       "generator_huge_pages": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}}
# numpy advises transparent huge pages for an allocation of 4 MiB or more (numpy's alloc.c, NUMPY_MADVISE_HUGEPAGE):
# the graph kind's cache tensor of one layer (1 x kv heads x SLOTS x head size, fp32) sits in 2 MiB pages from there on
HUGE_PAGE_MIN_BYTES = 1 << 22
# the rows GenAI 0.18 binds a sliding layer's cache at beyond the window: 528 for Gemma-3-270M's window of 512 (the
# input shapes of its generator session's GroupQueryAttention in ONNX Runtime's profile)
SLIDING_EXTRA = 16


def _hwm() -> int:
    """The process's peak resident bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _anon_huge() -> int:
    """The process's anonymous memory in transparent huge pages (smaps_rollup AnonHugePages), bytes."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def _usage() -> tuple:
    """(user s, system s, minor faults, major faults) of this process so far."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime, u.ru_stime, u.ru_minflt, u.ru_majflt


def _per_step(u0: tuple, u1: tuple, n: int) -> dict:
    """getrusage's difference over n steps, per step: user and system ms, minor and major page faults."""
    d = [b - a for a, b in zip(u0, u1)]
    return {"user_ms": d[0] / n * 1e3, "sys_ms": d[1] / n * 1e3, "minflt": d[2] / n, "majflt": d[3] / n}


def _ops(ev: list, n_steps: int) -> dict:
    """A profile's last n_steps model_run events: their median wall ms, and kernel ms per step by operator type."""
    runs = [e for e in ev if e.get("cat") == "Session" and e.get("name") == "model_run"][-n_steps:]
    ops: dict[str, float] = {}
    for e in ev:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and \
                runs[0]["ts"] <= e["ts"] <= runs[-1]["ts"] + runs[-1]["dur"]:
            ops[e["args"]["op_name"]] = ops.get(e["args"]["op_name"], 0.0) + e["dur"] / 1e3 / len(runs)
    return {"model_run_ms": statistics.median(r["dur"] / 1e3 for r in runs),
            "ops_ms": {k: round(v, 3) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])}}


def graph(spec: dict) -> dict:
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = o.inter_op_num_threads = 1
    if spec.get("profile"):
        o.enable_profiling = True
        o.profile_file_prefix = spec["profile"]
    s = ort.InferenceSession(str(Path(spec["folder"]) / "model.onnx"), o, providers=["CPUExecutionProvider"])
    ins = {i.name: i for i in s.get_inputs()}
    dec = json.loads((Path(spec["folder"]) / "genai_config.json").read_text())["model"]["decoder"]
    head, window = dec["head_size"], (dec.get("sliding_window") or {}).get("window_size")
    rng = np.random.default_rng(0)
    b = s.io_binding()
    for name, i in ins.items():
        if not name.startswith("past_"):
            continue
        hkv, slots = i.shape[1], i.shape[2] if isinstance(i.shape[2], int) else spec["slots"]
        if i.shape[2] == "past_sliding_length":  # a sliding layer: GenAI's window-sized cache
            slots = window + SLIDING_EXTRA
        v = ort.OrtValue.ortvalue_from_numpy((rng.standard_normal((1, hkv, slots, head)) * 0.5).astype(np.float32))
        b.bind_ortvalue_input(name, v)
        b.bind_ortvalue_output(name.replace("past_key_values", "present"), v)
    b.bind_output("logits")
    at, cpu = spec["at"], []
    for p in range(at, at + 5 + spec["steps"]):
        if p == at + 5:
            u0 = _usage()
        b.bind_cpu_input("input_ids", np.array([[42]], np.int64))
        b.bind_cpu_input("attention_mask", np.ones((1, p + 1), np.int64))
        c = time.process_time()
        s.run_with_iobinding(b)
        if p >= at + 5:
            cpu.append(time.process_time() - c)
    out = {"cpu_ms": statistics.median(cpu) * 1e3, **_per_step(u0, _usage(), spec["steps"]),
           "anon_huge_bytes": _anon_huge()}
    if spec.get("profile"):
        out.update(_ops(json.loads(Path(s.end_profiling()).read_text()), spec["steps"]))
    return out


def generator(spec: dict) -> dict:
    import onnxruntime_genai as og

    so = {"intra_op_num_threads": 1}
    if spec.get("profile"):
        so["enable_profiling"] = spec["profile"]
    cfg = og.Config(spec["folder"])
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": so}}}))
    m = og.Model(cfg)
    p = og.GeneratorParams(m)
    p.set_search_options(max_length=spec["slots"], do_sample=False)
    g = og.Generator(m, p)
    ids = [42] * spec["at"]
    chunk = len(ids) if spec["kind"] == "one_call" else CHUNK
    c = time.process_time()
    for s in range(0, len(ids), chunk):
        g.append_tokens(ids[s:s + chunk])
    prompt_cpu_s = time.process_time() - c
    hwm_prompt = _hwm()
    cpu, app, lg, wall = [], [], [], []
    for i in range(5 + spec["steps"]):
        if i == 5:
            u0 = _usage()
        w, c = time.perf_counter(), time.process_time()
        g.append_tokens([42])
        c1 = time.process_time()
        np.asarray(g.get_logits())
        c2, w2 = time.process_time(), time.perf_counter()
        if i >= 5:
            cpu.append(c2 - c)
            app.append(c1 - c)
            lg.append(c2 - c1)
            wall.append(w2 - w)
    out = {"cpu_ms": statistics.median(cpu) * 1e3, "append_ms": statistics.median(app) * 1e3,
           "logits_ms": statistics.median(lg) * 1e3, "wall_ms": statistics.median(wall) * 1e3,
           "prompt_cpu_s": round(prompt_cpu_s, 2), "peak_rss_after_prompt_bytes": hwm_prompt,
           "peak_rss_bytes": _hwm(), **_per_step(u0, _usage(), spec["steps"]), "anon_huge_bytes": _anon_huge()}
    if spec.get("profile"):
        del g, p, m  # GenAI writes the session's profile when the session goes
        f = sorted(glob.glob(spec["profile"] + "*.json"), key=os.path.getmtime)[-1]
        out.update(_ops(json.loads(Path(f).read_text()), spec["steps"]))
        out["outside_session_ms"] = out["wall_ms"] - out["model_run_ms"]
    return out


PAGE = 4096


def pages_fit(files: list[Path]) -> dict:
    """What GenAI's generator adds to its graph's step per 4 KiB page of K and V the step reads: least squares
    (through zero) of the generator's median CPU ms less the graph's, over every point of the JSONs where the graph
    kind's cache tensors of the full-context layers are numpy's huge pages (HUGE_PAGE_MIN_BYTES; a sliding layer's
    window cache is smaller, in 4 KiB pages in both): the pages one step reads on those layers, layers x K and V x
    kv heads x keys x head size x 4 bytes / 4096, the keys the median timed step attends (AT + 5 warm-up +
    steps / 2)."""
    xs, ys, rows = [], [], []
    for f in files:
        d = json.loads(Path(f).read_text())
        m, steps = d["model"], d["settings"]["steps"]
        full = m["layers"] - len((m.get("sliding_window") or {}).get("layers", ()))
        for key, s in d["summary"].items():
            if "added_ms" not in s or m["kv_heads"] * s["slots"] * m["head_size"] * 4 < HUGE_PAGE_MIN_BYTES:
                continue
            keys = s["at"] + 5 + steps / 2
            pages = full * 2 * m["kv_heads"] * keys * m["head_size"] * 4 / PAGE
            xs.append(pages)
            ys.append(s["added_ms"] / 1e3)
            rows.append({"file": Path(f).name, "point": key, "pages": round(pages), "added_ms": s["added_ms"],
                         "s_per_page": s["added_ms"] / 1e3 / pages})
    c = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return {"s_per_page": c, "rows": rows, "machine_cpu": sorted({json.loads(Path(f).read_text())["machine"].get(
        "cpu", "") for f in files})}


def run_child(spec: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from edgekv.children import child_setup

    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                       timeout=1800, preexec_fn=child_setup(), env={**os.environ, **ENV.get(spec["kind"], {})})
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or [str(p.returncode)])[-1]}
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "loadavg": round(os.getloadavg()[0], 2)}


def _points(text: str, steps: int) -> list[tuple[int, int]]:
    """'1000/1024,8100/8192' -> [(1000, 1024), (8100, 8192)]: positions AT in a cache of SLOTS (AT, the 5 warm-up
    steps and the timed steps must fit in it)."""
    out = []
    for part in filter(None, text.split(",")):
        at, _, slots = part.partition("/")
        out.append((int(at), int(slots or at)))
        if out[-1][0] + 5 + steps >= out[-1][1]:
            raise ValueError(f"point {part}: AT + 5 + {steps} steps must fit in SLOTS")
    return out


def _cpu() -> str:
    """The CPU's model name (lscpu's), as filled_context records machine.cpu."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--points", default="8100/8192", help="AT/SLOTS,...: decode positions and cache slots")
    ap.add_argument("--kinds", default="graph,generator", help=f"of {', '.join(KINDS)}")
    ap.add_argument("--one-call-points", default=None,
                    help="the points one_call runs at (default: every point; its prompt's logits are AT x vocab fp32)")
    ap.add_argument("--profile-at", default=None, help="AT/SLOTS: profile the graph and the generator there once")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "genai_step_smollm2_8k.json")
    ap.add_argument("--fit", nargs="+", type=Path, metavar="JSON",
                    help="print the generator's added seconds per 4 KiB page of cache read, fitted over these "
                         "results (pages_fit) and exit")
    ap.add_argument("--child")
    a = ap.parse_args(argv)
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(graph(spec) if spec["kind"].startswith("graph") else generator(spec)))
        return 0
    if a.fit:
        print(json.dumps(pages_fit(a.fit), indent=1))
        return 0
    if not a.folder or not (Path(a.folder) / "genai_config.json").is_file():
        print("genai_step: give a GenAI model folder (with genai_config.json)", file=sys.stderr)
        return 2
    try:
        points = _points(a.points, a.steps)
        one_call = _points(a.one_call_points, a.steps) if a.one_call_points is not None else points
        prof = _points(a.profile_at, a.steps) if a.profile_at else []
    except ValueError as e:
        print(f"genai_step: {e}", file=sys.stderr)
        return 2
    kinds = [k for k in a.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        print(f"genai_step: --kinds takes {', '.join(KINDS)}", file=sys.stderr)
        return 2
    cfg = json.loads((Path(a.folder) / "genai_config.json").read_text())["model"]
    window = cfg["decoder"].get("sliding_window")
    base = {"folder": str(Path(a.folder).resolve()), "steps": a.steps}
    configs = [(k, at, slots) for at, slots in points for k in kinds if k != "one_call" or (at, slots) in one_call]
    t0 = time.time()
    runs: dict[str, list] = {f"{k} {at}/{slots}": [] for k, at, slots in configs}
    for _ in range(a.repeats):
        for k, at, slots in configs:
            key = f"{k} {at}/{slots}"
            runs[key].append(run_child({**base, "kind": k, "at": at, "slots": slots}))
            print(key, runs[key][-1], flush=True)
    prof_dir = ROOT / "out" / "genai_step"
    prof_dir.mkdir(parents=True, exist_ok=True)
    profiles = {}
    for at, slots in prof:
        for k in ("graph", "generator"):
            key = f"{k} {at}/{slots}"
            profiles[key] = run_child({**base, "kind": k, "at": at, "slots": slots,
                                       "profile": str(prof_dir / f"{k}_{at}_{time.strftime('%H%M%S')}")})
            print("profile", key, profiles[key], flush=True)
    med = {key: {f: statistics.median(r[f] for r in v if f in r) for f in v[0] if f.endswith("_ms") or
                 f in ("minflt", "majflt", "anon_huge_bytes")}
           for key, v in runs.items() if v and all("cpu_ms" in r for r in v)}
    summary = {}
    for at, slots in points:
        g, n = med.get(f"graph {at}/{slots}"), med.get(f"generator {at}/{slots}")
        o = med.get(f"one_call {at}/{slots}")
        s = {"at": at, "slots": slots}
        if g and n:
            s.update(graph_ms=round(g["cpu_ms"], 2), generator_ms=round(n["cpu_ms"], 2),
                     added_ms=round(n["cpu_ms"] - g["cpu_ms"], 2), added_fraction=round(n["cpu_ms"] / g["cpu_ms"] - 1, 3),
                     logits_ms=round(n["logits_ms"], 3))
        if o and n:
            s.update(one_call_ms=round(o["cpu_ms"], 2), one_call_over_generator=round(o["cpu_ms"] / n["cpu_ms"] - 1, 3))
        for k in ("graph_small_pages", "generator_huge_pages"):
            if med.get(f"{k} {at}/{slots}"):
                s[f"{k}_ms"] = round(med[f"{k} {at}/{slots}"]["cpu_ms"], 2)
        summary[f"{at}/{slots}"] = s
    res = {"benchmark": "genai_step", "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
           "machine": {"cpu": _cpu(), "platform": platform.platform(), "processor": platform.processor()},
           "model": {"type": cfg["type"], "vocab_size": cfg["vocab_size"],
                     "layers": cfg["decoder"]["num_hidden_layers"], "kv_heads": cfg["decoder"]["num_key_value_heads"],
                     "head_size": cfg["decoder"]["head_size"],
                     "sliding_window": window and {"window_size": window["window_size"], "layers": window["layers"]}},
           "settings": {**base, "points": points, "kinds": kinds, "one_call_points": one_call,
                        "repeats": a.repeats, "threads": 1, "prompt_chunk": CHUNK},
           "what": __doc__.split("\n\n")[2], "runs": runs, "cpu_ms_median": med, "summary": summary,
           "profiles": profiles, "loadavg_end": list(os.getloadavg()), "seconds": round(time.time() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
