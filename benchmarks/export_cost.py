#!/usr/bin/env python
"""What an `edgekv export` costs: its wall time and peak RSS, whole and per stage, and what `edgekv export` predicted
before it started (edgekv.export.budget, the `estimate:` line).

    python benchmarks/export_cost.py --name llama-3.2-1b-onnx-int4-8k --out benchmarks/results/export_cost_X.json \
        -- -m /tmp/rand/llama-3.2-1b --format onnx --weights int4 --max-ctx 8k -o /tmp/exp/llama1b --threads 1

Everything after `--` is passed to `edgekv export` (run as `python -m edgekv.cli export ...`, a child that dies with
this process). The child's RSS (with its own children's) is sampled every 0.2 s with psutil; each sample is charged to
the stage whose `[i/n] NAME` line the export printed last, so the stage that holds the peak is named, and so is the
CPU time the child used since the sample before (each stage's `cpu_s`; the CPU of the child's own children counts when
they have exited). The JSON is
written atomically, and rewritten while the export runs (its stages and an RSS timeline, a point every 10 s and at each
stage change); a run that fails is stored too, with its last stderr line. `--kill-above SIZE` stops the export when it
passes SIZE (a shared host) and records the stage it had reached.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from edgekv.children import child_setup  # the export dies with this process

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
STAGE = re.compile(r"^\[(\d+)/(\d+)\] ([\w-]+)")


def _tree_rss(proc) -> int:
    import psutil
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(args: list[str], interval: float = 0.2, kill_above: int | None = None, progress=None) -> dict:
    import psutil
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "edgekv.cli", "export", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, preexec_fn=child_setup())
    proc = psutil.Process(child.pid)
    state = {"stage": "start", "lines": []}
    stages: dict[str, dict] = {}
    cpu = {"s": 0.0}

    def read_err():
        for line in child.stderr:
            line = line.rstrip("\n")
            state["lines"].append(line)
            m = STAGE.match(line)
            if m:
                state["stage"] = m.group(3)
                stages.setdefault(m.group(3), {"start_s": round(time.perf_counter() - t0, 1), "peak_rss": 0})
    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    # stdout (--json: the manifest, 100 KB with a .pte's verification) is read while the child runs: read after it
    # exits, a manifest over the pipe's 64 KB blocked the child's last write, and the child never exited
    got = {"out": ""}
    out_reader = threading.Thread(target=lambda: got.update(out=child.stdout.read()), daemon=True)
    out_reader.start()
    peak, timeline, stopped = 0, [], None
    while child.poll() is None:
        rss = _tree_rss(proc)
        before = cpu["s"]
        try:
            t = proc.cpu_times()
            cpu["s"] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
        peak = max(peak, rss)
        s = stages.setdefault(state["stage"], {"start_s": round(time.perf_counter() - t0, 1), "peak_rss": 0})
        s["peak_rss"] = max(s["peak_rss"], rss)
        # the CPU the child used since the last sample, charged to the stage it is in now (0.2 s of slack per stage)
        s["cpu_s"] = round(s.get("cpu_s", 0.0) + cpu["s"] - before, 2)
        if progress and (len(timeline) == 0 or timeline[-1][2] != state["stage"] or
                         time.perf_counter() - t0 - timeline[-1][0] >= 10):
            timeline.append((round(time.perf_counter() - t0, 1), rss, state["stage"]))
            progress({"stages": stages, "timeline": timeline, "peak_rss": peak, "running": True})
        if kill_above and rss > kill_above and stopped is None:
            # a shared host: stop the export before it takes the memory other jobs need; its stage is the finding
            stopped = {"stage": state["stage"], "rss": rss, "at_s": round(time.perf_counter() - t0, 1)}
            child.terminate()
        if stopped and time.perf_counter() - t0 - stopped["at_s"] > 5:
            child.kill()  # SIGTERM waits for the toolchain's C code to return to Python; memory does not
        time.sleep(interval)
    out_reader.join(timeout=30)
    out = got["out"]
    reader.join(timeout=5)
    wall = time.perf_counter() - t0
    estimate = next((ln for ln in state["lines"] if ln.startswith("estimate:")), None)
    r = {"argv": ["edgekv", "export", *args], "returncode": child.returncode, "wall_s": round(wall, 1),
         "cpu_s": round(cpu["s"], 1), "peak_rss": peak, "stages": stages, "estimate_line": estimate,
         "timings_s": None, "timeline": timeline, **({"stopped_above_kill_limit": stopped} if stopped else {})}
    if child.returncode == 0:
        try:
            m = json.loads(out)["manifest"]
            r["timings_s"] = m.get("timings_s")
            r["files"] = {k: v["bytes"] for k, v in m.get("files", {}).items()}
            r["n_params"] = m["model"]["n_params"]
            # each format's verification, its verdict and figures (the per-position rows left out)
            r["verification"] = {f: {k: v[k] for k in ("passed", "top1_agreement", "top1_agreement_clear",
                                                        "max_abs_diff", "logit_scale", "tolerance", "noise_floor",
                                                        "positions_compared", "decode_steps") if k in v}
                                 for f, v in (m.get("verification") or {}).items() if isinstance(v, dict)}
        except (ValueError, KeyError):
            pass
    else:
        r["error"] = next((ln for ln in reversed(state["lines"]) if ln.strip()), "")
    return r


def with_gb(r: dict) -> dict:
    """The peaks also in GB (1e9 bytes, 2 decimals), the unit benchmarks/README.md prints them in."""
    r = dict(r)
    r["peak_rss_gb"] = round(r["peak_rss"] / 1e9, 2)
    r["stages"] = {k: {**v, "peak_rss_gb": round(v["peak_rss"] / 1e9, 2)} for k, v in r["stages"].items()}
    if r.get("stopped_above_kill_limit"):
        r["stopped_above_kill_limit"] = {**r["stopped_above_kill_limit"],
                                         "rss_gb": round(r["stopped_above_kill_limit"]["rss"] / 1e9, 2)}
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True, type=Path, help="the JSON to write")
    ap.add_argument("--kill-above", default=None,
                    help="stop the export when its RSS passes this size (e.g. 16GB), recording the stage it was in")
    ap.add_argument("export_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    args = [x for x in a.export_args if x != "--"]
    if "--json" not in args:
        args.append("--json")
    import psutil

    from edgekv.units import parse_bytes
    head = {"name": a.name, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "kernel": platform.release(),
                     "mem_total": psutil.virtual_memory().total,
                     "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}}

    def write(r):  # atomically; also while the export runs, so a run stopped from outside leaves its profile
        tmp = a.out.with_name(f".{a.out.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({**head, **r}, indent=2) + "\n")
        tmp.replace(a.out)
    r = measure(args, kill_above=parse_bytes(a.kill_above) if a.kill_above else None, progress=write)
    head["host"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write(with_gb(r))
    print(json.dumps({"name": a.name, **{k: r[k] for k in ("returncode", "wall_s", "peak_rss")}}))


if __name__ == "__main__":
    main()
