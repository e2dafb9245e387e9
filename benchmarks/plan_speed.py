"""How fast `edgekv plan` answers over the whole catalog, and proof that it imports no torch.

Runs the real command in fresh processes (median of N) and writes JSON:
  {"runs": N, "median_s": ..., "min_s": ..., "options": ..., "models": ..., "heavy_modules_imported": [...]}
Usage: python benchmarks/plan_speed.py [--runs 5] [--device pixel8] [--ctx 32k] [--out FILE]
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

HEAVY = ("torch", "executorch", "onnxruntime", "onnx", "transformers")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="pixel8")
    ap.add_argument("--ctx", default="32k")
    ap.add_argument("--out")
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "edgekv.cli", "plan", "--device", a.device, "--ctx", a.ctx, "--json"]
    times = []
    for _ in range(a.runs):
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, check=True)
        times.append(time.perf_counter() - t)
        json.loads(p.stdout)  # each run must print valid JSON
    probe = ("import sys,runpy,io,contextlib\nsys.argv=" + repr(["edgekv"] + cmd[3:]) +
             "\nwith contextlib.redirect_stdout(io.StringIO()):\n    try:\n        runpy.run_module('edgekv.cli', run_name='__main__')\n"
             "    except SystemExit:\n        pass\n"
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    heavy = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    # in-process: the planning itself, without interpreter start-up
    from edgekv.devices import load_device
    from edgekv.plan import default_models, make_plan
    from edgekv.units import parse_ctx
    t = time.perf_counter()
    dev = load_device(a.device)
    archs = default_models(dev)
    plan = make_plan(dev, parse_ctx(a.ctx), archs)
    in_proc = time.perf_counter() - t
    result = {"command": " ".join(["edgekv"] + cmd[3:]), "runs": a.runs,
              "median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
              "in_process_s": round(in_proc, 4), "models": len(archs), "options": len(plan.rows),
              "heavy_modules_imported": json.loads(heavy.replace("'", '"')) if heavy else None}
    text = json.dumps(result, indent=2)
    if a.out:
        open(a.out, "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
