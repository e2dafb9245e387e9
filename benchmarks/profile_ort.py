"""Where an ONNX decode step's time goes: edgekv's graph next to ONNX Runtime GenAI's, in one harness.

    python benchmarks/profile_ort.py out/decode_speed/exports/smollm2-135m-kv_dtype_fp32-wint4-c2048 \\
        out/decode_speed/genai/SmolLM2-135M-Instruct.Q4_1-int4 [--threads 2] [--repeats 5] [--out FILE]

decode_speed compares each runtime with its own loop. This benchmark takes the loops apart. Each configuration runs
in a fresh process, and the configurations alternate, `--repeats` rounds of them:
  edgekv graph     edgekv's model.onnx, one token per call at positions --position.., the state bound in place
                   (IO binding made once, the state buffers bound as both past and present, as OrtStepper does)
  genai graph      GenAI's model.onnx through the same loop (its past and present share one buffer of the
                   export's max_ctx slots, as GenAI's past_present_share_buffer does)
  genai generator  GenAI's own C++ loop (generate_next_token) over the same positions
--compare EXPORT adds a second edgekv export to the same rounds (edgekv graph 2): the same strategy with other weights
(--weights int4 against --weights gguf) shows what the weights alone cost a step, op by op.
Each graph's step is timed in wall and CPU milliseconds (CPU time is the comparable figure on a loaded host).
For the graphs, a second process of each runs the same loop with ONNX Runtime's profiler on. Its kernel time
per step is summed by operator type. The profiler adds its own cost, so the types are read as shares, not times.
--positions also times edgekv's step at several positions. The slope is what each cached token costs a step: the
attention (GroupQueryAttention) reads 2 x layers x kv heads x head_dim x 4 bytes of it.
Both graphs' state holds the same random values (seeded); the token is fixed. Output: a table and JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_speed  # noqa: E402  (its fresh-process runner)


TOP_NODES = 12  # the slowest nodes, each on its own (one of a type can be most of it: a model's output head)


def kernel_ms_by_op(events: list[dict], steps: int) -> dict:
    """ONNX Runtime profile events -> {"model_run": ms per step, "kernels": ms, "ops": {op type: ms}} over the last
    `steps` model_run events (earlier ones are warm-up). A node's time is its `*_kernel_time` event."""
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-steps:]
    if not runs:
        raise ValueError("the profile has no model_run event")
    start = runs[0]["ts"]
    ops: dict[str, float] = defaultdict(float)
    nodes: dict[tuple[str, str], float] = defaultdict(float)
    each: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            ops[e["args"]["op_name"]] += e["dur"] / 1e3 / len(runs)
            nodes[(e["args"]["op_name"], e["name"][:-len("_kernel_time")])] += e["dur"] / 1e3 / len(runs)
            each[(e["args"]["op_name"], e["name"][:-len("_kernel_time")])].append(e["dur"] / 1e3)
    top = sorted(nodes.items(), key=lambda kv: -kv[1])[:TOP_NODES]
    # each node's median over the steps, summed per op type: a node's time is wall time, and on a busy host a step
    # the thread lost its core in inflates one node of it; the median over steps leaves those out
    med: dict[str, float] = defaultdict(float)
    for (op, _), ts in each.items():
        med[op] += statistics.median(ts)
    return {"model_run": sum(r["dur"] for r in runs) / 1e3 / len(runs), "kernels": sum(ops.values()),
            "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
            "nodes": [{"op": op, "node": name, "ms": ms} for (op, name), ms in top],
            "node_counts": dict(sorted(Counter(op for op, _ in nodes).items())),
            "ops_median": dict(sorted(med.items(), key=lambda kv: -kv[1]))}


def attention_slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope (ms per cached token) of step ms over position."""
    import numpy as np

    pos, ms = zip(*points)
    return float(np.polyfit(pos, ms, 1)[0])


# ---- the child process: one configuration, fresh ----


def _graph_loop(spec: dict) -> dict:
    import numpy as np
    import onnxruntime as ort

    kind, folder, threads = spec["kind"], Path(spec["folder"]), spec["threads"]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if kind == "edgekv":  # the options OrtStepper sets (lean)
        opts.enable_cpu_mem_arena = False
        opts.enable_mem_pattern = False
    if spec.get("profile"):
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(spec["profile"]) / kind)
    sess = ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    ins = {i.name: i for i in sess.get_inputs()}
    outs = [o.name for o in sess.get_outputs()]
    past = [n for n in ins if n.startswith("past_")]
    rng = np.random.default_rng(0)
    slots = spec["slots"]
    head = (json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
            if kind == "genai" else None)
    state = []
    # a float cache holds fp32 or fp16 values; kv-int8 / kv-int4 exports hold int8 / packed uint8 codes and fp16
    # scales (random codes time the same kernels as real ones)
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8,
              "tensor(uint8)": np.uint8}
    for n in past:  # [batch, kv heads, slots, head_dim]; GenAI's graph names batch, slots and head_dim; a
        b_, h, s_, d = ins[n].shape  # sliding layer's ring (Gemma 3: 512 slots) has its own static size
        shape = [1, h, s_ if isinstance(s_, int) else slots, d if isinstance(d, int) else head]
        dt = dtypes[ins[n].type]
        v = (rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, shape, dtype=dt) if np.issubdtype(dt, np.integer)
             else (rng.standard_normal(shape) * 0.5).astype(dt))
        state.append(ort.OrtValue.ortvalue_from_numpy(v))
    b = sess.io_binding()
    for i_name, o_name, v in zip(past, [o for o in outs if o.startswith("present")], state):
        b.bind_ortvalue_input(i_name, v)
        b.bind_ortvalue_output(o_name, v)
    b.bind_output(outs[0])

    def step(p: int):
        if kind == "edgekv":
            b.bind_cpu_input("tokens", np.array([[42]], np.int64))
            b.bind_cpu_input("pos", np.array([p], np.int64))
            if "rows" in ins:
                b.bind_cpu_input("rows", np.array([0], np.int64))
        else:
            b.bind_cpu_input("input_ids", np.array([[42]], np.int64))
            b.bind_cpu_input("attention_mask", np.ones((1, p + 1), np.int64))
        sess.run_with_iobinding(b)
        return b.get_outputs()[0].numpy()

    out = {}
    for at in spec["positions"]:
        for p in range(at, at + 5):  # warm-up
            step(p)
        times, cpu = [], []
        for p in range(at + 5, at + 5 + spec["steps"]):
            t, c = time.perf_counter(), time.process_time()
            step(p)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        out[str(at)] = statistics.median(times) * 1e3
        # the process's CPU time per step: on a busy shared host the wall time also counts the waits for a core
        out.setdefault("cpu_ms", {})[str(at)] = statistics.median(cpu) * 1e3
    if spec.get("profile"):
        path = sess.end_profiling()
        out["profile"] = kernel_ms_by_op(json.loads(Path(path).read_text()), spec["steps"])
        Path(path).unlink()
    return out


def _generator_loop(spec: dict) -> dict:
    import onnxruntime_genai as og

    cfg = og.Config(spec["folder"])
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": spec["threads"]}}}}))
    model = og.Model(cfg)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=spec["slots"], do_sample=False)
    gen = og.Generator(model, params)
    at = spec["positions"][0]
    gen.append_tokens([42] * at)
    for _ in range(5):
        gen.generate_next_token()
    times = []
    for _ in range(spec["steps"]):
        t = time.perf_counter()
        gen.generate_next_token()
        times.append(time.perf_counter() - t)
    return {str(at): statistics.median(times) * 1e3}


def run_child(spec: dict, timeout: int = 900) -> dict:
    return decode_speed.run_child(spec, timeout, script=__file__)


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    r = _generator_loop(spec) if spec["kind"] == "generator" else _graph_loop(spec)
    print("RESULT " + json.dumps(r), flush=True)


def table(result: dict) -> str:
    lines = [f"{'configuration':<18}{'threads':>8}{'ms/step':>10}{'tok/s':>8}{'cpu ms':>8}   runs (ms)"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"{row['name']:<18}{row['threads']:>8}   error: {row['error']}")
            continue
        cpu = "-" if row.get("cpu_ms_per_step") is None else f"{row['cpu_ms_per_step']:.2f}"
        lines.append(f"{row['name']:<18}{row['threads']:>8}{row['ms_per_step']:>10.2f}{1e3 / row['ms_per_step']:>8.1f}"
                     f"{cpu:>8}   {', '.join(f'{v:.2f}' for v in row['runs_ms'])}")
    for row in result["profiles"]:
        if "error" in row:
            lines.append(f"profiled {row['name']} ({row['threads']} thr): error: {row['error']}")
            continue
        ops = ", ".join(f"{k} {v:.0%}" for k, v in list(row["shares"].items())[:6])
        lines.append(f"profiled {row['name']} ({row['threads']} thr): kernels {row['kernels_ms']:.2f} of "
                     f"{row['model_run_ms']:.2f} ms per run; {ops}")
    for row in result.get("positions", []):
        if "error" in row:
            lines.append(f"edgekv step vs position ({row['threads']} thr): error: {row['error']}")
            continue
        lines.append(f"edgekv step vs position ({row['threads']} thr): "
                     + ", ".join(f"{p}: {t:.2f} ms" for p, t in row["points"])
                     + f"; {row['us_per_cached_token']:.2f} us per cached token, its cache read at "
                     f"{(row['attention_gb_s'] or 0):.1f} GB/s")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="an edgekv export folder with model.onnx (kv, kv-int8, kv-int4 ...)")
    ap.add_argument("genai", nargs="?", help="a GenAI model folder (decode_speed builds them in out/decode_speed)")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--position", type=int, default=560, help="first decode position (decode_speed's mean: ~560)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--positions", default="8,500,1000,1900", help="edgekv step time at these positions ('' skips)")
    ap.add_argument("--compare", help="a second edgekv export, timed and profiled in the same rounds (e.g. "
                                      "--weights int4 beside --weights gguf of one strategy)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from edgekv.export.manifest import load_export

    folder = Path(a.export).resolve()
    manifest = load_export(folder, check_hashes=False)
    slots = int(manifest["max_ctx"])
    threads = [int(t) for t in a.threads.split(",")]
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    names = ["edgekv graph"] + (["edgekv graph 2"] if a.compare else []) \
        + (["genai graph", "genai generator"] if a.genai else [])
    spec_of = {
        "edgekv graph": {"kind": "edgekv", "folder": str(folder)},
        "edgekv graph 2": {"kind": "edgekv", "folder": str(Path(a.compare or ".").resolve())},
        "genai graph": {"kind": "genai", "folder": str(Path(a.genai or ".").resolve())},
        "genai generator": {"kind": "generator", "folder": str(Path(a.genai or ".").resolve())},
    }
    base = {"slots": slots, "steps": a.steps, "positions": [a.position]}
    load_start = list(os.getloadavg())
    runs: dict[tuple[str, int], list] = {(n, t): [] for n in names for t in threads}
    for rep in range(a.repeats):  # round the configurations, so drift weighs on each alike
        for t in threads:
            for n in names:
                log(f"{n}, {t} thread(s), run {rep + 1} of {a.repeats} ...")
                runs[(n, t)].append(run_child({**spec_of[n], **base, "threads": t}))
    rows = []
    for (n, t), rs in runs.items():
        ok = [r[str(a.position)] for r in rs if "error" not in r]
        cpu = [r["cpu_ms"][str(a.position)] for r in rs if "cpu_ms" in r]
        rows.append({"name": n, "export": spec_of[n]["folder"], "threads": t, "ms_per_step": statistics.median(ok),
                     "runs_ms": ok, **({"cpu_ms_per_step": statistics.median(cpu), "runs_cpu_ms": cpu} if cpu else {}),
                     "loadavg": round(os.getloadavg()[0], 2)} if ok else
                    {"name": n, "threads": t, "error": rs[-1]["error"]})
    profiles = []
    tmp = ROOT / "out" / "profile_ort"
    tmp.mkdir(parents=True, exist_ok=True)
    for t in threads:
        for n in [n for n in names if n != "genai generator"]:
            log(f"{n}, {t} thread(s), profiled ...")
            r = run_child({**spec_of[n], **base, "threads": t, "profile": str(tmp)})
            if "error" in r:
                profiles.append({"name": n, "threads": t, "error": r["error"]})
                continue
            prof = r["profile"]
            profiles.append({"name": n, "threads": t, "model_run_ms": round(prof["model_run"], 4),
                             "kernels_ms": round(prof["kernels"], 4),
                             "ops_ms": {k: round(v, 4) for k, v in prof["ops"].items()},
                             "shares": {k: round(v / prof["kernels"], 4) for k, v in prof["ops"].items()},
                             "top_nodes": [{**x, "ms": round(x["ms"], 4)} for x in prof.get("nodes", [])],
                             "node_counts": prof.get("node_counts", {}),
                             "ops_median_ms": {k: round(v, 4) for k, v in prof["ops_median"].items()},
                             "kernels_median_ms": round(sum(prof["ops_median"].values()), 4)})
    positions = []
    pts = [int(p) for p in a.positions.split(",") if p]
    per_token = manifest["state"]["bytes"] / slots  # a float cache: every state byte is a cached token's
    for t in threads if pts else []:
        log(f"edgekv graph at positions {pts}, {t} thread(s) ...")
        r = run_child({**spec_of["edgekv graph"], **base, "positions": pts, "threads": t})
        if "error" in r:
            positions.append({"threads": t, "error": r["error"]})
            continue
        points = [(p, r[str(p)]) for p in pts]
        slope = attention_slope(points)
        positions.append({"threads": t, "points": points, "us_per_cached_token": slope * 1e3,
                          "state_bytes_per_token": per_token,
                          "attention_gb_s": per_token / (slope * 1e-3) / 1e9 if slope > 0 else None})
    result = {"benchmark": "profile_ort", "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "export": str(folder), "genai": a.genai, "settings": vars(a), "slots": slots, "rows": rows,
              "loadavg": [load_start, list(os.getloadavg())],
              "profiles": profiles, "positions": positions}
    print(table(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    decode_speed.entry(main, child_main)
