"""ONNX Runtime GenAI's decode step at a filled context: its builder's graph alone against its own generator loop.

    python benchmarks/genai_step.py GENAI_FOLDER [--slots 8192] [--at 8100] [--steps 24] [--repeats 2]
                                    [--out benchmarks/results/genai_step_smollm2_8k.json]

GENAI_FOLDER: a model ONNX Runtime GenAI's builder wrote (benchmarks/speed_child.py Work.genai_model, as
benchmarks/filled_context.py builds its genai:int4 rows: `builder -p int4 -e cpu`). Each configuration runs in a
fresh process, the repeats going round them, 1 thread, process CPU time per decode step (median over --steps):
  graph      GenAI's model.onnx in an ONNX Runtime session (its own options: memory arena on), one token at
             positions --at.., past and present bound to one buffer of --slots positions (GenAI's
             past_present_share_buffer) holding random values: the graph's step, nothing around it
  generator  GenAI's generator (og.Generator) after a prompt of --at tokens appended in calls of 512
             (filled_context GENAI_CHUNK), then one token appended per step and its logits read, as filled_context's
             child_genai decodes
  profile    the graph with ONNX Runtime's profiler on: kernel milliseconds per step by operator type
benchmarks/plan_vs_filled.py charges GenAI's rows as the graph's ops at the kernel rates (GroupQueryAttention on a
fp32 cache, MatMulNBits 4-bit blocks of 32): what the generator adds outside the graph is in no rate.
"""
from __future__ import annotations

import argparse
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


def graph(spec: dict) -> dict:
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = o.inter_op_num_threads = 1
    if spec.get("profile"):
        o.enable_profiling = True
        o.profile_file_prefix = spec["profile"]
    s = ort.InferenceSession(str(Path(spec["folder"]) / "model.onnx"), o, providers=["CPUExecutionProvider"])
    ins = {i.name: i for i in s.get_inputs()}
    head = json.loads((Path(spec["folder"]) / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    rng = np.random.default_rng(0)
    b = s.io_binding()
    for name, i in ins.items():
        if not name.startswith("past_"):
            continue
        hkv, slots = i.shape[1], i.shape[2] if isinstance(i.shape[2], int) else spec["slots"]
        v = ort.OrtValue.ortvalue_from_numpy((rng.standard_normal((1, hkv, slots, head)) * 0.5).astype(np.float32))
        b.bind_ortvalue_input(name, v)
        b.bind_ortvalue_output(name.replace("past_key_values", "present"), v)
    b.bind_output("logits")
    at, cpu = spec["at"], []
    for p in range(at, at + 5 + spec["steps"]):
        b.bind_cpu_input("input_ids", np.array([[42]], np.int64))
        b.bind_cpu_input("attention_mask", np.ones((1, p + 1), np.int64))
        c = time.process_time()
        s.run_with_iobinding(b)
        if p >= at + 5:
            cpu.append(time.process_time() - c)
    out = {"cpu_ms": statistics.median(cpu) * 1e3}
    if spec.get("profile"):
        ev = json.loads(Path(s.end_profiling()).read_text())
        runs = [e for e in ev if e.get("cat") == "Session" and e.get("name") == "model_run"][-spec["steps"]:]
        ops: dict[str, float] = {}
        for e in ev:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= runs[0]["ts"]:
                ops[e["args"]["op_name"]] = ops.get(e["args"]["op_name"], 0.0) + e["dur"] / 1e3 / len(runs)
        out["ops_ms"] = {k: round(v, 3) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])}
    return out


def generator(spec: dict) -> dict:
    import onnxruntime_genai as og

    cfg = og.Config(spec["folder"])
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": 1}}}}))
    m = og.Model(cfg)
    p = og.GeneratorParams(m)
    p.set_search_options(max_length=spec["slots"], do_sample=False)
    g = og.Generator(m, p)
    ids = [42] * spec["at"]
    for s in range(0, len(ids), CHUNK):
        g.append_tokens(ids[s:s + CHUNK])
    cpu = []
    for i in range(5 + spec["steps"]):
        c = time.process_time()
        g.append_tokens([42])
        np.asarray(g.get_logits())
        if i >= 5:
            cpu.append(time.process_time() - c)
    return {"cpu_ms": statistics.median(cpu) * 1e3}


def run_child(spec: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from edgekv.children import child_setup

    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                       timeout=1800, preexec_fn=child_setup())
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or [str(p.returncode)])[-1]}
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "loadavg": round(os.getloadavg()[0], 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--slots", type=int, default=8192)
    ap.add_argument("--at", type=int, default=8100)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "genai_step_smollm2_8k.json")
    ap.add_argument("--child")
    a = ap.parse_args(argv)
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(generator(spec) if spec["kind"] == "generator" else graph(spec)))
        return 0
    if not a.folder or not (Path(a.folder) / "genai_config.json").is_file():
        print("genai_step: give a GenAI model folder (with genai_config.json)", file=sys.stderr)
        return 2
    base = {"folder": str(Path(a.folder).resolve()), "slots": a.slots, "at": a.at, "steps": a.steps}
    t0 = time.time()
    runs: dict[str, list] = {"graph": [], "generator": []}
    for _ in range(a.repeats):
        for kind in runs:
            runs[kind].append(run_child({**base, "kind": kind}))
            print(kind, runs[kind][-1], flush=True)
    prof_dir = ROOT / "out" / "genai_step"
    prof_dir.mkdir(parents=True, exist_ok=True)
    prof = run_child({**base, "kind": "graph", "profile": str(prof_dir / "graph")})
    print("profile", prof, flush=True)
    res = {"benchmark": "genai_step", "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
           "machine": {"platform": platform.platform(), "processor": platform.processor()},
           "settings": {**base, "repeats": a.repeats, "threads": 1, "prompt_chunk": CHUNK},
           "what": __doc__.split("\n\n")[2], "runs": runs,
           "cpu_ms_median": {k: statistics.median(r["cpu_ms"] for r in v if "cpu_ms" in r) for k, v in runs.items()},
           "profile": prof, "loadavg_end": list(os.getloadavg()), "seconds": round(time.time() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
