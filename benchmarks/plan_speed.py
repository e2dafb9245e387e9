"""How fast `edgekv plan` answers, in CPU time beside `python -c "import numpy"` measured in the same run, and proof
that it imports no torch.

Each repeat runs, in fresh processes and in turn (interleaved, so that a change in the host's load falls on both):
the demo command (`edgekv plan --device D --ctx C`, its table), the same with --json, and `import numpy`. A child's CPU
time (user + system, from wait4) is what is compared: on a shared host wall time mostly measures the neighbours. One
untimed run of each comes first, with bytecode caching on, so that every timed run starts from compiled bytecode as an
installed edgekv does. The load average before and after is recorded beside the times.

Usage: python benchmarks/plan_speed.py [--runs 7] [--device pixel8] [--ctx 32k] [--out FILE] [--note TEXT]
JSON: {"command", "runs", "cpu_s": {"plan", "plan_json", "import_numpy"}: {"median", "min", "all"}, "ratio_to_numpy"
(median plan CPU / median numpy CPU), "target_ratio", "wall_median_s", "load_average": {"before", "after"},
"in_process_s", "models", "options", "heavy_modules_imported", "python", "host", "note", "date"}
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from edgekv.children import child_setup  # a child dies with this process

HEAVY = ("torch", "executorch", "onnxruntime", "onnx", "transformers")
TARGET_RATIO = 2.0  # issue 41: the demo command within twice the CPU time of importing numpy


def child_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package runs from cached bytecode
    env.pop("COLUMNS", None)
    return env


def run_child(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """One run, its CPU time read with wait4 (Popen.communicate would reap the child first)."""
    with tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, preexec_fn=child_setup())
        out = p.stdout.read()
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = code = os.waitstatus_to_exitcode(status)
        if code:
            err.seek(0)
            sys.exit(f"{' '.join(cmd)} failed ({code}): {err.read().decode(errors='replace').strip()[-500:]}")
    return ru.ru_utime + ru.ru_stime, wall, out.decode()


def summary(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "all": [round(x, 4) for x in xs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--device", default="pixel8")
    ap.add_argument("--ctx", default="32k")
    ap.add_argument("--out")
    ap.add_argument("--note", default=None, help="what this run measured (e.g. the commit of the edgekv it ran)")
    a = ap.parse_args()
    env = child_env()
    plan = [sys.executable, "-m", "edgekv.cli", "plan", "--device", a.device, "--ctx", a.ctx]
    cmds = {"plan": plan, "plan_json": plan + ["--json"], "import_numpy": [sys.executable, "-c", "import numpy"]}
    for cmd in cmds.values():  # untimed: bytecode compiled and cached, files in the page cache
        run_child(cmd, env)
    load_before = os.getloadavg()
    cpu = {k: [] for k in cmds}
    wall = {k: [] for k in cmds}
    for _ in range(a.runs):
        for k, cmd in cmds.items():
            c, w, out = run_child(cmd, env)
            if k == "plan_json":
                json.loads(out)  # each run must print valid JSON
            cpu[k].append(c)
            wall[k].append(w)
    load_after = os.getloadavg()
    probe = ("import sys,runpy,io,contextlib\nsys.argv=" + repr(["edgekv"] + plan[3:] + ["--json"]) +
             "\nwith contextlib.redirect_stdout(io.StringIO()):\n    try:\n        runpy.run_module('edgekv.cli', run_name='__main__')\n"
             "    except SystemExit:\n        pass\n"
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    heavy = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, preexec_fn=child_setup()).stdout.strip()
    # in-process: the planning itself, without interpreter start-up
    from edgekv.devices import load_device
    from edgekv.plan import default_models, make_plan
    from edgekv.units import parse_ctx
    t = time.perf_counter()
    dev = load_device(a.device)
    archs = default_models(dev)
    p = make_plan(dev, parse_ctx(a.ctx), archs)
    in_proc = time.perf_counter() - t
    ratio = statistics.median(cpu["plan"]) / statistics.median(cpu["import_numpy"])
    result = {"command": " ".join(["edgekv"] + plan[3:]), "runs": a.runs, "measure": "CPU seconds (user + system) of "
              "each fresh process, the three commands interleaved per repeat, after one untimed run of each",
              "cpu_s": {k: summary(v) for k, v in cpu.items()},
              "ratio_to_numpy": round(ratio, 3), "target_ratio": TARGET_RATIO, "within_target": ratio <= TARGET_RATIO,
              "wall_median_s": {k: round(statistics.median(v), 4) for k, v in wall.items()},
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in load_after], "cpus": os.cpu_count()},
              "in_process_s": round(in_proc, 4), "models": len(archs), "options": len(p.rows),
              "heavy_modules_imported": json.loads(heavy.replace("'", '"')) if heavy else None,
              "python": platform.python_version(), "host": platform.machine(), "note": a.note,
              "date": time.strftime("%Y-%m-%d", time.gmtime())}
    text = json.dumps(result, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
